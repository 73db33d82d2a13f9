"""Device functions the attention kernel reads K and V through, per page format.

``kv_loader(bits, head_dim)`` returns ``load(pages, scales, row, d) -> float32``. The kernel
gets every page array flat (``flat_pages``): [P, S, KV, X] as [P * S * KV * X], read at
``row * X + x`` for row ``(page * S + slot) * KV + head`` (uint32: the kernel computes it in 32
bits) and X a compile-time constant (``row_widths``), every index unsigned. Numba adds a
negative-index fix-up per signed index and dimension and multiplies by the runtime shape in
64 bits: with 4-D indexing that was about a fifth of the q4 decode loop's instructions.

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
to exact floats x that stand for the codes (8-bit: the code itself; 4-bit: code = 256 * (x -
0.53125), ``word_affine``) and the kernel applies the scale, the factor and the offset once per
row, so its products round differently from the reference's code * scale per element (within
the float32 tolerance the tests hold).

``kv_step_reader`` puts both forms behind one interface for the kernel's steps of several keys:
read every key's raw words (or elements) first, unpack each when it is used.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.cuda._launch import cuda, device_function
from engine.cuda.bits import bits_float, byte_perm

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


def row_widths(bits: int, head_dim: int, dpl: int, words: bool) -> tuple[int, int]:
    """(values, scales) per page row of one format as the kernel indexes them: words of
    ``dpl`` bytes, or elements (run-dtype values, int8 codes, or bytes of two 4-bit codes)."""
    if bits == 0:
        return head_dim, head_dim  # (the scales argument repeats the values: never read)
    width = head_dim * bits // 8  # bytes (engine/cache/quant.py data_width)
    return (width // dpl if words else width), head_dim // GROUP


def flat_pages(pages: torch.Tensor) -> torch.Tensor:
    """A page array [P, S, KV, X] as the kernels index it: one flat view."""
    return pages.view(-1)


@functools.cache
def kv_step_reader(k_bits: int, v_bits: int, head_dim: int, lanes: int, affine: bool = True):
    """``(raw_dtype, raw_width, scaled, read, unpack_k, unpack_v)``: how the attention kernel
    brings several keys' K and V into registers before it uses any of them (their loads
    overlap), then turns them into numbers.

    ``read(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs)`` stores key
    ``u``'s raw K and V (at ``row``, see the module docstring) of this lane in ``kr``/``vr``
    (``raw_width`` entries of ``raw_dtype`` per key) and, when ``scaled``, their group scales
    in ``ks``/``vs``; ``unpack_k(kr, u, lane, out)`` (and ``unpack_v``) then write the lane's
    ``dpl = head_dim // lanes`` float32 numbers of key ``u``.

    - Words (``reads_words``; ``scaled``): the lane's dims are ``lane * dpl + i``, one load and
      one scale per key and side; ``out`` gets exact floats standing for the codes
      (``word_affine``), and the kernel applies the scale once per row (to a dot product, or to
      a softmax weight) instead of once per element: value = code * scale, the same product in
      another order.
    - Elements (not ``scaled``): dims ``lane + lanes * i``, dequantized as they are read.
    """
    dpl = head_dim // lanes
    words = reads_words(k_bits, v_bits, dpl)
    kw, ksw = (np.uint64(x) for x in row_widths(k_bits, head_dim, dpl, words))
    vw, vsw = (np.uint64(x) for x in row_widths(v_bits, head_dim, dpl, words))
    if words:
        k_col, k_unpack = kv_word_parts(k_bits, dpl, affine)
        v_col, v_unpack = kv_word_parts(v_bits, dpl, affine)
        lanes_per_group = GROUP // dpl

        def read(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs):
            at = uint64(row)
            g = uint64(lane // lanes_per_group)
            kr[u] = k_pages[at * kw + uint64(k_col(lane))]
            ks[u] = float32(k_scales[at * ksw + g])
            vr[u] = v_pages[at * vw + uint64(v_col(lane))]
            vs[u] = float32(v_scales[at * vsw + g])

        def unpack_k(kr, u, lane, out):
            k_unpack(kr[u], lane, out)

        def unpack_v(vr, u, lane, out):
            v_unpack(vr[u], lane, out)

        raw_dtype = {4: int32, 8: int64}[dpl]
        width = 1
        scaled = True
    else:
        load_k, load_v = kv_loader(k_bits, head_dim), kv_loader(v_bits, head_dim)

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
    jit = device_function
    return raw_dtype, width, scaled, jit(read), jit(unpack_k), jit(unpack_v)


# Integer codes to float32 without an int-to-float conversion (a quarter-rate instruction):
# the bits 0x4B000000 | c (c < 2^23) are the float 2^23 + c, so subtracting 2^23 + bias gives
# c - bias exactly. One byte permute (PRMT) builds those bits from a word's byte k and the
# magic's three upper bytes (y:x bytes 5, 6, 7 of ``byte_perm(word, _MAGIC_BITS, ...)``).
_MAGIC_BITS = 0x4B000000
_MAGIC = 8388608.0  # 2^23
_MAGIC_OF_BYTE = tuple(0x7650 | k for k in range(4))  # byte_perm selectors: byte k + magic
_LOW_NIBBLES = 0x0F0F0F0F
_SIGN_BITS = 0x80808080


@functools.cache
def _bytes_to_floats(dpl: int, bias: float):
    """``convert(lo, hi, out)``: out[i] = byte i of the word lo:hi (bytes 0-3 of lo, then of
    hi) less ``bias``, as a float32: one byte permute and one add each."""
    offset = _MAGIC + bias

    def convert(lo, hi, out):
        for i in range(dpl):
            half = lo if i < 4 else hi
            out[i] = bits_float(byte_perm(half, _MAGIC_BITS, _MAGIC_OF_BYTE[i % 4])) - offset

    return device_function(convert)


# 4-bit codes skip even the add: with the bits 0x3F000000 | c << 16 (byte 2 = c < 16) the
# float is 0.5 + c / 256 exactly, so one byte permute per code gives x = (code + 136) / 256
# (the stored nibble c is code + 8): code = 256 * (x - 0.53125) (``word_affine``); the kernel
# folds the factor and the offset into per-tile constants.
# Not for 8-bit codes: there byte 2 would reach the exponent, and placing them lower scales
# the float32 rounding of the products up past 8-bit codes' own error.
_HALF_BITS = 0x3F000000
_HALF_OF_BYTE = tuple(0x7054 | (k << 8) for k in range(4))  # byte k into byte 2 of 0.5
_NIBBLE_FACTOR = 256.0
_NIBBLE_OFFSET = 136.0 / 256.0


@functools.cache
def _nibbles_to_affine(dpl: int):
    """``convert(lo, hi, out)``: out[i] = 0.5 + (byte i of the word lo:hi) / 256 as a float32,
    for bytes below 16: one byte permute each."""

    def convert(lo, hi, out):
        for i in range(dpl):
            half = lo if i < 4 else hi
            out[i] = bits_float(byte_perm(half, _HALF_BITS, _HALF_OF_BYTE[i % 4]))

    return device_function(convert)


def word_affine(bits: int, affine: bool = True) -> tuple[float, float]:
    """(factor, offset): a word read's unpacked float x stands for the code
    ``factor * (x - offset)`` -- (1, 0) for 8-bit codes, which unpack to the code itself, and
    for 4-bit ones without ``affine`` (a permute and an add each, as before)."""
    return (_NIBBLE_FACTOR, _NIBBLE_OFFSET) if bits == 4 and affine else (1.0, 0.0)


@functools.cache
def kv_word_parts(bits: int, dpl: int, affine: bool = True):
    """``(column, unpack)`` for word reads: ``column(lane)`` is the word holding the lane's
    ``dpl`` dims; ``unpack(word, lane, out)`` writes ``out[i]`` = x for element
    ``lane * dpl + i`` (see the module docstring) as a float32, where the element's code is
    ``factor * (x - offset)`` (``word_affine``)."""
    if not vector_dims(bits, dpl):
        raise ValueError(f"no word loader for {bits}-bit pages with {dpl} dims per lane")
    lanes_per_group = GROUP // dpl
    if bits == 8:
        bytes_to_floats = _bytes_to_floats(dpl, 128.0)

        def column(lane):
            return lane

        def unpack(w, lane, out):
            # byte ^ 0x80 is the int8 code + 128 (0..255) for either sign; per 4 bytes
            w = int64(w)  # (4-byte words too: the masks below are 32-bit)
            lo = (w & 0xFFFFFFFF) ^ _SIGN_BITS
            hi = ((w >> 32) & 0xFFFFFFFF) ^ _SIGN_BITS
            bytes_to_floats(lo, hi, out)

    else:
        nibbles_to_floats = _nibbles_to_affine(dpl) if affine else _bytes_to_floats(dpl, 8.0)

        def column(lane):
            g = lane // lanes_per_group
            j0 = (lane - g * lanes_per_group) * dpl  # first dim's index in its group
            return (g * HALF + j0 % HALF) // dpl

        def unpack(w, lane, out):
            g = lane // lanes_per_group
            j0 = (lane - g * lanes_per_group) * dpl
            w = int64(w) >> (4 if j0 >= HALF else 0)  # the lane's nibbles to the bytes' low halves
            nibbles_to_floats(w & _LOW_NIBBLES, (w >> 32) & _LOW_NIBBLES, out)

    jit = device_function
    return jit(column), jit(unpack)


def word_dtype(dpl: int) -> torch.dtype:
    return {4: torch.int32, 8: torch.int64}[dpl]


@functools.cache
def kv_loader(bits: int, head_dim: int):
    if bits not in (0, 8, 4):
        raise ValueError(f"no K/V loader for {bits}-bit pages (0, 8 or 4)")
    w, sw = (np.uint64(x) for x in row_widths(bits, head_dim, 1, False))
    if bits == 0:

        def load(pages, scales, row, d):
            return float32(pages[uint64(row) * w + uint64(d)])

    elif bits == 8:

        def load(pages, scales, row, d):
            at = uint64(row)
            scale = float32(scales[at * sw + uint64(d // GROUP)])
            return float32(pages[at * w + uint64(d)]) * scale

    else:

        def load(pages, scales, row, d):
            at = uint64(row)
            g = d // GROUP
            j = d - g * GROUP
            byte = int32(pages[at * w + uint64(g * HALF + j % HALF)])
            nibble = (byte >> 4) if j >= HALF else (byte & 15)
            return float32(nibble - 8) * float32(scales[at * sw + uint64(g)])

    return device_function(load)
