"""Work shared among threads on the CPU by a small pool of our own, for the Numba kernels that
release the GIL (``nogil``): the calling thread and the pool take chunks of a call's items in
turn until none is left. Since stop 53 the kernels share their work on torch's own OpenMP team
instead (engine/cpu/team.py); this pool is its fallback where that team cannot be used (no
OpenMP runtime found, a forked child). Numba's own parallel loops would do it too, but cannot
promise that two engines in one process may call a kernel at once.

In turn, not a fixed share each: torch's own OpenMP workers keep spinning on the other cores
for a while after each torch op, so a pool thread there may get a fraction of a core
(SmolLM2's decode attention, 8 x 1k, 2 cores: a fixed share took 2.1 ms per call after a
torch matmul, against 1.7 ms on the calling thread alone; chunks in turn, in a real decode
step, 2.0 against 1.95 ms). Whether more than 2 cores add up is not measured (this project's
CPU box has 2).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.cpu.spin import SPIN_SETTINGS

logger = logging.getLogger(__name__)

CHUNKS_PER_THREAD = 4  # work-queue granularity (a kernel call's dispatch: ~1 us)


@functools.cache
def advise_spin_count() -> None:
    """Once per process: with neither of ``SPIN_SETTINGS`` set (torch was loaded before the
    engine could set one: engine/cpu/spin.py), torch's workers spin long enough after each op
    to take a core from the kernels' second thread (SmolLM2, 2 threads, q4 decode at 8 x 1k:
    64.2 tok/s unset, 77.4 with GOMP_SPINCOUNT=20000;
    bench/results/kv_cpu_decode_gomp_spincount.json)."""
    if not any(name in os.environ for name in SPIN_SETTINGS):
        logger.info(
            "the CPU kernels share work among torch's %d threads, whose OpenMP workers spin "
            "between ops: import the engine before torch, or start the process with "
            "GOMP_SPINCOUNT=20000, to give the kernels their cores (README, 'KV cache')",
            torch.get_num_threads(),
        )


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool per size and process (a forked child has none of its parent's threads)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpu-kernel")


def in_turns(work: Callable[[int, int], None], items: int) -> None:
    """``work(first, last)`` over items [first, last) until all ``items`` are done, by up to
    ``torch.get_num_threads()`` threads (this one and the pool's). A pool thread that never
    starts (busy, or gone in a forked child) holds nothing up: this thread takes what is left,
    and a future that never started is cancelled, not waited for."""
    threads = max(1, min(torch.get_num_threads(), items))
    if threads == 1:
        work(0, items)
        return
    advise_spin_count()
    size = max(1, items // (CHUNKS_PER_THREAD * threads))
    starts = iter(range(0, items, size))  # (next() on it is atomic under the GIL)

    def take() -> None:
        for first in starts:
            work(first, min(first + size, items))

    futures = [_pool(threads - 1, os.getpid()).submit(take) for _ in range(threads - 1)]
    take()
    for future in futures:
        if not future.cancel():
            future.result()
