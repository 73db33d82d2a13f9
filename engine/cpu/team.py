"""The CPU kernels' work shared on torch's own OpenMP team: ``share(kernel, args, items)`` runs
``kernel(*args, first, last)`` over chunks of items [0, items) taken in turn by the calling
thread and torch's OpenMP workers, through the OpenMP runtime torch runs on (libgomp's
``GOMP_parallel``, which Intel's and LLVM's runtimes export too).

Why torch's team and not a pool of our own (engine/cpu/turns.py, still the fallback): after
each torch op its OpenMP workers keep spinning on their cores, so a pool thread there got a
fraction of a core, and waking it and waiting on its future cost ~110 us a call; torch's
workers are the threads already running on those cores, and take the work at once. SmolLM2's
q4 decode attention, 8 sequences, 2 threads, per layer after a torch matmul, one process
(medians of 100; one thread alone: 100, 286, 1049 us): 64 keys each, pool 190 -> team 74 us;
256 keys 394 -> 174; 1k keys 784 -> 577, with torch loaded before the engine or after.

How: a kernel's arguments (arrays and integers) are packed into a frame of int64 (an array's
data address, extents and strides; an integer's value) by a Numba-compiled launcher, which
calls ``GOMP_parallel`` with a C callback (a Numba ``cfunc``, one per kernel and argument
types) and the frame; each team thread unpacks the frame into array views and takes chunks by
an atomic counter in it until none is left. The launcher releases the GIL for the whole call.

When the team is not used (``team_runtime`` is None: not Linux, torch not built on OpenMP, no
runtime or more than one found; or one thread; or a process forked from the one that loaded
the runtime, where libgomp's pool lists threads the fork did not copy and a parallel region
waits for them forever): ``turns.in_turns``, the same chunks on our own pool.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from engine.cpu.turns import CHUNKS_PER_THREAD, in_turns
from engine.numba_cache import cached_njit

logger = logging.getLogger(__name__)

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
# frame: [next item, items, chunk], then SLOT int64 per argument: an array's data address, its
# extents, then its strides (bytes); an integer or a bool in the slot's first word
_NEXT, _ITEMS, _CHUNK, _HEAD = 0, 1, 2, 3
MAX_NDIM = 4
SLOT = 1 + 2 * MAX_NDIM
# the shared libraries that may be torch's OpenMP runtime (all three export GOMP_parallel)
_RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")
_LOADED_IN = os.getpid()  # (torch is imported above, so its runtime is loaded in this process)


@functools.cache
def team_runtime(pid: int) -> int | None:
    """The address of ``GOMP_parallel`` in the OpenMP runtime torch runs on, in process
    ``pid`` (None where the team is not used: see the module's docstring). Cached per process:
    a forked child asks again and gets None."""
    if pid != _LOADED_IN:
        return None
    path = None
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        path = _torch_openmp_library()
    try:
        function = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD).GOMP_parallel if path else None
    except (OSError, AttributeError):
        function = None
    if function is None:
        logger.info("torch's OpenMP runtime not found: the CPU kernels share work on a pool")
        return None
    logger.debug("the CPU kernels share work on torch's OpenMP team (%s)", path)
    return ctypes.cast(function, ctypes.c_void_p).value


def _torch_openmp_library() -> Path | None:
    """The OpenMP runtime mapped into this process: the one in torch's own folder if there is
    one there, else the only one mapped (None for none, or several and none of them torch's)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {Path(line.split()[-1]) for line in maps.splitlines() if "/" in line}
    runtimes = sorted(p for p in paths if p.name.startswith(_RUNTIME_NAMES) and ".so" in p.name)
    torch_dir = Path(torch.__file__).resolve().parent
    own = [p for p in runtimes if torch_dir in p.resolve().parents]
    if own:
        return own[0]
    return runtimes[0] if len(runtimes) == 1 else None


def share(kernel: Callable, args: tuple, items: int) -> None:
    """``kernel(*args, first, last)`` over [0, items) in chunks, by up to
    ``torch.get_num_threads()`` threads: torch's OpenMP team where it can (``team_runtime``),
    else ``turns.in_turns``. ``kernel`` is a Numba function that only reads ``args``' arrays
    and writes disjoint parts of them per item; ``args`` holds arrays (at most ``MAX_NDIM``
    dimensions), integers and bools."""
    threads = max(1, min(torch.get_num_threads(), items))
    if threads == 1:
        kernel(*args, 0, items)
        return
    runtime = team_runtime(os.getpid())
    if runtime is None:
        in_turns(lambda first, last: kernel(*args, first, last), items)
        return
    chunk = max(1, items // (CHUNKS_PER_THREAD * threads))
    _launch(runtime, _callback_address(kernel, args), threads, items, chunk, args)


def prepare(kernel: Callable, args: tuple) -> None:
    """Compile what ``share(kernel, args, ...)`` will run on the team (the callback for these
    argument types: ~0.5 s), now rather than at the first shared call, mid-request; nothing
    where the team will not run it (one thread, no runtime)."""
    if torch.get_num_threads() > 1 and team_runtime(os.getpid()) is not None:
        _callback_address(kernel, args)


# what of an array's flags Numba's type of it holds (its layout, alignment and writability)
_TYPED_FLAGS = 0x1 | 0x2 | 0x100 | 0x400  # NPY_ARRAY_{C,F}_CONTIGUOUS, ALIGNED, WRITEABLE


def _callback_address(kernel: Callable, args: tuple) -> int:
    """The address of ``kernel``'s callback for ``args``' types, by a key that tells the same
    types apart as Numba's (``numba.typeof`` on a tuple of arrays takes ~100 us)."""
    key = tuple(
        (a.dtype.num, a.ndim, a.flags.num & _TYPED_FLAGS) if isinstance(a, np.ndarray) else type(a)
        for a in args
    )
    callback = _callbacks.get((kernel, key))
    if callback is None:
        with _compiling:  # (one callback per key, never replaced: its code lives while it does)
            callback = _callbacks.get((kernel, key))
            if callback is None:
                callback = _callbacks[(kernel, key)] = _callback(kernel, numba.typeof(args))
    return callback.address


_callbacks: dict[tuple, Any] = {}
_compiling = threading.Lock()


@cached_njit(nogil=True)
def _launch(runtime, callback, threads, items, chunk, args):
    frame = np.empty(_HEAD + SLOT * len(args), np.int64)
    frame[_NEXT] = 0
    frame[_ITEMS] = items
    frame[_CHUNK] = chunk
    _pack(frame, args)
    _parallel(runtime, callback, frame.ctypes.data, threads)


def _callback(kernel: Callable, args_type: types.Type):
    """The team threads' C function for ``kernel`` over arguments of ``args_type``."""
    unpack = _unpacker(args_type)

    @numba.cfunc(types.void(types.CPointer(types.int64)), nopython=True)
    def run(frame):
        args = unpack(frame)
        while True:
            first = _fetch_add(frame, _NEXT, frame[_CHUNK])
            if first >= frame[_ITEMS]:
                return
            kernel(*args, first, min(first + frame[_CHUNK], frame[_ITEMS]))

    return run


def _check_argument(kind: types.Type) -> None:
    if isinstance(kind, types.Array):
        if kind.ndim > MAX_NDIM:
            raise numba.core.errors.TypingError(f"share: arrays of at most {MAX_NDIM} dimensions")
    elif not isinstance(kind, (types.Integer, types.Boolean)):
        raise numba.core.errors.TypingError(f"share: an argument of type {kind} cannot be packed")


@intrinsic
def _pack(typingctx, frame, args):
    """Write ``args`` into ``frame``'s slots (see ``SLOT``)."""
    for kind in args:
        _check_argument(kind)

    def codegen(context, builder, signature, llargs):
        base = context.make_array(signature.args[0])(context, builder, llargs[0]).data
        for i, kind in enumerate(signature.args[1]):
            value = builder.extract_value(llargs[1], i)
            words = _words(context, builder, kind, value)
            for k, word in enumerate(words):
                at = ir.Constant(_I64, _HEAD + i * SLOT + k)
                builder.store(word, builder.gep(base, [at]))
        return context.get_dummy_value()

    return types.void(frame, args), codegen


def _words(context, builder, kind, value) -> list:
    if isinstance(kind, types.Array):
        array = context.make_array(kind)(context, builder, value)
        shape = cgutils.unpack_tuple(builder, array.shape, kind.ndim)
        strides = cgutils.unpack_tuple(builder, array.strides, kind.ndim)
        return [builder.ptrtoint(array.data, _I64), *shape, *strides]
    return [context.cast(builder, value, kind, types.int64)]


def _unpacker(args_type: types.BaseTuple):
    """An intrinsic reading a frame's slots back as ``args_type``: the arrays as views of the
    caller's memory (no reference counts: the caller holds them for the call)."""

    @intrinsic
    def unpack(typingctx, frame):
        def codegen(context, builder, signature, llargs):
            values = [
                _unpacked(context, builder, llargs[0], i, kind) for i, kind in enumerate(args_type)
            ]
            return context.make_tuple(builder, args_type, values)

        return args_type(frame), codegen

    return unpack


def _unpacked(context, builder, frame, index, kind):
    def word(k):
        return builder.load(builder.gep(frame, [ir.Constant(_I64, _HEAD + index * SLOT + k)]))

    if not isinstance(kind, types.Array):
        return context.cast(builder, word(0), types.int64, kind)
    element = context.get_data_type(kind.dtype)
    array = context.make_array(kind)(context, builder)
    populate_array(
        array,
        data=builder.inttoptr(word(0), element.as_pointer()),
        shape=[word(1 + d) for d in range(kind.ndim)],
        strides=[word(1 + kind.ndim + d) for d in range(kind.ndim)],
        itemsize=context.get_constant(types.intp, context.get_abi_sizeof(element)),
        meminfo=None,
    )
    return array._getvalue()


@intrinsic
def _fetch_add(typingctx, frame, index, value):
    """``frame[index] += value`` atomically; returns the value before."""

    def codegen(context, builder, signature, llargs):
        index = context.cast(builder, llargs[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", builder.gep(llargs[0], [index]), llargs[2], "monotonic")

    return types.int64(frame, index, types.int64), codegen


@intrinsic
def _parallel(typingctx, runtime, callback, data, threads):
    """``GOMP_parallel(callback, data, threads, 0)`` by the runtime's address: the calling
    thread and ``threads`` - 1 of the team each run ``callback(data)``; returns when all did."""

    def codegen(context, builder, signature, llargs):
        pointer = ir.IntType(8).as_pointer()
        callback_type = ir.FunctionType(ir.VoidType(), [pointer])
        gomp_arguments = [callback_type.as_pointer(), pointer, _I32, _I32]
        gomp_type = ir.FunctionType(ir.VoidType(), gomp_arguments)
        words = [
            context.cast(builder, value, kind, types.int64)
            for value, kind in zip(llargs, signature.args, strict=True)
        ]
        function = builder.inttoptr(words[0], gomp_type.as_pointer())
        callback = builder.inttoptr(words[1], callback_type.as_pointer())
        data = builder.inttoptr(words[2], pointer)
        threads = builder.trunc(words[3], _I32)
        builder.call(function, [callback, data, threads, ir.Constant(_I32, 0)])  # (flags: none)
        return context.get_dummy_value()

    return types.void(runtime, callback, data, threads), codegen
