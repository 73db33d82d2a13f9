"""Sampler settings and batched, on-device sampling with per-row parameters.

One call samples every row of a step's logits at once: penalties, bias, temperature and the
truncations (top-k, top-p, min-p, typical) run as tensor ops over [B, V]; only the chosen token
ids (and, when a job asks, their probabilities) come back to the host. Nothing sorts the
vocabulary: top-k takes a bounded ``topk``, top-p sums the mass of a candidate set (the top-k
ids, else a ``topk`` grown until the cut lies inside it), and when every row's non-zero
probabilities lie in such a set the draw runs over it alone.

Reproducibility: each row draws its uniform random number from its own job's generator (a
``random.Random(seed)``) and samples by inverse CDF, so a seeded job picks the same tokens
whatever else shares the batch. Tokens of exactly equal probability straddling a top-p cut
are kept lowest ids first (a full sort, as before, kept them in an arbitrary order).

Two kinds of probabilities come back, only for the rows that ask:

- ``return_probs`` / ``top_k_return``: the job's *sampling* distribution, after penalties,
  bias, bans, temperature and truncation, renormalised (a truncated token reads 0). A greedy
  row (temperature 0, or top_k 1) reports that distribution at temperature 1 with its other
  truncations (top_p, min_p, typical): its chosen token's probability is the processed model
  probability, not the 1.0 ExLlamaV2 reports.
- ``logprobs`` (k >= 0): the *model's* log-probabilities, ``log_softmax`` of the raw logits
  over the tokenizer's vocabulary, before any penalty, bias, ban, filter or temperature (what
  OpenAI and vLLM report): the chosen token's and the k most likely tokens'. The same for
  greedy and sampled rows.

A row whose every token is banned (bias, bans) has nothing to sample: its token comes back
as ``BANNED_ROW`` (-1) and its probability as 0.0, never NaN; the generator ends that job
with an error.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.request import SamplerSettings

TOP_P_CANDIDATES = 64  # top_p looks at this many most likely tokens first (x4 until enough)
BANNED_ROW = -1  # the "token" of a row whose every token is banned


@dataclass(slots=True)
class SampleRequest:
    """One row to sample: its settings, context (for penalties), RNG and extras."""

    settings: SamplerSettings
    rng: random.Random
    context: Sequence[int] = ()  # token ids the penalties look at
    banned_tokens: Sequence[int] = ()  # e.g. stop tokens before min_new_tokens
    top_k_return: int = 0  # how many top tokens (and probs) to return
    return_probs: bool = False  # return the chosen token's probability
    logprobs: int | None = None  # k: model logprob of the chosen token and the top k
    # identifies the job across steps (its context only grows or loses a suffix between
    # two of its requests with a key): lets a SamplerState keep per-job state; None: none
    key: int | None = None


@dataclass(slots=True)
class SampleOutput:
    """Host values: chosen tokens and, per row, the requested extras."""

    tokens: list[int]
    probs: list[float] | None = None  # probability of each chosen token (final distribution)
    top_tokens: list[list[int]] | None = None
    top_probs: list[list[float]] | None = None
    # model log-probabilities (raw logits), for rows with ``logprobs`` set (None elsewhere)
    logprobs: list[float | None] | None = None
    top_logprob_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def sample(
    logits: torch.Tensor,
    requests: Sequence[SampleRequest],
    vocab_limit: int | None = None,
    token_mask: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample one token per row of ``logits`` [B, V] (float32) with per-row settings.

    ``vocab_limit``: ids at or above it are never picked (a model's embedding table is often
    padded past the tokenizer's last id; those rows decode to nothing).
    ``token_mask``: float [B, V] (or wider), an additive bias: 0 for the tokens each row may
    pick, -inf for the others (constrained decoding; all 0 for unconstrained rows), applied in
    one add after penalties and bans.
    """
    raw_logits, logits, limit = _edited_logits(logits, requests, vocab_limit)
    dead = None
    if token_mask is not None:  # INVARIANT (MaskEngine): every mask row allows a token
        logits = logits + token_mask[:, : logits.shape[1]]
    if any(r.settings.token_bias or r.banned_tokens for r in requests):
        dead = _all_banned(logits, limit)  # bans (and -inf biases) may leave a row empty
    greedy_tokens = _greedy_tokens(logits, limit)
    # Every row draws, greedy or not, so a job's random stream does not depend on its settings.
    draws = [r.rng.random() for r in requests]
    if all(r.settings.is_greedy for r in requests) and not _wants_extras(requests):
        tokens, probs = greedy_tokens, None
    else:
        # float64: a float32 draw just below 1.0 would round up to 1.0 and fall off the CDF
        uniforms = torch.tensor(draws, dtype=torch.float64, device=logits.device)
        probs, support = _final_distribution(logits, requests, limit)
        greedy = torch.tensor([r.settings.is_greedy for r in requests], device=logits.device)
        tokens = torch.where(greedy, greedy_tokens, _inverse_cdf(probs, uniforms, support))
    out = _to_host(tokens, probs, requests, dead)
    if any(r.logprobs is not None for r in requests):
        _add_logprobs(out, raw_logits, tokens, requests, limit)
    return out


def _all_banned(logits: torch.Tensor, limit: int) -> torch.Tensor:
    """[B] bool: rows with no token left. They are made uniform (0 logits) so that nothing
    downstream turns into NaN; their token is replaced by ``BANNED_ROW`` on the way out."""
    dead = ~(logits[:, :limit] > -math.inf).any(-1)
    logits.masked_fill_(dead[:, None], 0.0)
    return dead


def processed_distribution(
    logits: torch.Tensor, requests: Sequence[SampleRequest], vocab_limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``sample`` would draw from, per row: the greedy token [B] (argmax after
    penalties, bias and bans) and the final probabilities [B, V] (after temperature and the
    truncations, renormalised), or None when every row is greedy. Draws nothing.
    (Speculative verification compares draft tokens against exactly these.)"""
    _, logits, limit = _edited_logits(logits, requests, vocab_limit)
    greedy_tokens = _greedy_tokens(logits, limit)
    if all(r.settings.is_greedy for r in requests):
        return greedy_tokens, None
    return greedy_tokens, _final_distribution(logits, requests, limit)[0]


def _edited_logits(
    logits: torch.Tensor, requests: Sequence[SampleRequest], vocab_limit: int | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the logits as float32, the same after penalties, bias and bans, the vocabulary
    limit). The caller's tensor is never changed: edits go to a copy."""
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    raw = logits.float()
    limit = raw.shape[1] if vocab_limit is None else min(vocab_limit, raw.shape[1])
    edited = raw
    if any(r.settings.has_penalties or r.settings.token_bias or r.banned_tokens for r in requests):
        edited = raw.clone()
        _apply_penalties(edited, requests)
        _apply_bias_and_bans(edited, requests)
    return raw, edited, limit


def _greedy_tokens(logits: torch.Tensor, limit: int) -> torch.Tensor:
    # Greedy picks on the logits themselves: softmax can round near-equal logits into ties.
    # (max's indices: the first maximum, as argmax, and several times faster on a CPU)
    return logits[:, :limit].max(-1).indices


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


def _final_distribution(
    logits: torch.Tensor, requests: Sequence[SampleRequest], limit: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after temperature and truncation, renormalised: [B, V] (0 from id
    ``limit`` on); and, when every sampled row's non-zero probabilities are known to lie in a
    few candidate ids, those ids [B, m] (the draw then runs over them alone), else None."""
    device = logits.device
    temps = torch.tensor(
        [r.settings.temperature if not r.settings.is_greedy else 1.0 for r in requests],
        device=device,
    )
    scaled = logits / temps[:, None]
    scaled[:, limit:] = -math.inf
    probs = torch.softmax(scaled, dim=-1)
    settings = [r.settings for r in requests]
    support = None  # Support of the rows truncated so far (see _top_k)
    if any(s.top_k > 1 for s in settings):
        probs, support = _top_k(probs, [s.top_k for s in settings])
    if any(s.top_p < 1.0 for s in settings):
        top_p = torch.tensor([s.top_p for s in settings], device=device)
        probs, support = _top_p(probs, top_p, support)
    # min_p and typical only zero more entries: a support stays valid
    if any(s.min_p > 0 for s in settings):
        threshold = torch.tensor([s.min_p for s in settings], device=device)[:, None]
        probs = probs * (probs >= threshold * probs.max(-1, keepdim=True).values)
    if any(s.typical < 1.0 for s in settings):
        probs = _typical(probs, torch.tensor([s.typical for s in settings], device=device))
    if support is not None:
        # greedy rows take the argmax: where their probabilities lie does not matter
        greedy = torch.tensor([s.is_greedy for s in settings], device=device)
        if not bool((support.covered | greedy).all()):
            support = None
    return probs / probs.sum(-1, keepdim=True), None if support is None else support.ids


@dataclass(slots=True)
class _Support:
    """Candidate ids [B, m] per row; ``covered`` [B]: rows whose every non-zero probability
    has its id among them."""

    ids: torch.Tensor
    covered: torch.Tensor


def _top_k(probs: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, _Support]:
    """Keep each row's k most likely tokens (all tokens tied with the k-th too); k = 0 keeps
    all. One bounded ``topk`` of the largest k (+1, to see whether ties reach past it)."""
    vocab = probs.shape[1]
    k = torch.tensor(ks, device=probs.device).clamp(max=vocab)[:, None]
    unlimited = k == 0
    values, ids = probs.topk(min(max(ks) + 1, vocab), dim=-1)
    # probabilities are >= 0: a threshold of 0 keeps the whole row (as the k = V-th did)
    kth = torch.where(unlimited, 0.0, values.gather(1, (k - 1).clamp(min=0)))
    covered = values[:, -1:] < kth if values.shape[1] < vocab else torch.ones_like(unlimited)
    return probs.mul_(probs >= kth), _Support(ids, covered.squeeze(1))


def _top_p(
    probs: torch.Tensor, top_p: torch.Tensor, support: _Support | None
) -> tuple[torch.Tensor, _Support | None]:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, without sorting
    the vocabulary: the mass is summed over the most likely candidates only (the ids of an
    earlier truncation, else a ``topk`` that grows until every row's cut lies inside it).

    Tokens tied with the last one kept are kept in the number the sorted order reaches,
    lowest ids first (a full sort would order such ties arbitrarily)."""
    vocab = probs.shape[1]
    disabled = top_p >= 1.0
    limit = top_p[:, None] * probs.sum(-1, keepdim=True)
    usable = support is not None and bool((support.covered | disabled).all())
    m = min(vocab, TOP_P_CANDIDATES)
    while True:
        if usable:
            values, order = probs.gather(1, support.ids).sort(-1, descending=True)
            ids = support.ids.gather(1, order)
        else:
            values, ids = probs.topk(m, dim=-1)
        cut, last_id = _top_p_cut(values, ids, limit, vocab)
        # the cut lies inside the candidates, with every token tied with it
        inside = (values[:, -1:] < cut) | (values[:, -1:] == 0) | disabled[:, None]
        if usable or m == vocab or bool(inside.all()):
            break
        m = min(vocab, 4 * m)
    cut = torch.where(disabled[:, None], 0.0, cut)  # probabilities are >= 0: keep all
    probs.mul_(probs >= cut)  # (in place: as fast as masked_fill_ on large batches, or faster)
    # Tokens tied with the cut past the number kept (every one of them is a candidate).
    drop = (values == cut) & (ids > last_id)
    probs.scatter_(1, ids, torch.where(drop, 0.0, probs.gather(1, ids)))
    return probs, support if usable else _Support(ids, covered=~disabled)


def _top_p_cut(
    values: torch.Tensor, ids: torch.Tensor, limit: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """From candidates sorted by value: the smallest value kept and, among the tokens with
    that value, the largest id kept ([B, 1] each)."""
    mass_before = values.cumsum(-1) - values
    keep = mass_before < limit
    kept = keep.sum(-1, keepdim=True).clamp(min=1)
    cut = values.gather(1, kept - 1)
    tied = values == cut
    tied_kept = (keep & tied).sum(-1, keepdim=True).clamp(min=1)
    tied_ids = torch.where(tied, ids, vocab).sort(-1).values
    return cut, tied_ids.gather(1, tied_kept - 1)


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


def _inverse_cdf(
    probs: torch.Tensor, uniforms: torch.Tensor, support: torch.Tensor | None = None
) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total (u in [0, 1)).

    In float64 and scaled by the row total, the target stays strictly below the last step of
    the CDF, and the token found always has a non-zero probability (its CDF step is > 0).
    ``support``: ids [B, m] holding every non-zero probability of each row; the CDF over
    them in id order has the same steps as the whole row's (the zeros between add nothing).
    """
    if support is not None:
        ids = support.sort(-1).values
        picked = _inverse_cdf(probs.gather(1, ids), uniforms)
        return ids.gather(1, picked[:, None]).squeeze(1)
    cdf = probs.double().cumsum(-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp(max=probs.shape[1] - 1)


def _to_host(
    tokens: torch.Tensor,
    probs: torch.Tensor | None,
    requests: Sequence[SampleRequest],
    dead: torch.Tensor | None = None,
) -> SampleOutput:
    # One transfer for the tokens, all-banned rows marked in it (no extra device sync).
    marked = tokens if dead is None else torch.where(dead, BANNED_ROW, tokens)
    out = SampleOutput(tokens=marked.tolist())
    if probs is None:
        return out
    if any(r.return_probs for r in requests):
        chosen = probs.gather(1, tokens[:, None]).squeeze(1).tolist()
        out.probs = [0.0 if t == BANNED_ROW else p for t, p in zip(out.tokens, chosen, strict=True)]
    k = max(r.top_k_return for r in requests)
    if k:
        top = probs.topk(min(k, probs.shape[1]), dim=-1)
        indices, values = top.indices.tolist(), top.values.tolist()
        out.top_tokens = [row[: r.top_k_return] for row, r in zip(indices, requests, strict=True)]
        out.top_probs = [row[: r.top_k_return] for row, r in zip(values, requests, strict=True)]
    return out


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The model's log-probabilities of ``token_ids`` (one per row of ``logits``, already cut
    to the vocabulary) and each row's ``k`` most likely tokens with theirs."""
    # log p = logit - logsumexp(row): no [B, V] log_softmax is written; the top k of the
    # logits are the top k of the log-probabilities
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, token_ids[:, None]) - norm).squeeze(1).tolist()
    k = min(k, logits.shape[1])
    if not k:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    top = logits.topk(k, dim=-1)
    return chosen, top.indices.tolist(), (top.values - norm).tolist()


def _add_logprobs(
    out: SampleOutput,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    requests: Sequence[SampleRequest],
    limit: int,
) -> None:
    """The model's log-probabilities (raw logits, vocabulary ids below ``limit``) of the chosen
    tokens and the top k, computed on the device for the rows that asked only."""
    rows = [i for i, r in enumerate(requests) if r.logprobs is not None]
    if len(rows) == len(requests):  # a view, no copy
        wanted, chosen_ids = logits[:, :limit], tokens[:, None]
    else:
        index = torch.tensor(rows, device=logits.device)
        wanted, chosen_ids = logits[index, :limit], tokens[index, None]
    k = max(requests[i].logprobs for i in rows)
    chosen, top_ids, top_values = token_logprobs(wanted, chosen_ids[:, 0].clamp(0, limit - 1), k)
    out.logprobs = [None] * len(requests)
    out.top_logprob_ids = [[] for _ in requests]
    out.top_logprobs = [[] for _ in requests]
    for j, i in enumerate(rows):
        wanted = requests[i].logprobs
        out.logprobs[i] = chosen[j]
        out.top_logprob_ids[i] = top_ids[j][:wanted]
        out.top_logprobs[i] = top_values[j][:wanted]
