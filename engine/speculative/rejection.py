"""Verification of draft tokens for the whole batch at once, on the device.

Each speculating job brings k drafts d_1..d_k and the target's logits at its 1 + k rows (the
position of its pending token and of each draft). Row i is turned into the job's full
processed distribution p_i (penalties seeing d_1..d_i, bias, bans, temperature, top-k/p,
min-p, typical: ``sampling.processed_distribution``), then:

* greedy rows and deterministic drafts (n-gram, or a greedy draft model: q is one-hot):
  x_i = the token non-speculative sampling would pick at row i with the job's next uniform
  (the argmax for greedy rows); d_i is accepted while d_i == x_i, and the first x_i that
  differs (or x_k, the bonus token) is emitted. For a one-hot q this IS the rejection rule
  (accept with min(1, p/q) = p(d); on rejection sample p with d removed), and since each
  emitted token consumes exactly one uniform of the job's stream, a seeded job emits the very
  tokens it would emit without speculation.
* sampled drafts from a draft model with probabilities q_i: accept d_i when u * q_i(d_i) <=
  p_i(d_i), i.e. with probability min(1, p/q); at the first rejection emit a sample of
  normalize(max(0, p_i - q_i)); when all k pass, a bonus token from p_k. (Leviathan et al.
  2023 / Chen et al. 2023: the output follows p exactly.)

Only two [rows] tensors (accepted flags and candidate tokens) come back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.sampling import _inverse_cdf, processed_distribution


@dataclass(slots=True)
class DraftRows:
    """One speculating job's drafts and, for sampled drafts, their distributions."""

    job: Any  # DynamicJob
    drafts: tuple[int, ...]
    q: torch.Tensor | None = None  # [k, V] the draft's processed probabilities (None: one-hot)


@dataclass(slots=True)
class Verification:
    tokens: list[int]  # accepted drafts, then the token sampled after them
    accepted: int
    rejected: int


def verify(
    rows: Sequence[DraftRows], logits: torch.Tensor, vocab_limit: int | None = None
) -> list[Verification]:
    """``logits``: [sum(1 + k_j), V], each job's rows in order. Advances the jobs' RNGs."""
    requests = [
        r.job.sample_request(ahead=r.drafts[:i]) for r in rows for i in range(len(r.drafts) + 1)
    ]
    greedy, p = processed_distribution(logits, requests, vocab_limit)
    device = logits.device
    draws, states = _draw(rows)
    drafts = torch.tensor(
        [d for r in rows for d in (*r.drafts, -1)], dtype=torch.long, device=device
    )
    if p is None:
        candidates = greedy
    else:
        u = torch.tensor([d[0] for d in draws], dtype=torch.float64, device=device)
        is_greedy = torch.tensor([q.settings.is_greedy for q in requests], device=device)
        candidates = torch.where(is_greedy, greedy, _inverse_cdf(p, u))
    accepted = drafts == candidates
    if any(r.q is not None for r in rows):
        accepted, candidates = _sampled_drafts(rows, draws, p, drafts, accepted, candidates)
    return _results(rows, accepted.tolist(), candidates.tolist(), states)


def _draw(rows: Sequence[DraftRows]) -> tuple[list[tuple[float, float]], list]:
    """Uniforms per row: (u, v). Deterministic-draft jobs draw one per row and remember their
    RNG state, to be rewound to one draw per emitted token (see _results)."""
    draws, states = [], []
    for r in rows:
        rng = r.job.rng
        states.append(rng.getstate() if r.q is None else None)
        for _ in range(len(r.drafts) + 1):
            draws.append((rng.random(), rng.random() if r.q is not None else 0.0))
    return draws, states


def _sampled_drafts(rows, draws, p, drafts, accepted, candidates):
    """Rows of sampled drafts: accept with min(1, p/q), else sample the residual."""
    device = p.device
    q = torch.zeros_like(p)
    has_q = torch.zeros(p.shape[0], dtype=torch.bool, device=device)
    offset = 0
    for r in rows:
        k = len(r.drafts)
        if r.q is not None:
            q[offset : offset + k] = r.q.to(p.dtype)
            has_q[offset : offset + k] = True
        offset += k + 1
    index = drafts.clamp(min=0)[:, None]
    p_d = p.gather(1, index).squeeze(1).double()
    q_d = q.gather(1, index).squeeze(1).double()
    u = torch.tensor([d[0] for d in draws], dtype=torch.float64, device=device)
    v = torch.tensor([d[1] for d in draws], dtype=torch.float64, device=device)
    residual = (p - q).clamp_(min=0)
    # p == q leaves nothing (and then every draft is accepted): any row will do
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p, residual)
    recovered = _inverse_cdf(residual, v)
    accepted = torch.where(has_q, u * q_d <= p_d, accepted)
    return accepted, torch.where(has_q, recovered, candidates)


def _results(rows, accepted: list[bool], candidates: list[int], states) -> list[Verification]:
    out = []
    offset = 0
    for r, state in zip(rows, states, strict=True):
        k = len(r.drafts)
        m = 0
        while m < k and accepted[offset + m]:
            m += 1
        out.append(Verification([*r.drafts[:m], candidates[offset + m]], m, k - m))
        if state is not None:  # one uniform per emitted token, as without speculation
            r.job.rng.setstate(state)
            for _ in range(m + 1):
                r.job.rng.random()
        offset += k + 1
    return out
