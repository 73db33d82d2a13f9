"""``Blocks.greedy`` and ``Blocks.top`` (``engine.sampling_candidates``) for float32 rows on the
CPU as compiled loops (Numba, no CUDA): the same tokens and candidates, in less time.

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
  once first, all together, so that the misses overlap.

Rows holding a NaN have no defined candidates (``Blocks.top``'s callers check ``row_max``):
their values here are NaN, their ids 0.

Imported on first use (``engine.sampling_candidates``): numba's import and the compile stay
off every path that never samples on the CPU; the compiled code is cached on disk where numba
can write its cache.
"""

from __future__ import annotations

import logging

import numba
import numpy as np
import torch

from engine.sampling_candidates import BLOCK

logger = logging.getLogger(__name__)

SORT_IN_PLACE = 96  # candidates ordered by insertion up to this many (usually ~n + a few)
LINE = 16  # float32 values per 64-byte cache line


def _jit(fn):
    try:
        return numba.njit(nogil=True, cache=True)(fn)
    except RuntimeError:  # no writable cache location: compile in each process
        logger.info("numba cannot cache %s here; compiling it in each process", fn.__name__)
        return numba.njit(nogil=True)(fn)


def greedy(x: torch.Tensor, limit: int, maxima: torch.Tensor, row_max: torch.Tensor):
    """[B] long: ``Blocks.greedy`` of ``x[:, :limit]`` from its block maxima [B, full] and
    row maxima [B, 1]."""
    out = np.empty(x.shape[0], dtype=np.int64)
    _greedy_rows(_array(x), limit, _array(maxima), _array(row_max).reshape(-1), out)
    return torch.from_numpy(out)


def top(x: torch.Tensor, limit: int, maxima: torch.Tensor, n: int):
    """(values [B, n] float32, ids [B, n] long): ``Blocks.top(n)``; ``maxima`` [B, full]
    with ``full > n``."""
    rows = x.shape[0]
    values = np.empty((rows, n), dtype=np.float32)
    ids = np.empty((rows, n), dtype=np.int64)
    _top_rows(_array(x), limit, _array(maxima), n, values, ids)
    return torch.from_numpy(values), torch.from_numpy(ids)


def penalise(
    flat: torch.Tensor,
    keys: torch.Tensor,
    counts: torch.Tensor,
    slot: torch.Tensor,
    params: torch.Tensor,
) -> torch.Tensor:
    """``engine.sampling_penalties.apply_sparse_penalties`` on float32 logits viewed flat, in
    one loop that also reads the values it replaces: returns them (float32 [pairs])."""
    saved = np.empty(keys.shape[0], dtype=np.float32)
    _penalise(_array(flat), _array(keys), _array(counts), _array(slot), _array(params), saved)
    return torch.from_numpy(saved)


def put(flat: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[keys] = values`` (float32; a key given twice must come with one value twice)."""
    _put(_array(flat), _array(keys), _array(values))


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
def _penalise(flat, keys, counts, slot, params, saved):
    # float32 throughout, the torch form's operations in its order (bit-identical results)
    for i in range(keys.shape[0]):
        k = keys[i]
        v = flat[k]
        saved[i] = v
        c = counts[i]
        if c > 0:  # (an id whose count fell to 0 left the window: unchanged)
            s = slot[i]
            rep = params[s, 0]
            edited = v / rep if v > 0 else v * rep
            flat[k] = edited - c * params[s, 1] - params[s, 2]


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
    returns the new count. Stores unconditionally and advances on a hit (no branch per
    value): the buffers keep ``BLOCK`` spare slots."""
    for j in range(base, base + BLOCK):
        v = row[j]
        values[m] = v
        ids[m] = j
        m += v >= t
    return m


@_jit
def _order_candidates(values, ids, m):
    """Order the first ``m`` candidates by value (descending), then id (ascending)."""
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
    by_id = np.argsort(ids[:m])  # ids are distinct: a stable sort by value then keeps ties
    v, d = values[:m][by_id], ids[:m][by_id]
    by_value = np.argsort(-v, kind="mergesort")
    values[:m] = v[by_value]
    ids[:m] = d[by_value]


@_jit
def _top_rows(x, limit, maxima, n, out_values, out_ids):
    full = maxima.shape[1]
    tail = full * BLOCK
    size = (n + n // 8 + 3) * BLOCK + (limit - tail) + BLOCK
    values = np.empty(size, np.float32)
    ids = np.empty(size, np.int64)
    chosen = np.empty(full, np.int64)  # this row's blocks whose maximum reaches t
    touched = 0.0
    for r in range(x.shape[0]):
        t = _threshold(maxima[r], n)
        row = x[r]
        count = 0
        for b in range(full):
            if maxima[r, b] >= t:
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
        _order_candidates(values, ids, m)
        for k in range(n):
            if k < m:
                out_values[r, k] = values[k]
                out_ids[r, k] = ids[k]
            else:  # a row holding a NaN: nothing defined
                out_values[r, k] = np.nan
                out_ids[r, k] = 0
    return touched  # (returned: the reads must not be optimised away)
