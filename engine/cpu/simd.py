"""Explicit vector code for the CPU kernels, one quantization group (32 values) at a time in
one piece of LLVM vector IR (Numba intrinsics) instead of a Numba loop: its codes made floats
(``dequantize_4bit_group``, ``dequantize_8bit_group``) and the scale search's error of one
candidate scale (``rounding_error``).

Why: Numba leaves LLVM's SLP vectorizer off, and a loop over one group (a count known only at
run time, so that the loop vectorizer takes it) pays the vectorized loop's entry checks and
remainder for every group; Numba's integer promotion had also turned the 4-bit codes' masks
and shifts into 64-bit lanes with 512-bit scatters. Here a group is one load, byte-wide masks
and shifts, one conversion and one multiply per value. SmolLM2's decode attention over q4
pages, 8 x 1k, one thread: ~55 -> ~46 ns per key and KV head (medians of six processes; q8
unchanged within this box's noise).

The values are the loops' to the bit: a code times a float16 scale is exact in float32, and so
is its difference with 8 x the scale; the error's steps are the scalar code's, in float32,
with only the float64 sum in another (exact, but for rare roundings) order.

Each takes an array and the index tuple of the first element it touches; the group's elements
must lie in the array's last dimension (C order), which the callers guarantee (a group never
crosses a row). No bounds are checked.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from engine.cache.quant import GROUP

# floats per vector: 8 (256 bits). Vectors of 16 or 32 became 512-bit stores, which ran up
# to 25% slower in some processes (q8 decode attention: 43 against 55 ns per key and head)
LANES = 8
_I8 = ir.IntType(8)
_F32 = ir.FloatType()
BYTES_4BIT = GROUP // 2  # a 4-bit group's bytes: element j in the low nibble, j + 16 in the high


def _vector(element: ir.Type, values: list) -> ir.Constant:
    return ir.Constant(ir.VectorType(element, len(values)), values)


def _splat(builder: ir.IRBuilder, value: ir.Value, count: int) -> ir.Value:
    """``value`` in every lane of a ``count``-lane vector."""
    vector = ir.VectorType(value.type, count)
    lane0 = builder.insert_element(
        ir.Constant(vector, ir.Undefined), value, ir.Constant(ir.IntType(32), 0)
    )
    return builder.shuffle_vector(
        lane0, ir.Constant(vector, ir.Undefined), _vector(ir.IntType(32), [0] * count)
    )


def _element_pointer(context, builder, array_type, array, index_type, index, element, count):
    """A pointer to ``count`` elements from ``array[index]`` (no wraparound, no bounds check),
    typed as a vector of them."""
    ary = context.make_array(array_type)(context, builder, array)
    values = cgutils.unpack_tuple(builder, index, len(index_type))
    indices = [
        context.cast(builder, value, kind, types.intp)
        for value, kind in zip(values, index_type, strict=True)
    ]
    pointer = cgutils.get_item_pointer(context, builder, array_type, ary, indices, wraparound=False)
    return builder.bitcast(pointer, ir.VectorType(element, count).as_pointer())


def _group_pointers(context, builder, signature, args, code_bytes):
    """(``code_bytes`` codes at codes[codes_at], GROUP floats at out[out_at]) as vector
    pointers, from an intrinsic's (codes, codes_at, out, out_at, scale)."""
    kinds = signature.args
    source = _element_pointer(
        context, builder, kinds[0], args[0], kinds[1], args[1], _I8, code_bytes
    )
    target = _element_pointer(context, builder, kinds[2], args[2], kinds[3], args[3], _F32, GROUP)
    return source, target


def _indexed(array, at, dtype) -> bool:
    """Whether ``array`` is a C-order array of ``dtype`` and ``at`` an integer index tuple of
    its dimensions."""
    return (
        isinstance(array, types.Array)
        and array.dtype == dtype
        and array.layout == "C"
        and isinstance(at, types.BaseTuple)
        and len(at) == array.ndim
        and all(isinstance(kind, types.Integer) for kind in at)
    )


def _typed(codes, codes_at, out, out_at, scale) -> bool:
    """Codes: uint8, out: float32 (each ``_indexed``); scale float32."""
    return (
        _indexed(codes, codes_at, types.uint8)
        and _indexed(out, out_at, types.float32)
        and scale == types.float32
    )


def _store_floats(builder, codes, convert, scale, offset, target, first):
    """target[first : first + len(codes)] = convert(codes) x scale (less ``offset``), in
    vectors of ``LANES``."""
    count = codes.type.count
    lanes = ir.VectorType(_F32, LANES)
    step = _splat(builder, scale, LANES)
    base = builder.bitcast(target, lanes.as_pointer())
    for part in range(0, count, LANES):
        picked = builder.shuffle_vector(
            codes, codes, _vector(ir.IntType(32), list(range(part, part + LANES)))
        )
        value = builder.fmul(convert(picked, lanes), step)
        if offset is not None:
            value = builder.fsub(value, _splat(builder, offset, LANES))
        at = ir.Constant(ir.IntType(64), (first + part) // LANES)
        builder.store(value, builder.gep(base, [at]), align=4)


@intrinsic
def dequantize_4bit_group(typingctx, codes, codes_at, out, out_at, scale):
    """out[out_at : +32] = a 4-bit group's 16 bytes from codes[codes_at]: the low nibbles
    (elements 0..15) then the high ones (16..31), each less 8, times ``scale``."""
    if not _typed(codes, codes_at, out, out_at, scale):
        return None

    def codegen(context, builder, signature, args):
        source, target = _group_pointers(context, builder, signature, args, BYTES_4BIT)
        packed = builder.load(source, align=1)
        scale = args[4]
        offset = builder.fmul(scale, ir.Constant(_F32, 8.0))  # exact: 8 x a float16
        low = builder.and_(packed, _vector(_I8, [15] * BYTES_4BIT))
        high = builder.lshr(packed, _vector(_I8, [4] * BYTES_4BIT))
        _store_floats(builder, low, builder.uitofp, scale, offset, target, 0)
        _store_floats(builder, high, builder.uitofp, scale, offset, target, BYTES_4BIT)
        return context.get_dummy_value()

    return types.void(codes, codes_at, out, out_at, scale), codegen


@intrinsic
def dequantize_8bit_group(typingctx, codes, codes_at, out, out_at, scale):
    """out[out_at : +32] = the 32 bytes from codes[codes_at], each read as an int8, times
    ``scale``."""
    if not _typed(codes, codes_at, out, out_at, scale):
        return None

    def codegen(context, builder, signature, args):
        source, target = _group_pointers(context, builder, signature, args, GROUP)
        signed = builder.load(source, align=1)
        _store_floats(builder, signed, builder.sitofp, args[4], None, target, 0)
        return context.get_dummy_value()

    return types.void(codes, codes_at, out, out_at, scale), codegen


def _float_intrinsic(builder: ir.IRBuilder, name: str, value: ir.Value) -> ir.Value:
    """LLVM's ``llvm.<name>`` on a float vector (e.g. floor: one rounding instruction)."""
    fnty = ir.FunctionType(value.type, [value.type])
    suffix = f"v{value.type.count}f32"
    function = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.{name}.{suffix}")
    return builder.call(function, [value])


def _sum_lanes(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The sum of a vector's lanes, halves added pairwise."""
    count = vector.type.count
    while count > 1:
        count //= 2
        low = builder.shuffle_vector(vector, vector, _vector(ir.IntType(32), list(range(count))))
        high = builder.shuffle_vector(
            vector, vector, _vector(ir.IntType(32), list(range(count, 2 * count)))
        )
        vector = builder.fadd(low, high)
    return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))


@intrinsic
def rounding_error(typingctx, values, at, step, low, high):
    """The sum of a group's squared residuals under ``step``: for the 32 float32 values from
    values[at], q = floor(x / step + 0.5) (each step rounded to float32) clamped to
    [low, high], the residual x - q * step rounded to float32, squared exactly in float64
    and summed (lanes first, then the lanes' sums pairwise). ``quant.search_scales``' error
    of one candidate scale."""
    if not (_indexed(values, at, types.float32) and (step, low, high) == (types.float32,) * 3):
        return None

    def codegen(context, builder, signature, args):
        kinds = signature.args
        source = _element_pointer(
            context, builder, kinds[0], args[0], kinds[1], args[1], _F32, LANES
        )
        step, half = _splat(builder, args[2], LANES), _splat(builder, ir.Constant(_F32, 0.5), LANES)
        low, high = _splat(builder, args[3], LANES), _splat(builder, args[4], LANES)
        doubles = ir.VectorType(ir.DoubleType(), LANES)
        total = ir.Constant(doubles, [0.0] * LANES)
        for part in range(GROUP // LANES):
            x = builder.load(builder.gep(source, [ir.Constant(ir.IntType(64), part)]), align=4)
            q = _float_intrinsic(builder, "floor", builder.fadd(builder.fdiv(x, step), half))
            q = builder.select(builder.fcmp_ordered(">", q, low), q, low)  # max(q, low)
            q = builder.select(builder.fcmp_ordered("<", q, high), q, high)  # min(q, high)
            residual = builder.fpext(builder.fsub(x, builder.fmul(q, step)), doubles)
            total = builder.fadd(total, builder.fmul(residual, residual))
        return _sum_lanes(builder, total)

    return types.float64(values, at, step, low, high), codegen
