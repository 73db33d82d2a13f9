"""Shared by the kernel tests: where kernels run, which dtypes, and the one tolerance table.

Tolerances (max relative error): fp32 kernels do the reference's math in the same order, so
they agree to rounding; fp16 rounds inputs and outputs to 11 bits, so 2e-3 (the issue's bar).
"""

from __future__ import annotations

import torch

from engine.cuda import _launch

DEVICE = "cpu" if _launch.SIMULATOR else "cuda"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise |out - ref| / |ref| (|ref| floored at 1e-3 against near-zeros)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).abs() / ref64.abs().clamp_min(1e-3)).max().item()
