"""RMSNorm family: plain, fused with the residual add, and per-head (Qwen3 q/k norm).

Torch references; the Numba CUDA kernels of this family live beside them.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like the HF reference.

    x: [..., D]; weight: [D] -> [..., D] in x's dtype.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    # HF casts back to the input dtype *before* the weight multiply; keep that rounding order.
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual
