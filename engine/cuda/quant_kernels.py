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
from engine.cuda.attention import KVArgs, launch_attention
from engine.cuda.quant_reference import check_pair

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32
float16 = nbt.float16
float64 = nbt.float64
int32 = nbt.int32
_MAX_THREADS = 256
# Threads per block of the quantized write, forced (bench/cache_write_kernel.py --threads, the
# tests; None: the rule below). Its blocks run 64 registers a thread, so an SM holds 1024 of
# their threads at any block size, and the scale search keeps only 2 warps of a block busy:
# smaller blocks would keep more of an SM busy on prompt-sized writes (2048 tokens on the
# H200, 8B shape: q4 407 us against fp16's 60, 2026-11-30). Untimed, so not the rule yet.
_FORCE_WRITE_THREADS: int | None = None
_MAX_SHARED_BYTES = 48 * 1024  # static shared memory per block


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
# Rotary + quantized cache write, one launch, one block per (token, KV head): a 32-token
# decode write is 32 * KV blocks, not 32 (one block per token left most of an H200's 132 SMs
# idle), and a block's shared memory holds one head's rows.
#
# 1. Threads stride over the rotation pairs of the block's query heads (the KV head's group;
#    rotated q goes to the output, as in rotary.py) and of its k head; rotated k (rounded to
#    the run dtype, as the reference rounds it) and v go to shared memory as float32, sm[0] =
#    K and sm[2] = V, [D] each; with key centering (k_pages.center) the rotated k less its
#    center, in float32.
# 2. With rotation, the 32-point Hadamard transform of every group in place: five butterfly
#    stages (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h) for h = 1, 2, 4, 8, 16, threads striding
#    over the pairs of both buffers, the last stage times 1/sqrt(32): 5 shared-memory reads per
#    value. (Each output as a 32-term dot product, 32 reads and a parity per term, was ~19 us
#    of a q4 write's 36 us per 32-token decode call on the H200, 8B shape, one block per
#    token: bench/results/cache_write_kernel_h200_2026-11-27.json; with the butterflies and a
#    block per (token, KV head) 11.5 us: cache_write_kernel_h200_2026-11-30.json.)
# 3. Each group's scale: absmax / qmax (clamped to fp16's range), or for rotated 4-bit groups
#    quant.search_scales' search (the first element m of largest magnitude; per divisor d the
#    fp16 scale -m / d and the group's squared error under it, in float64; the first least
#    kept). One thread per (group, divisor) computes a trial into shared memory, then one
#    thread per group picks, stores the fp16 scale in the pages and its value in shared
#    memory. (One thread per group running the divisors in turn took ~57 us per layer for a
#    32-token decode step on the H200, 8B shape: a long serial chain with 2 warps busy.)
# 4. Threads stride over output bytes: q = clamp(floor(x / s + 0.5), qmin, qmax) with the
#    stored scale (1 where it is 0), int8 for 8 bits, two nibbles (q + 8) for 4 bits.
# 5. On a sink page (page < R, k_pages.sinks), threads stride over the values once more and
#    store them unquantized (after 1-2: centered and rotated) in the run dtype.
# No fastmath: x / s must be the IEEE quotient the reference takes.
# Padding tokens (negative slot) and slots past the pages rotate q and write nothing.
# --------------------------------------------------------------------------------------------


@functools.cache
def _quant_write_kernel(  # noqa: PLR0915 (one kernel, its steps inline)
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
    rotate_step = _hadamard_step(D)
    scale_step = _scale_step(D, k_bits, v_bits, rotate)
    TRIALS = num_trials(k_bits, v_bits, rotate)
    NG2 = 2 * D // GROUP  # K and V groups
    write_k = _code_writer(k_bits, D)
    write_v = _code_writer(v_bits, D)
    write_sinks = _sink_writer(dtype, D)

    @cuda.jit
    def kernel(
        q, k, v, cos, sin, k_data, v_data, k_scales, v_scales, k_center, slot_mapping, q_out,
        k_sinks, v_sinks,
    ):  # fmt: skip
        # sm[0] = K values, sm[1] = K scales, sm[2] = V values, sm[3] = V scales (float32)
        sm = cuda.shared.array((4, D), float32)
        trial_error = cuda.shared.array((NG2, TRIALS), float64)
        trial_scale = cuda.shared.array((NG2, TRIALS), float32)
        t = cuda.blockIdx.x
        kh = cuda.blockIdx.y  # the KV head; its query heads are group * kh ...
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        group = q.shape[1] // k.shape[1]
        half = D // 2
        page_size = k_data.shape[1]
        slot = slot_mapping[t]
        write = slot >= 0 and slot < k_data.shape[0] * page_size
        page = slot // page_size
        offset = slot - page * page_size
        for p in range(tid, (group + 1) * half, nt):
            g = p // half  # the group's query heads, then (g == group) the key
            j = p - g * half
            c = float32(cos[t, j])
            s = float32(sin[t, j])
            if g < group:
                h = kh * group + g
                x1 = float32(q[t, h, j])
                x2 = float32(q[t, h, j + half])
                q_out[t, h, j] = io(float32(io(x1 * c)) + float32(io(-x2 * s)))
                q_out[t, h, j + half] = io(float32(io(x2 * c)) + float32(io(x1 * s)))
            elif write:
                x1 = float32(k[t, kh, j])
                x2 = float32(k[t, kh, j + half])
                k1 = float32(io(float32(io(x1 * c)) + float32(io(-x2 * s))))
                k2 = float32(io(float32(io(x2 * c)) + float32(io(x1 * s))))
                if centered:  # (the reference: the rounded key in float32, less the center)
                    k1 -= k_center[kh, j]
                    k2 -= k_center[kh, j + half]
                sm[0, j] = k1
                sm[0, j + half] = k2
        if write:  # uniform per block: every thread takes the same branch
            for e in range(tid, D, nt):
                sm[2, e] = float32(v[t, kh, e])
            cuda.syncthreads()
            if rotate:
                rotate_step(sm, tid, nt)
            scale_step(sm, trial_error, trial_scale, k_scales, v_scales, page, offset, kh, tid, nt)
            cuda.syncthreads()
            write_k(k_data, sm, 0, page, offset, kh, tid, nt)
            write_v(v_data, sm, 2, page, offset, kh, tid, nt)
            if sinks and page < k_sinks.shape[0]:
                write_sinks(k_sinks, v_sinks, sm, page, offset, kh, tid, nt)

    return kernel


@functools.cache
def _sink_writer(dtype: torch.dtype, head_dim: int):
    """Step 5 as a device function: a sink page's slot also gets head ``kh``'s rows unquantized
    (sm[0] and sm[2], centered and rotated), rounded to the run dtype as the reference stores
    them."""
    io = _launch.NUMBA_DTYPES[dtype]

    def write(k_sinks, v_sinks, sm, page, offset, kh, tid, nt):
        for e in range(tid, head_dim, nt):
            k_sinks[page, offset, kh, e] = io(sm[0, e])
            v_sinks[page, offset, kh, e] = io(sm[2, e])

    return device_function(write)


@functools.cache
def _hadamard_step(n: int):
    """Step 2: sm[0] and sm[2] ([n] values each) replaced by their per-group transforms."""
    inv_sqrt = float32(1.0 / math.sqrt(GROUP))
    half = n // 2  # butterfly pairs per buffer and stage

    def rotate_step(sm, tid, nt):
        h = 1
        while h < GROUP:  # (uniform: every thread runs every stage and reaches the barrier)
            norm = inv_sqrt if 2 * h == GROUP else float32(1.0)
            for p in range(tid, 2 * half, nt):
                w = p // half
                r = p - w * half
                i = (r // h) * 2 * h + r % h  # r with a zero bit inserted at h
                a = sm[2 * w, i]
                b = sm[2 * w, i + h]
                sm[2 * w, i] = (a + b) * norm
                sm[2 * w, i + h] = (a - b) * norm
            cuda.syncthreads()
            h *= 2

    return device_function(rotate_step)


def write_shared_bytes(n: int, k_bits: int, v_bits: int, rotate: bool) -> int:
    """Shared memory of the write kernel for n = D values per side (one head): sm (float32
    [4, n]) and step 3's trials (float64 error + float32 scale per trial)."""
    return 16 * n + 2 * (n // GROUP) * num_trials(k_bits, v_bits, rotate) * 12


def num_trials(k_bits: int, v_bits: int, rotate: bool) -> int:
    """Scale trials per group in step 3: the search's divisors where a side searches, else 1."""
    return len(SEARCH_DIVISORS) if searches(k_bits, rotate) or searches(v_bits, rotate) else 1


@functools.cache
def _scale_step(n: int, k_bits: int, v_bits: int, rotate: bool):
    """Step 3: each group's fp16 scale into head ``kh``'s scales of the slot, and its float32
    value (1 for a zero scale: the group quantizes to zeros) into sm[1] (K) / sm[3] (V).
    ``trial_error`` (float64) and ``trial_scale`` [2 * groups, trials]: each trial's squared
    error and scale. n = D values per side."""
    groups = n // GROUP
    k_top, v_top = float32(qmax(k_bits)), float32(qmax(v_bits))
    k_search, v_search = searches(k_bits, rotate), searches(v_bits, rotate)
    trials_per_group = num_trials(k_bits, v_bits, rotate)
    scale_max = float32(FP16_MAX)
    k_trial, v_trial = _scale_trial(k_bits), _scale_trial(v_bits)

    def scale_step(sm, trial_error, trial_scale, k_scales, v_scales, page, offset, kh, tid, nt):
        for t in range(tid, 2 * groups * trials_per_group, nt):
            g = t // trials_per_group  # K groups, then V groups
            c = t - g * trials_per_group
            w = g // groups
            first = (g - w * groups) * GROUP
            if w == 0 and k_search:
                stored, error = k_trial(sm, 0, first, c)
            elif w == 1 and v_search:
                stored, error = v_trial(sm, 2, first, c)
            elif c == 0:
                top = k_top if w == 0 else v_top
                absmax = float32(0.0)
                for jj in range(GROUP):
                    absmax = max(absmax, abs(sm[2 * w, first + jj]))
                stored, error = float16(min(absmax / top, scale_max)), float64(0.0)
            else:
                continue
            trial_error[g, c] = error
            trial_scale[g, c] = float32(stored)  # (exact: an fp16)
        cuda.syncthreads()
        for g in range(tid, 2 * groups, nt):
            w = g // groups
            gg = g - w * groups
            best = 0
            if k_search if w == 0 else v_search:
                for c in range(1, trials_per_group):  # the first least error, as the reference
                    if trial_error[g, c] < trial_error[g, best]:
                        best = c
            stored = float16(trial_scale[g, best])
            if w == 0:
                k_scales[page, offset, kh, gg] = stored
            else:
                v_scales[page, offset, kh, gg] = stored
            step = float32(stored)
            sm[2 * w + 1, gg] = step if step != 0 else float32(1.0)

    return device_function(scale_step)


@functools.cache
def _scale_trial(bits: int):
    """``trial(sm, row, first, c) -> (float16 scale, float64 error)``: quant.search_scales'
    candidate c for the group of 32 values at sm[row, first:first + 32] (the scale -m / d_c,
    m its first element of largest magnitude) and the group's squared error under it, in
    the same float32 / float64 operations and order."""
    divisors = tuple(float32(-d) for d in SEARCH_DIVISORS)
    scale_max = float32(FP16_MAX)
    code = _coder(bits)

    def trial(sm, row, first, c):
        m = float32(0.0)
        for jj in range(GROUP):  # the first element of largest magnitude, as torch's argmax
            x = sm[row, first + jj]
            if abs(x) > abs(m):
                m = x
        stored = float16(min(max(m / divisors[c], -scale_max), scale_max))
        s = float32(stored)
        step = s if s != 0 else float32(1.0)
        error = float64(0.0)
        for jj in range(GROUP):
            x = sm[row, first + jj]
            r = float64(x - float32(code(x, step)) * s)
            error += r * r
        return stored, error

    return device_function(trial)


@functools.cache
def _coder(bits: int):
    """``code(x, s)``: the ``bits``-bit code of x under the step s (step 4's rounding)."""
    low, high = qmin(bits), qmax(bits)
    rnd = float32(0.5)

    def code(x, s):
        return min(max(int32(math.floor(x / s + rnd)), low), high)

    return device_function(code)


@functools.cache
def _code_writer(bits: int, head_dim: int):
    """Step 4 as a device function: ``write(pages, sm, row, page, offset, kh, tid, nt)`` stores
    the codes of the D values in sm[row] (scales in sm[row + 1]) into head kh of a page slot."""
    half = GROUP // 2
    code = _coder(bits)
    if bits == 8:

        def write(pages, sm, row, page, offset, kh, tid, nt):
            for e in range(tid, head_dim, nt):
                pages[page, offset, kh, e] = code(sm[row, e], sm[row + 1, e // GROUP])

    else:

        def write(pages, sm, row, page, offset, kh, tid, nt):
            for b in range(tid, head_dim // 2, nt):
                g = b // half  # the group in the head
                j = b - g * half
                s = sm[row + 1, g]
                lo = code(sm[row, g * GROUP + j], s)
                hi = code(sm[row, g * GROUP + j + half], s)
                pages[page, offset, kh, g * half + j] = (lo + 8) | ((hi + 8) << 4)

    return device_function(write)


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
    need = write_shared_bytes(head_dim, k_pages.bits, v_pages.bits, k_pages.rotate)
    if need > _MAX_SHARED_BYTES:
        raise ValueError(
            f"{name}: head_dim {head_dim} needs {need} bytes of shared memory per block, over "
            f"the {_MAX_SHARED_BYTES} a block may hold"
        )
    if cos.shape != (tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"{name}: cos/sin must be [T, D/2]")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in _launch.NUMBA_INDEX_DTYPES:
        raise ValueError(f"{name}: slot_mapping must be [T] int32/int64")


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
    tokens, heads, head_dim = q.shape
    if tokens == 0:
        return out
    kv_heads = k.shape[1]
    work = max((heads // kv_heads + 1) * head_dim // 2, 2 * head_dim)  # per (token, KV head)
    threads = 32
    while threads < work and threads < _MAX_THREADS and not _launch.SIMULATOR:
        threads *= 2
    threads = _FORCE_WRITE_THREADS or threads
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
