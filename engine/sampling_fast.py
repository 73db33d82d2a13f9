"""The generator's sampler: ``engine.sampling.sample`` without a pass over the vocabulary
beyond one read of the logits, with per-row parameters kept across steps.

``SamplerState.sample`` returns what ``engine.sampling.sample`` (the reference) returns, with
the same random draws; the work differs:

- Penalties, biases and bans are written into the logits in place at the positions they
  change (``engine.sampling_penalties``) and put back afterwards: no [B, V] copy.
- Greedy tokens come from block maxima (``engine.sampling_candidates``): no ``max`` with
  indices over the vocabulary, no probabilities.
- Sampled rows with a top_k (2 .. ``MAX_FAST_TOP_K``) run temperature, top-k, top-p, min-p
  and the inverse-CDF draw over their ``max(top_k) + 1`` largest logits only (found through
  block maxima, no ``topk`` over the vocabulary); the softmax over the whole row is never
  computed, since truncating to those candidates and renormalising makes it cancel out.
  Rows with a top_p but no top_k need the whole row's mass for their top-p: one dense
  ``exp`` pass over those rows only. On float32 CPU rows that pass is compiled
  (``engine.sampling_cpu.mass_histogram``) and also bins the mass by value, which sizes
  the candidates so they hold every such row's cut at once (a nucleus of hundreds of
  tokens costs one candidate pass, not several); elsewhere they start from
  ``TOP_P_CANDIDATES`` candidates, widened x4 while a cut lies past them. On float32 CPU
  rows the candidates' distribution and draw are compiled loops too
  (``engine.sampling_cpu_draw``), elsewhere torch ops.
- Sampled rows with neither a top_k nor a top_p (temperature and min-p alone: "dense"
  rows, an OpenAI client's default) draw from their whole row in one compiled pass on the
  CPU (``engine.sampling_cpu.dense_draw``: ``exp(l / T - max / T)``, min-p's threshold,
  the inverse CDF's crossing through block sums), by the kernels on CUDA; no softmax, no
  cumsum over the vocabulary.
- Per-row parameter tensors (temperature, top-k, top-p, min-p, penalties) are built once
  per batch composition and settings values (``RowParams``), not every step.

Where the results can differ from the reference (the same candidates in the same order,
the same draws, the same float32 operations per candidate otherwise):

- the reference's probabilities are ``softmax`` over the whole row, scaled by ``1 / sum``
  of every ``exp``; here they are ``exp(l / T - max)`` over the candidates, normalised by
  their own sum. Mathematically the same distribution; in float32 a value may differ in the
  last bits, so a token differs only when a draw (or a top-p / min-p cut) lands within that
  rounding of a boundary: for one draw, a chance of about 1e-7.
- that whole-row mass, on the compiled path, sums a polynomial ``exp`` (within ~2 ulp of
  torch's) in float64; the reference sums torch's in float32. A top-p cut moves only when
  it lies within that rounding of a boundary too. So it is for a dense row's CDF (the
  reference: ``softmax`` then a float64 cumsum; here unnormalised weights, summed by block
  in float64), and for its min-p threshold (``min_p`` against unnormalised weights).
- two different logits whose probabilities round to the same float32 count as a tie in the
  reference's top-k and as distinct here (the same holds for min-p's threshold, compared
  with unnormalised values here).
Greedy tokens, penalties, biases, bans, the random draws and which tokens are candidates are
bit-identical; so is every result the reference produces for the cases below.

Small all-greedy batches without penalties (fewer than ``MIN_BLOCK_ROWS`` rows) use the
reference as it is: its one whole-row ``max`` costs less than more, smaller calls there.

Everything else goes to the reference, unchanged: batches with a top_k above
``MAX_FAST_TOP_K`` (or at least the vocabulary), typical sampling, ``return_probs`` or
``top_k_return``, dense rows where neither the compiled loops (``ENGINE_SAMPLING_JIT=0``)
nor the kernels run, and rows with NaN or with every token banned. A row
whose ties at its k-th value reach past the candidates (the reference keeps every token tied
with the k-th) widens the candidates, as a top-p cut past them does; only a row tied all the
way to the vocabulary's end goes to the reference.

On CUDA tensors ``_choose`` runs the Numba CUDA kernels of ``engine.cuda.sampling`` instead
(the same tokens up to float rounding, said there; ``ENGINE_SAMPLING_KERNELS=0``: torch ops).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch

from engine.device_copy import upload
from engine.sampling import (
    TOP_P_CANDIDATES,
    SampleOutput,
    SampleRequest,
    _add_logprobs,
    _apply_bias_and_bans,
    _inverse_cdf,
    _top_p_cut,
    sample,
)
from engine.sampling_candidates import JIT_ENV, Blocks, compiled_rows
from engine.sampling_penalties import (
    ContextCounts,
    LogitEdits,
    PenaltyRows,
    penalise,
)

MAX_FAST_TOP_K = 1024  # larger top_k go to the reference (the candidate set stops paying)
SAMPLING_KERNELS_ENV = "ENGINE_SAMPLING_KERNELS"  # "0": the torch path on CUDA too
MIN_BLOCK_ROWS = 16  # block maxima for batches of at least this many rows
_SETTINGS_KEY = attrgetter(
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "penalty_range",
)


@dataclass(slots=True)
class RowParams:
    """Per-row sampling parameters of one batch, as tensors on the logits' device."""

    key: tuple  # (device, dense rows fast or not, every row's settings values): a change rebuilds
    greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    any_greedy: bool  # (no greedy row: nobody reads the greedy tokens of a sampled batch)
    fast: bool  # every sampled row is one the candidate path (or the dense draw) handles
    # sampled rows drawn from their whole distribution (no top_k, no top_p; temperature and
    # min_p only): by engine.sampling_cpu.dense_draw on the CPU, by the kernels on CUDA
    dense_rows: list[int]
    # [B] bool: rows whose candidates nobody reads (greedy and dense rows)
    no_candidates: torch.Tensor
    candidate_rows: bool  # some row samples from candidates (neither greedy nor dense)
    temps: torch.Tensor  # [B, 1] float32: the temperature, 1.0 for greedy rows
    top_k: torch.Tensor  # [B, 1] long, 1 for greedy rows and rows without a top_k
    max_top_k: int  # over the sampled rows
    # sampled rows without a top_k (their top_p < 1): [B, 1] bool and their indices
    unbounded: torch.Tensor
    unbounded_rows: list[int]
    top_p: torch.Tensor | None  # [B, 1] float32; None when every row has 1.0
    min_p: torch.Tensor | None  # [B, 1] float32; None when every row has 0
    penalised: list[int]  # rows with penalties
    penalties: torch.Tensor  # [rows with penalties, 3]: repetition, frequency, presence

    @classmethod
    def build(
        cls, key: tuple, requests: Sequence[SampleRequest], device, dense_ok: bool = False
    ) -> RowParams:
        """``dense_ok``: dense rows are drawn without the reference on ``device``
        (``_dense_draw_available``): they are then fast too."""
        settings = [r.settings for r in requests]
        greedy = [s.is_greedy for s in settings]
        dense = [not g and _is_dense(s) for s, g in zip(settings, greedy, strict=True)]
        sampled = [s for s, g in zip(settings, greedy, strict=True) if not g]
        fast = all(
            (
                (2 <= s.top_k <= MAX_FAST_TOP_K or (s.top_k == 0 and s.top_p < 1.0))
                and s.typical >= 1.0
            )
            or (dense_ok and _is_dense(s))
            for s in sampled
        )
        unbounded = [
            not g and s.top_k == 0 and not d
            for s, g, d in zip(settings, greedy, dense, strict=True)
        ]
        penalised = [i for i, s in enumerate(settings) if s.has_penalties]
        top_p = [s.top_p for s in settings]
        min_p = [s.min_p for s in settings]
        return cls(
            key=key,
            greedy=upload(greedy, device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            fast=fast,
            dense_rows=[i for i, d in enumerate(dense) if d],
            candidate_rows=not all(g or d for g, d in zip(greedy, dense, strict=True)),
            no_candidates=upload([g or d for g, d in zip(greedy, dense, strict=True)], device),
            # as the reference: float32 tensors from the Python floats
            temps=upload(
                [1.0 if g else s.temperature for s, g in zip(settings, greedy, strict=True)],
                device,
            )[:, None],
            top_k=upload(
                [1 if g or not s.top_k else s.top_k for s, g in zip(settings, greedy, strict=True)],
                device,
            )[:, None],
            max_top_k=max(
                (
                    s.top_k
                    for s, d in zip(settings, dense, strict=True)
                    if not d and not s.is_greedy
                ),
                default=1,
            ),
            unbounded=upload(unbounded, device)[:, None],
            unbounded_rows=[i for i, u in enumerate(unbounded) if u],
            top_p=upload(top_p, device)[:, None] if min(top_p) < 1.0 else None,
            min_p=upload(min_p, device)[:, None] if max(min_p) > 0 else None,
            penalised=penalised,
            penalties=upload(
                [
                    [s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
                    for s in (settings[i] for i in penalised)
                ],
                device,
            ).reshape(-1, 3),
        )


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """``SamplerState.sample_on_device``'s tokens, still on the device."""

    tokens: torch.Tensor  # [B] long; BANNED_ROW where the host sampler found no token
    # [B] bool: rows without a finite maximum (a NaN, every token banned): the caller asks the
    # reference again for them; their token here is the one the reference's greedy op picks
    # (the first NaN, or id 0), so the next step's input is right whenever the reference
    # then finds a token at all
    flags: torch.Tensor | None = None


class SamplerState:
    """Sampling for one generator across steps: cached ``RowParams``, each job's penalty
    window (keyed by ``SampleRequest.key``): in a ``PenaltyTable`` for float32 CPU logits,
    as a ``ContextCounts`` elsewhere."""

    def __init__(self, kernels: bool | None = None) -> None:
        """``kernels``: ``sample_on_device`` samples non-greedy batches with the Numba CUDA
        kernels (``engine.cuda.sampling``); None: on CUDA logits when they are available
        (True also under the CUDA simulator, for tests); False: never, in ``sample`` either."""
        if kernels is not None and not isinstance(kernels, bool):
            raise ValueError(f"kernels must be a bool or None, got {kernels!r}")
        if kernels:
            from engine.cuda import _launch  # numba only where it is asked for

            if not _launch.kernels_available():
                raise ValueError("kernels=True needs a CUDA device or the CUDA simulator")
        self.kernels = kernels
        self._params: RowParams | None = None
        self._contexts: dict[int, ContextCounts] = {}  # (rows the compiled loops do not take)
        self._penalty_table = None  # engine.sampling_penalty_table.PenaltyTable, once needed
        self.fast_calls = 0  # calls served by the candidate path (the rest: the reference)
        self.reference_calls = 0

    def params(self, requests: Sequence[SampleRequest], device) -> RowParams:
        # keyed by value: settings objects are mutable, their identity proves nothing
        dense_ok = _dense_draw_available(device)
        key = (str(device), dense_ok, tuple(_SETTINGS_KEY(r.settings) for r in requests))
        if self._params is None or self._params.key != key:
            self._params = RowParams.build(key, requests, device, dense_ok)
        return self._params

    def sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampleRequest],
        vocab_limit: int | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> SampleOutput:
        """``engine.sampling.sample`` (same arguments, same output), faster (see above)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        params = self.params(requests, logits.device)
        extras = any(r.return_probs or r.top_k_return for r in requests)
        # a few greedy rows without penalties: the reference is already one whole-row op
        small_greedy = params.all_greedy and not params.penalised and len(requests) < MIN_BLOCK_ROWS
        out = None
        if params.fast and not extras and not small_greedy:
            with torch.inference_mode():  # the runner's logits are inference tensors
                out = self._sample_fast(logits, requests, vocab_limit, token_mask, params)
        if out is None:  # a case for the reference (nothing was drawn yet)
            self.reference_calls += 1
            return sample(logits, requests, vocab_limit, token_mask)
        self.fast_calls += 1
        self._forget_others(requests)
        return out

    def sample_on_device(
        self,
        logits: torch.Tensor,
        requests: Sequence[SampleRequest],
        vocab_limit: int | None = None,
    ) -> DeviceSample:
        """The tokens of ``sample`` (no mask, no extras) as a tensor on the logits' device.

        Greedy batches (penalties, biases and bans included), and on the kernels every batch
        the candidate path takes, never wait for the device here: rows without a finite
        maximum (a NaN, every token banned) are flagged, and the caller runs the reference
        for them when it reads the tokens. Other batches sample as ``sample`` does (on the
        host's time) and hand back its tokens."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
        params = self.params(requests, logits.device)
        extras = any(r.return_probs or r.top_k_return or r.logprobs is not None for r in requests)
        if params.all_greedy and not extras:
            with torch.inference_mode():  # the runner's logits are inference tensors
                tokens, flags = self._greedy_on_device(logits, requests, vocab_limit, params)
            self.fast_calls += 1
            self._forget_others(requests)
            return DeviceSample(tokens, flags)
        if params.fast and not extras and self._kernels_for(logits):
            with torch.inference_mode():
                tokens, flags = self._kernels_on_device(logits, requests, vocab_limit, params)
            self.fast_calls += 1
            self._forget_others(requests)
            return DeviceSample(tokens, flags)
        out = self.sample(logits, requests, vocab_limit)
        return DeviceSample(upload(out.tokens, logits.device, torch.long))

    def _kernels_for(self, logits: torch.Tensor) -> bool:
        return _kernels_wanted(logits) if self.kernels is None else self.kernels

    def _kernels_on_device(self, logits, requests, vocab_limit, params: RowParams):
        """(tokens, flags) from ``sample_cuda`` after the edits, no host sync."""
        from engine.cuda.sampling import sample_cuda

        with self._edited(logits, requests, vocab_limit, params) as (raw, limit):
            # every row draws, as in ``sample``; float64: see _choose_with_torch
            draws = [r.rng.random() for r in requests]
            uniforms = upload(draws, raw.device, torch.float64)
            return sample_cuda(raw, limit, uniforms, _kernel_rows(params))

    def _greedy_on_device(self, logits, requests, vocab_limit, params: RowParams):
        with self._edited(logits, requests, vocab_limit, params) as (raw, limit):
            if raw.shape[0] < MIN_BLOCK_ROWS:  # a few rows: one whole-row op costs less
                best = raw[:, :limit].max(-1)
                tokens, row_max = best.indices, best.values
            else:
                blocks = Blocks.of(raw, limit)
                tokens, row_max = blocks.greedy(), blocks.row_max.squeeze(1)
            flags = ~(row_max > -math.inf)  # (a NaN maximum is not > -inf either)
        for r in requests:  # every row draws, as in ``sample``
            r.rng.random()
        return tokens, flags

    def _sample_fast(self, logits, requests, vocab_limit, token_mask, params: RowParams):
        with self._edited(logits, requests, vocab_limit, params) as (raw, limit):
            x = raw if token_mask is None else raw + token_mask[:, : raw.shape[1]]
            # (kernels=False keeps sample() on the torch ops too; None and True: the device's)
            tokens = _choose(x, limit, params, requests, False if self.kernels is False else None)
        if tokens is None:
            return None
        out = SampleOutput(tokens=tokens.tolist())
        if any(r.logprobs is not None for r in requests):
            _add_logprobs(out, raw, tokens, requests, limit)
        return out

    @contextlib.contextmanager
    def _edited(self, logits, requests, vocab_limit, params: RowParams) -> Iterator[tuple]:
        """(float32 logits with penalties, biases and bans written in, the vocabulary limit)
        while the block runs; the edited positions are put back after it."""
        raw = logits.float()
        if not raw.is_contiguous():
            raw = raw.contiguous()
        limit = raw.shape[1] if vocab_limit is None else min(vocab_limit, raw.shape[1])
        edits = LogitEdits(raw.view(-1))
        try:
            self._edit(raw, edits, requests, params)
            yield raw, limit
        finally:
            edits.restore()

    def _edit(self, raw, edits: LogitEdits, requests, params: RowParams) -> None:
        """Penalties, then biases and bans (the reference's order), in place."""
        vocab = raw.shape[1]
        # (row, its index among the penalised rows) for rows with a context to look at
        rows = [(i, j) for j, i in enumerate(params.penalised) if requests[i].context]
        if rows:
            penalties = params.penalties
            if len(rows) < len(params.penalised):
                penalties = penalties[[j for _, j in rows]]
            if compiled_rows(raw):  # one table of every job's window, compiled loops
                self._table().penalise(
                    edits, raw, [i for i, _ in rows], [requests[i] for i, _ in rows], penalties
                )
            else:
                windows = [self._window(requests[i], vocab) for i, _ in rows]
                pairs = PenaltyRows.gather([i for i, _ in rows], windows, vocab, raw.device)
                penalise(edits, pairs, penalties)
        touched = [
            i * vocab + t % vocab
            for i, r in enumerate(requests)
            for t in (*r.settings.token_bias, *r.banned_tokens)
            if -vocab <= t < vocab
        ]
        if touched:
            edits.save(upload(touched, raw.device))
            _apply_bias_and_bans(raw, requests)

    def _table(self):
        if self._penalty_table is None:
            from engine.sampling_penalty_table import PenaltyTable  # (numba: on first use)

            self._penalty_table = PenaltyTable()
        return self._penalty_table

    def _window(self, request: SampleRequest, vocab: int) -> ContextCounts:
        if request.key is None:  # no job to keep it for: count this context once
            counts = ContextCounts()
        else:
            counts = self._contexts.get(request.key)
            if counts is None:
                counts = self._contexts[request.key] = ContextCounts()
        counts.sync(request.context, vocab, request.settings.penalty_range)
        return counts

    def _forget_others(self, requests: Sequence[SampleRequest]) -> None:
        """Drop the context counts of jobs long gone (a job absent for one step keeps its)."""
        table = self._penalty_table
        if len(self._contexts) > 2 * len(requests) + 16:
            live = {r.key for r in requests}
            self._contexts = {k: v for k, v in self._contexts.items() if k in live}
        if table is not None and len(table) > 2 * len(requests) + 16:
            table.forget_except({r.key for r in requests})


def _choose(
    x: torch.Tensor, limit: int, params: RowParams, requests, kernels: bool | None = None
) -> torch.Tensor | None:
    """Each row's token, or None when a row needs the reference (then nothing is drawn).

    ``kernels``: use the Numba CUDA kernels (``engine.cuda.sampling``); None: on CUDA tensors
    when they are available, unless ``ENGINE_SAMPLING_KERNELS=0``."""
    if kernels is None:
        kernels = _kernels_wanted(x)
    if kernels:
        return _choose_with_kernels(x, limit, params, requests)
    return _choose_with_torch(x, limit, params, requests)


def _choose_with_torch(x: torch.Tensor, limit: int, params: RowParams, requests):
    """``_choose`` with torch ops: block maxima and candidates (``engine.sampling_candidates``)."""
    n = params.max_top_k + 1
    if n > limit and not params.all_greedy:
        return None
    if params.dense_rows and not compiled_rows(x):  # (the kernels' rows, asked for on torch)
        return None
    # a few rows: whole-row ops cost less than more calls, unless a top-p row without a top_k
    # would sort a whole row for its nucleus (the compiled loops need the block maxima)
    if x.shape[0] < MIN_BLOCK_ROWS and not (params.unbounded_rows and compiled_rows(x)):
        best = x[:, :limit].max(-1)  # the reference's greedy op
        greedy_tokens, row_max, blocks = best.indices, best.values, None
    else:
        blocks = Blocks.of(x, limit)
        greedy_tokens, row_max = None, blocks.row_max
    if bool((torch.isnan(row_max) | (row_max == -math.inf)).any()):
        return None  # NaN rows and rows with every token banned: the reference's handling
    if greedy_tokens is None and params.any_greedy:
        greedy_tokens = blocks.greedy()
    if params.all_greedy:
        for r in requests:  # every row draws, so a job's stream ignores its settings
            r.rng.random()
        return greedy_tokens
    if not params.candidate_rows:
        draws = [r.rng.random() for r in requests]  # (no candidates: nothing else to wait for)
        if greedy_tokens is None:  # every row is dense: each gets its token there
            greedy_tokens = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return _with_dense(greedy_tokens, x, limit, params, row_max, draws)
    if compiled_rows(x):
        found = _compiled_draw(x, limit, n, blocks, row_max, params, requests)
    else:
        found = _torch_draw(x, limit, n, blocks, row_max, params, requests)
    if found is None:
        return None
    sampled, draws = found
    return _merged(sampled, greedy_tokens, x, limit, params, row_max, draws)


def _torch_draw(x, limit: int, n: int, blocks, row_max, params: RowParams, requests):
    """(the candidate rows' tokens [B], every row's draw) with torch ops on the candidates;
    None when a row needs the reference (then nothing is drawn)."""
    total, n, histogram = _top_p_sizing(x, limit, n, blocks, row_max, params)
    found = _widened_candidates(x, limit, n, blocks, params, total, histogram)
    if found is None:
        return None
    probs, ids = found
    draws = [r.rng.random() for r in requests]
    # float64: a float32 draw just below 1.0 would round up to 1.0 and fall off the CDF
    uniforms = torch.tensor(draws, dtype=torch.float64, device=x.device)
    # the CDF in id order, as the reference's over the whole row (zeros add no step)
    order = ids.argsort(-1)
    sorted_ids = ids.gather(1, order)
    picked = _inverse_cdf(probs.gather(1, order), uniforms)
    return sorted_ids.gather(1, picked[:, None]).squeeze(1), draws


def _merged(sampled, greedy_tokens, x, limit: int, params: RowParams, row_max, draws):
    """The candidate rows' ``sampled`` tokens with the greedy rows' and the dense rows'."""
    tokens = sampled
    if greedy_tokens is not None:
        tokens = torch.where(params.greedy, greedy_tokens, sampled)
    return _with_dense(tokens, x, limit, params, row_max, draws) if params.dense_rows else tokens


def _compiled_draw(x, limit: int, n: int, blocks, row_max, params: RowParams, requests):
    """(the candidate rows' tokens [B], every row's draw) by ``engine.sampling_cpu_draw``
    (float32 CPU rows); None when a row needs the reference (then nothing is drawn)."""
    from engine import sampling_cpu_draw as draw

    total, n, histogram = _top_p_sizing(x, limit, n, blocks, row_max, params)
    # widened while ties at a row's k-th, or a top-p cut, lie past them
    for size, values, ids in _candidate_rounds(x, limit, n, blocks, histogram):
        answer, probs = draw.final_probs(values, ids, params, total, x.shape[1])
        if answer == draw.READY or (answer == draw.CUT_PAST and size == limit):
            break
    else:
        return None
    draws = [r.rng.random() for r in requests]
    return draw.pick(probs, ids, params.no_candidates, draws), draws


def _top_p_sizing(x, limit: int, n: int, blocks, row_max, params: RowParams):
    """(each row's whole mass [B, 1] or None, the candidates to start from, the
    ``MassHistogram`` or None) for the rows with a top_p and no top_k: a compiled pass that
    sizes the candidates on float32 CPU rows, else ``_row_mass`` and ``TOP_P_CANDIDATES``."""
    if not params.unbounded_rows:
        return None, n, None
    if blocks is not None and compiled_rows(x):
        from engine import sampling_cpu

        histogram = sampling_cpu.mass_histogram(
            x, limit, row_max, params.temps, params.top_p, params.unbounded_rows
        )
        return histogram.total, max(n, min(histogram.needed, limit)), histogram
    return _row_mass(x, limit, row_max, params), max(n, TOP_P_CANDIDATES), None


def _with_dense(tokens, x, limit: int, params: RowParams, row_max, draws) -> torch.Tensor:
    """``tokens`` with the dense rows' drawn from their whole distribution (compiled)."""
    from engine import sampling_cpu

    dense = sampling_cpu.dense_draw(
        x, limit, params.dense_rows, params.temps, params.min_p, row_max, draws
    )
    tokens = tokens.clone()
    tokens[params.dense_rows] = dense
    return tokens


def _is_dense(settings) -> bool:
    """Sampled from the whole distribution: no top_k, no top_p, no typical (temperature and
    min_p apply)."""
    return settings.top_k == 0 and settings.top_p >= 1.0 and settings.typical >= 1.0


def _dense_draw_available(device) -> bool:
    """Whether dense rows on ``device`` are drawn without the reference: by
    engine.sampling_cpu's loops on the CPU (the sampler makes rows float32 and contiguous:
    only ENGINE_SAMPLING_JIT decides), by the kernels on CUDA where ``_choose`` takes them."""
    if torch.device(device).type == "cpu":
        return os.environ.get(JIT_ENV, "1").strip() != "0"
    return _kernels_wanted_on(device)


def _widened_candidates(x, limit: int, n: int, blocks, params: RowParams, total, histogram=None):
    """(probs, ids) [B, m] of the ``m >= n`` largest logits: ``n``, widened (x4) while a row's
    top-p cut or the ties at its k-th lie past them; None when ties at a row's k-th reach the
    end of the vocabulary (the reference's handling). ``histogram``
    (``engine.sampling_cpu.MassHistogram``): floors for the top-p rows' candidates, each
    row's own in the first round (short rows padded: id -1), the batch's after a widening."""
    for size, values, ids in _candidate_rounds(x, limit, n, blocks, histogram):
        found = _candidate_probs(values, ids, x.shape[1], params, total)
        if found is not None and (found[1] or size == limit):
            return found[0], ids
    return None


def _candidate_rounds(x, limit: int, n: int, blocks, histogram) -> Iterator[tuple]:
    """(n, values, ids) [B, n] of each round of candidates: the ``n`` largest logits, then
    x4 as the caller asks for more, up to ``limit``. ``histogram``: floors for the top-p
    rows' candidates, each row's own in the first round (short rows padded: id -1), the
    batch's after a widening."""
    own = True
    while True:
        n = min(n, limit)
        if blocks is None:
            values, ids = x[:, :limit].topk(n, dim=-1)
        elif histogram is None:
            values, ids = blocks.top(n)
        else:
            values, ids = blocks.top(n, *histogram.bounds(n, own))
        own = False
        yield n, values, ids
        if n == limit:
            return
        n *= 4


def _kernels_wanted(x: torch.Tensor) -> bool:
    return _kernels_wanted_on(x.device)


def _kernels_wanted_on(device) -> bool:
    """Whether ``_choose`` takes the kernels for tensors on ``device``."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get(SAMPLING_KERNELS_ENV, "1").strip() == "0":
        return False
    from engine.cuda import _launch  # numba only where there is CUDA

    return _launch.kernels_available()


def _choose_with_kernels(x: torch.Tensor, limit: int, params: RowParams, requests):
    """``_choose`` on the kernels: the same tokens (``engine.cuda.sampling`` says where the
    float rounding may differ) and the same contract: a batch with a NaN or infinite-maximum
    row goes to the reference before anything is drawn. That check reads the greedy kernel's
    flags (a host sync, as the torch path's NaN check); the sampling launch needs none. The
    batches the torch path hands over for its candidates' sake (ties at the k-th past them,
    ``max top_k + 1 > limit``) are sampled here, by the reference's keep rules."""
    from engine.cuda.sampling import greedy_cuda, sample_cuda

    greedy_tokens, flags = greedy_cuda(x, limit)
    if bool(flags.any()):
        return None
    draws = [r.rng.random() for r in requests]  # every row draws, as the reference
    if params.all_greedy:
        return greedy_tokens
    # float64: a float32 draw just below 1.0 would round up to 1.0 and fall off the CDF
    uniforms = torch.tensor(draws, dtype=torch.float64, device=x.device)
    tokens, _ = sample_cuda(x, limit, uniforms, _kernel_rows(params))
    return tokens


# (the last RowParams, its kernel rows): one tuple, read and replaced whole (thread-safe)
_kernel_rows_cache: tuple = (None, None)


def _kernel_rows(params: RowParams):
    """``params`` as the kernels' per-row [B] tensors, built once per ``RowParams`` (a
    generator keeps one while its batch and settings stay the same)."""
    global _kernel_rows_cache
    cached_params, rows = _kernel_rows_cache
    if cached_params is params:
        return rows
    from engine.cuda.sampling import SampleRows

    temps = params.temps.reshape(-1)
    top_p = params.top_p.reshape(-1) if params.top_p is not None else torch.ones_like(temps)
    min_p = params.min_p.reshape(-1) if params.min_p is not None else torch.zeros_like(temps)
    # RowParams' top_k is 1 for rows without one (dense rows too); the kernels' 0 means none
    dense = (params.no_candidates & ~params.greedy)[:, None]
    top_k = params.top_k.masked_fill(params.unbounded | dense, 0).reshape(-1)
    rows = SampleRows(temps, top_k, top_p, min_p, params.greedy)
    _kernel_rows_cache = (params, rows)
    return rows


def _row_mass(x, limit: int, row_max: torch.Tensor, params: RowParams) -> torch.Tensor | None:
    """[B, 1]: each row's whole mass ``sum(exp(l / T - max / T))`` below ``limit`` for the
    rows without a top_k (their top-p needs it; 0 for the others), None when there are none.
    One dense pass over those rows only."""
    if not params.unbounded_rows:
        return None
    every = len(params.unbounded_rows) == x.shape[0]
    rows = torch.tensor(params.unbounded_rows, device=x.device)
    temps = params.temps[rows]
    scaled_max = row_max.reshape(-1, 1)[rows] / temps  # the candidates' first, scaled
    # one [rows, limit] temporary, edited in place: each fresh one of a batch's size costs
    # a CPU more in page faults than the arithmetic (the same operations, in the same order)
    scaled = (x[:, :limit] if every else x.index_select(0, rows)[:, :limit]) / temps
    mass = scaled.sub_(scaled_max).exp_().sum(-1, keepdim=True)
    if every:
        return mass
    total = torch.zeros(x.shape[0], 1, device=x.device)
    return total.index_copy_(0, rows, mass)


def _candidate_probs(
    values: torch.Tensor,
    ids: torch.Tensor,
    vocab: int,
    params: RowParams,
    total: torch.Tensor | None,
) -> tuple[torch.Tensor, bool] | None:
    """The final distribution over the candidates (``values``: logits, descending), as the
    reference's ``_final_distribution`` does over the whole row, and whether every row
    without a top_k has its top-p cut inside the candidates (else: widen them); None when a
    row's ties at its k-th value reach past the candidates (widen them too)."""
    scaled = values / params.temps
    probs = torch.exp(scaled - scaled[:, :1])  # descending, as the values
    # rows without a top_k keep everything here (a k-th value of 0), as the reference's
    kth = torch.where(params.unbounded, 0.0, probs.gather(1, params.top_k - 1))
    covered = (probs[:, -1:] < kth) | params.no_candidates[:, None] | params.unbounded
    if not bool(covered.all()):
        return None
    probs = probs * (probs >= kth)  # ties with the k-th are kept, as the reference's
    inside = True
    if params.top_p is not None:
        disabled = params.top_p >= 1.0
        mass = probs.sum(-1, keepdim=True)
        if total is not None:  # rows without a top_k: the whole row's mass, not the candidates'
            mass = torch.where(params.unbounded, total, mass)
        mass = params.top_p * mass
        cut, last_id = _top_p_cut(probs, ids, mass, vocab)
        if total is not None:  # the cut (and every token tied with it) among the candidates
            # (a row's last own candidate: pads, id -1, may follow it)
            last = probs.gather(1, ((ids >= 0).sum(-1, keepdim=True) - 1).clamp(min=0))
            inside = bool(((last < cut) | (last == 0) | ~params.unbounded).all())
        cut = torch.where(disabled, 0.0, cut)
        # tokens tied with the cut past the number kept: lowest ids first, as the reference
        drop = (probs == cut) & (ids > last_id)
        probs = torch.where(drop, 0.0, probs * (probs >= cut))
    if params.min_p is not None:
        probs = probs * (probs >= params.min_p * probs.max(-1, keepdim=True).values)
    return probs / probs.sum(-1, keepdim=True), inside
