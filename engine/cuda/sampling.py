"""Token choice on the GPU: greedy argmax and top-k / top-p / min-p / temperature sampling of
float32 logit rows, one block per row, nothing sorted, no host synchronisation.

These kernels compute what ``engine.sampling_fast._choose`` computes with torch ops (its
``_candidate_probs`` and ``engine.sampling._inverse_cdf``), given the same per-row float64
uniform draw (drawn on the host, one ``rng.random()`` per row, as now).

Algorithm (per row; threads stride the ids below ``limit``; every reduction is a fixed
shared-memory tree, so results are deterministic):

1. max pass: the row maximum ``M``, its FIRST id (the greedy token: exactly
   ``x[:, :limit].max(-1).indices``) and whether a NaN or an infinite maximum is present
   (flagged: the caller takes those rows to the reference). Greedy rows stop here; they never
   compute a probability.
2. probabilities are never stored: ``p(v) = exp(v / T - M / T)`` in float32, the torch path's
   operations in its order, recomputed per pass (the torch path's candidates, whose first is
   ``M``, normalise the same way; its softmax over the whole row cancels out).
3. top-k: the k-th largest logit by bisection over the float32 values' ordered bit patterns
   (<= 32 counting passes: how many ids hold a value >= the pivot; no exp). Its probability
   ``kth = p(x_k)`` is the torch path's ``probs.gather(1, top_k - 1)``; ids with ``p >= kth``
   are kept, so ties at the k-th are kept, as there. ``k >= limit`` or a k-th value of -inf
   keep everything (a threshold of 0), as the reference does. When the kept ids (k plus the
   ties) fit in ``_CANDIDATES`` (2048) slots, two passes over contiguous ranges copy their
   logits and ids to shared memory in id order, and steps 4-6 read that list, not the row.
4. top-p: ``L = top_p * S`` (S: the mass after top-k, one pass). The cut level ``c`` is the
   smallest probability whose mass above it is < L (the torch path's ``mass_before < L`` for the
   first token of that level), found by bisection over the float32 bit patterns of ``p`` in
   ``[kth, 1]`` (<= 30 passes, each with an exp per id). Of the ``t`` ids tied at ``c`` the
   first ``min(t, ceil((L - mass above c) / c))`` (at least 1) by id are kept, as the torch
   path's ``_top_p_cut`` keeps them lowest ids first. Rows with ``top_p >= 1`` skip this.
5. min-p: ``p >= min_p`` (the row's largest kept probability is ``exp(0) = 1`` exactly).
6. the draw: threads take contiguous id ranges. One pass counts the ties per range and sums
   the kept mass ``Z``; one pass sums each range's ``q = float32(p / Z)`` in float64; a scan
   gives each range its CDF start; the one thread whose range holds ``u * total`` walks it in
   id order to the first id whose cumulative mass exceeds it (``searchsorted(right=True)``).

Cost per row, in passes over the row's ``limit`` ids: greedy rows 1 (the max pass). Top-k rows
whose candidates fit: 1 + up to 32 counting passes (compare only) + 2 exp passes (the copy);
then up to 33 + 3 passes over at most 2048 shared-memory values. Rows without a top-k (or
whose candidates do not fit): 1 + (top-k: 32 + 2) + 1 mass pass + up to 30 exp passes for the
top-p cut + 2 exp passes over contiguous ranges + one range walked. Each pass ends in a
shared-memory tree reduction (log2(threads) + 2 barriers). (A radix select with shared
histograms would cut each search to 4 passes, at the price of float atomics whose order is
not deterministic; rows without a top-k could start from a top-m candidate set as the torch
path does. Neither is done yet. On an H200, vocabulary 128k, top-k 50 + top-p 0.9: ~0.9 ms per
call at batch 1 or 64, the torch path 0.8-1.1 ms: bench/kernel_launch.py.)

Exactness against the torch path (same draws): greedy tokens are exact. Sampled tokens use the
same float32 operations per probability (``/ T``, ``- M / T``, ``exp``, ``p / Z``) and the same
keep rules (ties at the k-th kept; ties at the top-p cut kept lowest ids first); on a GPU the
kernel's ``exp`` lowers to libdevice's ``__nv_expf``, the CUDA math library's ``expf`` that
torch's CUDA ``exp`` calls (on an H200 the kernel's tokens equalled the torch path's at
vocabulary 152k: tests/kernels/test_sampling_kernel.py's GPU test). What differs is summation order:
the masses ``S``, ``Z``, the mass above the cut (float64 here; torch: float32 sums, a float32
cumsum on CUDA, a float64-accumulated one on CPU) and the CDF (float64 in both, summed in
ranges here, sequentially there). So ``Z`` (hence every ``q``) and the top-p decision may
differ in the last float32 bit, and a token differs only when the draw, or ``top_p * S``,
lands within that rounding of a boundary: about 1e-7 per draw. Other documented differences:
rows with a +inf maximum are flagged (the torch path computes NaN probabilities for them);
when rounding puts ``u * total`` at or past the last CDF step the kernel takes the row's last
kept id (torch: the last candidate, possibly one of probability 0); under the simulator
``exp`` is Python's double ``exp`` rounded to float32, which can differ from torch's CPU
float32 ``exp`` by an ulp (the same kind of last-bit difference). Like the torch path, the
kernel takes ``p`` to be non-decreasing in the logit (the k-th probability is that of the
k-th logit). Batches the torch path hands to the reference (``max top_k + 1 > limit``, ties
at the k-th reaching past its candidates) are computed here directly, with the reference's
keep rules (ties at the k-th kept, ``k`` past the finite values keeps them all).

Launch functions take and return device tensors and never read a device value on the host:
``greedy_cuda`` -> (tokens int64 [B], flags bool [B]); ``sample_cuda`` -> the same, its greedy
rows given their greedy token. A flagged row's token is meaningless.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from engine.cuda import _launch
from engine.cuda._launch import device_function
from engine.cuda.bits import bits_float, float_bits

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32
float64 = nbt.float64
int32 = nbt.int32
int64 = nbt.int64

_MAX_THREADS = 1024
_SIM_THREADS = 8  # the simulator runs a Python thread per CUDA thread: few, for speed
_NEG_INF_KEY = -2139095041  # _key(-inf)
_ONE_BITS = 0x3F800000  # float32 1.0
# top-k rows whose kept ids (k and the ties at the k-th) fit are copied to shared memory
# (8 KB of logits, 8 KB of ids) and read there for the rest; larger sets stay in the row
_CANDIDATES = 2048


@device_function
def _key(f):
    """float32 -> int64 whose order is the floats' (-inf lowest, NaN patterns past +inf)."""
    b = int64(float_bits(f))
    return b if b >= 0 else b ^ 0x7FFFFFFF


@device_function
def _unkey(k):
    return bits_float(k if k >= 0 else k ^ 0x7FFFFFFF)


@device_function
def _prob(v, temp, scaled_max):
    """The torch path's ``exp(v / T - max / T)``, in its float32 operations."""
    return float32(math.exp(float32(float32(v / temp) - scaled_max)))


# -- block reductions: fixed trees over shared memory, every thread gets the result ----------
# (each ends with a barrier, so the buffer may be reused by the next call)


@device_function
def _block_sum(v, buf):
    """The block's sum of v, in buf's type (float64 masses, int64 counts: Numba compiles one
    version per type)."""
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            buf[tid] += buf[tid + step]
        cuda.syncthreads()
        step //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@device_function
def _max_i64(v, buf):
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step and buf[tid + step] > buf[tid]:
            buf[tid] = buf[tid + step]
        cuda.syncthreads()
        step //= 2
    best = buf[0]
    cuda.syncthreads()
    return best


@device_function
def _scan_f64(v, buf):
    """(exclusive prefix, inclusive prefix, total) of v over threads in thread order
    (Hillis-Steele). A thread's inclusive prefix is the next one's exclusive prefix, bit for
    bit: the ranges [exclusive, inclusive) tile [0, total)."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nt:
        add = buf[tid - off] if tid >= off else float64(0.0)
        cuda.syncthreads()
        buf[tid] += add
        cuda.syncthreads()
        off *= 2
    before = buf[tid - 1] if tid > 0 else float64(0.0)
    after = buf[tid]
    total = buf[nt - 1]
    cuda.syncthreads()
    return before, after, total


@device_function
def _scan_i64(v, buf):
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    buf[tid] = v
    cuda.syncthreads()
    off = 1
    while off < nt:
        add = buf[tid - off] if tid >= off else int64(0)
        cuda.syncthreads()
        buf[tid] += add
        cuda.syncthreads()
        off *= 2
    before = buf[tid - 1] if tid > 0 else int64(0)
    cuda.syncthreads()
    return before


@device_function
def _row_max(vals, n, fbuf, ibuf):
    """(max, its first id, NaN seen) of ``vals[:n]``; the id is ``n`` if empty."""
    tid = cuda.threadIdx.x
    best = float32(-math.inf)
    best_id = int64(n)  # none yet
    nan = int64(0)
    for i in range(tid, n, cuda.blockDim.x):  # ids ascending: a thread keeps its first maximum
        v = vals[i]
        if v != v:
            nan = 1
        elif best_id == n or v > best:
            best = v
            best_id = i
    fbuf[tid] = float64(best)
    ibuf[tid] = best_id
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            other_id = ibuf[tid + step]
            other = fbuf[tid + step]
            mine = ibuf[tid]
            if other_id != n and (
                mine == n or other > fbuf[tid] or (other == fbuf[tid] and other_id < mine)
            ):
                fbuf[tid] = other
                ibuf[tid] = other_id
        cuda.syncthreads()
        step //= 2
    row_max = float32(fbuf[0])
    arg = ibuf[0]
    cuda.syncthreads()
    nans = _block_sum(nan, ibuf)
    return row_max, arg, nans


@device_function
def _kth_logit(vals, n, k, row_max, ibuf):
    """The k-th largest of ``vals[:n]`` (1 <= k < n, no NaN): the largest ordered key whose
    value has at least k values >= it."""
    lo = int64(_NEG_INF_KEY)  # every value is >= -inf: count n >= k
    hi = _key(row_max) + 1  # nothing is above the maximum: count 0 < k
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        pivot = _unkey(mid)
        count = int64(0)
        for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            if vals[i] >= pivot:
                count += 1
        if _block_sum(count, ibuf) >= k:
            lo = mid
        else:
            hi = mid
    return _unkey(lo)


@device_function
def _range(n):
    """This thread's contiguous ids [start, end) of n (ranges in thread order)."""
    chunk = (n + cuda.blockDim.x - 1) // cuda.blockDim.x
    start = min(cuda.threadIdx.x * chunk, n)
    return start, min(start + chunk, n)


@device_function
def _compact(vals, n, temp, scaled_max, kth, cvals, cids, ibuf):
    """How many of ``vals[:n]`` have p >= kth; when at most ``_CANDIDATES``, they are copied
    with their ids to ``cvals`` / ``cids``, in id order (each thread's range at its offset)."""
    start, end = _range(n)
    count = int64(0)
    for i in range(start, end):
        if _prob(vals[i], temp, scaled_max) >= kth:
            count += 1
    total = _block_sum(count, ibuf)
    at = _scan_i64(count, ibuf)
    if total <= _CANDIDATES:
        for i in range(start, end):
            v = vals[i]
            if _prob(v, temp, scaled_max) >= kth:
                cvals[at] = v
                cids[at] = i
                at += 1
    cuda.syncthreads()
    return total


@device_function
def _mass_above(vals, n, temp, scaled_max, kth, level, fbuf):
    """float64 sum of the kept (p >= kth) probabilities above ``level``."""
    mass = float64(0.0)
    for i in range(cuda.threadIdx.x, n, cuda.blockDim.x):
        p = _prob(vals[i], temp, scaled_max)
        if p >= kth and p > level:
            mass += float64(p)
    return _block_sum(mass, fbuf)


@device_function
def _top_p_level(vals, n, temp, scaled_max, kth, cap, fbuf):
    """The smallest probability level whose kept mass above it, in float32, is < cap."""
    lo = int64(float_bits(kth)) - 1 if kth > 0 else int64(-1)  # mass above: all, >= cap
    hi = int64(_ONE_BITS)  # nothing is above 1: mass 0 < cap (cap > 0)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        above = _mass_above(vals, n, temp, scaled_max, kth, bits_float(mid), fbuf)
        if float32(above) < cap:
            hi = mid
        else:
            lo = mid
    return bits_float(hi)


@device_function
def _kept(p, kth, level, rank, ties_kept, min_p):
    """Whether a probability survives top-k, top-p (``rank``: its index among the ids tied at
    ``level``, counted in id order) and min-p."""
    if p < kth or p < min_p:
        return False
    if p > level:
        return True
    return p == level and rank < ties_kept


@device_function
def _range_masses(vals, start, end, temp, scaled_max, kth, level, low_p):
    """Over ids [start, end): the kept mass above the level (float64), the same after min-p,
    and how many kept ids are tied at the level."""
    above = float64(0.0)
    mass = float64(0.0)
    ties = int64(0)
    for i in range(start, end):
        p = _prob(vals[i], temp, scaled_max)
        if p >= kth:
            if p > level:
                above += float64(p)
                if p >= low_p:
                    mass += float64(p)
            elif p == level:
                ties += 1
    return above, mass, ties


@device_function
def _ties_kept(topp, level, cap, above, ties):
    """How many of the ids tied at the top-p level are kept (lowest ids first): ids j = 0, 1,
    ... while (mass above) + j * level < cap, at least 1 (the torch path's ``_top_p_cut``)."""
    if not topp or level <= 0:
        return ties
    wanted = (float64(cap) - above) / float64(level)  # a float first: a tiny level overflows
    if wanted >= float64(ties):
        return ties
    return max(int64(1), int64(math.ceil(wanted)))


@device_function
def _walk(vals, start, end, temp, scaled_max, cut, rank, target, acc):
    """Ids [start, end) in order, adding each kept ``q = p / Z`` to ``acc`` (float64): the
    first id whose cumulative mass exceeds ``target`` (``target`` < 0: none, the whole range
    summed), else the range's last kept id; (that id or -1, the sum). ``cut``: (kth, level,
    ties kept, min_p, Z); ``rank``: the ties before ``start``."""
    kth, level, ties_kept, low_p, norm = cut
    chosen = int64(-1)
    for i in range(start, end):
        p = _prob(vals[i], temp, scaled_max)
        keep = _kept(p, kth, level, rank, ties_kept, low_p)
        if p == level and p >= kth:
            rank += 1
        if keep:
            q = float32(p / norm)
            if q > 0:
                acc += float64(q)
                chosen = i
                if acc > target >= 0:
                    break
    return chosen, acc


@device_function
def _draw(vals, n, ids, compact, u, temp, scaled_max, kth, p_cut, low_p, fbuf, ibuf):
    """Steps 4-6 (top-p, min-p, the draw) over ``vals[:n]`` (the row, or its compacted top-k
    candidates: then ``ids`` maps their positions to ids); returns the chosen id."""
    level = float32(0.0)
    cap = float32(0.0)
    if p_cut < 1.0:
        total = float32(_mass_above(vals, n, temp, scaled_max, kth, float32(-1.0), fbuf))
        cap = float32(p_cut * total)
        level = _top_p_level(vals, n, temp, scaled_max, kth, cap, fbuf)
    # contiguous ranges from here on: the ties and the CDF go in id order
    start, end = _range(n)
    above, mass, ties = _range_masses(vals, start, end, temp, scaled_max, kth, level, low_p)
    above = _block_sum(above, fbuf)
    mass = _block_sum(mass, fbuf)
    rank = _scan_i64(ties, ibuf)
    ties_kept = _ties_kept(p_cut < 1.0, level, cap, above, _block_sum(ties, ibuf))
    if level >= low_p:
        mass += float64(ties_kept) * float64(level)
    cut = (kth, level, ties_kept, low_p, float32(mass))
    # the CDF: each range's sum of q = p / Z, a scan, then the range holding the draw walked
    last, part = _walk(vals, start, end, temp, scaled_max, cut, rank, -1.0, float64(0.0))
    before, after, cdf_total = _scan_f64(part, fbuf)
    # the last kept position: the choice if rounding puts u * total past every step
    chosen = _max_i64(last, ibuf)
    target = u * cdf_total
    if part > 0 and before <= target < after:
        # (if rounding keeps the walk's sum <= target: the range's last kept id)
        ibuf[0] = _walk(vals, start, end, temp, scaled_max, cut, rank, target, before)[0]
    cuda.syncthreads()
    if target < cdf_total:
        chosen = ibuf[0]
    cuda.syncthreads()
    return int64(ids[chosen]) if compact else chosen


def _sample_kernel_py(x, limit, uniforms, temps, top_k, top_p, min_p, greedy, tokens, flags):
    row = cuda.blockIdx.x
    fbuf = cuda.shared.array(_MAX_THREADS, float64)
    ibuf = cuda.shared.array(_MAX_THREADS, int64)
    cvals = cuda.shared.array(_CANDIDATES, float32)
    cids = cuda.shared.array(_CANDIDATES, int32)
    xr = x[row]
    row_max, arg, nans = _row_max(xr, limit, fbuf, ibuf)
    bad = nans > 0 or row_max == math.inf or row_max == -math.inf
    token = arg
    if not bad and greedy[row] == 0:
        temp = temps[row]
        scaled_max = float32(row_max / temp)
        k = top_k[row]
        u = uniforms[row]
        kth = float32(0.0)  # keeps every probability
        n = int64(0)
        if 0 < k < limit:
            kth = _prob(_kth_logit(xr, limit, k, row_max, ibuf), temp, scaled_max)
            if kth > 0:
                n = _compact(xr, limit, temp, scaled_max, kth, cvals, cids, ibuf)
        if 0 < n <= _CANDIDATES:  # the top-k candidates and their ties fit: read them there
            token = _draw(cvals, n, cids, True, u, temp, scaled_max, kth, top_p[row],
                          min_p[row], fbuf, ibuf)  # fmt: skip
        else:
            token = _draw(xr, limit, cids, False, u, temp, scaled_max, kth, top_p[row],
                          min_p[row], fbuf, ibuf)  # fmt: skip
    if cuda.threadIdx.x == 0:
        tokens[row] = token
        flags[row] = 1 if bad else 0


def _greedy_kernel_py(x, limit, tokens, flags):
    row = cuda.blockIdx.x
    fbuf = cuda.shared.array(_MAX_THREADS, float64)
    ibuf = cuda.shared.array(_MAX_THREADS, int64)
    row_max, arg, nans = _row_max(x[row], limit, fbuf, ibuf)
    if cuda.threadIdx.x == 0:
        tokens[row] = arg
        flags[row] = 1 if nans > 0 or row_max == math.inf or row_max == -math.inf else 0


_X = nbt.Array(float32, 2, "A")
_F32 = nbt.Array(float32, 1, "A")
_F64 = nbt.Array(float64, 1, "A")
_I64 = nbt.Array(int64, 1, "A")
_U8 = nbt.Array(nbt.uint8, 1, "A")


_sample_sig = nbt.void(_X, int64, _F64, _F32, _I64, _F32, _F32, _U8, _I64, _U8)
_greedy_sig = nbt.void(_X, int64, _I64, _U8)


@functools.cache
def _sample_kernel():
    return cuda.jit(_sample_sig)(_sample_kernel_py)


@functools.cache
def _greedy_kernel():
    return cuda.jit(_greedy_sig)(_greedy_kernel_py)


# -- launches ------------------------------------------------------------------------------


@dataclass(slots=True)
class SampleRows:
    """Per-row sampling parameters, [B] tensors on the logits' device.

    temps float32 (ignored for greedy rows), top_k int64 (0: no top-k), top_p float32 (>= 1:
    none), min_p float32 (0: none), greedy bool (temperature 0 or top_k 1: the argmax)."""

    temps: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor


def _threads(limit: int) -> int:
    """Threads per row: a power of 2, about 8 ids each, 32 to 1024 (16 in the simulator)."""
    if _launch.SIMULATOR:
        return _SIM_THREADS
    threads = 32
    while threads * 8 < limit and threads < _MAX_THREADS:
        threads *= 2
    return threads


def _check(name: str, x: torch.Tensor, limit: int, threads: int | None) -> int:
    if not _launch.kernels_available():
        raise ValueError(f"{name}: no CUDA device (and NUMBA_ENABLE_CUDASIM is not set)")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"{name}: x must be float32 [B, V], got {x.dtype} {tuple(x.shape)}")
    if not 1 <= limit <= x.shape[1]:
        raise ValueError(f"{name}: limit {limit} outside 1..{x.shape[1]}")
    threads = _threads(limit) if threads is None else threads
    if threads < 1 or threads > _MAX_THREADS or threads & (threads - 1):
        raise ValueError(f"{name}: threads {threads} is not a power of 2 in 1..{_MAX_THREADS}")
    return threads


def _outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    return (
        torch.empty(rows, dtype=torch.int64, device=x.device),
        torch.zeros(rows, dtype=torch.bool, device=x.device),
    )


def greedy_cuda(
    x: torch.Tensor, limit: int, threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], flags bool [B]): each row's first id of its maximum below ``limit``
    (``x[:, :limit].max(-1).indices`` for rows without NaN) and whether the row holds a NaN
    or an infinite maximum (every value -inf, or a +inf). No probabilities, no host sync."""
    threads = _check("greedy_cuda", x, limit, threads)
    tokens, flags = _outputs(x)
    if x.shape[0]:
        _launch.launch(
            _greedy_kernel(), x.shape[0], threads, x, limit, tokens, flags.view(torch.uint8)
        )
    return tokens, flags


def sample_cuda(
    x: torch.Tensor,
    limit: int,
    uniforms: torch.Tensor,
    rows: SampleRows,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], flags bool [B]): each row's token from its settings (``rows``) and
    its draw (``uniforms``: float64 [B] in [0, 1)), as the torch fast path picks it (see the
    module docstring); greedy rows get ``greedy_cuda``'s token; flags as there. No host
    sync."""
    threads = _check("sample_cuda", x, limit, threads)
    parts = (uniforms, rows.temps, rows.top_k, rows.top_p, rows.min_p, rows.greedy)
    _launch.check_device("sample_cuda", x, *parts)
    wanted = (torch.float64, torch.float32, torch.int64, torch.float32, torch.float32, torch.bool)
    for name, t, dtype in zip(
        ("uniforms", "temps", "top_k", "top_p", "min_p", "greedy"), parts, wanted, strict=True
    ):
        if t.shape != (x.shape[0],) or t.dtype != dtype:
            raise ValueError(
                f"sample_cuda: {name} must be {dtype} [{x.shape[0]}], "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    tokens, flags = _outputs(x)
    if x.shape[0]:
        _launch.launch(
            _sample_kernel(),
            x.shape[0],
            threads,
            x,
            limit,
            uniforms,
            rows.temps,
            rows.top_k,
            rows.top_p,
            rows.min_p,
            rows.greedy.view(torch.uint8),
            tokens,
            flags.view(torch.uint8),
        )
    return tokens, flags
