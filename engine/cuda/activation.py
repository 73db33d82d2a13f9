"""SiLU-and-multiply for the gated MLP. Torch reference; the CUDA kernel lives beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first, then up) -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
