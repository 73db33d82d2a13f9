"""Numba CUDA ops over quantized pages (q8/q6/q4; layout in engine/cache/quant.py).

- ``paged_attention_quant_cuda``: the paged attention kernel of attention.py, specialised on
  the K and V page formats: each lane dequantizes the elements it owns as it loads them
  (kv_load.py), so a q4 page moves a quarter of fp16's bytes and nothing is dequantized into a
  buffer. With rotated pages the kernel rotates the query once on entry and the output once
  on the way out (word reads; attention.py's ``_q_rotator`` and the merge), and works in the
  rotated space in between, never inverting anything per key (element reads: torch matmuls
  around the launch).
- ``quant_rotary_cache_write_cuda``: rotary on q and k fused with the quantized write of k and
  v (one launch, one block per (token, KV head); see the comment above the kernel).

Torch references: engine/cuda/quant_reference.py; tests check these against them under the
simulator.
"""

from __future__ import annotations

import functools
import math

import torch

from engine.batch import ForwardBatch
from engine.cache.quant import (
    FP16_MAX,
    GROUP,
    SEARCH_DIVISORS,
    QuantPages,
    WrittenRows,
    qmax,
    qmin,
    searches,
)
from engine.cuda import _launch, attention_mma
from engine.cuda._launch import device_function
from engine.cuda.attention import KVArgs, launch_attention, num_sms
from engine.cuda.mma import warp_shfl_xor, warp_shfl_xor_all
from engine.cuda.quant_reference import check_pair

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32
float16 = nbt.float16
float64 = nbt.float64
int32 = nbt.int32
_MAX_THREADS = 256
# From this many blocks per SM up (prompt-sized writes) the quantized write runs 2 warps per
# block, each taking its share of the groups in turn; below, a warp per group. H200, 8B shape
# (8 KV heads x 128: 8 groups; bench/results/cache_write_kernel_h200_2026-11-30_stop60.json):
# at 32 tokens (256 blocks) a warp per group was the fastest for every mode (q4 7.3 us, 9.0
# at 4 warps, 12.7 at 2); at 2048 tokens (16384 blocks) 2 warps were (q4 214 -> 173 us, q6
# 179 -> 119, q8 120 -> 73, fp16's own write 60). Where between the two it turns is not
# measured: 8 blocks per SM is a guess that keeps decode batches of up to 131 sequences (at
# 8 KV heads on an H200's 132 SMs) on a warp per group.
_WIDE_GRID_BLOCKS_PER_SM = 8
_WIDE_GRID_WARPS = 2
# Threads per block of the quantized write, forced (bench/cache_write_kernel.py --threads, the
# tests; None: a warp per group, up to _MAX_THREADS). A multiple of 32: each warp takes whole
# groups. Fewer warps than groups run the groups in turn.
_FORCE_WRITE_THREADS: int | None = None


def _check_attention(q: torch.Tensor, k_pages, v_pages, batch: ForwardBatch, window, splits):
    name = "paged_attention_quant_cuda"
    if not _launch.kernels_available():
        raise ValueError(f"{name}: no CUDA device (and NUMBA_ENABLE_CUDASIM is not set)")
    if not isinstance(k_pages, QuantPages):
        raise ValueError(f"{name}: takes QuantPages, got {type(k_pages).__name__}")
    check_pair(k_pages, v_pages)
    _launch.check_dtype(name, q)
    _launch.check_device(name, q, k_pages.data, v_pages.data, batch.block_tables)
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, H, D], got shape {tuple(q.shape)}")
    _, page_size, kv_heads, head_dim = k_pages.shape
    if q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"{name}: q {tuple(q.shape)} does not fit pages {k_pages.shape}")
    if page_size != batch.page_size or q.shape[0] != batch.num_tokens:
        raise ValueError(f"{name}: the batch does not match q {tuple(q.shape)} / page size")
    if window is not None and window <= 0:
        raise ValueError(f"{name}: sliding_window must be positive, got {window}")
    if splits is not None and splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {splits}")


def paged_attention_quant_cuda(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``quant_paged_attention_reference`` as the Numba kernels; returns a new [T, H, D].

    Decode batches that the tensor-core kernel serves (attention_mma.supports) go there
    instead when ``attention_mma.routes_decode`` says so: by default the CUDA-graph runner's
    decode steps (ENGINE_TENSOR_CORE_DECODE)."""
    _check_attention(q, k_pages, v_pages, batch, sliding_window, num_splits)
    if attention_mma.routes_decode(q) and attention_mma.supports(
        k_pages.bits, v_pages.bits, None if k_pages.sinks is None else k_pages.sinks.dtype,
        q.shape[2], q.shape[1] // k_pages.shape[2], batch.page_size, batch.max_query_len,
    ):  # fmt: skip
        return attention_mma.decode_attention_mma(
            q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
            rotate=k_pages.rotate, k_bits=k_pages.bits, v_bits=v_pages.bits,
            k_sinks=k_pages.sinks, v_sinks=v_pages.sinks, sliding_window=sliding_window,
            num_splits=num_splits,
        )  # fmt: skip
    pages = KVArgs(
        k_pages.data,
        v_pages.data,
        k_pages.scales,
        v_pages.scales,
        k_pages.bits,
        v_pages.bits,
        k_pages.shape[2],
        k_pages.sinks,
        v_pages.sinks,
        k_pages.rotate,
    )
    return launch_attention(q, pages, batch, scale, sliding_window, num_splits)


# --------------------------------------------------------------------------------------------
# Rotary + quantized cache write, one launch, one block per (token, KV head); within a block,
# one warp per group of 32 values (a KV head of 128 dims: 4 K groups + 4 V groups, 8 warps),
# a lane per value, so that after step 1 a group's work is warp shuffles only: no shared
# memory and no block barrier.
#
# 1. Threads stride over the rotation pairs of the block's query heads (the KV head's group;
#    rotated q goes to the output, as in rotary.py).
# 2. Each warp takes a group (a warp takes several when the block has fewer warps than
#    groups; the simulator runs one): its lane holds the group's element lane, for K rotated
#    (rounded to the run dtype, as the reference rounds it) and, with key centering
#    (k_pages.center), less its center, in float32; for V as given, in float32.
# 3. With rotation, the group's 32-point Hadamard transform: five butterfly stages
#    (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h), h = 1, 2, 4, 8, 16, each an xor shuffle of
#    distance h; the last stage times 1/sqrt(32). (The same float32 operations as the
#    reference's quant.hadamard_butterflies.)
# 4. The group's scale: absmax / qmax (clamped to fp16's range; an xor-shuffle max), or for
#    rotated 4-bit groups quant.search_scales' search: m the group's first element of largest
#    magnitude (an xor-shuffle reduction on (|x|, lane)); per divisor d the fp16 scale -m / d
#    and the group's squared error under it, each lane its own term, summed in float64 by
#    xor shuffles (all divisors at once: eight independent reductions); the first least kept.
#    Every lane ends with the same sums, so the choice is uniform over the warp. Lane 0
#    stores the fp16 scale.
# 5. Each lane codes its value: q = clamp(floor(x / s + 0.5), qmin, qmax) with the stored
#    scale (1 where it is 0); int8 for 8 bits; for 4 bits lane j < 16 packs its nibble q + 8
#    with lane j + 16's (one xor shuffle) into byte j of the group.
# 6. On a sink page (page < R, k_pages.sinks) each lane also stores its value unquantized
#    (after 2-3: centered and rotated) in the run dtype.
# No fastmath: x / s must be the IEEE quotient the reference takes.
# Padding tokens (negative slot) and slots past the pages rotate q and write nothing.
#
# History (H200, Llama-3-8B shape, bench/cache_write_kernel.py): one block per token with a
# 32-term dot product per rotated value took 36 us per 32-token decode call (2026-11-27);
# a block per (token, KV head) with shared-memory butterflies and one thread per (group,
# divisor) running each trial's two 32-step loops, 11.5 us, but 407 us per 2048-token
# prompt write against fp16's 60 (2026-11-30): its search kept 2 of 8 warps busy on long
# serial chains, and without rotation one thread per group ran the absmax.
# --------------------------------------------------------------------------------------------


@functools.cache
def _quant_write_kernel(
    dtype: torch.dtype,
    head_dim: int,
    k_bits: int,
    v_bits: int,
    rotate: bool,
    centered: bool,
    sinks: bool = False,
):
    io = _launch.NUMBA_DTYPES[dtype]
    D = head_dim
    half = D // 2
    side_groups = D // GROUP  # groups per side (K, V)
    load_key = _key_loader(dtype, D, centered)
    k_scale, v_scale = _group_scaler(k_bits, rotate), _group_scaler(v_bits, rotate)
    k_store, v_store = _lane_code_writer(k_bits), _lane_code_writer(v_bits)

    @cuda.jit
    def kernel(
        q, k, v, cos, sin, k_data, v_data, k_scales, v_scales, k_center, slot_mapping, q_out,
        k_sinks, v_sinks,
    ):  # fmt: skip
        t = cuda.blockIdx.x
        kh = cuda.blockIdx.y  # the KV head; its query heads are group * kh ...
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        group = q.shape[1] // k.shape[1]
        for p in range(tid, group * half, nt):
            h = kh * group + p // half
            j = p % half
            c = float32(cos[t, j])
            s = float32(sin[t, j])
            x1 = float32(q[t, h, j])
            x2 = float32(q[t, h, j + half])
            q_out[t, h, j] = io(float32(io(x1 * c)) + float32(io(-x2 * s)))
            q_out[t, h, j + half] = io(float32(io(x2 * c)) + float32(io(x1 * s)))
        page_size = k_data.shape[1]
        slot = slot_mapping[t]
        if slot < 0 or slot >= k_data.shape[0] * page_size:  # (uniform per block)
            return
        page = slot // page_size
        offset = slot - page * page_size
        lane = tid & 31
        for g in range(tid >> 5, 2 * side_groups, nt >> 5):
            key = g < side_groups  # K groups, then V groups (uniform per warp)
            gg = g if key else g - side_groups
            e = gg * GROUP + lane
            x = load_key(k, cos, sin, k_center, t, kh, e) if key else float32(v[t, kh, e])
            if rotate:
                x = _rotate_lanes(x, lane)
            if key:
                stored = k_scale(x, lane)
                k_store(k_data, k_scales, x, stored, page, offset, kh, gg, lane)
            else:
                stored = v_scale(x, lane)
                v_store(v_data, v_scales, x, stored, page, offset, kh, gg, lane)
            if sinks and page < k_sinks.shape[0]:
                if key:
                    k_sinks[page, offset, kh, e] = io(x)
                else:
                    v_sinks[page, offset, kh, e] = io(x)

    return kernel


@functools.cache
def _key_loader(dtype: torch.dtype, head_dim: int, centered: bool):
    """Step 2 for K: ``load(k, cos, sin, k_center, t, kh, e)``, element e of token t's key
    head kh after rotary, rounded to the run dtype as the reference rounds it, in float32,
    less its center when the pages center keys."""
    io = _launch.NUMBA_DTYPES[dtype]
    half = head_dim // 2

    def load(k, cos, sin, k_center, t, kh, e):
        j = e % half
        c = float32(cos[t, j])
        s = float32(sin[t, j])
        x1 = float32(k[t, kh, j])
        x2 = float32(k[t, kh, j + half])
        if e < half:
            x = float32(io(float32(io(x1 * c)) + float32(io(-x2 * s))))
        else:
            x = float32(io(float32(io(x2 * c)) + float32(io(x1 * s))))
        if centered:  # (the reference: the rounded key in float32, less the center)
            x -= k_center[kh, e]
        return x

    return device_function(load)


@device_function
def _rotate_lanes(x, lane):
    """Step 3: lane ``lane``'s element of its warp's group after the 32-point transform."""
    inv_sqrt = float32(1.0 / math.sqrt(GROUP))
    h = 1
    while h < GROUP:
        y = warp_shfl_xor(x, h)
        x = (y - x) if lane & h else (x + y)  # (the pair's second / first element)
        if 2 * h == GROUP:
            x *= inv_sqrt
        h *= 2
    return x


@functools.cache
def _group_scaler(bits: int, rotate: bool):
    """Step 4: ``scale(x, lane) -> float16``, the stored scale of the warp's group (lane holds
    element lane), the same in every lane."""
    top = float32(qmax(bits))
    scale_max = float32(FP16_MAX)
    if not searches(bits, rotate):

        def absmax_scale(x, lane):
            a = abs(x)
            h = 1
            while h < GROUP:
                a = max(a, warp_shfl_xor(a, h))
                h *= 2
            return float16(min(a / top, scale_max))

        return device_function(absmax_scale)
    divisors = tuple(float32(-d) for d in SEARCH_DIVISORS)
    trials = len(divisors)
    code = _coder(bits)

    def searched_scale(x, lane):
        m = x  # the first element of largest magnitude, as torch's argmax
        at = lane
        h = 1
        while h < GROUP:
            other = warp_shfl_xor(m, h)
            other_at = warp_shfl_xor(at, h)
            if abs(other) > abs(m) or (abs(other) == abs(m) and other_at < at):
                m = other
                at = other_at
            h *= 2
        error = cuda.local.array(trials, float64)
        for c in range(trials):
            s = float32(float16(min(max(m / divisors[c], -scale_max), scale_max)))
            r = float64(x - float32(code(x, s if s != 0 else float32(1.0))) * s)
            error[c] = r * r
        other = cuda.local.array(trials, float64)
        h = 1
        while h < GROUP:  # (the trials' sums side by side: independent shuffle chains)
            warp_shfl_xor_all(error, other, trials, h)
            for c in range(trials):
                error[c] += other[c]
            h *= 2
        best = 0
        for c in range(1, trials):  # the first least error, as the reference
            if error[c] < error[best]:
                best = c
        return float16(min(max(m / divisors[best], -scale_max), scale_max))

    return device_function(searched_scale)


@functools.cache
def _coder(bits: int):
    """``code(x, s)``: the ``bits``-bit code of x under the step s (step 5's rounding)."""
    low, high = qmin(bits), qmax(bits)
    rnd = float32(0.5)

    def code(x, s):
        return min(max(int32(math.floor(x / s + rnd)), low), high)

    return device_function(code)


@functools.cache
def _lane_code_writer(bits: int):
    """Step 5 as a device function: ``store(pages, scales, x, stored, page, offset, kh, gg,
    lane)`` stores the group gg's scale ``stored`` (lane 0) and lane's code of x into head kh
    of a page slot."""
    code = _coder(bits)
    pair = GROUP // 2  # 4 bits: byte j holds elements j and j + 16

    @device_function
    def step(stored):  # the stored scale as a divisor: 1 for a zero (all-zero) group
        s = float32(stored)
        return s if s != 0 else float32(1.0)

    if bits == 8:

        def store(pages, scales, x, stored, page, offset, kh, gg, lane):
            if lane == 0:
                scales[page, offset, kh, gg] = stored
            pages[page, offset, kh, gg * GROUP + lane] = code(x, step(stored))

    else:

        def store(pages, scales, x, stored, page, offset, kh, gg, lane):
            if lane == 0:
                scales[page, offset, kh, gg] = stored
            q = code(x, step(stored))
            high = warp_shfl_xor(q, pair)
            if lane < pair:
                pages[page, offset, kh, gg * pair + lane] = (q + 8) | ((high + 8) << 4)

    return device_function(store)


def _check_write(q, k, v, cos, sin, k_pages, v_pages, slot_mapping) -> None:
    name = "quant_rotary_cache_write_cuda"
    if not isinstance(k_pages, QuantPages):
        raise ValueError(f"{name}: takes QuantPages, got {type(k_pages).__name__}")
    check_pair(k_pages, v_pages)
    _launch.check_dtype(name, q, k, v, cos, sin)
    _launch.check_device(name, q, k, v, cos, sin, k_pages.data, v_pages.data, slot_mapping)
    if len({t.dtype for t in (q, k, v, cos, sin)}) != 1:
        raise ValueError(f"{name}: q, k, v, cos and sin must share a dtype")
    tokens, _, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != head_dim:
        raise ValueError(f"{name}: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q")
    if (k.shape[1], head_dim) != k_pages.shape[2:]:
        raise ValueError(f"{name}: k {tuple(k.shape)} does not fit pages {k_pages.shape}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{name}: {q.shape[1]} query heads are not a multiple of k's heads")
    if cos.shape != (tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos/sin must be [T, D/2]")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in _launch.NUMBA_INDEX_DTYPES:
        raise ValueError(f"{name}: slot_mapping must be [T] int32/int64")


def write_warps(blocks: int, head_dim: int, sms: int) -> int:
    """Warps per block of the quantized write on ``blocks`` (token, KV head) blocks over
    ``sms`` SMs: a warp per group of the KV head (K and V), up to ``_MAX_THREADS``, and
    ``_WIDE_GRID_WARPS`` on a grid of ``_WIDE_GRID_BLOCKS_PER_SM`` blocks per SM or more."""
    per_group = min(2 * head_dim // GROUP, _MAX_THREADS // 32)
    if blocks >= _WIDE_GRID_BLOCKS_PER_SM * sms:
        return min(per_group, _WIDE_GRID_WARPS)
    return per_group


def _write_warps(blocks: int, head_dim: int, device: torch.device) -> int:
    if _launch.SIMULATOR:  # (it runs one warp, which takes every group in turn)
        return 1
    return write_warps(blocks, head_dim, num_sms(device))


def quant_rotary_cache_write_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """``quant_rotary_cache_write_reference`` in one launch; returns the rotated q (new). The
    rows are also left in ``k_pages.written`` (when the pages keep them) for the attention of
    this forward's prompt chunks (engine/cuda/quant_reference.py)."""
    _check_write(q, k, v, cos, sin, k_pages, v_pages, slot_mapping)
    if k_pages.written is not None:
        k_pages.written.put(WrittenRows(slot_mapping, k, v, cos, sin))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tokens, _, head_dim = q.shape
    if tokens == 0:
        return out
    kv_heads = k.shape[1]
    threads = _FORCE_WRITE_THREADS or 32 * _write_warps(tokens * kv_heads, head_dim, q.device)
    if threads % 32:  # (a forced count: each warp takes whole groups)
        raise ValueError(f"quant_rotary_cache_write_cuda: {threads} threads, not whole warps")
    centered = k_pages.center is not None
    sinks = k_pages.sinks is not None
    if sinks and (k_pages.sinks.dtype != q.dtype or v_pages.sinks is None):
        raise ValueError(
            f"quant_rotary_cache_write_cuda: sink rows must be {q.dtype} in K and V pages"
        )
    kernel = _quant_write_kernel(
        q.dtype, head_dim, k_pages.bits, v_pages.bits, k_pages.rotate, centered, sinks
    )
    if _launch.SIMULATOR:  # the simulator copies arrays in as single buffers; a GPU takes views
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # (not centered: the kernel never reads k_center; the scales stand in for its argument)
    center = k_pages.center if centered else k_pages.scales
    args = (q, k, v, cos, sin, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, center)
    # (without sink pages the kernel never writes them: the scales stand in for the arguments)
    k_sinks = k_pages.sinks if sinks else k_pages.scales
    v_sinks = v_pages.sinks if sinks else v_pages.scales
    _launch.launch(
        kernel, (tokens, kv_heads), threads, *args, slot_mapping.contiguous(), out, k_sinks, v_sinks
    )
    return out
