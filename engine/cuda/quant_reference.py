"""Torch references of the ops over quantized pages (q8/q6/q4, layout in engine/cache/quant.py),
and the op-set entries that route each call by the storage it gets.

- ``quant_rotary_cache_write_reference``: rotary on q and k as today, then k and v are
  quantized (rotated per group first when the pages say so) into their slots.
- ``quant_paged_attention_reference``: dequantizes only the pages the batch's block table
  names (what the fp16 reference gathers), never the whole cache, and runs the same masked
  attention. With rotated pages the query is rotated once and the output once: the scores and
  the weighted sum are taken in the rotated space (see quant.py).

With ``exact_chunks`` (the pages keep a ``written`` stash), a prompt chunk of more than one
token (``ForwardBatch.prompt_chunks``) reads the K/V its own tokens wrote in this forward
exactly, from the rows the write left in ``k_pages.written``, and only the earlier tokens
through their codes. ExLlamaV2 attends so (its prompt chunk sits unquantized in the fp16
buffer it attends over); on SmolLM2 it takes q4+rot's perplexity increase over the 4096-token
bench text, prefilled in chunks of 1024, from +3.97% to +0.87%
(bench/results/kv_quant_quality_exact_chunks.json). Every other row reads all keys through
their codes: a decode row, as the Numba decode kernel does, so CPU and GPU decode agree; a row
with drafts to verify or with generated tokens (recomputed after a preemption), so that
speculative decoding keeps the plain decode's tokens. The cost: a prompt token's numerics
depend on how its prompt was chunked (the scheduler's token budget, prefix-cache hits).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import (
    QuantPages,
    WrittenRows,
    dequantize_pages,
    put_rows,
    rotate_groups,
    rotated_groups,
    write_slots,
)
from engine.cuda.attention import AttentionGroup, by_group, padded_attention
from engine.cuda.rotary import rotary_reference, rotary_rows


def quant_rotary_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    slot_mapping: torch.Tensor,
    *,
    write: Callable[[QuantPages, torch.Tensor, torch.Tensor], None] = write_slots,
) -> torch.Tensor:
    """``rotary_cache_write_reference`` into quantized pages; returns the rotated q. The
    rows are also left in ``k_pages.written`` (when the pages keep them) for this forward's
    attention. ``write`` quantizes rows into slots (``write_slots``'s contract; the CPU op set
    passes its kernel's)."""
    if k_pages.written is not None:
        k_pages.written.put(WrittenRows(slot_mapping, k, v, cos, sin))
    q, k = rotary_reference(q, k, cos, sin)
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padding rows are not written
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    write(k_pages, k, slots)
    write(v_pages, v, slots)
    return q


def quant_paged_attention_reference(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    *,
    gather: Callable[..., torch.Tensor] | None = None,
    model_basis: bool = False,
) -> torch.Tensor:
    """``paged_attention_reference`` over quantized pages: q [T, H, D] -> [T, H, D].
    ``gather``: how a group's context is gathered (``gather_context``'s contract; by default
    ``gather_context``, in torch; engine/cuda/kv_gather.py's kernel on a GPU).
    ``model_basis``: rotated pages are rotated back as they are gathered, so q and the output
    are not rotated (two float32 matmuls fewer); otherwise q and the output are, and the
    attention runs in the rotated basis."""
    check_pair(k_pages, v_pages)
    gather = gather_context if gather is None else gather
    own_k, own_v = own_rows(k_pages, batch) or (None, None)
    unrotate = model_basis and k_pages.rotate
    rotate = k_pages.rotate and not model_basis

    def attend(group: AttentionGroup, q_group: torch.Tensor) -> torch.Tensor:
        table = group.block_tables
        k = gather(k_pages, table, q.dtype, own_k, unrotate)
        v = gather(v_pages, table, q.dtype, own_v, unrotate)
        return padded_attention(q_group, k, v, group, scale, sliding_window)

    out = by_group(rotate_groups(q) if rotate else q, batch, attend)
    return rotate_groups(out) if rotate else out


@dataclass(frozen=True, slots=True)
class OwnRows:
    """The K (or V) rows this forward wrote for its prompt chunks of more than one token,
    which its attention reads exactly instead of through their codes, as the cache write took
    them: keys before rotary, with their rotary tables and the pages' center, so that a
    gather kernel makes each row in its registers (engine/cuda/kv_gather.py) with no torch op
    per layer, and ``exact`` makes them in torch."""

    slots: torch.Tensor  # [N] long, ascending
    rows: torch.Tensor  # [N] long: each slot's row of the write (into values, cos, sin)
    values: torch.Tensor  # [T, KV, D], the write's rows (the model's dtype)
    cos: torch.Tensor | None = None  # [T, D / 2]: keys (rotary applied here); values: None
    sin: torch.Tensor | None = None
    center: torch.Tensor | None = None  # [KV, D] float32, subtracted (centered key pages)

    def exact(self) -> torch.Tensor:
        """[N, KV, D] float32 in the model's basis: the rows as their codes would dequantize
        without the error (rotary in the model's dtype, as the torch write applies it)."""
        x = self.values[self.rows]
        if self.cos is not None:
            x = rotary_rows(x, self.cos[self.rows], self.sin[self.rows])
        x = x.float()
        return x if self.center is None else x - self.center


def gather_context(
    pages: QuantPages,
    index: torch.Tensor,
    dtype: torch.dtype,
    own: OwnRows | None = None,
    unrotate: bool = False,
) -> torch.Tensor:
    """The pages ``index`` ([B, n] page ids) dequantized into [B, n * S, KV, D] of ``dtype``
    (sink and recent pages from their rows; ``unrotate``: rotated back per group), with the
    ``own`` rows put in (in the output's basis: rotated when the pages are and ``unrotate``
    is not) wherever the pages hold their slots (``put_rows``). Rotations by the cache
    write's butterflies, as the gather kernels rotate (engine/cpu/kv_gather.py: the same
    float32 values bit for bit; engine/cuda/kv_gather.py)."""
    out = _context(dequantize_pages(pages, index, dtype))
    if unrotate:
        out = _butterflies(out)
    if own is None:
        return out
    values = own.exact()
    if pages.rotate and not unrotate:
        values = _butterflies(values)
    b, blocks = index.shape
    page_size = pages.shape[1]
    offsets = torch.arange(page_size, device=index.device)
    ids = (index.long()[..., None] * page_size + offsets).reshape(b, blocks * page_size)
    at = torch.searchsorted(own.slots, ids).clamp_(max=own.slots.numel() - 1)
    return put_rows(out, own.slots[at] == ids, values, at)


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] with each group of 32 times H by the cache write's butterflies, in float32
    (``quant.rotated_groups``), then in x's dtype: the gather kernels' arithmetic (a matmul by
    H rounds in an order of the BLAS's choosing)."""
    return rotated_groups(x, True).flatten(-2).to(x.dtype)


def own_rows(k_pages: QuantPages, batch: ForwardBatch) -> tuple[OwnRows, OwnRows] | None:
    """The K and V rows this forward wrote for its prompt chunks of more than one token,
    from the stash on the K pages (None: none, or the write left no rows for this batch).
    Their order by slot is found once per forward (``AttentionPlan.own_order``)."""
    if k_pages.written is None:
        return None
    written = k_pages.written.take(batch.slot_mapping)
    if written is None or not any(batch.prompt_chunks):
        return None
    order = _own_order(batch, written)
    if order is None:
        return None
    slots, rows = order
    keys = OwnRows(slots, rows, written.k, written.cos, written.sin, k_pages.center)
    return keys, OwnRows(slots, rows, written.v)


def own_slot_index(own_slots, slot):
    """Where ``slot`` is in the ascending ``own_slots`` (-1: not there): a binary search,
    after a range test that settles most context rows (pages before the chunk's). Plain
    Python that the gather kernels compile (a CUDA device function, a Numba CPU function)."""
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


def _own_order(
    batch: ForwardBatch, written: WrittenRows
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(slots ascending, their rows of the write) of the batch's prompt chunks of more than
    one token; rows from host values (no device sync), once per forward (every layer's write
    takes the batch's slot mapping: the plan keeps them)."""
    plan = batch.attention
    if plan.own_order is None:
        rows: list[int] = []
        start = 0
        for q_len, prompt in zip(batch.q_lens, batch.prompt_chunks, strict=True):
            if prompt and q_len > 1:
                rows.extend(range(start, start + q_len))
            start += q_len
        if not rows:
            plan.own_order = ()
            return None
        device = batch.slot_mapping.device
        keep = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        slots = written.slot_mapping[keep].long()
        order = slots.argsort()
        plan.own_order = (slots[order], keep[order])
    return plan.own_order or None


def _context(gathered: torch.Tensor) -> torch.Tensor:
    """[B, n, S, KV, D] -> [B, n * S, KV, D]."""
    b, n, s, kv, d = gathered.shape
    return gathered.reshape(b, n * s, kv, d)


def check_pair(k_pages: QuantPages, v_pages: QuantPages) -> None:
    if not isinstance(v_pages, QuantPages) or k_pages.shape != v_pages.shape:
        raise ValueError("K and V pages must both be QuantPages of one shape")
    if k_pages.rotate != v_pages.rotate:
        raise ValueError("K and V pages must agree on the rotation")


def by_storage(plain: Callable, quantized: Callable, pages_arg: int) -> Callable:
    """An op that calls ``quantized`` when its positional argument ``pages_arg`` is
    ``QuantPages`` and ``plain`` otherwise, so the model code stays storage-agnostic."""

    def op(*args: Any, **kwargs: Any) -> Any:
        if isinstance(args[pages_arg], QuantPages):
            return quantized(*args, **kwargs)
        return plain(*args, **kwargs)

    op.__name__ = getattr(plain, "__name__", "op")
    op.__doc__ = plain.__doc__
    return op
