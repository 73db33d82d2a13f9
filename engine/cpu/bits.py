"""Bit casts between float32 and int32 inside Numba CPU kernels (Numba has no scalar view):
one LLVM ``bitcast`` each, which LLVM vectorizes like any other instruction; and float16
tensors handed to the kernels as their bits (Numba has no float16 on the CPU)."""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


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
