"""CPU cores for the serving processes (Linux): the engine on cores of its own.

Why: a replica's step thread is on the critical path of every token, and on a small machine
the HTTP proxy, the ingress and Ray's own processes are scheduled onto its core whenever they
wake (the kernel tends to wake a message's receiver where its sender ran). On the 2-core CI
box (demo model, 64 streams, ``bench/serving_overhead.py``) the served app made 0.72-1.01 of
the bare engine's tokens/s with default placement (mean 0.82 over 4 runs) and 0.86-1.09 with
the replica on one core and the rest of the app on the other (mean 0.95 over 6). Pinning only
the step thread, the replica's event loop and Ray threads on the other core, was no better
(0.79-0.88): the GIL passes between the replica's threads, which costs less on one core.

- ``serving.engine_cpus``: the cores the LLM replicas may run on. Each replica claims
  ``cores_per_replica`` of them (its torch threads, at least one) for itself, so replicas on
  one node never share a core; the claim is an exclusive ``flock`` on a file per core under
  ``claim_dir()`` (released by the kernel when the process ends, however it ends). A replica
  that finds too few free cores shares the whole set and says so (WARNING): it still runs.
- ``serving.ingress_cpus``: the cores the ingress replicas run on (shared, nothing claimed).

Pinning moves every thread of the process (threads started later inherit it). Keeping
*other* processes off the engine's cores is the operator's part: start the app under
``taskset -c <the other cores> serve run ...``; replicas then move themselves to their cores.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CLAIM_DIR_ENV = "PAGEDSERVE_CPU_CLAIMS"  # where the per-core claim files live

# Claim files held open by this process: closing one would release its core.
_held_claims: list[int] = []


def parse_cpu_list(value: Any, key: str) -> tuple[int, ...] | None:
    """A preset's core list: a list of core numbers (``[1, 2]``) or Linux's cpulist text
    (``"1-3,5"``); None stays None. ``ValueError`` names the key and the value."""
    if value is None:
        return None
    if isinstance(value, str):
        cores = _parse_cpulist_text(value, key)
    elif isinstance(value, list):
        if not all(isinstance(c, int) and not isinstance(c, bool) for c in value):
            raise ValueError(f"{key} must hold core numbers (integers), got {value!r}")
        cores = list(value)
    else:
        raise ValueError(f"{key} must be a list of core numbers or a cpulist string, got {value!r}")
    if not cores:
        raise ValueError(f"{key} must name at least one core, got {value!r}")
    if min(cores) < 0:
        raise ValueError(f"{key} core numbers must be >= 0, got {value!r}")
    if len(set(cores)) != len(cores):
        raise ValueError(f"{key} names a core twice: {value!r}")
    return tuple(sorted(cores))


def _parse_cpulist_text(text: str, key: str) -> list[int]:
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{key} {text!r} is not a cpulist such as '1-3,5'")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"{key} {text!r}: range {part!r} runs backwards")
        cores.extend(range(first, last + 1))
    return cores


def claim_dir() -> Path:
    """The folder of the per-core claim files (``$PAGEDSERVE_CPU_CLAIMS``, else under the
    system temp dir): one per node, shared by every replica there."""
    folder = os.environ.get(CLAIM_DIR_ENV)
    return Path(folder) if folder else Path(tempfile.gettempdir()) / "pagedserve-cpu-claims"


def claim_cores(cores: Iterable[int], count: int) -> tuple[int, ...] | None:
    """Claim ``count`` of ``cores`` for this process (the lowest free ones), held until it
    ends; None (nothing claimed) when fewer than ``count`` are free."""
    folder = claim_dir()
    folder.mkdir(parents=True, exist_ok=True)
    taken: list[tuple[int, int]] = []  # (core, fd)
    for core in cores:
        if len(taken) == count:
            break
        fd = os.open(folder / f"cpu{core}.lock", os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process holds this core
            os.close(fd)
            continue
        taken.append((core, fd))
    if len(taken) < count:
        for _, fd in taken:
            os.close(fd)  # (closing releases the lock)
        return None
    _held_claims.extend(fd for _, fd in taken)
    return tuple(core for core, _ in taken)


def pin_process(cores: Iterable[int], key: str) -> None:
    """Move every thread of this process onto ``cores`` (threads started later inherit it).
    ``ValueError`` (naming ``key``) where the cores do not exist here or may not be used."""
    cores = set(cores)
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{key} needs Linux (os.sched_setaffinity); remove it on this platform")
    count = os.cpu_count() or 0
    missing = sorted(c for c in cores if c >= count)
    if missing:
        raise ValueError(f"{key}: this machine has cores 0-{count - 1}, not {missing}")
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:  # EINVAL: none of them is in this container's cpuset
            raise ValueError(f"{key} {sorted(cores)} cannot be used here: {e.strerror}") from None


def _thread_ids() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]


def pin_engine(cores: tuple[int, ...] | None, cores_per_replica: int) -> tuple[int, ...] | None:
    """Pin this replica (the whole process) to ``cores_per_replica`` cores of ``cores`` that it
    claims for itself, or to all of ``cores`` when too few are free; returns the cores it
    runs on (None: ``cores`` is None, nothing changed)."""
    if cores is None:
        return None
    key = "serving.engine_cpus"
    count = max(1, min(cores_per_replica, len(cores)))
    claimed = claim_cores(cores, count)
    if claimed is None:
        logger.warning(
            "%s: fewer than %d of %s are free of other replicas; this replica shares all of them",
            key,
            count,
            list(cores),
        )
        claimed = cores
    pin_process(claimed, key)
    logger.info("engine pinned to cores %s", list(claimed))
    return claimed


def pin_ingress(cores: tuple[int, ...] | None) -> None:
    """Pin this ingress replica to ``cores`` (shared with the other ingress replicas)."""
    if cores is not None:
        pin_process(cores, "serving.ingress_cpus")
        logger.info("ingress pinned to cores %s", list(cores))
