"""Repairs to the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), made where the engine turns it
on (``engine.cuda._launch``), so that every simulated process gets them: the tests, the
benches' CPU dry runs (subprocesses, which no pytest conftest reaches), Ray workers."""

from __future__ import annotations

import sys
import threading

import numpy as np

_patched = False


def lock_shared_arrays() -> None:
    """Make the simulator's ``cuda.shared.array`` allocation atomic (idempotent).

    The simulator gives a block's threads one array per call site: the first thread to get
    there creates it (``FakeCUDAShared.array``: look up, create if missing, store), with no
    lock. A thread switch between the lookup and the store lets a second thread create its
    own array, which it then reduces over alone: it reads its own buffer as the block's
    values. The engine's short switch interval (``_launch``) makes such switches likely. A
    sampling kernel in a bench dry run then drew garbage ids or overflowed ``exp`` in about
    one call in three (13 of 40 in one process); a CI run once failed the same way inside
    pytest, whose conftest alone held this repair then. Same lookup key as the simulator's
    (the caller's file and line), under one lock."""
    global _patched
    if _patched:
        return
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    original = kernelapi.FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory; refused alignment
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array
    _patched = True
