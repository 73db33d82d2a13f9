"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama checkpoints use), fused
with the paged K/V cache write.

Torch references; the CUDA kernel (one launch: rotate q and k, write k and v into their pages)
lives beside them.
"""

from __future__ import annotations

import torch

from engine.cuda.cache_write import cache_write_reference


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KV, D], cos/sin: [T, D/2] (already in q's dtype) -> rotated q, k."""
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k, write rotated k and v into the pages at ``slot_mapping`` (negative
    slots are padding: not written); returns the rotated q [T, H, D]."""
    q, k = rotary_reference(q, k, cos, sin)
    cache_write_reference(k, v, k_pages, v_pages, slot_mapping)
    return q
