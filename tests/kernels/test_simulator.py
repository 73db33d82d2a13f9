"""The CUDA simulator's repairs (engine/cuda/simulator.py) reach every simulated process that
imports the engine's kernels, not only pytest's: the benches' dry runs run in subprocesses."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

import engine.cuda._launch  # noqa: F401 (the simulator's repairs, before any launch)

REPO = Path(__file__).resolve().parents[2]

# Many threads of one simulated block reach one cuda.shared.array call site at once, under a
# tiny switch interval; every one of them must get the same array. The simulator's own
# allocation gave some trial more than one array in 26 of 200 trials on a 2-core box.
CONTENTION = textwrap.dedent(
    """
    import sys, threading
    import numpy as np
    import engine.cuda._launch  # noqa: F401 (turns the repairs on)
    from numba.cuda.simulator import kernelapi

    sys.setswitchinterval(1e-6)

    def arrays_made(threads=32):
        shared = kernelapi.FakeCUDAShared(0)
        got = [None] * threads
        start = threading.Barrier(threads)

        def run(i):
            start.wait()
            got[i] = shared.array(8, np.float32)

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return len({id(g) for g in got})

    split = sum(arrays_made() > 1 for _ in range(200))
    print("split", split)
    """
)


def test_a_fresh_simulated_process_allocates_one_shared_array_per_block_and_site() -> None:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", CONTENTION], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["split", "0"], proc.stdout


# --- the block runner (engine/cuda/simulator.py ``wait_on_barriers``) ---------------------------


@cuda.jit
def _block_sum(values, out, early):
    """Halving tree sum in shared memory; the threads at or past ``early`` return after the
    first barrier, so later barriers open with only the threads still running."""
    shared = cuda.shared.array(64, dtype=np.float32)
    i = cuda.threadIdx.x
    shared[i] = values[cuda.blockIdx.x * 64 + i]
    cuda.syncthreads()
    if i >= early:
        return
    stride = early // 2
    while stride:
        if i < stride:
            shared[i] += shared[i + stride]
        cuda.syncthreads()
        stride //= 2
    if i == 0:
        out[cuda.blockIdx.x] = shared[0]


@cuda.jit
def _fails_in_one_thread(out):
    """Thread 5 of block 1 raises between two barriers."""
    i = cuda.threadIdx.x
    cuda.syncthreads()
    if cuda.blockIdx.x == 1 and i == 5:
        raise ValueError("thread five")
    cuda.syncthreads()  # (the other threads wait here until they are aborted)
    out[cuda.blockIdx.x * 16 + i] = i


def _within(seconds: float, launch) -> None:
    """Runs ``launch()`` in a daemon thread; fails (rather than hanging the suite) if a
    barrier never opens. Exceptions come back to the caller."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            launch()
        except BaseException as e:  # (handed back to the test)
            errors.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the launch did not finish in {seconds} s (a barrier hangs)"
    if errors:
        raise errors[0]


def test_a_barrier_opens_once_every_running_thread_waits() -> None:
    """Blocks whose threads reach barriers in turn, and whose threads partly return early,
    reduce as on a GPU: a barrier waits for every thread still running, no more."""
    from engine.cuda import _launch, simulator

    assert _launch.SIMULATOR and simulator._blocks_patched
    values = np.arange(3 * 64, dtype=np.float32)
    for early in (64, 32, 8):
        out = np.zeros(3, dtype=np.float32)
        _within(30, functools.partial(_block_sum[3, 64], values, out, early))
        want = values.reshape(3, 64)[:, :early].sum(axis=1)
        assert np.array_equal(out, want), (early, out, want)


def test_a_thread_that_raises_ends_its_launch_with_its_ids_and_the_next_launch_runs() -> None:
    out = np.zeros(32, dtype=np.int64)
    with pytest.raises(ValueError, match=r"tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]: thread five"):
        _within(30, lambda: _fails_in_one_thread[2, 16](out))
    values = np.ones(64, dtype=np.float32)
    total = np.zeros(1, dtype=np.float32)
    _within(30, lambda: _block_sum[1, 64](values, total, 64))  # nothing left stuck
    assert total[0] == 64
