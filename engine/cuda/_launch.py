"""Launch plumbing shared by the Numba CUDA kernels: simulator detection, how torch tensors are
handed to a kernel, and which stream a kernel runs on.

On a GPU, kernels take torch CUDA tensors directly (DLPack, no copy) and launch on torch's
current stream, so they order with torch's own kernels and can be captured in a CUDA graph
with no host synchronisation. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CPU-only
CI), kernels take numpy views of CPU tensors (shared memory, so in-place writes land in the
torch tensor) and run on the default (fake) stream.

INVARIANT: ``NUMBA_ENABLE_CUDASIM`` must be set before numba is first imported; import numba
only through this module so the check below sees the mode actually in force.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from numba import cuda

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"

# fp16 and fp32 are the dtypes every kernel supports; bf16 runs are converted at load (see
# engine.model.model) because the simulator has no bf16 and bit-twiddled bf16 loads are a
# later optimisation.
KERNEL_DTYPES = (torch.float16, torch.float32)


def kernels_available() -> bool:
    """True when kernels can run: a CUDA device, or the simulator."""
    return SIMULATOR or cuda.is_available()


def arg(t: torch.Tensor) -> Any:
    """A torch tensor as a kernel argument (a numpy view in the simulator)."""
    if SIMULATOR:
        if t.dtype == torch.bfloat16:
            raise ValueError("bfloat16 tensors are not supported by the CUDA simulator")
        return t.detach().numpy()
    return t.detach()


def stream() -> Any:
    """The stream to launch on: torch's current stream (0, the fake stream, in the simulator).

    Looked up per launch on purpose: inside ``torch.cuda.graph`` torch switches to a capture
    stream, and a stream object cached earlier would launch outside the capture."""
    if SIMULATOR:
        return 0
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def check_dtype(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported by the CUDA kernels")


def blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))
