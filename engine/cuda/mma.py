"""Warp-level tensor-core products and packed-half arithmetic for device code: inline PTX on a
GPU, an emulation in the simulator built on block barriers (the simulator has no warp
shuffles and cannot run PTX).

Every value is a 32-bit register as Numba sees it: an int32 holding four 8-bit elements or two
fp16 halves (low half first), or a float32. The fragment layouts are the PTX ISA's (section
"Matrix Fragments for mma.m16n8k16 / m16n8k32"), lane = 4 * group + thread_in_group:

- ``mma_u8s8`` (m16n8k32, u8 x s8 + s32): A rows group / group + 8, k 4 * t .. 4 * t + 3 in
  a0 / a1 and 16 + 4 * t .. in a2 / a3; B k 4 * t .. in b0, 16 + 4 * t .. in b1, column group.
- ``mma_f16`` (m16n8k16, f16 x f16 + f32): A rows group / group + 8, k 2 * t, 2 * t + 1 in
  a0 / a1 and 2 * t + 8, 2 * t + 9 in a2 / a3; B k 2 * t, 2 * t + 1 in b0, + 8 in b1.
- Both: D rows group (d0, d1) and group + 8 (d2, d3), columns 2 * t and 2 * t + 1.

The emulation reproduces that layout from the definitions above, so a kernel tested in the
simulator is only as right as the layout reading; a GPU run checks the two against each other
(tests/kernels/test_attention_mma.py on a GPU).

``warp_shfl(value, lane)`` / ``warp_shfl_xor(value, mask)`` / ``warp_shfl_xor_all(src, dst,
count, mask)`` (a local array's values at once) are the shuffles the kernels built on these
use, ``warp_any(predicate)`` their vote: full-warp ``shfl.sync`` / ``vote.any`` on a GPU, one
block barrier per call in the simulator (valid when every thread of the block makes the same
sequence of calls).
"""

from __future__ import annotations

import threading

import numpy as np

from engine.cuda._launch import SIMULATOR, cuda, device_function

int32 = cuda.int32
float32 = cuda.float32

HALF2_1032 = 0x64086408  # two fp16 1032.0: a nibble u put in 0x6400 | u is 1024 + u
HALF2_MAGIC = 0x64006400  # fp16 1024.0 twice
HALF2_1152 = 0x64806480  # two fp16 1152.0: a byte u put in 0x6400 | u is 1024 + u


def _u32(x) -> int:
    return int(x) & 0xFFFFFFFF


def _i32(x) -> int:
    v = _u32(x)
    return v - (1 << 32) if v >= 1 << 31 else v


def _halves(x) -> np.ndarray:
    return np.array([_u32(x)], dtype=np.uint32).view(np.float16)  # [low, high]


def _from_halves(lo, hi) -> int:
    return _i32(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


def _bytes(x, signed: bool) -> list[int]:
    out = [(_u32(x) >> (8 * i)) & 255 for i in range(4)]
    return [b - 256 if signed and b >= 128 else b for b in out]


def _hsub2_sim(x, y):
    a, b = _halves(x), _halves(y)
    return _from_halves(a[0] - b[0], a[1] - b[1])  # numpy rounds each to fp16


def _hmul2_sim(x, y):
    a, b = _halves(x), _halves(y)
    return _from_halves(a[0] * b[0], a[1] * b[1])


def _pack_half2_sim(lo, hi):
    return _from_halves(np.float16(np.float32(lo)), np.float16(np.float32(hi)))


# The simulator's warp exchanges: each call writes this thread's values into a block buffer,
# waits at one barrier, reads. Buffers alternate between two phases (a per-thread call count):
# a thread can write a phase again only after the next call's barrier, which every thread
# reaches only once it has read that phase, so one barrier per call suffices.
_phase = threading.local()


def _next_phase() -> int:
    phase = getattr(_phase, "value", 0)
    _phase.value = phase ^ 1
    return phase


def _value_buffer():
    return cuda.shared.array((2, 1024), np.float64)  # one per block (the simulator keys by line)


def _warp_shfl_sim(value, lane):
    buf = _value_buffer()[_next_phase()]
    tid = cuda.threadIdx.x
    buf[tid] = value
    cuda.syncthreads()
    out = buf[(tid & ~31) | (int(lane) & 31)]
    return np.float32(out) if isinstance(value, (float, np.floating)) else int(out)


def _warp_shfl_xor_sim(value, mask):
    return _warp_shfl_sim(value, (cuda.threadIdx.x & 31) ^ int(mask))


def _warp_any_sim(predicate):
    buf = _value_buffer()[_next_phase()]
    tid = cuda.threadIdx.x
    buf[tid] = 1.0 if predicate else 0.0
    cuda.syncthreads()
    return bool(buf[tid & ~31 : (tid & ~31) + 32].any())


def _array_buffer():
    return cuda.shared.array((2, 1024, 64), np.float64)  # (one per block, as _value_buffer)


def _warp_shfl_xor_all_sim(src, dst, count, mask):
    buf = _array_buffer()[_next_phase()]
    tid = cuda.threadIdx.x
    for i in range(count):
        buf[tid, i] = src[i]
    cuda.syncthreads()
    for i in range(count):
        dst[i] = buf[tid ^ int(mask), i]


def _register_buffer():
    return cuda.shared.array((2, 1024, 6), np.int64)  # (one per block, as _value_buffer)


def _mma_sim(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, dot, zero):
    """D = A B + C from the fragments: every lane puts its registers in a block buffer, then
    reads the A rows and B columns its D entries need (``dot``: a register pair's elementwise
    product sum)."""
    regs = _register_buffer()[_next_phase()]
    tid = cuda.threadIdx.x
    warp = tid & ~31
    for i, r in enumerate((a0, a1, a2, a3, b0, b1)):
        regs[tid, i] = _i32(r)
    cuda.syncthreads()
    group, t = (tid & 31) >> 2, tid & 3
    d = [c0 + zero, c1 + zero, c2 + zero, c3 + zero]
    for source in range(4):
        ra = regs[warp + group * 4 + source]
        for col in range(2):
            rb = regs[warp + (2 * t + col) * 4 + source]
            d[col] += dot(ra[0], rb[4]) + dot(ra[2], rb[5])
            d[2 + col] += dot(ra[1], rb[4]) + dot(ra[3], rb[5])
    return d[0], d[1], d[2], d[3]


def _dot_u8s8(a, b):
    return sum(x * y for x, y in zip(_bytes(a, False), _bytes(b, True), strict=True))


def _dot_f16(a, b):
    x, y = _halves(a).astype(np.float32), _halves(b).astype(np.float32)
    return np.float32(x[0] * y[0] + x[1] * y[1])


def _mma_u8s8_sim(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    d = _mma_sim(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, _dot_u8s8, 0)
    return tuple(_i32(v) for v in d)


def _mma_f16_sim(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    d = _mma_sim(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, _dot_f16, np.float32(0))
    return tuple(np.float32(v) for v in d)


if SIMULATOR:
    wrap_i32 = device_function(_i32)
    hsub2 = device_function(_hsub2_sim)
    hmul2 = device_function(_hmul2_sim)
    pack_half2 = device_function(_pack_half2_sim)
    warp_shfl = device_function(_warp_shfl_sim)
    warp_shfl_xor = device_function(_warp_shfl_xor_sim)
    warp_shfl_xor_all = device_function(_warp_shfl_xor_all_sim)
    warp_any = device_function(_warp_any_sim)
    mma_u8s8 = device_function(_mma_u8s8_sim)
    mma_f16 = device_function(_mma_f16_sim)
else:  # pragma: no cover - needs a GPU (compiled for sm_90 by bench/kernel_sass.py)
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic
    from numba.cuda.typing import signature

    def _asm(builder, asm: str, constraints: str, out_types, args):
        """Call inline PTX; returns its outputs (a list) as LLVM values."""
        struct = ir.LiteralStructType(out_types) if len(out_types) > 1 else out_types[0]
        fnty = ir.FunctionType(struct, [a.type for a in args])
        result = builder.call(ir.InlineAsm(fnty, asm, constraints), args)
        if len(out_types) == 1:
            return [result]
        return [builder.extract_value(result, i) for i in range(len(out_types))]

    def _as_i32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.int32)

    def _as_f32(context, builder, value, ty):
        return context.cast(builder, value, ty, types.float32)

    def _half2_op(opcode: str):
        @intrinsic
        def op(typingctx, x, y):
            def codegen(context, builder, sig, args):
                values = [
                    _as_i32(context, builder, v, t) for v, t in zip(args, sig.args, strict=True)
                ]
                (out,) = _asm(builder, f"{opcode}.f16x2 $0, $1, $2;", "=r,r,r",
                              [ir.IntType(32)], values)  # fmt: skip
                return out

            return signature(types.int32, x, y), codegen

        return op

    hsub2 = _half2_op("sub.rn")
    hmul2 = _half2_op("mul.rn")

    @intrinsic
    def pack_half2(typingctx, lo, hi):
        """Two float32 rounded to fp16, ``lo`` in the low half (cvt.rn.f16x2.f32 takes the
        high half first)."""

        def codegen(context, builder, sig, args):
            lo_v, hi_v = (
                _as_f32(context, builder, v, t) for v, t in zip(args, sig.args, strict=True)
            )
            (out,) = _asm(builder, "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f",
                          [ir.IntType(32)], [hi_v, lo_v])  # fmt: skip
            return out

        return signature(types.int32, lo, hi), codegen

    @device_function
    def wrap_i32(x):
        """The low 32 bits of an integer, as an int32 (two's complement)."""
        return int32(x)

    @device_function
    def warp_shfl(value, lane):
        return cuda.shfl_sync(0xFFFFFFFF, value, lane)

    @device_function
    def warp_shfl_xor(value, mask):
        return cuda.shfl_xor_sync(0xFFFFFFFF, value, mask)

    @device_function
    def warp_any(predicate):
        """Whether ``predicate`` holds in any lane of the warp (vote.any)."""
        return cuda.any_sync(0xFFFFFFFF, predicate)

    @device_function
    def warp_shfl_xor_all(src, dst, count, mask):
        """dst[i] = lane ``lane ^ mask``'s src[i] for i < count (at most 64)."""
        for i in range(count):
            dst[i] = cuda.shfl_xor_sync(0xFFFFFFFF, src[i], mask)

    def _mma_intrinsic(asm: str, acc):
        """A 10-operand mma.sync (4 A registers, 2 B, 4 C) returning its 4 D registers."""
        operand = "r" if acc is types.int32 else "f"
        constraints = ",".join([f"={operand}"] * 4 + ["r"] * 6 + [operand] * 4)

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            def codegen(context, builder, sig, args):
                regs = [
                    _as_i32(context, builder, v, t)
                    for v, t in zip(args[:6], sig.args[:6], strict=True)
                ]
                cast = _as_i32 if acc is types.int32 else _as_f32
                accs = [
                    cast(context, builder, v, t)
                    for v, t in zip(args[6:], sig.args[6:], strict=True)
                ]
                out_type = context.get_value_type(acc)
                outs = _asm(builder, asm, constraints, [out_type] * 4, regs + accs)
                return context.make_tuple(builder, sig.return_type, outs)

            args = (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            return signature(types.UniTuple(acc, 4), *args), codegen

        return mma

    mma_u8s8 = _mma_intrinsic(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        types.int32,
    )
    mma_f16 = _mma_intrinsic(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        types.float32,
    )
