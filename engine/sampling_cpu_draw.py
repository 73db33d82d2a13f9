"""The candidates' final distribution and the draw from it, as compiled loops (float32 CPU
rows): what ``engine.sampling_fast._candidate_probs`` and the inverse CDF after it do with
torch ops, per row in one pass.

Why: those torch ops are ~30 calls over [B, n] tensors (temperature, the top-k keep, the
top-p cut with its tie rule, min-p, the normalisation, an argsort by id, gathers, a float64
cumsum and a searchsorted), a few microseconds each however small the batch, and sorts of
the whole [B, n] where n is wide (a top_p without a top_k: hundreds of candidates). At batch
256 (``bench/host_overhead.py``, 2-core CPU): penalties and topk_topp ~0.45 ms a step, topp
~10 ms; here ~40 us and ~1.2 ms.

The same rules, in the same float32 operations per candidate. Sums differ in order: the
kept mass (torch's vectorised float32 sum, a float64 running sum here), the cumulative mass
before each candidate, and a wide nucleus' CDF (summed by buckets of ids, then within one:
``_bucket_crossing``); so a top-p cut or a draw can differ only when it lies within float32
(float64 for the CDF) rounding of a boundary, as ``engine.sampling_fast`` documents for the
candidate path. Greedy and dense rows draw elsewhere (``no_candidates``).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_cpu import SORT_IN_PLACE, _array, _jit

READY, WIDEN, CUT_PAST = 0, 1, 2  # ``final_probs``' answers
BUCKET = 64  # ids per bucket of a wide nucleus' draw (``_bucket_crossing``)


def final_probs(values, ids, params, total, vocab: int) -> tuple[int, np.ndarray]:
    """(answer, probs [B, n] float32): each drawing row's candidates (``values`` [B, n]
    descending, ``ids``) weighted as ``_candidate_probs`` keeps them, unnormalised; rows in
    ``params.no_candidates`` are left undefined. ``total`` ([B, 1] float32, or None): the
    whole-row mass of the rows without a top_k (``MassHistogram.total``).

    The answer: READY; WIDEN when a row's ties at its k-th value reach past the candidates
    (nothing else is computed then); CUT_PAST when a row without a top_k has its top-p cut
    past its candidates (every row is computed: at the vocabulary's end they are used)."""
    rows = values.shape[0]
    probs = np.empty(values.shape, np.float32)
    answer = _final_rows(
        _array(values),
        _array(ids),
        _row(params.temps),
        _row(params.top_k),
        _row(params.unbounded),
        np.ones(rows, np.float32) if params.top_p is None else _row(params.top_p),
        np.zeros(rows, np.float32) if params.min_p is None else _row(params.min_p),
        _row(params.no_candidates),
        np.zeros(rows, np.float32) if total is None else _row(total),
        vocab,
        probs,
    )
    return answer, probs


def pick(probs: np.ndarray, ids, skip, uniforms: list[float]) -> torch.Tensor:
    """[B] long: each drawing row's token from ``final_probs``' weights by the inverse CDF in
    id order (as ``_inverse_cdf`` over the normalised probabilities); -1 in rows in ``skip``."""
    out = np.empty(probs.shape[0], np.int64)
    ids = _array(ids)
    buckets = np.zeros(max(int(ids.max()), 0) // BUCKET + 1, np.float64)
    _pick_rows(probs, ids, _row(skip), np.asarray(uniforms, dtype=np.float64), buckets, out)
    return torch.from_numpy(out)


def _row(t: torch.Tensor) -> np.ndarray:
    return _array(t).reshape(-1)


@_jit
def _final_rows(values, ids, temps, top_k, unbounded, top_p, min_p, skip, total, vocab, out):
    answer = READY
    n = values.shape[1]
    for r in range(values.shape[0]):
        if skip[r]:
            continue
        probs = out[r]
        top = values[r, 0] / temps[r]
        for j in range(n):  # exp(l / T - max / T), descending as the values
            probs[j] = np.exp(values[r, j] / temps[r] - top)
        if not unbounded[r]:  # (a row without a top_k keeps every candidate here)
            kth = probs[top_k[r] - 1]
            if not probs[n - 1] < kth:
                return WIDEN
            for j in range(n):  # ties with the k-th are kept, as the reference's
                if not probs[j] >= kth:
                    probs[j] = 0.0
        if top_p[r] < 1.0:
            mass = np.float32(total[r]) if unbounded[r] else _sum(probs)
            if not _top_p(probs, ids[r], top_p[r] * mass, vocab, unbounded[r]):
                answer = CUT_PAST
        if min_p[r] > 0:
            _min_p(probs, min_p[r])
    return answer


@_jit
def _sum(probs):
    mass = 0.0
    for j in range(probs.shape[0]):
        mass += probs[j]
    return np.float32(mass)


@_jit
def _pick_rows(probs, ids, skip, uniforms, buckets, out):
    order = np.empty(probs.shape[1], np.int64)
    for r in range(probs.shape[0]):
        if skip[r]:
            out[r] = -1
        else:
            out[r] = _inverse_cdf(probs[r], ids[r], uniforms[r], order, buckets)


@_jit
def _top_p(probs, ids, limit, vocab, check_inside):
    """Zero what the top-p cut drops: the tokens whose mass before them (descending order)
    reaches ``limit``, and those tied with the cut past the number kept (the higher ids
    first, as the reference's). Returns False when ``check_inside`` and the row's last own
    candidate (ids -1 pad a row) is neither below the cut nor 0: the cut may lie past the
    candidates."""
    n = probs.shape[0]
    kept, tied_kept = 0, 0
    held = 0.0
    for j in range(n):  # a prefix: the mass before a token only grows
        if np.float32(np.float32(held + probs[j]) - probs[j]) < limit:
            kept += 1
        held += probs[j]
    cut = probs[max(kept, 1) - 1]
    inside = True
    if check_inside:
        own = 0
        for j in range(n):
            own += ids[j] >= 0
        last = probs[max(own, 1) - 1]
        inside = last < cut or last == 0
    for j in range(kept):  # the kept ones tied with the cut
        tied_kept += probs[j] == cut
    last_id = _kth_tied_id(probs, ids, cut, max(tied_kept, 1), vocab)
    for j in range(n):
        p = probs[j]
        if (p == cut and ids[j] > last_id) or not p >= cut:
            probs[j] = 0.0
    return inside


@_jit
def _kth_tied_id(probs, ids, cut, k, vocab):
    """The ``k``-th smallest id among the candidates whose probability is ``cut`` (``vocab``
    past the last of them)."""
    found = 0
    previous = -2  # (ids -1 pad a row's candidates)
    while found < k:
        smallest = vocab
        for j in range(probs.shape[0]):
            if probs[j] == cut and previous < ids[j] < smallest:
                smallest = ids[j]
        if smallest == vocab:
            return vocab
        previous = smallest
        found += 1
    return previous


@_jit
def _min_p(probs, min_p):
    top = np.float32(0.0)
    for j in range(probs.shape[0]):
        top = max(top, probs[j])
    threshold = min_p * top
    for j in range(probs.shape[0]):
        if not probs[j] >= threshold:
            probs[j] = 0.0


@_jit
def _inverse_cdf(probs, ids, u, order, buckets):
    """The first id, in id order, whose cumulative probability (float64, over the normalised
    probabilities) exceeds ``u`` times the total; zeros add no step, so only the kept
    candidates count. A few dozen are ordered by id; a wide nucleus (a top_p without a
    top_k: hundreds) is summed by id buckets instead (``_bucket_crossing``)."""
    total = np.float32(0.0)
    m = 0
    for j in range(probs.shape[0]):
        if probs[j] > 0:
            order[m] = j
            m += 1
            total += probs[j]
    if m > SORT_IN_PLACE:
        return _bucket_crossing(probs, ids, order, m, total, u, buckets)
    _by_id(ids, order, m)
    cdf = 0.0
    for i in range(m):
        cdf += np.float32(probs[order[i]] / total)
    return _walk(probs, ids, order, m, total, u * cdf, 0.0)


@_jit
def _by_id(ids, order, m):
    """Order ``order[:m]`` (positions) by their ids: insertion, for a few dozen."""
    for i in range(1, m):
        j, k = order[i], i - 1
        while k >= 0 and ids[order[k]] > ids[j]:
            order[k + 1] = order[k]
            k -= 1
        order[k + 1] = j


@_jit
def _walk(probs, ids, order, m, total, target, held):
    """From ``held``, the first of ``order[:m]`` (in id order) whose cumulative probability
    exceeds ``target``; the last one where rounding leaves the target past every step."""
    for i in range(m):
        held += np.float32(probs[order[i]] / total)
        if held > target:
            return ids[order[i]]
    return ids[order[m - 1]]


@_jit
def _bucket_crossing(probs, ids, order, m, total, u, buckets):
    """``_inverse_cdf`` over ``m`` kept candidates without ordering them all: their
    probabilities summed per bucket of ``BUCKET`` consecutive ids (float64), the bucket the
    target falls in found from those sums, then only its own candidates ordered by id. The
    sums group the same terms differently from one running sum, so a draw can differ only
    within float64 rounding of a step. ``buckets`` (zeros, enough for every id) is left
    zeroed."""
    last = 0
    for i in range(m):
        b = ids[order[i]] // BUCKET
        buckets[b] += np.float32(probs[order[i]] / total)
        last = max(last, b)
    cdf = 0.0
    for b in range(last + 1):
        cdf += buckets[b]
    target = u * cdf
    held, crossing = 0.0, last
    for b in range(last + 1):
        if held + buckets[b] > target:
            crossing = b
            break
        held += buckets[b]
    for b in range(last + 1):
        buckets[b] = 0.0
    inside = 0  # the crossing bucket's candidates, to the front of ``order``
    for i in range(m):
        if ids[order[i]] // BUCKET == crossing:
            order[inside], order[i] = order[i], order[inside]
            inside += 1
    _by_id(ids, order, inside)
    return _walk(probs, ids, order, inside, total, target, held)
