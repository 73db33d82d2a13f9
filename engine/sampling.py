"""Sampler settings and batched, on-device sampling with per-row parameters.

One call samples every row of a step's logits at once: penalties, bias, temperature and the
truncations (top-k, top-p, min-p, typical) run as tensor ops over [B, V]; only the chosen token
ids (and, when a job asks, their probabilities) come back to the host.

Reproducibility: each row draws its uniform random number from its own job's generator (a
``random.Random(seed)``) and samples by inverse CDF, so a seeded job picks the same tokens
whatever else shares the batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplerSettings


@dataclass(slots=True)
class SampleRequest:
    """One row to sample: its settings, context (for penalties), RNG and extras."""

    settings: SamplerSettings
    rng: random.Random
    context: Sequence[int] = ()  # token ids the penalties look at
    banned_tokens: Sequence[int] = ()  # e.g. stop tokens before min_new_tokens
    top_k_return: int = 0  # how many top tokens (and probs) to return
    return_probs: bool = False  # return the chosen token's probability


@dataclass(slots=True)
class SampleOutput:
    """Host values: chosen tokens and, per row, the requested extras."""

    tokens: list[int]
    probs: list[float] | None = None  # probability of each chosen token (final distribution)
    top_tokens: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None


def sample(
    logits: torch.Tensor, requests: Sequence[SampleRequest], vocab_limit: int | None = None
) -> SampleOutput:
    """Sample one token per row of ``logits`` [B, V] (float32) with per-row settings.

    ``vocab_limit``: ids at or above it are never picked (a model's embedding table is often
    padded past the tokenizer's last id; those rows decode to nothing).
    """
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    logits = logits.float().clone()
    if vocab_limit is not None and vocab_limit < logits.shape[1]:
        logits[:, vocab_limit:] = -math.inf
    _apply_penalties(logits, requests)
    _apply_bias_and_bans(logits, requests)
    # Greedy picks on the logits themselves: softmax can round near-equal logits into ties.
    greedy_tokens = logits.argmax(-1)
    # Every row draws, greedy or not, so a job's random stream does not depend on its settings.
    # float64: a float32 draw just below 1.0 would round up to 1.0 and fall off the CDF
    uniforms = torch.tensor(
        [r.rng.random() for r in requests], dtype=torch.float64, device=logits.device
    )
    if all(r.settings.is_greedy for r in requests) and not _wants_extras(requests):
        return SampleOutput(tokens=greedy_tokens.tolist())
    probs = _final_distribution(logits, requests)
    greedy = torch.tensor([r.settings.is_greedy for r in requests], device=logits.device)
    tokens = torch.where(greedy, greedy_tokens, _inverse_cdf(probs, uniforms))
    return _to_host(tokens, probs, requests)


def _wants_extras(requests: Sequence[SampleRequest]) -> bool:
    return any(r.return_probs or r.top_k_return for r in requests)


def _apply_penalties(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    rows = [i for i, r in enumerate(requests) if r.settings.has_penalties and r.context]
    if not rows:
        return
    vocab = logits.shape[1]
    contexts = [_penalty_window(requests[i]) for i in rows]
    width = max(len(c) for c in contexts)
    # Pad with an out-of-vocabulary slot that is dropped after counting.
    ids = torch.full((len(rows), width), vocab, dtype=torch.long)
    for j, ctx in enumerate(contexts):
        row = torch.tensor(ctx, dtype=torch.long)
        # ids outside the vocabulary count nowhere (like out-of-range bias and ban ids)
        ids[j, : len(ctx)] = torch.where((row >= 0) & (row < vocab), row, vocab)
    ids = ids.to(logits.device)
    counts = torch.zeros(len(rows), vocab + 1, device=logits.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    params = torch.tensor(
        [
            [s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
            for s in (requests[i].settings for i in rows)
        ],
        device=logits.device,
    )
    index = torch.tensor(rows, device=logits.device)
    sub = logits[index]
    seen = counts > 0
    rep = params[:, :1]
    # Repetition penalty (CTRL style): shrink positive logits, push negative ones further down.
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - counts * params[:, 1:2] - seen.float() * params[:, 2:3]
    logits[index] = sub


def _penalty_window(request: SampleRequest) -> Sequence[int]:
    window = request.settings.penalty_range
    return request.context[-window:] if window else request.context


def _apply_bias_and_bans(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
    vocab = logits.shape[1]
    for i, r in enumerate(requests):
        if r.settings.token_bias:
            ids = [t for t in r.settings.token_bias if t < vocab]
            values = [r.settings.token_bias[t] for t in ids]
            logits[i, ids] += torch.tensor(values, device=logits.device)
        if r.banned_tokens:
            logits[i, [t for t in r.banned_tokens if t < vocab]] = -math.inf


def _final_distribution(logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
    """Probabilities after temperature and truncation, renormalised: [B, V]."""
    device = logits.device
    temps = torch.tensor(
        [r.settings.temperature if not r.settings.is_greedy else 1.0 for r in requests],
        device=device,
    )
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    settings = [r.settings for r in requests]
    if any(s.top_k > 1 for s in settings):
        probs = _top_k(probs, [s.top_k for s in settings])
    if any(s.top_p < 1.0 for s in settings):
        probs = _top_p(probs, torch.tensor([s.top_p for s in settings], device=device))
    if any(s.min_p > 0 for s in settings):
        threshold = torch.tensor([s.min_p for s in settings], device=device)[:, None]
        probs = probs * (probs >= threshold * probs.max(-1, keepdim=True).values)
    if any(s.typical < 1.0 for s in settings):
        probs = _typical(probs, torch.tensor([s.typical for s in settings], device=device))
    return probs / probs.sum(-1, keepdim=True)


def _top_k(probs: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = probs.shape[1]
    k = torch.tensor([k if k > 0 else vocab for k in ks], device=probs.device).clamp(max=vocab)
    kth = probs.sort(-1, descending=True).values.gather(1, (k - 1)[:, None])
    return probs * (probs >= kth)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep_sorted = mass_before < top_p[:, None] * sorted_probs.sum(-1, keepdim=True)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    # rows that disabled top_p keep everything (float rounding of the cumsum must not cut)
    return probs * (keep | (top_p >= 1.0)[:, None])


def _typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy."""
    p = probs / probs.sum(-1, keepdim=True)
    logp = torch.log(p.clamp_min(1e-30))
    entropy = -(p * logp).nansum(-1, keepdim=True)
    distance = (-logp - entropy).abs()
    distance = torch.where(p > 0, distance, torch.full_like(distance, math.inf))
    order = distance.argsort(-1)
    sorted_p = p.gather(1, order)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep_sorted = mass_before < mass[:, None]
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    return probs * (keep | (mass >= 1.0)[:, None])


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total (u in [0, 1)).

    In float64 and scaled by the row total, the target stays strictly below the last step of
    the CDF, and the token found always has a non-zero probability (its CDF step is > 0).
    """
    cdf = probs.double().cumsum(-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp(max=probs.shape[1] - 1)


def _to_host(
    tokens: torch.Tensor, probs: torch.Tensor, requests: Sequence[SampleRequest]
) -> SampleOutput:
    out = SampleOutput(tokens=tokens.tolist())
    if any(r.return_probs for r in requests):
        out.probs = probs.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(r.top_k_return for r in requests)
    if k:
        top = probs.topk(min(k, probs.shape[1]), dim=-1)
        indices, values = top.indices.tolist(), top.values.tolist()
        out.top_tokens = [row[: r.top_k_return] for row, r in zip(indices, requests, strict=True)]
        out.top_probs = [row[: r.top_k_return] for row, r in zip(values, requests, strict=True)]
    return out
