"""How long torch's OpenMP workers spin between ops, bounded before torch loads (torch-free).

Torch's OpenMP workers keep spinning on their cores for a while after every torch op. When
the engine's Numba kernels shared their work on a pool of their own (engine/cpu/turns.py,
now the fallback), a kernel's second thread there got a fraction of a core. Since stop 53 they
share it on torch's team itself (engine/cpu/team.py), whose spinning workers take it at once:
there the bound makes no difference (SmolLM2 q4 decode at 8 x 1k, 2 threads, prefill chunks
of 512, one process per setting, medians of three: 38.9 tok/s with 20000 and with 300000,
libgomp's default, against 35.5 and 33.6 on the pool), and it stays for the fallback.

libgomp's ``GOMP_SPINCOUNT`` bounds that spinning, but libgomp reads it once, when torch is
first imported. So ``import engine`` sets it, to ``SPIN_COUNT``, while it still can: when
torch is not loaded yet and neither it nor ``OMP_WAIT_POLICY`` is set already (what a user
sets wins). Measured on a 2-core box, SmolLM2, 2 torch threads, decode tok/s, unset against
20000 (bench/results/kv_cpu_decode_gomp_spincount.json, on the pool): q4 at 8 x 1k
64.2 -> 77.4, fp16 at 8 contexts from 4000 tokens halving 54.2 -> 71.7, fp16 at 8 x 1k on
torch's own ops 68.5 -> 68.9; 50000 gained less, and 2000 cost torch's ops.

Child processes inherit it like any other variable. A process that imported torch before the
engine keeps libgomp's default, and the first kernel call shared on the fallback pool logs
the advice (``turns.advise_spin_count``).
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "20000"
# What bounds the spinning (libgomp reads them once, when torch loads it)
SPIN_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def bound_spinning(environ=os.environ, modules=sys.modules) -> bool:
    """Sets ``GOMP_SPINCOUNT`` in ``environ`` where that still takes effect and nobody chose
    a setting; returns whether it did."""
    if "torch" in modules or any(name in environ for name in SPIN_SETTINGS):
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
