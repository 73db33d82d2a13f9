"""A batch's context K or V gathered from quantized pages into one contiguous tensor, in one
kernel launch: what the prompt-chunk route (``quant_chunk_attention_cuda``, the CUDA op set's
for batches with prompt chunks or drafts) attends over with torch's SDPA on the tensor cores.

The torch reference (engine/cuda/quant_reference.py: ``gather_context``, the rotations of q
and the output) gathers the codes and scales of every page a group names, unpacks, scales,
puts in the sink and recent pages' rows and the chunk's own exact rows, and rotates q and
the output (two float32 matmuls): 118 torch ops for a prompt chunk's attention on q4 pages
with sink pages, 15 by this route (a dispatch counter in tests/kernels/test_kv_gather.py).
Those ops made a q4 mixed step host-bound on the H200: CPU 46-58 ms against 19-21 ms of GPU
work per 32 layers, 2.1 ms of it the rotations' matmuls
(bench/results/mixed_step_profile_h200_2026-11-27.txt). Here a grid block row takes one
page of one sequence, and 8 threads one quantization group (32 values) of one of its rows,
4 consecutive values each (one 32-bit load of codes, one 8-byte store of an fp16 output: a
warp reads and writes whole sectors), and write:

- a slot among the chunk's own rows (``OwnRows``: slots ascending, found by binary search):
  that row as the cache write took it, made here (keys: rotary on the pair of dims i and
  i +- D/2 from the forward's tables, rounded as the write rounds it, less the pages'
  center), so no torch op per layer makes them;
- a page below ``num_rows_pages`` (sink and recent pages): its unquantized row;
- otherwise code times the group's fp16 scale, in float32 (exact: at most 8 + 11
  significant bits);
- a negative page id (the padding of a block table): zeros (the attention masks them).

Rows and codes of rotated pages are rotated back (a 32-point Walsh-Hadamard transform over
the group's 8 threads: two butterfly levels in registers, three by warp shuffles,
``unrotate``), so the attention runs in the model's basis (own rows, made in it, are rotated
into the pages' basis instead when ``unrotate`` is off); then one rounding to the output
dtype. Codes and rows without ``unrotate`` are the reference's bit for bit, and so are own
rows of values on pages not rotated.
"""

from __future__ import annotations

import functools

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import GROUP, QuantPages
from engine.cuda import _launch
from engine.cuda.mma import pack_half2, warp_shfl_xor
from engine.cuda.quant_reference import (
    OwnRows,
    own_slot_index,
    quant_paged_attention_reference,
)

cuda = _launch.cuda
float32 = _launch.nbt.float32
int32 = _launch.nbt.int32
int64 = _launch.nbt.int64

_THREADS = 128
# Threads per quantization group, each taking PER_LANE consecutive values: a warp then writes
# 4 whole groups, 256 contiguous bytes of an fp16 output (one 8-byte store per thread), and
# reads their codes (128 or 64 contiguous bytes). One thread per group wrote 32 values 64
# bytes apart from its neighbours' (32 stores per thread, each of a warp's touching 32
# sectors). The Hadamard levels across values of different threads go by warp shuffles.
LANES = 8
PER_LANE = GROUP // LANES
_INV_SQRT_GROUP = float32(1.0 / GROUP**0.5)
_LOW_WORD = 0xFFFFFFFF


@functools.cache
def _gather_kernel(  # noqa: C901, PLR0915 (one kernel)
    bits: int, has_rows: bool, unrotate: bool, packed: bool, page_size: int, kv: int,
    num_groups: int, rotated: bool = False, keys: bool = False, centered: bool = False,
):  # fmt: skip
    """``packed``: an fp16 output, written as an int64 view (4 values per store). The page
    shape is compiled in: a thread's (slot, head, group, lane) within its page then costs
    divisions by constants, not the 64-bit divisions by runtime sizes that would otherwise
    be most of a lane's instructions (a grid block row per page: no division for those).
    ``rotated``: the pages are (own rows, made in the model's basis, are rotated unless
    ``unrotate``); ``keys``: own rows take rotary, and ``centered`` the pages' center."""
    HALF = GROUP // 2
    PAGE_THREADS = page_size * kv * num_groups * LANES
    HALF_DIM = num_groups * GROUP // 2
    HADAMARD_OWN = rotated and not unrotate  # (and the stored values: ``unrotate``)
    io = _launch.NUMBA_DTYPES[torch.float16 if packed else torch.float32]  # the output dtype
    own_row = _launch.device_function(own_slot_index)

    @_launch.device_function
    def load(words, scales, rows, num_rows_pages, page, s, h, g, sub, vals):
        """The lane's values (dims 32 g + PER_LANE sub ...) of the row: a sink or recent
        page's unquantized row, else its codes (one 32-bit word of the page bytes, ``words``)
        times the group's scale (exact in float32)."""
        if has_rows and page < num_rows_pages:
            d = g * GROUP + PER_LANE * sub
            for k in range(PER_LANE):
                vals[k] = float32(rows[page, s, h, d + k])
            return
        scale = float32(scales[page, s, h, g])
        if bits == 8:  # the lane's 4 signed bytes, dim d + k in byte k (little-endian)
            word = int32(words[page, s, h, g * (GROUP // 4) + sub])
            for k in range(PER_LANE):
                byte = (word >> (8 * k)) & 255
                vals[k] = float32(byte - 256 if byte >= 128 else byte) * scale
        else:  # byte i of the group: dim i in its low nibble, dim 16 + i in its high one
            word = int32(words[page, s, h, g * (HALF // 4) + sub % (HALF // PER_LANE)])
            shift = 4 * (sub // (HALF // PER_LANE))
            for k in range(PER_LANE):
                vals[k] = float32(((word >> (8 * k + shift)) & 15) - 8) * scale

    @_launch.device_function
    def hadamard(vals, sub, apply):
        """The group times H_32 / sqrt(32) (its own inverse: engine/cache/quant.py
        ``hadamard``, Sylvester's order), in place when ``apply`` (the same for a group's 8
        lanes; every lane shuffles either way): butterflies of strides 1 and 2 within the
        lane's values, 4, 8 and 16 with lanes sub ^ 1, 2, 4 (the strides in order, each pair
        summed as x + y and x - y: the sums one thread per group made)."""
        if apply:
            for stride in (1, 2):
                for i in range(PER_LANE):
                    if i & stride == 0:
                        x = vals[i]
                        y = vals[i + stride]
                        vals[i] = x + y
                        vals[i + stride] = x - y
        for mask in (1, 2, 4):
            upper = sub & mask
            for i in range(PER_LANE):
                other = warp_shfl_xor(vals[i], mask)
                if apply:
                    vals[i] = other - vals[i] if upper else vals[i] + other
        if apply:
            for i in range(PER_LANE):
                vals[i] *= _INV_SQRT_GROUP

    @_launch.device_function
    def own_load(own_rows, own_values, own_cos, own_sin, center, at, h, d, vals):
        """The lane's values of own row ``at`` as the write took it: keys with rotary (the
        pair of dims i and i +- D/2), each product and the sum rounded to the model's dtype as
        the cache write kernel (engine/cuda/quant_kernels.py) and ``rotary_rows`` round them,
        less the center in float32: the key its codes were made from."""
        row = own_rows[at]
        for k in range(PER_LANE):
            x = float32(own_values[row, h, d + k])
            if keys:
                i = (d + k) % HALF_DIM
                c = float32(own_cos[row, i])
                sn = float32(own_sin[row, i])
                if d + k < HALF_DIM:
                    other = -float32(own_values[row, h, d + k + HALF_DIM])
                else:
                    other = float32(own_values[row, h, d + k - HALF_DIM])
                x = float32(io(float32(io(x * c)) + float32(io(other * sn))))
            if centered:
                x -= float32(center[h, d + k])
            vals[k] = x

    def gather(words, scales, rows, num_rows_pages, index, own_slots, own_rows, own_values,
               own_cos, own_sin, center, out):  # fmt: skip
        """out[b, j * S + s, h, 32 g ...] for the block's (b, j) = (blockIdx.z, blockIdx.y)
        and the thread's (s, h, g), PER_LANE values of it per thread. No thread leaves before
        the shuffles (every lane takes part)."""
        b = cuda.blockIdx.z
        j = cuda.blockIdx.y
        local = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        live = local < PAGE_THREADS
        sub = local % LANES
        g = local // LANES % num_groups
        h = local // (LANES * num_groups) % kv
        s = local // (LANES * num_groups * kv)
        d = g * GROUP + PER_LANE * sub
        # (a negative page: block-table padding, zeros, which the attention masks)
        page = index[b, j] if live else -1
        # (no own rows: an empty own_slots, so that one compiled kernel serves every batch of
        # a cache, the warm-up's included)
        at = own_row(own_slots, page * page_size + s) if page >= 0 else -1
        vals = cuda.local.array(PER_LANE, float32)
        for k in range(PER_LANE):
            vals[k] = float32(0.0)
        if at >= 0:  # the chunk's own row, exact
            own_load(own_rows, own_values, own_cos, own_sin, center, at, h, d, vals)
        elif page >= 0:
            load(words, scales, rows, num_rows_pages, page, s, h, g, sub, vals)
        if unrotate or HADAMARD_OWN:  # into the output's basis, rounded once below
            hadamard(vals, sub, HADAMARD_OWN if at >= 0 else unrotate)
        if not live:
            return
        if packed:  # four fp16 (each rounded to nearest), lowest dim in the low bits
            lo = int64(pack_half2(vals[0], vals[1])) & _LOW_WORD
            hi = int64(pack_half2(vals[2], vals[3]))
            out[b, j * page_size + s, h, d // PER_LANE] = (hi << 32) | lo
        else:
            for k in range(PER_LANE):
                out[b, j * page_size + s, h, d + k] = vals[k]

    return cuda.jit(gather)


@functools.cache
def _dummy(device: torch.device, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A tensor the kernel never reads, of the type of the one it stands for (own rows when
    there are none: empty slots and rows, a [1, 1, 1] of values, [1, 1] tables and center),
    made once per device, not per call (as an ordinary tensor even when that first call runs
    under ``torch.inference_mode``: a cached inference tensor would behave differently later)."""
    with torch.inference_mode(False):
        return torch.zeros((0,) if ndim == 1 else (1,) * ndim, dtype=dtype, device=device)


def gather_context(
    pages: QuantPages,
    index: torch.Tensor,
    dtype: torch.dtype,
    own: OwnRows | None = None,
    unrotate: bool = False,
) -> torch.Tensor:
    """The pages ``index`` ([B, n] page ids) dequantized into a new [B, n * S, KV, D] of
    ``dtype``: ``dequantize_pages`` (sink and recent pages from their rows), rotated back
    per group when ``unrotate`` (rotated pages read in the model's basis), with the ``own``
    rows (keys: rotary and the center applied here) put in, in the output's basis, where the
    pages hold their slots, as the torch ``gather_context`` (engine/cuda/quant_reference.py)
    does. Own rows of keys go with the K pages that keep written rows (``exact_chunks``)."""
    if dtype not in _launch.KERNEL_DTYPES:  # (no tensor made to check it: a per-layer call)
        raise ValueError(f"gather_context: dtype {dtype} is not supported by the CUDA kernels")
    if index.dim() != 2:
        raise ValueError(f"gather_context: index must be [B, n], got {tuple(index.shape)}")
    # one compiled kernel per pages, own rows or not: K pages that keep written rows give
    # their own rows rotary (and the center, when centered), V pages neither
    keys = pages.written is not None
    centered = keys and pages.center is not None
    if own is not None and ((own.cos is not None) != keys or (own.center is not None) != centered):
        raise ValueError(
            "gather_context: own rows of keys (rotary tables, center) go with the K pages "
            "that keep written rows, and only with them"
        )
    index = index.contiguous()  # (a group's slice of a block table: one layout, one compile)
    _, page_size, kv, _ = pages.data.shape
    groups = pages.scales.shape[3]
    b, n = index.shape
    out = torch.empty((b, n * page_size, kv, groups * GROUP), dtype=dtype, device=index.device)
    if out.numel() == 0:
        return out
    table = _dummy(index.device, dtype, 2)
    if own is None:
        slots = rows_of = _dummy(index.device, torch.int64, 1)
        values, cos, sin, center = _dummy(index.device, dtype, 3), table, table, pages.center
    else:
        if own.values.dtype != dtype:
            raise ValueError(f"gather_context: own rows are {own.values.dtype}, not {dtype}")
        slots, rows_of, cos, sin, center = own.slots, own.rows, own.cos, own.sin, own.center
        # (a view of the fused qkv projection: copied, so that every call has one layout)
        values = own.values if own.values.is_contiguous() else own.values.contiguous()
        cos, sin = (table, table) if cos is None else (cos, sin)
    center = _dummy(index.device, torch.float32, 2) if center is None else center
    has_rows = pages.sinks is not None
    rows = pages.sinks if has_rows else out  # (a dummy when there are none)
    num_rows_pages = pages.sinks.shape[0] if has_rows else 0
    packed = dtype == torch.float16
    kernel = _gather_kernel(pages.bits, has_rows, unrotate, packed, page_size, kv, groups,
                            pages.rotate, keys, centered)  # fmt: skip
    grid = (_launch.blocks(page_size * kv * groups * LANES, _THREADS), n, b)
    _launch.launch(
        kernel, grid, _THREADS, pages.data.view(torch.int32), pages.scales, rows,
        num_rows_pages, index, slots, rows_of, values, cos, sin, center,
        out.view(torch.int64) if packed else out,
    )  # fmt: skip
    return out


def quant_chunk_attention_cuda(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The CUDA op set's route for batches with prompt chunks or drafts over quantized pages
    (engine/ops.py ``by_query_length``): ``quant_paged_attention_reference``'s SDPA over the
    context this kernel gathers (one launch per K and V and per group of sequences) in the
    model's basis, so neither q nor the output is rotated."""
    return quant_paged_attention_reference(
        q, k_pages, v_pages, batch, scale, sliding_window, gather=gather_context,
        model_basis=True,
    )  # fmt: skip
