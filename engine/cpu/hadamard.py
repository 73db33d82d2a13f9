"""The 32-point Hadamard rotation of quantization groups inside Numba CPU kernels: the same
five butterfly stages, in the same float32 operations and order, as the torch reference
(engine/cache/quant.py ``hadamard_butterflies``) and the CUDA kernels, so what a CPU kernel
rotates is the reference's bit for bit. Compiled without fastmath: no operation may be fused
or reordered."""

from __future__ import annotations

import numba
import numpy as np

from engine.cache.quant import BUTTERFLY_NORM, GROUP
from engine.numba_cache import cached_njit

_NORM = np.float32(BUTTERFLY_NORM)


@numba.njit(inline="always")
def _stage(row, base, h):
    """The butterflies of stride h over the group at row[base:base + 32]."""
    for start in range(base, base + GROUP, 2 * h):
        for i in range(start, start + h):
            a, b = row[i], row[i + h]
            row[i], row[i + h] = a + b, a - b


@cached_njit
def rotate_row(row):
    """Each group of 32 of the float32 ``row`` [D] times H, in place: (x_i, x_i+h) ->
    (x_i + x_i+h, x_i - x_i+h) for h = 1, 2, 4, 8, 16, the last stage times 1 / sqrt(32).
    (Each stride a constant of its own call: LLVM unrolls and vectorizes the stages, which
    a loop over h, and a division per pair before that, kept scalar.)"""
    last = GROUP // 2
    for base in range(0, row.shape[0], GROUP):
        _stage(row, base, 1)
        _stage(row, base, 2)
        _stage(row, base, 4)
        _stage(row, base, 8)
        for i in range(base, base + last):
            a, b = row[i], row[i + last]
            row[i], row[i + last] = (a + b) * _NORM, (a - b) * _NORM
