"""The generator's sampler (engine.sampling_fast) against the reference engine.sampling.sample.

Greedy tokens, top-k candidates and sparse penalties must be bit-identical to the reference's
dense forms; sampled tokens must be the reference's for the same seeds (they may differ only
when a draw lands within float32 rounding of a CDF step, which these fixed seeds never do),
and every job's random stream must advance exactly as with the reference.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from engine.sampling import SampleRequest, SamplerSettings, _apply_penalties, sample
from engine.sampling_candidates import BLOCK, JIT_ENV, Blocks
from engine.sampling_fast import MIN_BLOCK_ROWS, SamplerState
from engine.sampling_penalties import (
    ContextCounts,
    LogitEdits,
    PenaltyRows,
    penalise,
)


def _logits(rows: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 3.0
    return x.round() if ties else x  # rounded: many exactly equal values


# -- greedy and candidates --------------------------------------------------------------------


@pytest.fixture(params=["compiled", "torch"])
def block_ops(request, monkeypatch):
    """Both forms of what follows the block maxima on the CPU: engine.sampling_cpu's compiled
    loops (the default) and the torch ops (ENGINE_SAMPLING_JIT=0)."""
    monkeypatch.setenv(JIT_ENV, "1" if request.param == "compiled" else "0")
    return request.param


@pytest.mark.parametrize("vocab", [BLOCK - 5, BLOCK, 3 * BLOCK + 7, 1000, 4099])
@pytest.mark.parametrize("ties", [False, True])
def test_block_greedy_is_the_first_maximum(vocab, ties, block_ops):
    for seed in range(5):
        x = _logits(40, vocab, seed, ties)
        x[0] = 1.0  # every id tied: the first
        x[1, -1] = 100.0  # the maximum in the tail (or last block)
        x[2, [3, min(BLOCK + 1, vocab - 2), vocab - 1]] = 100.0  # tied maxima, several blocks
        x[3] = -torch.inf
        x[3, vocab // 2] = 0.0
        x[4] = -torch.inf  # no finite value: id 0
        x[5, [vocab // 3, vocab // 2]] = torch.nan  # NaNs: the first, as max gives it
        x[6, -1] = torch.nan  # a NaN in the tail (or last block) only
        x[7, 1] = 1000.0  # a maximum before a NaN: the NaN still wins
        x[7, vocab - 2] = torch.nan
        for limit in (vocab, vocab - 1, max(1, vocab - BLOCK - 3)):
            expected = x[:, :limit].max(-1).indices
            assert torch.equal(Blocks.of(x, limit).greedy(), expected), (vocab, limit, seed)


@pytest.mark.parametrize("vocab", [3 * BLOCK + 7, 1000, 4099, 4096])
@pytest.mark.parametrize("n", [2, 6, 51])
@pytest.mark.parametrize("cut", [0, 3])
def test_block_top_values_are_topk_values(vocab, n, cut, block_ops):
    for seed, ties in ((0, False), (1, True), (2, True)):
        x = _logits(24, vocab, seed, ties)
        if seed == 2:
            x = _logits(30, vocab, seed, ties)[3:27]  # rows of a larger tensor (an offset)
        limit = vocab - cut
        values, ids = Blocks.of(x, limit).top(n)
        assert torch.equal(values, x[:, :limit].topk(n).values)
        assert bool((ids < limit).all())
        assert torch.equal(x.gather(1, ids), values)  # each id holds its value
        assert all(len(set(row)) == n for row in ids.tolist())  # distinct ids


@pytest.mark.parametrize("limit", [64 * BLOCK - 3, 62 * BLOCK, 62 * BLOCK + 5, 40 * BLOCK])
def test_padded_vocabulary_ids_past_the_limit_never_count(limit, block_ops):
    """A row a few blocks wider than the limit (a padded vocabulary) takes its block maxima
    over the whole contiguous row; whatever the padding holds (NaN, +inf) changes nothing."""
    x = _logits(12, 64 * BLOCK, 5, ties=True)
    x[:, limit:] = torch.inf
    x[::2, -1] = torch.nan
    greedy = Blocks.of(x, limit).greedy()
    assert torch.equal(greedy, x[:, :limit].max(-1).indices)
    values, ids = Blocks.of(x, limit).top(51)
    assert torch.equal(values, x[:, :limit].topk(51).values)
    assert bool((ids < limit).all())


def _by_value_then_id(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n largest values of each row, ties broken by the lower id (a stable sort)."""
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :n]
    return x.gather(1, ids), ids


@pytest.mark.parametrize("n", [2, 51, 100, 129])
def test_compiled_top_orders_by_value_then_id(n, monkeypatch):
    """engine.sampling_cpu's top n: exactly the values topk gives, ties broken by the lower id;
    over rows with many ties (more candidates than the in-place ordering takes), banned blocks,
    +inf, and a row view of a larger tensor."""
    monkeypatch.setenv(JIT_ENV, "1")
    vocab = 130 * BLOCK + 11
    for seed in range(3):
        x = _logits(20, vocab, seed, ties=seed > 0)
        x[0, : 120 * BLOCK] = -torch.inf  # most blocks banned
        x[1, 7] = torch.inf
        x[2, :] = 1.0  # all tied: ids 0..n-1
        x[3, 5 * BLOCK : 9 * BLOCK] = 50.0  # 4 * BLOCK ties at the top
        x[4, -5:] = 60.0  # the largest values in the tail
        x[5] = x[5].round()  # few distinct values: many tied at the n-th
        for limit in (vocab, vocab - 11, vocab - 3):
            view = x[1:, :] if seed == 2 else x
            values, ids = Blocks.of(view, limit).top(n)
            expected_values, expected_ids = _by_value_then_id(view[:, :limit], n)
            assert torch.equal(values, expected_values), (seed, limit)
            assert torch.equal(ids, expected_ids), (seed, limit)


# -- penalties ---------------------------------------------------------------------------------


def _penalty_requests(rows: int, vocab: int, rng: random.Random) -> list[SampleRequest]:
    requests = []
    for _ in range(rows):
        settings = SamplerSettings(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3]),
            frequency_penalty=rng.choice([0.0, 0.25, -0.5]),
            presence_penalty=rng.choice([0.0, 0.75]),
            penalty_range=rng.choice([0, 3, 20]),
        )
        # repeated tokens, ids outside the vocabulary, empty contexts
        context = [rng.randrange(-2, vocab + 3) for _ in range(rng.randrange(0, 60))]
        context += context[: rng.randrange(0, 10)]
        requests.append(SampleRequest(settings, random.Random(0), context=context))
    return requests


@pytest.mark.parametrize("seed", range(6))
def test_sparse_penalties_are_bit_identical_to_the_dense_form(seed):
    """``penalise``'s torch ops (every device but the CPU's float32 logits, which
    tests/unit/test_penalty_table.py checks)."""
    rng = random.Random(seed)
    vocab = rng.choice([10, 100, 777])
    requests = _penalty_requests(12, vocab, rng)
    logits = _logits(12, vocab, seed, ties=seed % 2 == 1)
    logits[0, :3] = 0.0  # zero logits: neither shrunk nor pushed
    expected = logits.clone()
    _apply_penalties(expected, requests)
    rows = [i for i, r in enumerate(requests) if r.settings.has_penalties and r.context]
    windows = []
    for i in rows:
        counts = ContextCounts()
        window = requests[i].settings.penalty_range
        # counted as a job's would be: a start, then token by token
        counts.sync(requests[i].context[:3], vocab, window)
        for end in range(4, len(requests[i].context) + 1):
            counts.sync(requests[i].context[:end], vocab, window)
        windows.append(counts)
    pairs = PenaltyRows.gather(rows, windows, vocab, logits.device)
    params = torch.tensor(
        [
            [s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
            for s in (requests[i].settings for i in rows)
        ]
    ).reshape(-1, 3)
    edited = logits.clone()
    edits = LogitEdits(edited.view(-1))
    penalise(edits, pairs, params)
    assert torch.equal(edited, expected)
    edits.restore()
    assert torch.equal(edited, logits)


@pytest.mark.parametrize("compiled", [True, False], ids=["loops", "torch"])
def test_logit_edits_restore_overlapping_saves_last_first(compiled, monkeypatch):
    monkeypatch.setenv(JIT_ENV, "1" if compiled else "0")
    original = torch.arange(6, dtype=torch.float32)
    flat = original.clone()
    edits = LogitEdits(flat)
    edits.save(torch.tensor([0, 1, 1]))  # (a key twice, as a bias and a ban may give)
    flat[:2] = 5.0
    edits.save(torch.tensor([1, 2]))  # holds the edited 5.0 at 1: must not win
    flat[1:3] = 7.0
    edits.restore()
    assert torch.equal(flat, original)


def _window_counts(context, vocab, window) -> dict[int, int]:
    tokens = context[-window:] if window else context
    counted = {}
    for t in tokens:
        if 0 <= t < vocab:
            counted[t] = counted.get(t, 0) + 1
    return counted


@pytest.mark.parametrize("window", [0, 1, 7])
def test_context_counts_follow_appends_windows_and_rollbacks(window):
    vocab = 30
    counts = ContextCounts()

    def check():
        ids, values = counts.arrays()
        got = {int(i): int(c) for i, c in zip(ids, values, strict=True) if c}
        assert got == _window_counts(context, vocab, window)
        assert len(set(ids.tolist())) == len(ids)  # one entry per id

    rng = random.Random(window)
    context = [rng.randrange(-1, vocab + 2) for _ in range(10)]
    counts.sync(context, vocab, window)
    check()
    for step in range(150):  # past the first capacity; ids outside the vocabulary too
        context.extend(rng.randrange(-1, vocab + 2) for _ in range(1 + step % 3))
        counts.sync(context, vocab, window)
        check()
    del context[50:]  # a rollback, then different tokens
    context += [9, 9]
    counts.sync(context, vocab, window)
    check()
    context[-1] = 1  # same length, different last token
    counts.sync(context, vocab, window)
    check()


# -- whole sampler against the reference --------------------------------------------------------

SETTINGS = [
    SamplerSettings(temperature=0.8, top_k=50, top_p=0.9),
    SamplerSettings(temperature=1.3, top_k=5),
    SamplerSettings(top_k=2, min_p=0.2),
    SamplerSettings(temperature=0.6, top_k=40, top_p=0.5, min_p=0.05),
    SamplerSettings(top_k=20, top_p=1.0),  # top_p disabled
    SamplerSettings(top_k=30, repetition_penalty=1.2, frequency_penalty=0.3, penalty_range=16),
    SamplerSettings(top_k=8, top_p=0.8, presence_penalty=0.7),
    SamplerSettings.greedy(),
    SamplerSettings(top_k=1),  # greedy too
    SamplerSettings(temperature=0.0, repetition_penalty=1.5),
    SamplerSettings(top_p=0.8),  # no top_k: candidates widened until the cut is inside
    SamplerSettings(temperature=0.7, top_p=0.95, min_p=0.02, frequency_penalty=0.2),
]


def _requests(settings, rows, vocab, seed, **extra) -> tuple[list, list]:
    """Two identical request lists (independent generators with the same seeds)."""
    rng = random.Random(seed)
    pairs = ([], [])
    for i in range(rows):
        s = settings[i % len(settings)] if isinstance(settings, list) else settings
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        banned = tuple(rng.sample(range(vocab), 2)) if i % 7 == 3 else ()
        for requests in pairs:
            requests.append(
                SampleRequest(
                    s,
                    random.Random(seed * 1000 + i),
                    context=context if s.has_penalties else (),
                    banned_tokens=banned,
                    key=i,
                    **extra,
                )
            )
    return pairs


def _check_same(logits, settings, vocab_limit=None, seed=0, state=None, **extra) -> SamplerState:
    state = state or SamplerState()
    reference, fast = _requests(settings, logits.shape[0], logits.shape[1], seed, **extra)
    before = logits.clone()
    expected = sample(logits, reference, vocab_limit)
    got = state.sample(logits, fast, vocab_limit)
    # the caller's logits are left as they came, bit for bit (NaN included)
    assert torch.equal(logits.view(torch.int32), before.view(torch.int32))
    assert got.tokens == expected.tokens
    assert got.logprobs == expected.logprobs
    # each job's random stream advanced exactly as with the reference
    assert [r.rng.random() for r in fast] == [r.rng.random() for r in reference]
    return state


@pytest.mark.parametrize("rows", [3, MIN_BLOCK_ROWS, 48])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: repr(s)[15:60])
def test_same_tokens_as_the_reference_for_every_seed(rows, settings):
    state = SamplerState()
    for seed in range(8):
        vocab = [300, 2048, 5000][seed % 3]
        logits = _logits(rows, vocab, seed, ties=seed % 4 == 3)
        _check_same(logits, settings, vocab - 7 * (seed % 2), seed, state)
    assert state.fast_calls > 0 or (rows < MIN_BLOCK_ROWS and settings.is_greedy)


@pytest.mark.parametrize("rows", [5, 40])
def test_mixed_batches_and_logprobs_match_the_reference(rows):
    state = SamplerState()
    for seed in range(10):
        logits = _logits(rows, 3000, seed, ties=seed % 3 == 0)
        _check_same(logits, SETTINGS, 2990, seed, state, logprobs=2)
    assert state.fast_calls > 0


def test_top_k_beyond_the_vocabulary_and_edge_rows_go_to_the_reference():
    state = SamplerState()
    logits = _logits(20, 100, 0)
    _check_same(logits, SamplerSettings(top_k=500), state=state)  # top_k > vocabulary
    # no truncation: the compiled dense draw where there are compiled loops
    _check_same(logits, SamplerSettings(top_k=0, top_p=1.0), state=state)
    _check_same(logits, SamplerSettings(top_k=10, typical=0.5), state=state)
    nan = logits.clone()
    nan[4, 7] = torch.nan
    _check_same(nan, SamplerSettings(top_k=10), state=state)
    _check_same(nan, SamplerSettings.greedy(), state=state)
    _check_same(nan, SamplerSettings(temperature=0.7), state=state)  # a NaN row: the reference
    dense = 1 if os.environ.get(JIT_ENV, "1").strip() != "0" else 0
    assert state.fast_calls == dense and state.reference_calls == 6 - dense


@pytest.mark.parametrize("settings", SETTINGS[:4] + SETTINGS[5:7], ids=lambda s: repr(s)[15:60])
def test_ties_at_the_kth_past_the_candidates_widen_them(settings):
    """Rounded logits: hundreds of ids tie with a row's k-th value. The reference keeps them
    all; the candidates are widened until they hold every tie (no hand-over to the
    reference), and the tokens are the reference's."""
    state = SamplerState()
    for seed in range(4):
        logits = _logits(MIN_BLOCK_ROWS + 4, 4000, seed).div(2).round()
        _check_same(logits, settings, 3990, seed, state)
    assert state.reference_calls == 0 and state.fast_calls == 4


def test_row_with_every_token_banned_comes_back_as_the_reference_marks_it():
    logits = _logits(20, 50, 1)
    reference, fast = _requests(SamplerSettings(top_k=5), 20, 50, 0)
    for requests in (reference, fast):
        requests[2].banned_tokens = tuple(range(50))
    assert SamplerState().sample(logits, fast).tokens == sample(logits, reference).tokens


def test_inference_tensors_are_edited_and_restored():
    with torch.inference_mode():
        logits = _logits(MIN_BLOCK_ROWS, 500, 3)
    _check_same(logits, SETTINGS[5])  # penalties edit the logits in place, then restore


def test_row_parameters_are_cached_by_value():
    state = SamplerState()
    settings = SamplerSettings(top_k=5, top_p=0.9)
    requests = [SampleRequest(settings, random.Random(i)) for i in range(4)]
    first = state.params(requests, torch.device("cpu"))
    assert state.params(requests, torch.device("cpu")) is first  # same batch: kept
    settings.top_p = 0.5  # the same (mutable) object, changed
    changed = state.params(requests, torch.device("cpu"))
    assert changed is not first and changed.top_p.flatten().tolist() == [0.5] * 4
    assert state.params(requests[:3], torch.device("cpu")) is not changed  # another batch


@pytest.mark.parametrize("compiled", [True, False], ids=["table", "contexts"])
def test_penalty_contexts_follow_a_job_across_steps(compiled, monkeypatch):
    """One job per row sampled step after step, its context growing (and once rolled back):
    every step is the reference's, with the CPU's penalty table and with the per-job
    ContextCounts that logits off the CPU take (ENGINE_SAMPLING_JIT=0 here)."""
    monkeypatch.setenv(JIT_ENV, "1" if compiled else "0")
    state = SamplerState()
    rows, vocab = MIN_BLOCK_ROWS, 400
    settings = SamplerSettings(top_k=12, repetition_penalty=1.4, frequency_penalty=0.4)
    contexts = [[random.Random(i).randrange(vocab) for _ in range(5)] for i in range(rows)]
    reference = [SampleRequest(settings, random.Random(i), contexts[i], key=i) for i in range(rows)]
    fast = [SampleRequest(settings, random.Random(i), contexts[i], key=i) for i in range(rows)]
    for step in range(12):
        logits = _logits(rows, vocab, step)
        expected = sample(logits, reference, vocab)
        assert state.sample(logits, fast, vocab).tokens == expected.tokens
        for context, token in zip(contexts, expected.tokens, strict=True):
            context.append(token)
        if step == 6:
            del contexts[0][2:]  # a rollback
    assert state.fast_calls == 12
    assert (state._penalty_table is not None, bool(state._contexts)) == (compiled, not compiled)


@pytest.mark.parametrize("rows", [4, 20])
def test_top_p_without_top_k_widens_the_candidates_as_needed(rows):
    """Flat rows: the top-p cut lies past the first 64 candidates (then 256, ...)."""
    state = SamplerState()
    for seed in range(4):
        logits = _logits(rows, 3000, seed) * 0.05  # nearly uniform: a wide nucleus
        _check_same(logits, SamplerSettings(top_p=[0.3, 0.9, 0.99, 0.5][seed]), state=state)
    assert state.fast_calls == 4 and state.reference_calls == 0


@pytest.mark.parametrize("scale", [0.2, 3.0, 40.0])
def test_top_p_rows_past_the_blocks_reach_match_the_reference(scale):
    """Rows whose top-p nucleus holds more tokens than the row has blocks (sized by
    engine.sampling_cpu's mass histogram, no widening), peaked rows whose mass lies past the
    histogram's bins, and batches mixing them with top-k and greedy rows."""
    state = SamplerState()
    settings = [
        SamplerSettings(top_p=0.95, temperature=1.3),
        SamplerSettings(top_p=0.999999),
        SamplerSettings(top_k=7, top_p=0.8),
        SamplerSettings.greedy(),
        SamplerSettings(top_p=0.5, min_p=0.01, temperature=0.5),
    ]
    for seed in range(3):
        logits = _logits(MIN_BLOCK_ROWS + 5, 1500, seed) * scale
        logits[1, ::3] = -torch.inf  # banned ids
        _check_same(logits, settings[seed % 2 :], 1490, seed, state)
        _check_same(logits, settings[0], 1490, seed, state)
    # (at scale 40 the top-k row's k-th probability underflows to 0: that batch goes to the
    # reference, as it always has)
    assert state.reference_calls == (1 if scale == 40.0 else 0)


def _dense_mass(x: torch.Tensor, limit: int, temps: torch.Tensor) -> torch.Tensor:
    """sum(exp(l / T - max / T)) with _row_mass's float32 operations, summed in float64."""
    scaled = x[:, :limit] / temps
    return (scaled - scaled.amax(-1, keepdim=True)).exp().double().sum(-1)


@pytest.mark.parametrize("scale", [0.05, 3.0, 30.0])
def test_mass_histogram_sizes_the_top_p_candidates(scale):
    """The compiled pass's mass is the dense one; the ``needed`` largest values of each listed
    row hold its top-p mass; a row's floor for n has at least n values at or above it."""
    from engine import sampling_cpu

    rows, vocab, limit = 12, 3 * BLOCK * 7 + 5, 3 * BLOCK * 7
    x = _logits(rows, vocab, 4) * scale
    x[2, : limit // 2] = -torch.inf
    x[3] = 0.25  # every value tied
    temps = torch.tensor([0.3, 0.8, 1.0, 1.7] * 3)[:, None]
    top_p = torch.tensor([0.5, 0.9, 0.99, 0.3] * 3)[:, None]
    listed = [r for r in range(rows) if r != 5]
    row_max = x[:, :limit].amax(-1, keepdim=True)
    histogram = sampling_cpu.mass_histogram(x, limit, row_max, temps, top_p, listed)
    expected = _dense_mass(x, limit, temps)
    total = histogram.total.squeeze(1).double()
    assert total[5] == 0  # a row not listed
    assert torch.allclose(total[listed], expected[listed], rtol=1e-6, atol=0)
    assert 0 < histogram.needed <= limit
    assert histogram.needed == histogram.row_needed.max() and histogram.row_needed[5] == 0
    ordered = x[:, :limit].double().div(temps.double()).sort(-1, descending=True).values
    weights = (ordered - ordered[:, :1]).exp()
    for r in listed:  # each row's own count holds its top-p mass
        held = weights[r, : histogram.row_needed[r]].sum()
        assert held >= top_p[r, 0].double() * expected[r], r
    for n in (1, 40, histogram.needed, limit // 2):
        for own in (False, True):
            floors, needs = histogram.bounds(n, own)
            assert needs[5] == n and (needs <= n).all()
            assert (
                needs[listed] == (np.minimum(n, histogram.row_needed[listed]) if own else n)
            ).all()
            at_least = (x[:, :limit] >= torch.from_numpy(floors)[:, None]).sum(-1).numpy()
            assert ((at_least >= needs) | (floors == -np.inf)).all(), (n, own)
            assert floors[5] == -np.inf
    if scale < 1.0:  # flat rows: floors narrow even an n past the blocks' reach
        floors, _ = histogram.bounds(histogram.needed)
        assert (floors[listed] > -np.inf).any()


@pytest.mark.parametrize("n", [2, 60, 300])
def test_top_with_floors_orders_by_value_then_id(n, monkeypatch):
    """``Blocks.top(n, floors)``: the n largest by value then id, whatever the floor (a good
    one, -inf, or one too high, which falls back to every value), n past the blocks too."""
    monkeypatch.setenv(JIT_ENV, "1")
    vocab, limit = 40 * BLOCK + 9, 40 * BLOCK + 3
    x = _logits(6, vocab, 2, ties=True)
    expected_values, expected_ids = _by_value_then_id(x[:, :limit], n)
    kth = expected_values[:, -1]
    floors = torch.stack([kth, kth - 1, torch.full_like(kth, -torch.inf), kth + 0.5] * 2)[
        torch.arange(6), torch.arange(6) % 4
    ]
    values, ids = Blocks.of(x, limit).top(n, floors.numpy())
    assert torch.equal(values, expected_values)
    assert torch.equal(ids, expected_ids)
    # rows that need fewer than n: their own largest, then pads past their floor
    needs = np.array([n, max(1, n // 3), 1, n, max(1, n // 2), n], dtype=np.int64)
    own = torch.stack([expected_values[r, needs[r] - 1] for r in range(6)])
    values, ids = Blocks.of(x, limit).top(n, own.numpy(), needs)
    for r in range(6):
        real = int((ids[r] >= 0).sum())
        assert needs[r] <= real <= n
        assert torch.equal(values[r, :real], expected_values[r, :real])
        assert torch.equal(ids[r, :real], expected_ids[r, :real])
        assert bool((values[r, real:] == -torch.inf).all() and (ids[r, real:] == -1).all())
        # every value at or above the floor is there
        assert real == min(n, int((x[r, :limit] >= own[r]).sum()))


def test_compiled_exp_is_within_a_few_ulp():
    from engine import sampling_cpu

    row = np.concatenate(
        [
            np.linspace(-90.0, 0.0, 5001, dtype=np.float32),
            np.array([-np.inf, -86.99, -87.0, -87.01, -1e-30, 0.0], dtype=np.float32),
        ]
    )
    limit = row.shape[0]
    weights = np.empty(limit, np.float32)
    powers = np.empty(limit, np.int32)
    where = np.empty(limit, np.int32)
    sampling_cpu._exp_row(row, limit, np.float32(1.0), np.float32(0.0), weights, powers)
    sampling_cpu._bins(row, limit, np.float32(1.0), np.float32(0.0), where)
    expected = np.exp(row.astype(np.float64))
    live = row > sampling_cpu.EXP_FLOOR
    ulp = np.spacing(expected[live].astype(np.float32)).astype(np.float64)
    assert np.abs(weights[live] - expected[live]).max() <= 3 * ulp.max()
    assert (np.abs(weights[live] - expected[live]) <= 3 * ulp).all()
    assert (weights[~live] == 0).all()
    bins = np.minimum(-row * sampling_cpu.MASS_BINS_PER_UNIT, sampling_cpu.MASS_BINS)
    assert (where == bins.astype(np.int32)).all()


DENSE_SETTINGS = [
    SamplerSettings(),  # temperature 1, nothing else: the whole row
    SamplerSettings(temperature=0.6),
    SamplerSettings(temperature=1.4, min_p=0.05),
    SamplerSettings(temperature=0.9, presence_penalty=0.7, repetition_penalty=1.2),
]


@pytest.mark.parametrize("rows", [1, 5, MIN_BLOCK_ROWS + 3])
def test_rows_without_top_k_or_top_p_draw_as_the_reference(rows):
    """Plain temperature (and min-p) rows draw from their whole distribution in one compiled
    pass: the reference's tokens and random streams, alone and mixed with greedy, top-k and
    top-p rows, with bans, penalties and a vocabulary limit."""
    state = SamplerState()
    mixed = [*DENSE_SETTINGS, SamplerSettings.greedy(), SamplerSettings(top_k=20, top_p=0.8)]
    for seed in range(6):
        vocab = [300, 5000, 4096][seed % 3]
        logits = _logits(rows, vocab, seed, ties=seed % 3 == 1) * (0.5 + seed % 2)
        _check_same(logits, DENSE_SETTINGS[seed % 4], vocab - 3 * (seed % 2), seed, state)
        _check_same(logits, mixed, vocab - 3 * (seed % 2), seed, state)
        _check_same(logits, DENSE_SETTINGS, None, seed, state, logprobs=1)
    compiled = os.environ.get(JIT_ENV, "1").strip() != "0"  # (else: the reference's)
    assert state.reference_calls == (0 if compiled else 18)


def test_dense_draw_is_the_inverse_cdf_of_the_softmax():
    """engine.sampling_cpu.dense_draw against the reference's softmax and inverse CDF over
    many draws: every token is the reference's, including draws at 0 and just below 1."""
    from engine import sampling_cpu

    rows, vocab, limit = 8, 3000, 2990
    x = _logits(rows, vocab, 7) * 2
    x[3, 100:] = -torch.inf  # a short support
    temps = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.8, 1.0, 3.0, 0.2])[:, None]
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.3, 0.0, 0.0, 0.05])[:, None]
    row_max = x[:, :limit].amax(-1, keepdim=True)
    scaled = x[:, :limit] / temps
    probs = torch.softmax(scaled, -1)
    probs = probs * (probs >= min_p * probs.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    cdf = probs.double().cumsum(-1)
    for u in [0.0, 1e-9, 0.25, 0.5, 0.731, 0.999, 1 - 2**-40]:
        draws = [u] * rows
        got = sampling_cpu.dense_draw(x, limit, list(range(rows)), temps, min_p, row_max, draws)
        targets = torch.tensor(draws, dtype=torch.float64)[:, None] * cdf[:, -1:]
        expected = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=limit - 1)
        assert torch.equal(got, expected), u
        assert bool((probs.gather(1, got[:, None]) > 0).all())
    x[5, [40, 7, 900]] = torch.inf  # a +inf logit holds all the mass: the first one
    row_max = x[:, :limit].amax(-1, keepdim=True)
    got = sampling_cpu.dense_draw(x, limit, [5, 6], temps, min_p, row_max, [0.3] * rows)
    assert got.tolist()[0] == 7


def test_top_p_near_one_sizes_the_candidates_short_of_the_row():
    """A top_p within the mass margin of 1 still sizes the candidates from the histogram (a
    peaked row's nucleus), not the whole row."""
    from engine import sampling_cpu

    x = _logits(4, 4000, 9) * 3
    limit = 4000
    temps = torch.ones(4, 1)
    top_p = torch.full((4, 1), 0.99995)
    row_max = x.amax(-1, keepdim=True)
    histogram = sampling_cpu.mass_histogram(x, limit, row_max, temps, top_p, [0, 1, 2, 3])
    assert histogram.needed < limit // 2


@pytest.mark.parametrize("rows", [3, MIN_BLOCK_ROWS + 1])
def test_a_token_mask_limits_every_kind_of_row_as_in_the_reference(rows):
    """Constrained decoding's additive mask (-inf where a row may not go) over dense, top-p,
    top-k and greedy rows: the reference's tokens, and every token allowed."""
    settings = [
        SamplerSettings(temperature=0.9),
        SamplerSettings(top_p=0.8),
        SamplerSettings(top_k=30, min_p=0.02),
        SamplerSettings.greedy(),
        SamplerSettings(temperature=1.2, min_p=0.1),
    ]
    state = SamplerState()
    for seed in range(4):
        vocab = 3000
        logits = _logits(rows, vocab, seed)
        gen = torch.Generator().manual_seed(seed)
        mask = torch.where(torch.rand(rows, vocab, generator=gen) < 0.7, -torch.inf, 0.0)
        reference, fast = _requests(settings, rows, vocab, seed)
        expected = sample(logits, reference, vocab - 5, mask)
        got = state.sample(logits, fast, vocab - 5, mask)
        assert got.tokens == expected.tokens
        assert all(mask[i, t] == 0 for i, t in enumerate(got.tokens))
        assert [r.rng.random() for r in fast] == [r.rng.random() for r in reference]
    # (without the compiled loops the dense rows take the batch to the reference)
    assert state.fast_calls == (4 if os.environ.get(JIT_ENV, "1").strip() != "0" else 0)


@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0])
def test_compiled_draw_gives_the_torch_ops_tokens(scale):
    """engine.sampling_cpu_draw against the torch ops it stands in for (_candidate_probs and
    the inverse CDF), on the same candidates and draws: the same token in every row, over
    batches mixing top-k, top-p with and without a top-k, min-p and greedy rows, with ties
    (rounded logits) too."""
    from engine.sampling_fast import _compiled_draw, _torch_draw

    state = SamplerState()
    for seed in range(6):
        logits = _logits(64, 3000, seed, ties=seed % 2 == 1) * scale
        settings = SETTINGS if seed % 3 else [s for s in SETTINGS if s.top_k != 0]
        requests = _requests(settings, 64, 3000, seed)
        params = state.params(requests[0], logits.device)
        blocks = Blocks.of(logits, 3000)
        n, row_max = params.max_top_k + 1, blocks.row_max
        compiled = _compiled_draw(logits, 3000, n, blocks, row_max, params, requests[0])
        torch_ops = _torch_draw(logits, 3000, n, blocks, row_max, params, requests[1])
        assert compiled is not None and torch_ops is not None
        drawn = ~params.no_candidates
        assert torch.equal(compiled[0][drawn], torch_ops[0][drawn]), seed
        assert compiled[1] == torch_ops[1]  # the same draws, one per row


def test_kernels_false_keeps_sample_on_the_torch_ops(monkeypatch):
    """SamplerState(kernels=False): sample() never takes the kernels, even where they would
    run (here: made to look available); the default takes them there."""
    import engine.sampling_fast as sampling_fast

    calls = []

    def kernels(x, limit, params, requests):
        calls.append(len(requests))
        return sampling_fast._choose_with_torch(x, limit, params, requests)

    monkeypatch.setattr(sampling_fast, "_kernels_wanted", lambda x: True)
    monkeypatch.setattr(sampling_fast, "_choose_with_kernels", kernels)
    logits = _logits(MIN_BLOCK_ROWS, 500, 0)
    _check_same(logits, SETTINGS[0], state=SamplerState(kernels=False))
    assert calls == []
    _check_same(logits, SETTINGS[0], state=SamplerState())
    assert calls == [MIN_BLOCK_ROWS]
