"""Device functions the attention kernel reads K and V through, per page format.

``kv_loader(bits)`` returns ``load(pages, scales, row, d) -> float32``. The kernel gets every
page array as rows: [P, S, KV, X] viewed as [P * S * KV, X], row ``(page * S + slot) * KV +
head`` (unsigned), so that one index multiply serves a key's values and scales and no index
is signed (Numba adds a negative-index fix-up per signed index and dimension: with 4-D indexing
that was about a fifth of the decode loop's instructions on the H200).

- bits 0: unquantized pages [P, S, KV, D] in the run dtype (``scales`` is not read);
- bits 8: int8 codes [P, S, KV, D] times the group's fp16 scale;
- bits 4: uint8 [P, S, KV, D / 2]: element d of group g = d // 32 sits in byte g * 16 + d % 16,
  low nibble for d % 32 < 16, high nibble otherwise, stored as q + 8.

The layout is engine/cache/quant.py's (its INVARIANT); the product is taken in float32 as the
torch reference's ``dequantize`` takes it, so both see the same values. A lane that owns dims
lane, lane + LT, ... (LT = 16 or 32) reads, for each i, one byte of the group's 16: the lanes
of a key group read contiguous bytes.

``kv_word_parts(bits, dpl)`` is the vector form for quantized pages: a lane owns the ``dpl``
(4 or 8) CONSECUTIVE dims ``lane * dpl ...``, which lie in one scale group and, in both
formats, in ``dpl`` consecutive bytes (8-bit: one byte each; 4-bit: the low or the high
nibbles of ``dpl`` bytes). So the pages are read as words of ``dpl`` bytes (``word_dtype``:
the kernel gets ``pages.view(word_dtype(dpl))``): one load and one scale per lane per key,
where the element loader issues ``dpl`` byte loads and ``dpl`` scale loads. The words unpack
to the integer codes (exact floats) and the kernel multiplies by the scale once per row, so
its products round differently from the reference's code * scale per element (within the
float32 tolerance the tests hold).

``kv_step_reader`` puts both forms behind one interface for the kernel's steps of several keys:
read every key's raw words (or elements) first, unpack each when it is used.
"""

from __future__ import annotations

import functools

import torch

from engine.cuda._launch import cuda
from engine.cuda.bits import bits_float

float32 = cuda.float32  # bound here: inside a simulated kernel ``cuda`` is the fake module
int32 = cuda.int32
int64 = cuda.int64
uint64 = cuda.uint64  # page-array indices: unsigned, so Numba adds no negative-index fix-up
GROUP = 32
HALF = GROUP // 2


def vector_dims(bits: int, dpl: int) -> bool:
    """Whether ``kv_word_parts`` serves this page format and dims per lane."""
    return bits in (8, 4) and dpl in (4, 8)


def reads_words(k_bits: int, v_bits: int, dpl: int) -> bool:
    """Whether the attention kernel reads K and V as words (lanes own consecutive dims)."""
    return vector_dims(k_bits, dpl) and vector_dims(v_bits, dpl)


@functools.cache
def kv_step_reader(k_bits: int, v_bits: int, dpl: int, lanes: int):
    """``(raw_dtype, raw_width, scaled, read, unpack_k, unpack_v)``: how the attention kernel
    brings several keys' K and V into registers before it uses any of them (their loads
    overlap), then turns them into numbers.

    ``read(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs)`` stores key
    ``u``'s raw K and V (at ``row``, see the module docstring) of this lane in ``kr``/``vr``
    (``raw_width`` entries of ``raw_dtype`` per key) and, when ``scaled``, their group scales
    in ``ks``/``vs``; ``unpack_k(kr, u, lane, out)`` (and ``unpack_v``) then write the lane's
    ``dpl`` float32 numbers of key ``u``.

    - Words (``reads_words``; ``scaled``): the lane's dims are ``lane * dpl + i``, one load and
      one scale per key and side; ``out`` gets the integer codes, exact in float32, and the
      kernel applies the scale once per row (to a dot product, or to a softmax weight) instead
      of once per element: value = code * scale, the same product in another order.
    - Elements (not ``scaled``): dims ``lane + lanes * i``, dequantized as they are read.
    """
    if reads_words(k_bits, v_bits, dpl):
        k_col, k_unpack = kv_word_parts(k_bits, dpl)
        v_col, v_unpack = kv_word_parts(v_bits, dpl)
        lanes_per_group = GROUP // dpl

        def read(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs):
            g = uint64(lane // lanes_per_group)
            kr[u] = k_pages[row, uint64(k_col(lane))]
            ks[u] = float32(k_scales[row, g])
            vr[u] = v_pages[row, uint64(v_col(lane))]
            vs[u] = float32(v_scales[row, g])

        def unpack_k(kr, u, lane, out):
            k_unpack(kr[u], lane, out)

        def unpack_v(vr, u, lane, out):
            v_unpack(vr[u], lane, out)

        raw_dtype = {4: int32, 8: int64}[dpl]
        width = 1
        scaled = True
    else:
        load_k, load_v = kv_loader(k_bits), kv_loader(v_bits)

        def read(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs):
            for i in range(dpl):
                kr[u * dpl + i] = load_k(k_pages, k_scales, row, lane + lanes * i)
                vr[u * dpl + i] = load_v(v_pages, v_scales, row, lane + lanes * i)

        def unpack_k(kr, u, lane, out):
            for i in range(dpl):
                out[i] = kr[u * dpl + i]

        unpack_v = unpack_k
        raw_dtype = float32
        width = dpl
        scaled = False
    jit = cuda.jit(device=True)
    return raw_dtype, width, scaled, jit(read), jit(unpack_k), jit(unpack_v)


# Integer codes to float32 without an int-to-float conversion (a quarter-rate instruction):
# the bits 0x4B000000 | c (c < 2^23) are the float 2^23 + c, so subtracting 2^23 + bias gives
# c - bias exactly.
_MAGIC_BITS = 0x4B000000
_MAGIC = 8388608.0  # 2^23


@functools.cache
def kv_word_parts(bits: int, dpl: int):
    """``(column, unpack)`` for word reads: ``column(lane)`` is the word holding the lane's
    ``dpl`` dims; ``unpack(word, lane, out)`` writes ``out[i]`` = the code of element
    ``lane * dpl + i`` (see the module docstring), as a float32."""
    if not vector_dims(bits, dpl):
        raise ValueError(f"no word loader for {bits}-bit pages with {dpl} dims per lane")
    lanes_per_group = GROUP // dpl
    if bits == 8:
        offset = _MAGIC + 128.0

        def column(lane):
            return lane

        def unpack(w, lane, out):
            # byte ^ 0x80 is the int8 code + 128 (0..255) for either sign
            for i in range(dpl):
                b = ((w >> (8 * i)) & 255) ^ 128
                out[i] = bits_float(_MAGIC_BITS | b) - offset

    else:
        offset = _MAGIC + 8.0

        def column(lane):
            g = lane // lanes_per_group
            j0 = (lane - g * lanes_per_group) * dpl  # first dim's index in its group
            return (g * HALF + j0 % HALF) // dpl

        def unpack(w, lane, out):
            g = lane // lanes_per_group
            j0 = (lane - g * lanes_per_group) * dpl
            w >>= 4 if j0 >= HALF else 0  # once: the shifts below are constants
            for i in range(dpl):
                out[i] = bits_float(_MAGIC_BITS | ((w >> (8 * i)) & 15)) - offset

    jit = cuda.jit(device=True)
    return jit(column), jit(unpack)


def as_rows(pages: torch.Tensor) -> torch.Tensor:
    """A page array [P, S, KV, X] as the kernels index it: [P * S * KV, X] (a view)."""
    return pages.view(-1, pages.shape[-1])


def word_dtype(dpl: int) -> torch.dtype:
    return {4: torch.int32, 8: torch.int64}[dpl]


@functools.cache
def kv_loader(bits: int):
    if bits == 0:

        def load(pages, scales, row, d):
            return float32(pages[row, uint64(d)])

    elif bits == 8:

        def load(pages, scales, row, d):
            return float32(pages[row, uint64(d)]) * float32(scales[row, uint64(d // GROUP)])

    elif bits == 4:

        def load(pages, scales, row, d):
            g = d // GROUP
            j = d - g * GROUP
            byte = int32(pages[row, uint64(g * HALF + j % HALF)])
            nibble = (byte >> 4) if j >= HALF else (byte & 15)
            return float32(nibble - 8) * float32(scales[row, uint64(g)])

    else:
        raise ValueError(f"no K/V loader for {bits}-bit pages (0, 8 or 4)")
    return cuda.jit(device=True)(load)
