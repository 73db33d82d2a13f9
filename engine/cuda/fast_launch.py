"""Kernel launches without Numba's per-call argument handling (GPU only).

Why: on an H200 (2026-11-26) an eager decode forward of the Llama-3.2-1B shape took ~26 ms
with the Numba kernels against ~2 ms replayed as a CUDA graph, and prefill with the kernels
was 2.7x slower than with the torch references: the time was the host launching kernels.
Numba's dispatcher, on every launch, types each argument (a torch tensor goes through the
Python ``typeof`` of its ``__cuda_array_interface__``), wraps each tensor in a new device
array (the interface read again), builds a stream object and a launch configuration, and
warns about small grids -- tens of microseconds per tensor argument, hundreds per kernel.

Here each dispatcher gets a ``FastLauncher``. The first launch with a given argument
signature (per tensor: dtype, rank, C-contiguity; per scalar: its Python type) goes through
Numba as before, which compiles, checks and converts; the launcher then looks up the
compiled overload Numba used and from its declared argument types builds one packer per
argument, which writes the values Numba's ``_prepare_args`` writes for that type (an array
is meminfo 0, parent 0, size, itemsize, data pointer, shape, byte strides; a scalar is the
ctypes value of its declared type). Later launches with the same signature pack the tensors
directly and call ``cuda.core.launch`` with a cached launch configuration and stream.

What falls back to Numba's path (always correct, only slower): a signature whose overload
cannot be identified, a declared type with no packer here (records, tuples, F-ordered
arrays), debug or cooperative kernels, tensors not on a CUDA device (Numba copies those),
and any failure setting the launcher up (it logs once and stays on Numba's path): the
pieces used are Numba-CUDA internals (checked against numba-cuda 0.30).

``ENGINE_NUMBA_LAUNCH=numba`` turns the fast path off (a benchmark baseline, or a
workaround should a numba-cuda release change those internals).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

LAUNCH_ENV = "ENGINE_NUMBA_LAUNCH"
LAUNCH_MODES = ("fast", "numba")

Packer = Callable[[Any, list], None]
_UNSUPPORTED = object()  # a signature that always takes Numba's path


def launch_mode() -> str:
    mode = os.environ.get(LAUNCH_ENV, "fast")
    if mode not in LAUNCH_MODES:
        raise ValueError(f"{LAUNCH_ENV}={mode!r}: expected one of {', '.join(LAUNCH_MODES)}")
    return mode


def signature_key(args: Sequence[Any]) -> tuple:
    """What decides the overload and the packing: per tensor its dtype, rank, C-contiguity
    and whether it is on a CUDA device; per scalar its Python type."""
    return tuple(
        (a.dtype, a.dim(), a.is_contiguous(), a.is_cuda) if isinstance(a, torch.Tensor) else type(a)
        for a in args
    )


class FastLauncher:
    """Launches one Numba dispatcher, packing arguments itself once a signature is known."""

    def __init__(self, dispatcher: Any, numba_launch: Callable[..., None]) -> None:
        self.dispatcher = dispatcher
        self._numba_launch = numba_launch  # (dispatcher, grid, block, args): Numba's path
        self._by_signature: dict[tuple, Any] = {}

    def launch(self, grid: Any, block: Any, args: Sequence[Any]) -> None:
        key = signature_key(args)
        compiled = self._by_signature.get(key)
        if compiled is None:
            self._numba_launch(self.dispatcher, grid, block, args)  # compiles, checks types
            self._by_signature[key] = _compile_packing(self.dispatcher, args)
            return
        if compiled is _UNSUPPORTED:
            self._numba_launch(self.dispatcher, grid, block, args)
            return
        compiled.launch(grid, block, args)


class _PackedKernel:
    """One compiled overload: its CUfunction and a packer per argument."""

    def __init__(self, kernel: Any, packers: list[Packer]) -> None:
        from cuda.core import launch

        self._function = kernel._codelibrary.get_cufunc().kernel
        self._packers = packers
        self._launch = launch

    def launch(self, grid: Any, block: Any, args: Sequence[Any]) -> None:
        values: list = []
        for pack, value in zip(self._packers, args, strict=True):
            pack(value, values)
        self._launch(_core_stream(), _launch_config(grid, block), self._function, *values)


def _compile_packing(dispatcher: Any, args: Sequence[Any]) -> Any:
    """The packed form of the overload Numba just launched for ``args``, or _UNSUPPORTED."""
    try:
        kernel = _overload_for(dispatcher, args)
        if kernel is None or getattr(kernel, "debug", False) or kernel.cooperative:
            return _UNSUPPORTED
        if len(kernel.argument_types) != len(args):
            return _UNSUPPORTED
        types = kernel.argument_types
        packers = [_packer(ty, value) for ty, value in zip(types, args, strict=True)]
        if any(p is None for p in packers):
            return _UNSUPPORTED
        return _PackedKernel(kernel, packers)  # type: ignore[arg-type]
    except Exception:  # Numba internals moved: stay on its own (correct) path
        logger.warning("fast kernel launch unavailable; using Numba's launch", exc_info=True)
        return _UNSUPPORTED


def _overload_for(dispatcher: Any, args: Sequence[Any]) -> Any:
    overloads = dispatcher.overloads
    if len(overloads) == 1:  # an explicit signature (or the one compiled so far)
        return next(iter(overloads.values()))
    types = tuple(dispatcher.typeof_pyval(a) for a in args)
    return overloads.get(types)


def _packer(ty: Any, value: Any) -> Packer | None:
    from numba.cuda import types

    if isinstance(ty, types.Array):
        return _array_packer(ty, value)
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(ty, types.Integer):
        return _scalar(getattr(ctypes, f"c_{ty}"))
    if ty == types.float32:
        return _scalar(ctypes.c_float)
    if ty == types.float64:
        return _scalar(ctypes.c_double)
    if ty == types.boolean:
        return lambda v, out: out.append(bool(v))
    if ty == types.float16:
        return lambda v, out: out.append(ctypes.c_uint16(int(np.float16(v).view(np.uint16))))
    return None


def _scalar(ctype: Any) -> Packer:
    return lambda v, out: out.append(ctype(v))


_NUMBA_TO_TORCH = {
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


def _array_packer(ty: Any, value: Any) -> Packer | None:
    """Numba's array argument: meminfo, parent, size, itemsize, data, shape, byte strides."""
    if not isinstance(value, torch.Tensor) or not value.is_cuda or value.dim() != ty.ndim:
        return None
    if _NUMBA_TO_TORCH.get(str(ty.dtype)) != value.dtype or ty.layout not in ("C", "A"):
        return None
    if ty.layout == "C" and not value.is_contiguous():
        return None
    itemsize = value.element_size()

    def pack_c(t: torch.Tensor, out: list) -> None:
        # C layout: strides from the shape, as Numba computes them for a contiguous array
        shape = t.shape
        strides = [itemsize] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        out += (0, 0, t.numel(), itemsize, t.data_ptr(), *shape, *strides)

    def pack_any(t: torch.Tensor, out: list) -> None:
        out += (0, 0, t.numel(), itemsize, t.data_ptr(), *t.shape)
        out += (s * itemsize for s in t.stride())

    return pack_c if value.is_contiguous() else pack_any


_LAUNCH_CONFIGS: dict[tuple, Any] = {}
_STREAMS: dict[int, Any] = {}


def _launch_config(grid: Any, block: Any) -> Any:
    key = (grid, block)
    config = _LAUNCH_CONFIGS.get(key)
    if config is None:
        from cuda.core import LaunchConfig
        from numba.cuda._compat import CUDA_CORE_GE_1_0

        coop = {"is_cooperative": False} if CUDA_CORE_GE_1_0 else {"cooperative_launch": False}
        config = _LAUNCH_CONFIGS[key] = LaunchConfig(grid=grid, block=block, shmem_size=0, **coop)
    return config


def _core_stream() -> Any:
    """torch's current stream as a cuda.core stream, looked up per launch (graph capture
    switches streams) and cached per handle."""
    handle = torch.cuda.current_stream().cuda_stream
    core = _STREAMS.get(handle)
    if core is None:
        from numba import cuda
        from numba.cuda.cudadrv import driver

        core = _STREAMS[handle] = driver._to_core_stream(cuda.external_stream(handle))
    return core
