"""Bit casts inside Numba CPU kernels (Numba has no scalar view): an int32's float32, one LLVM
``bitcast``, which LLVM vectorizes like any other instruction; a float32 rounded to float16
with its bits; and float16 tensors handed to the kernels as their bits (Numba has no float16
on the CPU)."""

from __future__ import annotations

import platform

import numpy as np
import torch
from llvmlite import binding, ir
from numba.core import config, types
from numba.extending import intrinsic

from engine.numba_cache import cached_njit


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE 754 bits are the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@intrinsic
def bits_from_float(typingctx, value):
    """The IEEE 754 bits of the float32 ``value``, as an int32."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


def float16_bits(values: torch.Tensor) -> np.ndarray:
    """A float16 tensor's bits as a uint16 numpy view of the same memory (CPU)."""
    return values.view(torch.int16).numpy().view(np.uint16)


def converts_float16(features: str | None = None, machine: str | None = None) -> bool:
    """Whether the CPU Numba compiles for converts float32 to float16 in an instruction (x86:
    F16C in the target's features, as Numba takes them: ``NUMBA_CPU_FEATURES`` or the host's;
    ARM64: always). Elsewhere LLVM would call a runtime helper that Numba's JIT does not
    provide (the process crashes), so ``float16_rounded`` rounds on the bits instead."""
    if features is None:
        host = config.CPU_FEATURES
        features = host if host is not None else binding.get_host_cpu_features().flatten()
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return "+f16c" in features.split(",")
    return machine in ("aarch64", "arm64")


@intrinsic
def float16_by_conversion(typingctx, value):
    """(the float32 ``value`` rounded to float16, to nearest even, as a float32; its float16
    bits as an int32 in 0..65535), by LLVM's conversion to half and back: one instruction
    each where ``converts_float16``. Values past float16's range become infinities; the
    callers clamp first."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        rounded = builder.fpext(half, ir.FloatType())
        bits = builder.zext(builder.bitcast(half, ir.IntType(16)), ir.IntType(32))
        return context.make_tuple(builder, signature.return_type, [rounded, bits])

    return types.Tuple((types.float32, types.int32))(types.float32), codegen


@cached_njit
def float16_by_bits(x):
    """``float16_by_conversion`` on the float32's bits (for CPUs without the conversion; the
    13, or below float16's normal range more, low significand bits dropped, rounding up past
    half and on half to an even result; a carry into the exponent is the next binade's first
    value, as in the bits themselves)."""
    b = bits_from_float(np.float32(x))
    sign = (b >> 16) & 0x8000
    exponent = (b >> 23) & 0xFF  # biased by 127; float16's by 15
    significand = (b & 0x7FFFFF) | (0x800000 if exponent else 0)
    # units of float16's last place: 2^-24 below its normal range (exponent < 113), else
    # 2^(exponent - 137), of which the first 1024 are implicit
    shift = 126 - exponent if exponent < 113 else 13
    units = 0 if shift > 24 else _round_shift(significand, shift)  # (below 2^-25: zero)
    if exponent < 113:
        value = units * 2.0**-24
        bits = sign | units  # (1024 units: the least normal's bits, as float16 has them)
    else:
        bits = sign | (((exponent - 112) << 10) + units - 1024)
        value = np.float64(float_from_bits(np.int32((exponent - 10) << 23))) * units  # 2^(e-137)
    return np.float32(-value if sign else value), np.int32(bits)


@cached_njit
def _round_shift(n, shift):
    """round(n / 2^shift) to nearest even, for a non-negative integer n."""
    kept = n >> shift
    rest = n & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    if rest > halfway or (rest == halfway and kept & 1):
        kept += 1
    return kept


# (value, bits) of a float32 rounded to float16, in the kernels
float16_rounded = float16_by_conversion if converts_float16() else float16_by_bits
