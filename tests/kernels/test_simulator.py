"""The CUDA simulator's repairs (engine/cuda/simulator.py) reach every simulated process that
imports the engine's kernels, not only pytest's: the benches' dry runs run in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
