"""Bit casts between float32 and int32, and byte permutes, for device code: libdevice on a
GPU, numpy in the simulator (where libdevice returns None)."""

from __future__ import annotations

import numpy as np

from engine.cuda._launch import SIMULATOR, cuda, device_function

int32 = cuda.int32


def _float_bits_sim(f):
    return int(np.array(f, dtype=np.float32).view(np.int32)[()])


def _bits_float_sim(b):
    return np.array(b, dtype=np.int32).view(np.float32)[()]


def _byte_perm_sim(x, y, s):
    pool = (int(x) & 0xFFFFFFFF) | ((int(y) & 0xFFFFFFFF) << 32)  # bytes 0-3: x, 4-7: y
    out = 0
    for k in range(4):
        out |= ((pool >> (8 * ((int(s) >> (4 * k)) & 7))) & 255) << (8 * k)
    return np.array(out, dtype=np.uint32).view(np.int32)[()]


@device_function
def odd_parity(x):
    """popcount(x) & 1 for 0 <= x < 32: the sign bit of Sylvester's H_32 entry (a, b) is that
    of a & b."""
    return (x ^ (x >> 1) ^ (x >> 2) ^ (x >> 3) ^ (x >> 4)) & 1


if SIMULATOR:
    float_bits = device_function(_float_bits_sim)
    bits_float = device_function(_bits_float_sim)
    byte_perm = device_function(_byte_perm_sim)
else:  # pragma: no cover - needs a GPU
    from numba.cuda import libdevice

    @device_function
    def float_bits(f):
        """The float32 ``f``'s bits as an int32."""
        return libdevice.float_as_int(f)

    @device_function
    def bits_float(b):
        """The float32 whose bits are the int32 ``b``."""
        return libdevice.int_as_float(int32(b))

    @device_function
    def byte_perm(x, y, s):
        """Byte k of the result is byte (s >> 4k) & 7 of y:x (one PRMT instruction; the
        selectors' sign-replicate bit is not used)."""
        return libdevice.byte_perm(int32(x), int32(y), int32(s))


if not SIMULATOR:  # pragma: no cover - needs a GPU (compiled for sm_90 in the tests)
    from numba.cuda.extending import intrinsic
    from numba.cuda.intrinsics import shfl_sync_intrinsic

    @intrinsic
    def shfl_segment16_sync(typingctx, mask, value, src_lane):
        """``value`` of lane ``src_lane`` (0..15) of the calling lane's half-warp, as CUDA's
        ``__shfl_sync(mask, value, src_lane, 16)``: the segment goes in the instruction's
        clamp operand, so a constant ``src_lane`` needs no lane arithmetic."""
        return shfl_sync_intrinsic(typingctx, mask, 0, value, src_lane, ((32 - 16) << 8) | 0x1F)
