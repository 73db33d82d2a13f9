"""The candidates' final distribution and the draw from it, as compiled loops (float32 CPU
rows whose every sampled row has a top_k): what ``engine.sampling_fast._candidate_probs``
and the inverse CDF after it do with torch ops, per row in one pass.

Why: those torch ops are ~30 calls over [B, ~k] tensors (temperature, the top-k keep, the
top-p cut with its tie rule, min-p, the normalisation, an argsort by id, gathers, a float64
cumsum and a searchsorted), a few microseconds each whatever the batch: ~0.45 ms a step at
batch 256 (``bench/host_overhead.py`` penalties and topk_topp, 2-core CPU), ~40 us here.

The same rules, in the same float32 operations per candidate; two sums differ in order
(torch's vectorised float32 sum of the kept mass, and its cumsum, against a float64 running
sum here), so a top-p cut or a draw can differ only when it lies within float32 rounding of
a boundary, as the module ``engine.sampling_fast`` documents for the candidate path.

Rows with a top_p but no top_k (their cut needs the whole row's mass) stay with the torch
ops; so do greedy and dense rows, which draw elsewhere (``skip``).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sampling_cpu import _array, _jit

COVERED, WIDEN = 0, 1  # ``covered``'s answers


def covered(values: torch.Tensor, temps, top_k, skip) -> bool:
    """Whether no drawing row's ties at its k-th value reach past the candidates ``values``
    [B, n] (descending), as ``_candidate_probs`` asks before it keeps anything (else the
    caller widens them)."""
    return _covered(_array(values), _row(temps), _row(top_k), _row(skip)) == COVERED


def draw(values, ids, temps, top_k, top_p, min_p, skip, uniforms: list[float], vocab: int):
    """[B] long: each drawing row's token from its candidates (``values`` descending, ``ids``
    [B, n]), as ``_candidate_probs`` keeps them and the inverse CDF in id order draws; rows
    in ``skip`` get -1. ``top_p`` / ``min_p``: [B, 1] or None (every row 1.0 / 0)."""
    rows = values.shape[0]
    out = np.empty(rows, np.int64)
    _draw_rows(
        _array(values),
        _array(ids),
        _row(temps),
        _row(top_k),
        np.ones(rows, np.float32) if top_p is None else _row(top_p),
        np.zeros(rows, np.float32) if min_p is None else _row(min_p),
        _row(skip),
        np.asarray(uniforms, dtype=np.float64),
        vocab,
        out,
    )
    return torch.from_numpy(out)


def _row(t: torch.Tensor) -> np.ndarray:
    return _array(t).reshape(-1)


@_jit
def _covered(values, temps, top_k, skip):
    n = values.shape[1]
    for r in range(values.shape[0]):
        if skip[r]:
            continue
        top = values[r, 0] / temps[r]
        kth = np.exp(values[r, top_k[r] - 1] / temps[r] - top)
        if not np.exp(values[r, n - 1] / temps[r] - top) < kth:
            return WIDEN
    return COVERED


@_jit
def _draw_rows(values, ids, temps, top_k, top_p, min_p, skip, uniforms, vocab, out):
    n = values.shape[1]
    probs = np.empty(n, np.float32)
    order = np.empty(n, np.int64)
    for r in range(values.shape[0]):
        if skip[r]:
            out[r] = -1
            continue
        top = values[r, 0] / temps[r]
        for j in range(n):  # exp(l / T - max / T), descending as the values
            probs[j] = np.exp(values[r, j] / temps[r] - top)
        kth = probs[top_k[r] - 1]
        for j in range(n):  # ties with the k-th are kept, as the reference's
            if not probs[j] >= kth:
                probs[j] = 0.0
        if top_p[r] < 1.0:
            _top_p(probs, ids[r], top_p[r], vocab)
        if min_p[r] > 0:
            _min_p(probs, min_p[r])
        out[r] = _inverse_cdf(probs, ids[r], uniforms[r], order)


@_jit
def _top_p(probs, ids, top_p, vocab):
    """Zero what the top-p cut drops: the tokens whose mass before them (descending order)
    reaches ``top_p`` of the kept mass, and those tied with the cut past the number kept
    (the higher ids first, as the reference's)."""
    n = probs.shape[0]
    mass = 0.0
    for j in range(n):
        mass += probs[j]
    limit = top_p * np.float32(mass)
    kept, held = 0, 0.0
    for j in range(n):
        if np.float32(np.float32(held + probs[j]) - probs[j]) < limit:
            kept += 1
        held += probs[j]
    kept = max(kept, 1)
    cut = probs[kept - 1]
    # the ``tied_kept``-th smallest id among the tokens tied with the cut stays, past it go
    tied_kept = 0
    held = 0.0
    for j in range(n):
        before = np.float32(np.float32(held + probs[j]) - probs[j])
        held += probs[j]
        if probs[j] == cut and before < limit:
            tied_kept += 1
    last_id = _kth_tied_id(probs, ids, cut, max(tied_kept, 1), vocab)
    for j in range(n):
        p = probs[j]
        if (p == cut and ids[j] > last_id) or not p >= cut:
            probs[j] = 0.0


@_jit
def _kth_tied_id(probs, ids, cut, k, vocab):
    """The ``k``-th smallest id among the candidates whose probability is ``cut`` (``vocab``
    past the last of them)."""
    found = 0
    previous = -1
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
def _inverse_cdf(probs, ids, u, order):
    """The first id, in id order, whose cumulative probability (float64, over the normalised
    probabilities) exceeds ``u`` times the total; zeros add no step, so only the kept
    candidates are ordered."""
    total = np.float32(0.0)
    m = 0
    for j in range(probs.shape[0]):
        if probs[j] > 0:
            order[m] = j
            m += 1
            total += probs[j]
    for i in range(1, m):  # by id (insertion: a few dozen kept tokens)
        j, k = order[i], i - 1
        while k >= 0 and ids[order[k]] > ids[j]:
            order[k + 1] = order[k]
            k -= 1
        order[k + 1] = j
    cdf = 0.0
    for i in range(m):
        cdf += np.float32(probs[order[i]] / total)
    target = u * cdf
    held = 0.0
    for i in range(m):
        held += np.float32(probs[order[i]] / total)
        if held > target:
            return ids[order[i]]
    return ids[order[m - 1]]
