"""Bit casts between float32 and int32 for device code: libdevice on a GPU, numpy in the
simulator (where libdevice returns None)."""

from __future__ import annotations

import numpy as np

from engine.cuda._launch import SIMULATOR, cuda

int32 = cuda.int32


def _float_bits_sim(f):
    return int(np.array(f, dtype=np.float32).view(np.int32)[()])


def _bits_float_sim(b):
    return np.array(b, dtype=np.int32).view(np.float32)[()]


if SIMULATOR:
    float_bits = cuda.jit(device=True)(_float_bits_sim)
    bits_float = cuda.jit(device=True)(_bits_float_sim)
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def float_bits(f):
        """The float32 ``f``'s bits as an int32."""
        return libdevice.float_as_int(f)

    @cuda.jit(device=True)
    def bits_float(b):
        """The float32 whose bits are the int32 ``b``."""
        return libdevice.int_as_float(int32(b))
