"""Explicit vector code for the CPU kernels, one quantization group (32 values) at a time in
one piece of LLVM vector IR (Numba intrinsics) instead of a Numba loop: its codes made floats
(``dequantize_4bit_group``, ``dequantize_8bit_group``) and the scale search's error of one
candidate scale (``rounding_error``). And decode attention's inner loops over a tile of keys
or values (``score_rows``, ``weigh_rows``), since stop 58: as Numba loops, each query row's
dot product with each key paid the vectorized loop's entry checks and a sum across lanes,
and each value added to a row of the output loaded and stored that row again (SmolLM2's
heads, q4, 32 x 1024, one thread: 3.0 -> 2.1 ms per layer with both and the softmax's
maximum in eight running maxima).

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


# ---- a block of rows against query rows: decode attention's dot products and weighted sums


def _fmuladd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a x b + c on float vectors, fused where the CPU can (LLVM's ``llvm.fmuladd``)."""
    fnty = ir.FunctionType(a.type, [a.type] * 3)
    name = f"llvm.fmuladd.v{a.type.count}f32"
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), [a, b, c])


def _float_pointer(context, builder, array_type, array, index_type, index) -> ir.Value:
    """A float* to ``array[index]`` (no wraparound, no bounds check)."""
    pointer = _element_pointer(context, builder, array_type, array, index_type, index, _F32, 1)
    return builder.bitcast(pointer, _F32.as_pointer())


def _block_rows(context, builder, array_type, array) -> tuple[ir.Value, ir.Value]:
    """(a float* to a C-order float32 [S, D] array's first element, D)."""
    block = context.make_array(array_type)(context, builder, array)
    dim = cgutils.unpack_tuple(builder, block.shape, 2)[1]
    return builder.bitcast(block.data, _F32.as_pointer()), dim


def _is_block(block) -> bool:
    return (
        isinstance(block, types.Array)
        and block.dtype == types.float32
        and block.ndim == 2
        and block.layout == "C"
    )


def _rows_typed(out, out_at, rows, rows_at, block, count) -> bool:
    return (
        _indexed(out, out_at, types.float32)
        and _indexed(rows, rows_at, types.float32)
        and _is_block(block)
        and isinstance(count, types.Integer)
    )


def _rows_arguments(context, builder, signature, args) -> tuple:
    """(intp, out's float*, the rows' float*, the block's float*, D, count) from the
    arguments (out, out_at, rows, rows_at, block, count) that ``_rows_typed`` took."""
    kinds = signature.args
    out = _float_pointer(context, builder, kinds[0], args[0], kinds[1], args[1])
    rows = _float_pointer(context, builder, kinds[2], args[2], kinds[3], args[3])
    block, dim = _block_rows(context, builder, kinds[4], args[4])
    count = context.cast(builder, args[5], kinds[5], types.intp)
    return context.get_value_type(types.intp), out, rows, block, dim, count


def _load_lanes(builder, pointer, offset) -> ir.Value:
    """LANES floats from ``pointer`` + ``offset`` (unaligned)."""
    at = builder.gep(pointer, [offset])
    return builder.load(builder.bitcast(at, ir.VectorType(_F32, LANES).as_pointer()), align=4)


def _store_lanes(builder, value, pointer, offset) -> None:
    at = builder.gep(pointer, [offset])
    builder.store(value, builder.bitcast(at, ir.VectorType(_F32, LANES).as_pointer()), align=4)


def _lane_sums(builder: ir.IRBuilder, vectors: list) -> ir.Value:
    """[sum of vectors[0]'s lanes, ..., sum of vectors[7]'s] from LANES vectors: three rounds
    of adding lanes pairwise across two vectors at a time (7 adds for 8 sums, where one
    vector's sum alone takes 3 adds and 3 shuffles). The rounds' lane masks are for LANES =
    8."""
    rounds = (
        ([0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]),
        ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]),
        ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]),
    )
    for low, high in rounds:
        vectors = [
            builder.fadd(
                builder.shuffle_vector(a, b, _vector(ir.IntType(32), low)),
                builder.shuffle_vector(a, b, _vector(ir.IntType(32), high)),
            )
            for a, b in zip(vectors[::2], vectors[1::2], strict=True)
        ]
    return vectors[0]


@intrinsic
def score_rows(typingctx, scores, scores_at, query, query_at, block, count):
    """scores[scores_at + s] = query[query_at : + D] . block[s] for each row s < ``count`` of
    ``block`` (float32 [S, D], C order; D a multiple of LANES). Eight rows at a time, each
    with its own vector of products, their eight lane sums made together (``_lane_sums``)
    and stored as one vector; the query's vectors are loaded once for the eight rows."""
    if not _rows_typed(scores, scores_at, query, query_at, block, count):
        return None

    def codegen(context, builder, signature, args):
        intp, out, q, rows, dim, count = _rows_arguments(context, builder, signature, args)
        lanes, zero = ir.Constant(intp, LANES), ir.Constant(ir.VectorType(_F32, LANES), None)
        sums = [cgutils.alloca_once(builder, zero.type) for _ in range(LANES)]
        whole = builder.mul(builder.sdiv(count, lanes), lanes)

        def dots(first, rows_now):  # sums[i] = lane products of row first + i, i < rows_now
            for total in sums[:rows_now]:
                builder.store(zero, total)
            start = builder.mul(first, dim)
            along_row = (ir.Constant(intp, 0), dim, lanes, intp)
            with cgutils.for_range_slice(builder, *along_row) as (d, _):
                q_lanes = _load_lanes(builder, q, d)
                for i, total in enumerate(sums[:rows_now]):
                    row_at = builder.add(
                        start, builder.add(builder.mul(ir.Constant(intp, i), dim), d)
                    )
                    row = _load_lanes(builder, rows, row_at)
                    builder.store(_fmuladd(builder, q_lanes, row, builder.load(total)), total)

        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), whole, lanes, intp) as (s, _):
            dots(s, LANES)
            _store_lanes(builder, _lane_sums(builder, [builder.load(t) for t in sums]), out, s)
        with cgutils.for_range_slice(builder, whole, count, ir.Constant(intp, 1), intp) as (s, _):
            dots(s, 1)
            builder.store(_sum_lanes(builder, builder.load(sums[0])), builder.gep(out, [s]))
        return context.get_dummy_value()

    return types.void(scores, scores_at, query, query_at, block, count), codegen


# vectors of an output row that ``weigh_rows`` keeps in registers at once: with rows taken in
# pairs, 8 running sums, enough to cover a multiply-add's latency
WEIGHED_VECTORS = 4


@intrinsic
def weigh_rows(typingctx, out, out_at, weights, weights_at, block, count):
    """out[out_at : + D] += sum over rows s < ``count`` of weights[weights_at + s] x block[s]
    (``block`` float32 [S, D], C order; D a multiple of LANES). The output's vectors stay in
    registers over the rows (WEIGHED_VECTORS at a time, even and odd rows in sums of their
    own), instead of being loaded and stored again for every row."""
    if not _rows_typed(out, out_at, weights, weights_at, block, count):
        return None

    def codegen(context, builder, signature, args):
        intp, acc, w, rows, dim, count = _rows_arguments(context, builder, signature, args)
        vector = ir.VectorType(_F32, LANES)
        even = [cgutils.alloca_once(builder, vector) for _ in range(WEIGHED_VECTORS)]
        odd = [cgutils.alloca_once(builder, vector) for _ in range(WEIGHED_VECTORS)]
        one, two = ir.Constant(intp, 1), ir.Constant(intp, 2)
        pairs = builder.sdiv(count, two)

        def add_row(s, d, sums):  # sums[i] += w[s] x block[s, d + i * LANES : + LANES]
            weight = _splat(builder, builder.load(builder.gep(w, [s])), LANES)
            start = builder.add(builder.mul(s, dim), d)
            for i, total in enumerate(sums):
                row = _load_lanes(builder, rows, builder.add(start, ir.Constant(intp, i * LANES)))
                builder.store(_fmuladd(builder, weight, row, builder.load(total)), total)

        def weigh(d, width):  # out[d : + width * LANES] over every row
            for i in range(width):
                builder.store(
                    _load_lanes(builder, acc, builder.add(d, ir.Constant(intp, i * LANES))), even[i]
                )
                builder.store(ir.Constant(vector, None), odd[i])
            with cgutils.for_range(builder, pairs, intp=intp) as loop:
                s = builder.mul(loop.index, two)
                add_row(s, d, even[:width])
                add_row(builder.add(s, one), d, odd[:width])
            last = builder.sub(count, one)
            with builder.if_then(builder.icmp_signed("==", builder.mul(pairs, two), last)):
                add_row(last, d, even[:width])
            for i in range(width):
                total = builder.fadd(builder.load(even[i]), builder.load(odd[i]))
                _store_lanes(builder, total, acc, builder.add(d, ir.Constant(intp, i * LANES)))

        span = ir.Constant(intp, WEIGHED_VECTORS * LANES)
        whole = builder.mul(builder.sdiv(dim, span), span)
        with cgutils.for_range_slice(builder, ir.Constant(intp, 0), whole, span, intp) as (d, _):
            weigh(d, WEIGHED_VECTORS)
        lanes = ir.Constant(intp, LANES)
        with cgutils.for_range_slice(builder, whole, dim, lanes, intp) as (d, _):
            weigh(d, 1)
        return context.get_dummy_value()

    return types.void(out, out_at, weights, weights_at, block, count), codegen
