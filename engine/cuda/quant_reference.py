"""Torch references of the ops over quantized pages (q8/q6/q4, layout in engine/cache/quant.py),
and the op-set entries that route each call by the storage it gets.

- ``quant_rotary_cache_write_reference``: rotary on q and k as today, then k and v are
  quantized (rotated per group first when the pages say so) into their slots.
- ``quant_paged_attention_reference``: dequantizes only the pages the batch's block table
  names (what the fp16 reference gathers), never the whole cache, and runs the same masked
  attention. With rotated pages the query is rotated once and the output once: the scores and
  the weighted sum are taken in the rotated space (see quant.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import QuantPages, dequantize_pages, rotate_groups, write_slots
from engine.cuda.attention import AttentionGroup, by_group, padded_attention
from engine.cuda.rotary import rotary_reference


def quant_rotary_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``rotary_cache_write_reference`` into quantized pages; returns the rotated q."""
    q, k = rotary_reference(q, k, cos, sin)
    slots = slot_mapping.long()
    if bool((slots < 0).any()):  # padding rows are not written
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    write_slots(k_pages, k, slots)
    write_slots(v_pages, v, slots)
    return q


def quant_paged_attention_reference(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``paged_attention_reference`` over quantized pages: q [T, H, D] -> [T, H, D]."""
    check_pair(k_pages, v_pages)

    def attend(group: AttentionGroup, q_group: torch.Tensor) -> torch.Tensor:
        k = _context(dequantize_pages(k_pages, group.block_tables, q.dtype))
        v = _context(dequantize_pages(v_pages, group.block_tables, q.dtype))
        return padded_attention(q_group, k, v, group, scale, sliding_window)

    if k_pages.rotate:
        q = rotate_groups(q)
    out = by_group(q, batch, attend)
    return rotate_groups(out) if k_pages.rotate else out


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
