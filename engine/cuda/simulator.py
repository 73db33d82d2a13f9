"""Repairs to the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), made where the engine turns it
on (``engine.cuda._launch``), so that every simulated process gets them: the tests, the
benches' CPU dry runs (subprocesses, which no pytest conftest reaches), Ray workers."""

from __future__ import annotations

import functools
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


_blocks_patched = False


class _Block:
    """One simulated block's barrier: how many of its threads still run (``live``), how many
    of them wait in ``syncthreads`` (``waiting``; when that is all of them, the barrier
    opens), and the first thread whose kernel raised (``failed``; the others are aborted)."""

    def __init__(self, size: int) -> None:
        self.cond = threading.Condition()
        self.live = size
        self.waiting = 0
        self.generation = 0  # barriers opened so far: a waiter leaves when it moves on
        self.failed: threading.Thread | None = None

    def open_if_all_wait(self) -> None:  # (holding ``cond``)
        if self.live and self.waiting == self.live:
            self.generation += 1
            self.waiting = 0
            self.cond.notify_all()


def wait_on_barriers() -> None:
    """Run simulated blocks on a condition variable instead of the simulator's polling
    (idempotent).

    The simulator's ``BlockManager.run`` starts a thread per CUDA thread and then loops,
    holding the GIL, over every live thread asking whether it is blocked in ``syncthreads``
    or alive, and opens a barrier once all live threads are blocked; each barrier also
    needs that loop to get the GIL back. Here a thread that reaches a barrier counts itself
    in and sleeps, the last one to arrive (or a thread that exits while all others wait)
    opens it, and the launching thread sleeps until the block's threads are done. The
    semantics are the simulator's: a barrier opens when every thread still running waits in
    it (threads that returned early do not hold it), warp primitives go through the same
    ``syncthreads``, and the first exception a thread raises aborts the others (they raise
    at their next barrier) and is raised in the launching thread with its thread's and
    block's ids. On a 2-core box, both at a 0.1 ms switch interval, the sampling kernels'
    tests went from 47-55 s to 18 s and the tensor-core kernel's from 37-51 s to 31-32 s
    (``_launch`` has how the switch interval was then chosen)."""
    global _blocks_patched
    if _blocks_patched:
        return
    from numba.cuda.simulator import kernel

    kernel.BlockThread.syncthreads = _syncthreads
    kernel.BlockManager.run = _run_block
    _blocks_patched = True


def _syncthreads(thread) -> None:
    """``BlockThread.syncthreads``: wait until every running thread of the block is here."""
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    block = thread._block
    with block.cond:
        block.waiting += 1
        generation = block.generation
        block.open_if_all_wait()
        while block.generation == generation and not thread.abort:
            block.cond.wait()
    if thread.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _run_block(manager, grid_point, *args) -> None:
    """``BlockManager.run``: one block's threads to the end, or its first exception."""
    from numba.cuda.simulator import kernel

    block = _Block(int(np.prod(manager._block_dim)))
    threads = []
    target = functools.partial(_run_thread, block, threads, manager._f, args)
    with block.cond:  # (no thread runs its kernel before every thread is listed)
        for block_point in np.ndindex(*manager._block_dim):
            thread = kernel.BlockThread(target, manager, grid_point, block_point, manager._debug)
            thread._block = block
            threads.append(thread)
            thread.start()
        while block.live and block.failed is None:
            block.cond.wait()
    if block.failed is not None:  # raised at once, as the simulator does (no joins)
        block.failed.join()  # (it has only to record its exception)
        raise block.failed.exception[0].with_traceback(block.failed.exception[1])
    for thread in threads:
        thread.join()


def _run_thread(block: _Block, threads: list, kernel_function, args: tuple) -> None:
    """One simulated thread's kernel; counted out of the block when it ends, and on an
    exception the block's other threads are aborted."""
    try:
        kernel_function(*args)
    except BaseException:
        with block.cond:
            if block.failed is None:
                block.failed = threading.current_thread()
                for other in threads:
                    other.abort = True
                block.cond.notify_all()
        raise
    finally:
        with block.cond:
            block.live -= 1
            block.open_if_all_wait()
            if not block.live:  # (what the launching thread waits for)
                block.cond.notify_all()
