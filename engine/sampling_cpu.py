"""``Blocks.greedy`` and ``Blocks.top`` (``engine.sampling_candidates``), the top-p mass and
the whole-row draw (``engine.sampling_fast``) for float32 rows on the CPU as compiled loops
(Numba, no CUDA): the same tokens and candidates, in less time.

Why: once torch's vectorised ``amax`` has the block maxima (one read of the logits, NaN
propagated), what is left is small per row but costs torch several calls: ``topk`` over a row's
~500 block maxima alone takes ~5 us per row on a CPU, gathering the chosen blocks with
``index_select`` and narrowing them again as much. Per row, the loops here:

- greedy: the first block whose maximum is the row's maximum (or is NaN), then the first id in
  it holding that value (or a NaN); the tail (ids past the last whole block) last. The first
  maximum, as ``max(-1).indices`` gives it.
- top n: a threshold ``t`` with at least ``n`` block maxima at or above it, found by bisection
  on the maxima's values (stopped once at most ``n + n // 8 + 2`` of them are). Those ``n``
  blocks hold ``n`` values >= ``t``, so each of the row's ``n`` largest values is >= ``t`` too,
  and lies in a block whose maximum is >= ``t``, or in the tail: those are scanned for values
  >= ``t``. The candidates, ordered by value (descending) then id, give the ``n`` largest: the
  values ``topk`` returns, ties at the ``n``-th broken by the lower id. The scan reads ~n
  blocks per row at scattered places, which the caches no longer hold after the maxima pass
  (a miss per cache line, one after another, was half its time): each block's lines are read
  once first, all together, so that the misses overlap. A caller's per-row floor (a value
  with at least ``n`` values above it) raises ``t`` where it is higher: so an ``n`` past the
  number of blocks is narrowed too.
- mass histogram (rows with a top_p and no top_k): one pass computing ``exp(l / T - max / T)``
  (a vectorised polynomial: ``math.exp`` is a call per value), summing it and binning it by
  ``max / T - l / T``; the bins give how many of the largest values hold the top-p mass, and
  floors for the candidate scan above.
- dense draw (rows with neither top_k nor top_p): the same ``exp`` pass, min-p's threshold,
  block sums, then the inverse CDF's crossing: whole blocks by their sums, ids inside the
  block the draw falls in.

Rows holding a NaN have no defined candidates (``Blocks.top``'s callers check ``row_max``):
their values here are NaN, their ids 0.

Imported on first use (``engine.sampling_candidates``): numba's import and the compile stay
off every path that never samples on the CPU; the compiled code is cached on disk where numba
can write its cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.numba_cache import cached_njit
from engine.sampling_candidates import BLOCK

SORT_IN_PLACE = 96  # candidates ordered by insertion up to this many (usually ~n + a few)
LINE = 16  # float32 values per 64-byte cache line


def _jit(fn=None, **options):
    """``numba.njit`` without the GIL, cached on disk where numba can write
    (``engine.numba_cache``); ``options``: more of njit's (``@_jit(fastmath=...)``)."""
    return cached_njit(fn, nogil=True, **options)


def greedy(x: torch.Tensor, limit: int, maxima: torch.Tensor, row_max: torch.Tensor):
    """[B] long: ``Blocks.greedy`` of ``x[:, :limit]`` from its block maxima [B, full] and
    row maxima [B, 1]."""
    out = np.empty(x.shape[0], dtype=np.int64)
    _greedy_rows(_array(x), limit, _array(maxima), _array(row_max).reshape(-1), out)
    return torch.from_numpy(out)


def top(x: torch.Tensor, limit: int, maxima: torch.Tensor, n: int, floors=None, needs=None):
    """(values [B, n] float32, ids [B, n] long): ``Blocks.top(n)``; ``maxima`` [B, full].

    ``floors`` (float32 [B], optional): per row a value with at least ``needs[r]`` (default
    ``n``) of the row's values at or above it (-inf: none known), ``MassHistogram.bounds``;
    without one, a row's ``n`` must be below ``full`` or its whole row is scanned and ordered.
    ``needs`` (int64 [B], at most ``n``): a row is given at least its ``needs[r]`` largest
    values, and more up to ``n`` only as far as its floor reaches: the rest of its ``n`` are
    pads, value -inf and id -1."""
    rows = x.shape[0]
    values = np.empty((rows, n), dtype=np.float32)
    ids = np.empty((rows, n), dtype=np.int64)
    if floors is None:
        floors = np.full(rows, -np.inf, dtype=np.float32)
    if needs is None:
        needs = np.full(rows, n, dtype=np.int64)
    _top_rows(_array(x), limit, _array(maxima), n, floors, needs, values, ids)
    return torch.from_numpy(values), torch.from_numpy(ids)


MASS_BINS_PER_UNIT = 8  # histogram bins per unit of scaled logit (a factor e^(1/8) of mass)
MASS_BINS = 256  # 32 units below the maximum: each value past them weighs below e^-32
# the candidates hold top_p's mass plus this fraction of the row's (the cut compares float32
# cumsums; a cut past the candidates after all only costs a widening, ``_widened_candidates``)
MASS_MARGIN = 1e-4


@dataclass(slots=True)
class MassHistogram:
    """For the rows sampled with a top_p and no top_k: each row's whole mass
    ``sum(exp(l / T - max / T))`` below ``limit`` (``_row_mass``'s, in one compiled pass), and
    how many of its largest values hold its top-p mass (so the candidates are sized once,
    not widened by trial), from a histogram of the values by ``max / T - l / T``."""

    total: torch.Tensor  # [B, 1] float32; 0 for the other rows
    row_needed: np.ndarray  # [B] int64: candidates enough for each listed row's cut (0: others)
    cum_counts: np.ndarray  # [B, MASS_BINS] int64: values in bins 0..j (zeros: rows not listed)
    scaled_max: np.ndarray  # [B] float32: max / T
    temps: np.ndarray  # [B] float32

    @property
    def needed(self) -> int:
        """Candidates enough for every listed row's top-p cut (0: none listed)."""
        return int(self.row_needed.max())

    def bounds(self, n: int, own: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(floors float32 [B], needs int64 [B]) for ``sampling_cpu.top(n)``: per listed row
        a value with at least ``needs[r]`` of the row's values at or above it (one bin lower
        than the histogram says: the scan compares logits, not bins), -inf for the other rows
        and where the bins hold fewer. ``needs``: ``n``, or with ``own`` each listed row's own
        count where smaller (its candidates end there, padded to ``n``)."""
        needs = np.full(self.temps.shape[0], n, dtype=np.int64)
        if own:
            listed = self.row_needed > 0
            needs[listed] = np.minimum(n, self.row_needed[listed])
        floors = np.empty(self.temps.shape[0], dtype=np.float32)
        _floors(self.cum_counts, self.scaled_max, self.temps, needs, floors)
        return floors, needs


def mass_histogram(
    x: torch.Tensor,
    limit: int,
    row_max: torch.Tensor,
    temps: torch.Tensor,
    top_p: torch.Tensor,
    rows: list[int],
) -> MassHistogram:
    """``MassHistogram`` of ``rows`` of ``x[:, :limit]`` (no NaN there; ``row_max``,
    ``temps`` and ``top_p``: [B, 1] float32)."""
    batch = x.shape[0]
    listed = np.zeros(batch, dtype=np.bool_)
    listed[rows] = True
    temps, scaled_max = _scaled_max(row_max, temps)
    total = np.zeros(batch, dtype=np.float32)
    row_needed = np.zeros(batch, dtype=np.int64)
    cum_counts = np.zeros((batch, MASS_BINS), dtype=np.int64)
    _mass_rows(
        _array(x), limit, listed, temps, scaled_max, _per_row(top_p), total, row_needed, cum_counts
    )
    total_column = torch.from_numpy(total)[:, None]
    return MassHistogram(total_column, row_needed, cum_counts, scaled_max, temps)


def put(flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[keys] = values`` (float32; a key given twice must come with one value twice)."""
    _put(_array(flat), _array(keys), _array(values))


def _per_row(t: torch.Tensor) -> np.ndarray:
    """A [B, 1] (or [B]) per-row parameter as a contiguous float32 [B] array."""
    return np.ascontiguousarray(_array(t).reshape(-1), dtype=np.float32)


def _scaled_max(row_max: torch.Tensor, temps: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(temperatures, ``max / T``) per row, float32 as the candidates' probabilities divide."""
    temps = _per_row(temps)
    return temps, _per_row(row_max) / temps


def _array(t: torch.Tensor) -> np.ndarray:
    # (the runner's logits are inference tensors: numpy() reads them without a copy)
    return t.detach().numpy()


@_jit
def _greedy_rows(x, limit, maxima, row_max, out):
    full = maxima.shape[1]
    for r in range(x.shape[0]):
        best = row_max[r]
        start, stop = full * BLOCK, limit  # the tail, unless a block holds the maximum
        for b in range(full):
            m = maxima[r, b]
            if m == best or m != m:  # (a NaN block maximum: the row's maximum is NaN)
                start, stop = b * BLOCK, (b + 1) * BLOCK
                break
        out[r] = 0
        for j in range(start, stop):
            v = x[r, j]
            if v == best or v != v:
                out[r] = j
                break


@_jit
def _put(flat, keys, values):
    for i in range(keys.shape[0]):
        flat[keys[i]] = values[i]


@_jit
def _count_at_least(values, t):
    count = 0
    for i in range(values.shape[0]):
        count += values[i] >= t
    return count


@_jit
def _threshold(maxima, n):
    """A value with at least ``n`` of ``maxima`` >= it, and not many more (bisection); -inf
    when fewer than ``n`` are finite."""
    lo, hi = np.inf, -np.inf
    for i in range(maxima.shape[0]):
        v = maxima[i]
        if v > hi:
            hi = v
        if -np.inf < v < lo:
            lo = v
    if _count_at_least(maxima, lo) < n:
        return -np.inf
    enough = n + n // 8 + 2
    for _ in range(64):
        mid = lo + (hi - lo) * 0.5
        if not lo < mid < hi:  # converged (or hi is +inf, and so is mid)
            break
        count = _count_at_least(maxima, mid)
        if count >= n:
            lo = mid
            if count <= enough:
                break
        else:
            hi = mid
    return lo


@_jit
def _scan_block(row, base, t, values, ids, m):
    """Append the values >= ``t`` of ``row[base : base + BLOCK]`` (and their ids) at ``m``;
    returns the new count. A branch per value: hits are rare (~one or two per block, as
    ``t`` sits near the n-th largest block maximum), so it is predicted, and the loop that
    stored every value and advanced on a hit took ~1.4x as long (``bench/host_overhead.py``
    top-k rows at batch 256, 2-core CPU: 0.71 against 1.01 ms over rows in cache)."""
    for j in range(base, base + BLOCK):
        v = row[j]
        if v >= t:
            values[m] = v
            ids[m] = j
            m += 1
    return m


@_jit
def _order_candidates(values, ids, m):
    """Order the first ``m`` candidates, given in id order, by value (descending), then id."""
    if m <= SORT_IN_PLACE:
        for i in range(1, m):
            v, d, k = values[i], ids[i], i - 1
            while k >= 0 and (values[k] < v or (values[k] == v and ids[k] > d)):
                values[k + 1] = values[k]
                ids[k + 1] = ids[k]
                k -= 1
            values[k + 1] = v
            ids[k + 1] = d
        return
    # a stable radix sort of 32-bit keys that order the values descending: the candidates
    # come in id order, so ties stay by id. Four counting passes (fewer where every key
    # shares a byte) over hundreds of candidates (a wide top-p nucleus) took ~1/3 of the
    # time of numpy's sort of (value, id) int64 keys, whose comparisons mispredict half the
    # time on random values
    keys = np.empty(m, np.int64)
    bits = values[:m].view(np.int32)
    for i in range(m):
        values[i] += np.float32(0.0)  # -0.0 -> +0.0: tied with 0.0 as topk ties them
        keys[i] = np.int64(_descending(bits[i])) + 2**31
    keys, order = _radix_sort(keys, ids[:m].copy())
    for i in range(m):
        ids[i] = order[i]
        bits[i] = _from_descending(np.int32(keys[i] - 2**31))


@_jit
def _radix_sort(keys, ids):
    """(keys, ids) ordered by ``keys`` (int64 in [0, 2^32)), stably: least significant byte
    first, a pass skipped where every key has the same byte there."""
    m = keys.shape[0]
    spare_keys = np.empty(m, np.int64)
    spare_ids = np.empty(m, np.int64)
    starts = np.empty(256, np.int64)
    for shift in range(0, 32, 8):
        starts[:] = 0
        for i in range(m):
            starts[(keys[i] >> shift) & 255] += 1
        if starts[(keys[0] >> shift) & 255] == m:
            continue  # one byte for all: the order stays
        total = 0
        for d in range(256):
            count = starts[d]
            starts[d] = total
            total += count
        for i in range(m):
            d = (keys[i] >> shift) & 255
            spare_keys[starts[d]] = keys[i]
            spare_ids[starts[d]] = ids[i]
            starts[d] += 1
        keys, spare_keys = spare_keys, keys
        ids, spare_ids = spare_ids, ids
    return keys, ids


@_jit
def _descending(b):
    """An int32 that orders float32 bit patterns ``b`` from the largest value down:
    non-negative floats order as their bits, negative ones reversed (all bits but the sign
    flipped); then every bit flipped, for descending order."""
    ordered = b ^ np.int32(0x7FFFFFFF) if b < 0 else b
    return ~ordered


@_jit
def _from_descending(key):
    """The float32 bit pattern of a ``_descending`` key."""
    ordered = ~key
    return ordered ^ np.int32(0x7FFFFFFF) if ordered < 0 else ordered


@_jit
def _collect(row, maxima, limit, t, values, ids, chosen):
    """The values ``>= t`` of ``row[:limit]`` and their ids, in id order (blocks whose maximum
    reaches ``t``, then the tail): (count, values, ids, a sum of the prefetch reads), the
    buffers grown as needed."""
    full = maxima.shape[0]
    tail = full * BLOCK
    count = 0
    touched = 0.0
    for b in range(full):
        if maxima[b] >= t:
            chosen[count] = b
            count += 1
            # one read per cache line of the block: independent loads the CPU overlaps,
            # so the scan below finds the block cached (the maxima pass has streamed the
            # whole batch through since; the scan alone waits out a miss per line)
            for j in range(b * BLOCK, (b + 1) * BLOCK, LINE):
                touched += row[j]
    need = (count + 1) * BLOCK + limit - tail
    if need > values.shape[0]:
        values = np.empty(need, np.float32)
        ids = np.empty(need, np.int64)
    m = 0
    for c in range(count):
        m = _scan_block(row, chosen[c] * BLOCK, t, values, ids, m)
    for j in range(tail, limit):
        v = row[j]
        values[m] = v
        ids[m] = j
        m += v >= t
    return m, values, ids, touched  # (returned: the reads must not be optimised away)


@_jit
def _top_rows(x, limit, maxima, n, floors, needs, out_values, out_ids):
    full = maxima.shape[1]
    tail = full * BLOCK
    size = (n + n // 8 + 3) * BLOCK + (limit - tail) + BLOCK
    values = np.empty(size, np.float32)
    ids = np.empty(size, np.int64)
    chosen = np.empty(full, np.int64)  # a row's blocks whose maximum reaches t
    touched = 0.0
    for r in range(x.shape[0]):
        need = needs[r]
        t = _threshold(maxima[r], need)
        if floors[r] > t:  # the caller's floor is closer (n past the blocks' reach)
            t = floors[r]
        m, values, ids, reads = _collect(x[r], maxima[r], limit, t, values, ids, chosen)
        touched += reads
        if m < need and t > -np.inf:  # a floor too high after all (rounding): every value
            m, values, ids, reads = _collect(x[r], maxima[r], limit, -np.inf, values, ids, chosen)
        _order_candidates(values, ids, m)
        for k in range(n):
            if k < m:
                out_values[r, k] = values[k]
                out_ids[r, k] = ids[k]
            elif m >= need:  # past the row's own candidates: a pad
                out_values[r, k] = -np.inf
                out_ids[r, k] = -1
            else:  # a row holding a NaN: nothing defined
                out_values[r, k] = np.nan
                out_ids[r, k] = 0
    return touched


@_jit
def _mass_rows(x, limit, listed, temps, scaled_max, top_p, total, row_needed, cum_counts):
    """``MassHistogram``'s pass: per listed row, ``exp(l / T - max / T)`` summed (float64,
    stored as float32) and binned by ``max / T - l / T``; ``row_needed``: the candidates
    enough for its top-p cut (``limit`` where its top-p mass lies past the bins)."""
    bins = cum_counts.shape[1]
    mass = np.zeros(bins + 1, np.float64)  # (the last bin: every value past the others)
    counts = np.zeros(bins + 1, np.int64)
    weights = np.empty(limit, np.float32)
    powers = np.empty(limit, np.int32)
    where = np.empty(limit, np.int32)
    for r in range(x.shape[0]):
        if not listed[r]:
            continue
        _exp_row(x[r], limit, temps[r], scaled_max[r], weights, powers)
        _bins(x[r], limit, temps[r], scaled_max[r], where)
        mass[:] = 0.0
        counts[:] = 0
        for j in range(limit):
            k = where[j]
            counts[k] += 1
            mass[k] += weights[j]
        whole = mass.sum()
        total[r] = whole
        # top_p's mass as the candidates' cut compares it (float32), with a margin where
        # there is room for one (a top_p within it of 1: the margin is what is left)
        target = np.float64(top_p[r] * total[r])
        target += min(MASS_MARGIN * whole, 0.5 * (whole - target))
        needed = limit  # (the mass past the bins: every value)
        held, count, found = 0.0, 0, False
        for k in range(bins):
            held += mass[k]
            count += counts[k]
            cum_counts[r, k] = count
            if held >= target and not found:
                # one bin more (values at a bin's edge may land either side of it) and one
                # value past it: the last candidate lies below the cut, which shows it inside
                needed = count + (counts[k + 1] if k + 1 < bins else 0) + 1
                found = True
        row_needed[r] = min(needed, limit)


LOG2E = np.float32(1.4426950408889634)
LN2_HI = np.float32(0.693359375)  # ln 2 in two parts: k * LN2_HI is exact for |k| < 2^9
LN2_LO = np.float32(-2.12194440e-4)
EXP_FLOOR = np.float32(-87.0)  # exp of anything below: 0 here (a normal float32 above it)
BIN_SCALE = np.float32(MASS_BINS_PER_UNIT)


@_jit(fastmath={"contract"})
def _exp_row(row, limit, temp, top, weights, powers):
    """``weights[j] = exp(row[j] / temp - top)`` for ``j < limit`` (float32 within ~2 ulp;
    0 below e^-87; ``row[j] / temp - top`` in float32, as the candidates' probabilities).

    A polynomial (Cephes' expf) rather than ``math.exp``: a call per value there, while these
    loops compile to vector instructions (~4x faster over a row); the power of two goes into
    the exponent bits in a second pass (no scalar bit casts here). Its multiply-adds are fused
    ("contract": one rounding each, not two; the pass over 256 x 32768 values took 3.9 ms
    against 4.3 on the 2-core CPU). The division stays: ``row[j] * (1 / temp)`` (3.5 ms) may
    differ from the candidates' quotient, whose error an exponent of up to ~87 magnifies."""
    for j in range(limit):
        below = row[j] / temp - top
        v = max(below, EXP_FLOOR)
        k = np.floor(v * LOG2E + np.float32(0.5))
        f = v - k * LN2_HI - k * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * f + np.float32(1.3981999507e-3)
        p = p * f + np.float32(8.3334519073e-3)
        p = p * f + np.float32(4.1665795894e-2)
        p = p * f + np.float32(1.6666665459e-1)
        p = p * f + np.float32(5.0000001201e-1)
        p = p * f * f + f + np.float32(1.0)
        live = below > EXP_FLOOR
        weights[j] = p if live else np.float32(0.0)
        powers[j] = np.int32(k) << 23 if live else 0
    bits = weights[:limit].view(np.int32)
    for j in range(limit):
        bits[j] += powers[j]


@_jit
def _bins(row, limit, temp, top, where):
    """``where[j]``: the ``MassHistogram`` bin of ``row[j]`` (``MASS_BINS``: none)."""
    for j in range(limit):
        below = row[j] / temp - top
        where[j] = np.int32(min(-below * BIN_SCALE, np.float32(MASS_BINS)))  # (-inf: none)


@_jit
def _floors(cum_counts, scaled_max, temps, needs, out):
    bins = cum_counts.shape[1]
    for r in range(cum_counts.shape[0]):
        out[r] = -np.inf
        n = needs[r]
        if cum_counts[r, bins - 1] < n:
            continue
        k = 0
        while cum_counts[r, k] < n:
            k += 1
        # the values of bins 0..k are > (max / T - (k + 1) / bins_per_unit) * T; one bin
        # lower still, as margin for the rounding of that product
        if k + 2 < bins:
            out[r] = (scaled_max[r] - (k + 2) / MASS_BINS_PER_UNIT) * temps[r]


def dense_draw(
    x: torch.Tensor,
    limit: int,
    rows: list[int],
    temps: torch.Tensor,
    min_p: torch.Tensor | None,
    row_max: torch.Tensor,
    uniforms: list[float],
) -> torch.Tensor:
    """[len(rows)] long: the token each of ``rows`` draws from its whole distribution below
    ``limit`` (temperature, then min-p when given; no top-k or top-p), as the reference's
    inverse CDF in id order: the first id whose cumulative weight exceeds ``u * total``.
    ``temps``, ``min_p``, ``row_max``: [B, 1] float32; ``uniforms``: [B] (no NaN rows)."""
    temps, scaled_max = _scaled_max(row_max, temps)
    min_p = np.zeros_like(temps) if min_p is None else _per_row(min_p)
    out = np.empty(len(rows), dtype=np.int64)
    _dense_rows(
        _array(x),
        limit,
        np.asarray(rows, dtype=np.int64),
        temps,
        min_p,
        scaled_max,
        np.asarray(uniforms, dtype=np.float64),
        out,
    )
    return torch.from_numpy(out)


@_jit
def _dense_rows(x, limit, rows, temps, min_p, scaled_max, uniforms, out):
    weights = np.empty(limit, np.float32)
    powers = np.empty(limit, np.int32)
    sums = np.empty((limit + BLOCK - 1) // BLOCK, np.float64)
    for i in range(rows.shape[0]):
        r = rows[i]
        if scaled_max[r] == np.inf:  # every finite weight is 0 beside +inf: the first +inf
            out[i] = _first_at_least(x[r], limit, np.inf)
            continue
        # exp(l / T - max / T): the softmax up to its scale, which the draw divides out
        _exp_row(x[r], limit, temps[r], scaled_max[r], weights, powers)
        if min_p[r] > 0:  # the row's largest weight is exp(0) = 1: min-p's threshold is min_p
            _below_to_zero(weights, limit, min_p[r])
        _block_sums(weights, limit, sums)
        out[i] = _crossing(weights, limit, sums, uniforms[r] * sums.sum())


@_jit
def _first_at_least(row, limit, value):
    for j in range(limit):
        if row[j] >= value:
            return j
    return 0


@_jit
def _below_to_zero(weights, limit, threshold):
    for j in range(limit):
        w = weights[j]
        weights[j] = w if w >= threshold else np.float32(0.0)


@_jit
def _block_sums(weights, limit, sums):
    """Each block's weights summed in float64: four interleaved sums, which the CPU overlaps
    (one running sum waits out each add's latency: twice the time)."""
    for b in range(sums.shape[0]):
        start, stop = b * BLOCK, min(limit, (b + 1) * BLOCK)
        s0 = s1 = s2 = s3 = 0.0
        j = start
        while j + 4 <= stop:
            s0 += weights[j]
            s1 += weights[j + 1]
            s2 += weights[j + 2]
            s3 += weights[j + 3]
            j += 4
        while j < stop:
            s0 += weights[j]
            j += 1
        sums[b] = (s0 + s1) + (s2 + s3)


@_jit
def _crossing(weights, limit, sums, target):
    """The first id whose cumulative weight exceeds ``target`` (float64): whole blocks by
    their sums, then the ids of the block it falls in; the last id with a weight where
    rounding leaves the target past every step (as ``searchsorted``'s clamp)."""
    held = 0.0
    for b in range(sums.shape[0]):
        if held + sums[b] <= target:
            held += sums[b]
            continue
        for j in range(b * BLOCK, min(limit, (b + 1) * BLOCK)):
            w = weights[j]
            if w > 0:
                held += w
                if held > target:
                    return j
    for j in range(limit - 1, -1, -1):
        if weights[j] > 0:
            return j
    return 0
