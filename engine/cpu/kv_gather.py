"""A batch's context K or V gathered from quantized pages into one float32 tensor on the CPU,
by a Numba kernel: what a prompt chunk (or a row with drafts to verify) attends over with
torch's SDPA. The CPU counterpart of engine/cuda/kv_gather.py, with the same contract as the
torch reference (engine/cuda/quant_reference.py ``gather_context``), which unpacks, scales,
puts in the sink and recent pages' rows, makes the chunk's own rows (rotary, center) and
rotates them in ~20 torch ops per call, and whose attention in the pages' basis rotates q
and the output by a matmul per layer. The route below reads the context in the model's
basis (``unrotate``), as the CUDA op set does, so q and the output are not rotated.
SmolLM2, 1 x 4000 tokens in prompt chunks of 512, 2 cores, both routes in one process
(bench/cpu_chunk_gather.py): q4 prefill 8.58 -> 8.22 s, q8 8.56 -> 8.41 (fp16 7.61). The
kernel's own time is mostly the output's memory (a new tensor per call, whose pages it
faults in as it writes them) and, rotating back, the butterflies (scalar code: ~0.5 ns a
value).

Per (sequence, page) work item, for each row and KV head of the page:

- a slot among the chunk's own rows (``OwnRows``, slots ascending: a binary search) gets
  that row as the cache write took it: keys with rotary (each product and the sum rounded
  to float32, as ``rotary_rows``), less the pages' center; rotated into the pages' basis
  when the pages are rotated and ``unrotate`` is off;
- a page below the rows' count (sink and recent pages) its unquantized row;
- any other page its codes times the group's float16 scale (exact in float32);
- a negative page id (block-table padding, which the attention masks) zeros.

Stored rows and codes are rotated back (``unrotate``) by the reference's butterflies
(engine/cpu/hadamard.py), so every value is the reference's bit for bit. Work items are
taken in turn by torch's threads (engine/cpu/team.py). Other dtypes (a float16 or bfloat16
model on the CPU) go to the torch reference.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.cache.quant import GROUP, QuantPages
from engine.cpu.bits import float16_bits
from engine.cpu.decode_attention import half_table
from engine.cpu.hadamard import rotate_row
from engine.cpu.simd import BYTES_4BIT, dequantize_4bit_group, dequantize_8bit_group
from engine.cpu.team import share
from engine.cuda import quant_reference
from engine.cuda.quant_reference import (
    OwnRows,
    own_slot_index,
    quant_paged_attention_reference,
)
from engine.numba_cache import cached_njit

_own_index = cached_njit(own_slot_index)


@cached_njit
def _own_row(values, r, cos, sin, center, keys, centered, h, out):
    """out [D] = the write's row r ``values`` [T, KV, D] at head h as its codes were made
    from: keys with rotary from tables [T, D / 2] (x_i cos_i - x_i+D/2 sin_i below D/2,
    x_i cos_i + x_i-D/2 sin_i above, each product and the sum rounded to float32), less the
    center [KV, D] (``centered``)."""
    dim = out.shape[0]
    half = dim // 2
    for d in range(dim):
        x = values[r, h, d]
        if keys:
            i = d % half
            other = -values[r, h, d + half] if d < half else values[r, h, d - half]
            x = np.float32(np.float32(x * cos[r, i]) + np.float32(other * sin[r, i]))
        if centered:
            x = np.float32(x - center[h, d])
        out[d] = x


@cached_njit
def _dequantized(data, scales, page, s, h, table, bits, out):
    """out [D] = the codes data[page, s, h] [W] times their groups' float16 scales
    scales[page, s, h] [D / 32] (bits; 4-bit: byte j of a group holds element j in its low
    nibble, j + 16 in its high one, each + 8), a group at a time in vector code
    (engine/cpu/simd.py)."""
    for g in range(scales.shape[3]):
        scale = table[scales[page, s, h, g]]
        if bits == 8:
            dequantize_8bit_group(data, (page, s, h, g * GROUP), out, (g * GROUP,), scale)
        else:
            dequantize_4bit_group(data, (page, s, h, g * BYTES_4BIT), out, (g * GROUP,), scale)


@cached_njit(nogil=True)
def _gather_items(
    index, data, scales, table, bits, rows, num_rows_pages,
    own_slots, own_rows, own_values, cos, sin, center, keys, centered, rotate_own, unrotate,
    out, first, last,
):  # fmt: skip
    """out [B, n * S, KV, D] for work items [first, last) (item b * n + j: page index[b, j]):
    see the module's docstring. Each row is made in a scratch row, then copied: indexing
    the arrays whole, since a slice per row (a view, its reference count taken and dropped)
    cost more than the row's values."""
    n = index.shape[1]
    page_size, kv, dim = out.shape[1] // n, out.shape[2], out.shape[3]
    row = np.empty(dim, np.float32)
    for item in range(first, last):
        b, j = item // n, item % n
        page = index[b, j]
        for s in range(page_size):
            t = j * page_size + s
            at = _own_index(own_slots, page * page_size + s) if page >= 0 else -1
            for h in range(kv):
                if page < 0:
                    row[:] = 0.0
                elif at >= 0:
                    _own_row(own_values, own_rows[at], cos, sin, center, keys, centered, h, row)
                    if rotate_own:
                        rotate_row(row)
                else:
                    if page < num_rows_pages:
                        for d in range(dim):
                            row[d] = rows[page, s, h, d]
                    else:
                        _dequantized(data, scales, page, s, h, table, bits, row)
                    if unrotate:
                        rotate_row(row)
                for d in range(dim):
                    out[b, t, h, d] = row[d]


@functools.cache
def _empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An array the kernel never reads, of the type of the one it stands for (the kernel's
    argument types stay fixed: one compiled version)."""
    return np.zeros(shape, dtype)


def _indices(ids: torch.Tensor) -> np.ndarray:
    """Page ids, slots or rows as one array type (int64, C order): a block table's slice for
    a group of sequences is neither."""
    return np.ascontiguousarray(ids.numpy(), dtype=np.int64)


def _floats(values: torch.Tensor) -> np.ndarray:
    """float32 values in C order (own rows are a view of the fused qkv projection)."""
    return np.ascontiguousarray(values.numpy())


def _own_arrays(own: OwnRows | None) -> tuple:
    """(slots, rows, values, cos, sin, center, keys, centered) as the kernel takes them, of
    one type and layout whatever the call (unused ones as small arrays it never reads), so
    that the kernel has one compiled version: the one the runner's warm-up made."""
    unused = _empty((1, 1), np.float32)
    if own is None:
        no_ids = _empty((0,), np.int64)
        return no_ids, no_ids, _empty((1, 1, 1), np.float32), unused, unused, unused, False, False
    keys, centered = own.cos is not None, own.center is not None
    cos, sin = (_floats(own.cos), _floats(own.sin)) if keys else (unused, unused)
    center = _floats(own.center) if centered else unused
    rows = (_indices(own.slots), _indices(own.rows), _floats(own.values))
    return (*rows, cos, sin, center, keys, centered)


def takes(pages: QuantPages, dtype: torch.dtype, own: OwnRows | None) -> bool:
    """Whether the kernel takes this gather: float32 out of CPU pages, with float32 sink rows
    and own rows (and rotary tables), if any."""
    if dtype != torch.float32 or pages.data.device.type != "cpu":
        return False
    if pages.sinks is not None and pages.sinks.dtype != torch.float32:
        return False
    if own is None:
        return True
    tables = () if own.cos is None else (own.cos, own.sin)
    return all(t.dtype == torch.float32 for t in (own.values, *tables))


def gather_context_cpu(
    pages: QuantPages,
    index: torch.Tensor,
    dtype: torch.dtype,
    own: OwnRows | None = None,
    unrotate: bool = False,
) -> torch.Tensor:
    """``quant_reference.gather_context`` (same contract, same values bit for bit; zeros at
    block-table padding) by the kernel, or by the reference where the kernel does not take
    the call (``takes``)."""
    if not takes(pages, dtype, own):
        return quant_reference.gather_context(pages, index, dtype, own, unrotate)
    if index.dim() != 2:
        raise ValueError(f"gather_context: index must be [B, n], got {tuple(index.shape)}")
    _, page_size, kv, _ = pages.data.shape
    dim = pages.scales.shape[3] * GROUP
    b, n = index.shape
    out = torch.empty((b, n * page_size, kv, dim), dtype=torch.float32)
    if out.numel() == 0:
        return out
    has_rows = pages.sinks is not None
    rows = pages.sinks.numpy() if has_rows else _empty((1, 1, 1, 1), np.float32)
    num_rows_pages = pages.sinks.shape[0] if has_rows else 0
    args = (
        _indices(index), pages.data.view(torch.uint8).numpy(), float16_bits(pages.scales),
        half_table(), pages.bits, rows, num_rows_pages, *_own_arrays(own),
        pages.rotate and not unrotate, unrotate, out.numpy(),
    )  # fmt: skip
    share(_gather_items, args, b * n)
    return out


def quant_chunk_attention_cpu(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The CPU op set's route for prompt chunks and drafts over quantized pages:
    ``quant_paged_attention_reference``'s SDPA over the context this kernel gathers, in the
    model's basis, so neither q nor the output is rotated (engine/cuda/kv_gather.py's
    ``quant_chunk_attention_cuda`` on the CPU). Pages the kernel does not take (a float16 or
    bfloat16 model) stay on the reference in the pages' basis: its rotation back of a whole
    context by butterflies in torch would cost more than rotating q and the output."""
    if not takes(k_pages, q.dtype, None):
        return quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, sliding_window)
    return quant_paged_attention_reference(
        q, k_pages, v_pages, batch, scale, sliding_window, gather=gather_context_cpu,
        model_basis=True,
    )  # fmt: skip
