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
(bench/results/mixed_step_profile_h200_2026-11-27.txt). Here one thread takes one
quantization group (32 values) of one row and writes:

- a slot among the chunk's own rows (``own_slots``, ascending; ``OwnRows``, taken in the
  model's basis): that row, as the torch ``gather_context`` puts it in;
- a page below ``num_rows_pages`` (sink and recent pages): its unquantized row;
- otherwise code times the group's fp16 scale, in float32 (exact: at most 8 + 11
  significant bits);
- a negative page id (the padding of a block table): zeros (the attention masks them).

Rows and codes of rotated pages are rotated back (a 32-point Walsh-Hadamard transform in the
thread's registers, ``unrotate``), so the attention runs in the model's basis; then one
rounding to the output dtype. Without ``unrotate`` the values are the reference's, bit for
bit.
"""

from __future__ import annotations

import functools

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import GROUP, QuantPages
from engine.cuda import _launch
from engine.cuda.quant_reference import quant_paged_attention_reference

cuda = _launch.cuda
float32 = _launch.nbt.float32
int32 = _launch.nbt.int32

_THREADS = 128
_INV_SQRT_GROUP = float32(1.0 / GROUP**0.5)


def _own_row(own_slots, slot):
    """Where ``slot`` is in the ascending ``own_slots`` (-1: not there): a binary search."""
    lo = 0
    hi = own_slots.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if own_slots[mid] < slot:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < own_slots.shape[0] and own_slots[lo] == slot else -1


def _unrotate(vals):
    """vals [32] times H_32 / sqrt(32) (its own inverse: engine/cache/quant.py ``hadamard``,
    Sylvester's order), in place: five butterfly levels."""
    for stride in (1, 2, 4, 8, 16):
        for i in range(GROUP):
            if i & stride == 0:
                x = vals[i]
                y = vals[i + stride]
                vals[i] = x + y
                vals[i + stride] = x - y
    for i in range(GROUP):
        vals[i] *= _INV_SQRT_GROUP


@functools.cache
def _gather_kernel(bits: int, has_rows: bool, unrotate: bool):  # noqa: C901 (one kernel)
    HALF = GROUP // 2
    own_row = _launch.device_function(_own_row)
    unrotate_group = _launch.device_function(_unrotate)

    @_launch.device_function
    def codes(data, scales, page, s, h, g, vals):
        """The group's codes times its scale into vals (exact in float32)."""
        scale = float32(scales[page, s, h, g])
        if bits == 8:
            for i in range(GROUP):
                vals[i] = float32(data[page, s, h, g * GROUP + i]) * scale
        else:  # byte i of the group: dim i in its low nibble, dim 16 + i in its high one
            for i in range(HALF):
                byte = int32(data[page, s, h, g * HALF + i])
                vals[i] = float32((byte & 15) - 8) * scale
                vals[HALF + i] = float32((byte >> 4) - 8) * scale

    def gather(data, scales, rows, num_rows_pages, index, own_slots, own_values, out):
        """out[b, j * S + s, h, 32 g ...] for the thread's (b, j, s, h, g)."""
        num_groups = scales.shape[3]
        kv = data.shape[2]
        page_size = data.shape[1]
        blocks = index.shape[1]
        idx = cuda.grid(1)
        if idx >= index.shape[0] * blocks * page_size * kv * num_groups:
            return
        g = idx % num_groups
        h = idx // num_groups % kv
        s = idx // (num_groups * kv) % page_size
        j = idx // (num_groups * kv * page_size) % blocks
        b = idx // (num_groups * kv * page_size * blocks)
        t = j * page_size + s
        d0 = g * GROUP
        page = index[b, j]
        if page < 0:  # (block-table padding: masked by the attention)
            for i in range(GROUP):
                out[b, t, h, d0 + i] = 0
            return
        # (no own rows: an empty own_slots, so that one compiled kernel serves every batch of
        # a cache, the warm-up's included)
        at = own_row(own_slots, page * page_size + s)
        if at >= 0:  # the chunk's own row, exact (and in the output's basis already)
            for i in range(GROUP):
                out[b, t, h, d0 + i] = own_values[at, h, d0 + i]
            return
        vals = cuda.local.array(GROUP, float32)
        if has_rows and page < num_rows_pages:  # a sink or recent page: its exact row
            for i in range(GROUP):
                vals[i] = float32(rows[page, s, h, d0 + i])
        else:
            codes(data, scales, page, s, h, g, vals)
        if unrotate:  # stored rotated: back to the model's basis, rounded once below
            unrotate_group(vals)
        for i in range(GROUP):
            out[b, t, h, d0 + i] = vals[i]

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
    total = b * n * page_size * kv * groups
    if total == 0:
        return out
    if own_slots is None:  # (none to find; own_values a dummy the kernel never reads)
        own_slots, own_values = index.new_zeros(0, dtype=torch.int64), out[0, :1]
    elif own_values.dtype != dtype:
        raise ValueError(f"gather_context: own_values are {own_values.dtype}, not {dtype}")
    has_rows = pages.sinks is not None
    rows = pages.sinks if has_rows else out  # (a dummy when there are none)
    num_rows_pages = pages.sinks.shape[0] if has_rows else 0
    kernel = _gather_kernel(pages.bits, has_rows, unrotate)
    _launch.launch(
        kernel, _launch.blocks(total, _THREADS), _THREADS, pages.data, pages.scales, rows,
        num_rows_pages, index, own_slots, own_values, out,
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
