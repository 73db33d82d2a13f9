"""A batch's context K or V gathered from quantized pages into one contiguous tensor, in one
kernel launch: what the prompt-chunk route (``quant_chunk_attention_cuda``, the CUDA op set's
for batches with prompt chunks or drafts) attends over with torch's SDPA on the tensor cores.

The torch reference (engine/cuda/quant_reference.py: ``gather_context``, the rotations of q
and the output) gathers the codes and scales of every page a group names, unpacks, scales,
puts in the sink and recent pages' rows and the chunk's own exact rows, and rotates q and
the output (two float32 matmuls): 128 torch ops for a prompt chunk's attention on q4 pages
with sink pages, 38 by this route (a dispatch counter in tests/kernels/test_kv_gather.py).
Those ops made a q4 mixed step host-bound on the H200: CPU 46-58 ms against 19-21 ms of GPU
work per 32 layers, 2.1 ms of it the rotations' matmuls
(bench/results/mixed_step_profile_h200_2026-11-27.txt). Here a grid block row takes one
page of one sequence, and 8 threads one quantization group (32 values) of one of its rows,
4 consecutive values each (one 32-bit load of codes, one 8-byte store of an fp16 output: a
warp reads and writes whole sectors), and write:

- a slot among the chunk's own rows (``own_slots``, ascending; ``OwnRows``, taken in the
  model's basis): that row, as the torch ``gather_context`` puts it in;
- a page below ``num_rows_pages`` (sink and recent pages): its unquantized row;
- otherwise code times the group's fp16 scale, in float32 (exact: at most 8 + 11
  significant bits);
- a negative page id (the padding of a block table): zeros (the attention masks them).

Rows and codes of rotated pages are rotated back (a 32-point Walsh-Hadamard transform over
the group's 8 threads: two butterfly levels in registers, three by warp shuffles,
``unrotate``), so the attention runs in the model's basis; then one rounding to the output
dtype. Without ``unrotate`` the values are the reference's, bit for
bit.
"""

from __future__ import annotations

import functools

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import GROUP, QuantPages
from engine.cuda import _launch
from engine.cuda.mma import pack_half2, warp_shfl_xor
from engine.cuda.quant_reference import quant_paged_attention_reference

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


def _own_row(own_slots, slot):
    """Where ``slot`` is in the ascending ``own_slots`` (-1: not there): a binary search,
    after a range test that settles most context rows (pages before the chunk's)."""
    hi = own_slots.shape[0]
    if hi == 0 or slot < own_slots[0] or slot > own_slots[hi - 1]:
        return -1
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if own_slots[mid] < slot:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < own_slots.shape[0] and own_slots[lo] == slot else -1


@functools.cache
def _gather_kernel(  # noqa: C901, PLR0915 (one kernel)
    bits: int, has_rows: bool, unrotate: bool, packed: bool, page_size: int, kv: int,
    num_groups: int,
):  # fmt: skip
    """``packed``: an fp16 output, written as an int64 view (4 values per store). The page
    shape is compiled in: a thread's (slot, head, group, lane) within its page then costs
    divisions by constants, not the 64-bit divisions by runtime sizes that would otherwise
    be most of a lane's instructions (a grid block row per page: no division for those)."""
    HALF = GROUP // 2
    PAGE_THREADS = page_size * kv * num_groups * LANES
    own_row = _launch.device_function(_own_row)

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
    def unrotate_group(vals, sub):
        """The group times H_32 / sqrt(32) (its own inverse: engine/cache/quant.py
        ``hadamard``, Sylvester's order), in place: butterflies of strides 1 and 2 within the
        lane's values, 4, 8 and 16 with lanes sub ^ 1, 2, 4 (the strides in order, each
        pair summed as x + y and x - y: the sums one thread per group made)."""
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
                vals[i] = other - vals[i] if upper else vals[i] + other
        for i in range(PER_LANE):
            vals[i] *= _INV_SQRT_GROUP

    def gather(words, scales, rows, num_rows_pages, index, own_slots, own_values, out):
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
        # (a negative page: block-table padding, zeros, which the attention masks)
        page = index[b, j] if live else -1
        # (no own rows: an empty own_slots, so that one compiled kernel serves every batch of
        # a cache, the warm-up's included)
        at = own_row(own_slots, page * page_size + s) if page >= 0 else -1
        vals = cuda.local.array(PER_LANE, float32)
        for k in range(PER_LANE):
            vals[k] = float32(0.0)
        if page >= 0 and at < 0:
            load(words, scales, rows, num_rows_pages, page, s, h, g, sub, vals)
        if unrotate:  # stored rotated: back to the model's basis, rounded once below
            unrotate_group(vals, sub)
        if not live:
            return
        d = g * GROUP + PER_LANE * sub
        if at >= 0:  # the chunk's own row, exact (and in the output's basis already)
            for k in range(PER_LANE):
                vals[k] = float32(own_values[at, h, d + k])
        if packed:  # four fp16 (each rounded to nearest), lowest dim in the low bits
            lo = int64(pack_half2(vals[0], vals[1])) & _LOW_WORD
            hi = int64(pack_half2(vals[2], vals[3]))
            out[b, j * page_size + s, h, d // PER_LANE] = (hi << 32) | lo
        else:
            for k in range(PER_LANE):
                out[b, j * page_size + s, h, d + k] = vals[k]

    return cuda.jit(gather)


def gather_context(
    pages: QuantPages,
    index: torch.Tensor,
    dtype: torch.dtype,
    own_slots: torch.Tensor | None = None,
    own_values: torch.Tensor | None = None,
    unrotate: bool = False,
) -> torch.Tensor:
    """The pages ``index`` ([B, n] page ids) dequantized into a new [B, n * S, KV, D] of
    ``dtype``: ``dequantize_pages`` (sink and recent pages from their rows), rotated back
    per group when ``unrotate`` (rotated pages read in the model's basis), with the rows
    ``own_values`` [N, KV, D] (``dtype``, in the output's basis) put in at the slots
    ``own_slots`` [N] (ascending) where the pages hold them, as the torch ``gather_context``
    (engine/cuda/quant_reference.py) does."""
    if dtype not in _launch.KERNEL_DTYPES:  # (no tensor made to check it: a per-layer call)
        raise ValueError(f"gather_context: dtype {dtype} is not supported by the CUDA kernels")
    if index.dim() != 2:
        raise ValueError(f"gather_context: index must be [B, n], got {tuple(index.shape)}")
    if (own_slots is None) != (own_values is None):
        raise ValueError("gather_context: own_slots and own_values go together")
    index = index.contiguous()  # (a group's slice of a block table: one layout, one compile)
    _, page_size, kv, _ = pages.data.shape
    groups = pages.scales.shape[3]
    b, n = index.shape
    out = torch.empty((b, n * page_size, kv, groups * GROUP), dtype=dtype, device=index.device)
    if out.numel() == 0:
        return out
    if own_slots is None:  # (none to find; own_values a dummy the kernel never reads)
        own_slots, own_values = index.new_zeros(0, dtype=torch.int64), out[0, :1]
    elif own_values.dtype != dtype:
        raise ValueError(f"gather_context: own_values are {own_values.dtype}, not {dtype}")
    has_rows = pages.sinks is not None
    rows = pages.sinks if has_rows else out  # (a dummy when there are none)
    num_rows_pages = pages.sinks.shape[0] if has_rows else 0
    packed = dtype == torch.float16
    kernel = _gather_kernel(pages.bits, has_rows, unrotate, packed, page_size, kv, groups)
    grid = (_launch.blocks(page_size * kv * groups * LANES, _THREADS), n, b)
    _launch.launch(
        kernel, grid, _THREADS, pages.data.view(torch.int32), pages.scales, rows,
        num_rows_pages, index, own_slots, own_values, out.view(torch.int64) if packed else out,
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
