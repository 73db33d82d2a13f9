"""Shared test setup.

Without a CUDA device the Numba CUDA kernels run in the CUDA simulator; the switch must be set
before numba is first imported, which is why it lives at the top of the root conftest.
GPU tests (marked ``gpu``) skip themselves on machines without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest


def _lock_simulator_shared_arrays() -> None:
    """Make the CUDA simulator's ``cuda.shared.array`` allocation atomic.

    The simulator gives a block's threads one array per call site: the first thread to get
    there creates it (``FakeCUDAShared.array``: look up, create if missing, store), with no
    lock. A thread switch between the lookup and the store lets a second thread create its
    own array, which it then reduces over alone (it reads its own buffer's zeros as the
    block's sum). A CI run once failed that way (a sampling kernel's row total came out 0 in
    one thread, "divide by zero" in the simulator, the last id drawn); the tests' short
    switch interval makes such switches likelier. Same lookup key as the simulator's (the
    caller's file and line), under one lock."""
    import sys
    import threading

    import numpy as np
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


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    _lock_simulator_shared_arrays()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
