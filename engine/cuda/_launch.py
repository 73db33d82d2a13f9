"""Launch plumbing shared by the Numba CUDA kernels: simulator detection, how torch tensors are
handed to a kernel, and which stream a kernel runs on.

On a GPU, kernels take torch CUDA tensors directly (DLPack, no copy) and launch on torch's
current stream, so they order with torch's own kernels and can be captured in a CUDA graph
with no host synchronisation. Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CPU-only
CI), kernels take CPU tensors wrapped as simulator device arrays: the simulator then works on the
tensor's own memory (strided views and in-place outputs included) instead of copying numpy
arguments in and out, and runs on the default (fake) stream.

INVARIANT: ``NUMBA_ENABLE_CUDASIM`` must be set before numba is first imported; import numba
only through this module so the check below sees the mode actually in force.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from numba import cuda
from numba.cuda import types as nbt

from engine.cuda import fast_launch

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"
if SIMULATOR:
    # Speed only, for every simulated process (the tests, the benches' CPU dry runs):
    # simulated blocks wait on a condition variable rather than the simulator's polling loop
    # (engine/cuda/simulator.py ``wait_on_barriers``), and threads switch every 2 ms. While
    # that loop held the GIL until a switch forced it off (5 ms by default), 1e-4 s had made
    # a simulated speculative-decoding test 4x faster (67 s -> 17 s); without the loop, the
    # barrier waits themselves hand the GIL on, and forced switches only cost (2-core box,
    # test_quant_graphs + test_kv_gather + a q4 speculation test: 73 s polling at 1e-4 s,
    # 77 s waiting at 1e-4, 54-56 at 1e-3, 52.5 at 2e-3, 55-62 at 5e-3).
    sys.setswitchinterval(2e-3)
    # ... where a thread switch inside the simulator's unlocked shared-array allocation
    # gives two threads of a block different arrays: repaired here too
    from engine.cuda import simulator

    simulator.lock_shared_arrays()
    simulator.wait_on_barriers()

# fp16 and fp32 are the dtypes every kernel supports; bf16 runs are converted at load (see
# engine.model.model) because the simulator has no bf16 and bit-twiddled bf16 loads are a
# later optimisation.
KERNEL_DTYPES = (torch.float16, torch.float32)


def kernels_available() -> bool:
    """True when kernels can run: a CUDA device, or the simulator."""
    return SIMULATOR or cuda.is_available()


NUMBA_DTYPES = {torch.float16: nbt.float16, torch.float32: nbt.float32}
NUMBA_INDEX_DTYPES = {torch.int32: nbt.int32, torch.int64: nbt.int64}


def device_function(fn: Callable | None = None, **options: Any) -> Any:
    """``cuda.jit(device=True, **options)(fn)`` (also a decorator, bare or with options). In
    the simulator a function that never names the cuda module (bit tricks, rounding, index
    arithmetic) stays a plain Python function: the simulator runs every device-function call
    inside a swap of its module's globals under a lock, rescanning them whenever no thread is
    inside, which for helpers called per element (a Hadamard sign per term) made most of the
    simulated kernels' time (one test: 141 s)."""
    if fn is None:
        return functools.partial(device_function, **options)
    if SIMULATOR and not _names_cuda(fn):
        return fn
    return cuda.jit(device=True, **options)(fn)


def _names_cuda(fn: Callable, seen: set[int] | None = None) -> bool:
    """Whether ``fn``'s code (nested code included), or a plain Python function it names (a
    global or a closure cell, followed the same way), names the cuda module. (The swap makes
    the fake module visible to the plain helpers of the swapped function's module too.)"""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    cells = [cell.cell_contents for cell in fn.__closure__ or ()]
    pending = [fn.__code__]
    while pending:
        code = pending.pop()
        cells += [fn.__globals__.get(name) for name in code.co_names]
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return any(
        value is cuda or (isinstance(value, types.FunctionType) and _names_cuda(value, seen))
        for value in cells
    )


def arg(t: torch.Tensor) -> Any:
    """A torch tensor as a kernel argument: the tensor itself on a GPU (DLPack, no copy); in
    the simulator a device-array wrapper over the tensor's memory."""
    if SIMULATOR:
        if t.dtype == torch.bfloat16:
            raise ValueError("bfloat16 tensors are not supported by the CUDA simulator")
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(t.detach().numpy())
    return t.detach()


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors on one device: CPU in the simulator, CUDA otherwise."""
    want = "cpu" if SIMULATOR else "cuda"
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != want:
        found = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{name}: tensors must all be on one {want} device (found {found})")


def stream() -> Any:
    """The stream to launch on: torch's current stream (0, the fake stream, in the simulator).

    Looked up per launch on purpose: inside ``torch.cuda.graph`` torch switches to a capture
    stream, and a stream object cached earlier would launch outside the capture."""
    if SIMULATOR:
        return 0
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def launch(kernel: Any, grid: Any, block: Any, *args: Any) -> None:
    """``kernel[grid, block, stream()](*args)`` with torch tensors passed as they are: on a GPU
    through ``engine.cuda.fast_launch`` (unless ``ENGINE_NUMBA_LAUNCH=numba``), which packs
    the arguments itself once Numba has launched a signature; else through Numba."""
    if SIMULATOR or fast_launch.launch_mode() == "numba":
        _numba_launch(kernel, grid, block, args)
        return
    launcher = _LAUNCHERS.get(id(kernel))
    if launcher is None:  # (the launcher holds the dispatcher: its id stays unique)
        launcher = _LAUNCHERS[id(kernel)] = fast_launch.FastLauncher(kernel, _numba_launch)
    launcher.launch(grid, block, args)


_LAUNCHERS: dict[int, fast_launch.FastLauncher] = {}


def _numba_launch(kernel: Any, grid: Any, block: Any, args: Any) -> None:
    kernel[grid, block, stream()](*(arg(a) if isinstance(a, torch.Tensor) else a for a in args))


def check_dtype(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported by the CUDA kernels")


def blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))
