"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama checkpoints use).

Torch reference; the CUDA kernel (fused with the K/V cache write) lives beside it.
"""

from __future__ import annotations

import torch


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
