"""engine.sampling_penalty_table: every job's penalty window in one table, against the dense
form (engine.sampling._apply_penalties) and a plain recount of each window."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from engine.sampling import SampleRequest, SamplerSettings, _apply_penalties
from engine.sampling_penalties import LogitEdits
from engine.sampling_penalty_table import MIN_CAPACITY, PenaltyTable


def _penalty_requests(rows: int, vocab: int, rng: random.Random) -> list[SampleRequest]:
    requests = []
    for row in range(rows):
        settings = SamplerSettings(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3]),
            frequency_penalty=rng.choice([0.0, 0.25, -0.5]),
            presence_penalty=rng.choice([0.0, 0.75]),
            penalty_range=rng.choice([0, 3, 20]),
        )
        # repeated tokens, ids outside the vocabulary
        context = [rng.randrange(-2, vocab + 3) for _ in range(rng.randrange(1, 60))]
        context += context[: rng.randrange(0, 10)]
        key = None if row % 5 == 4 else row  # some counted for one call only
        requests.append(SampleRequest(settings, random.Random(0), context=context, key=key))
    return requests


def _params(requests) -> torch.Tensor:
    return torch.tensor(
        [
            [s.repetition_penalty, s.frequency_penalty, s.presence_penalty]
            for s in (r.settings for r in requests)
        ]
    ).reshape(-1, 3)


def _window_counts(context, vocab, window) -> dict[int, int]:
    counted = {}
    for t in context[-window:] if window else context:
        if 0 <= t < vocab:
            counted[t] = counted.get(t, 0) + 1
    return counted


@pytest.mark.parametrize("seed", range(6))
def test_table_penalties_are_bit_identical_to_the_dense_form(seed):
    """Rows penalised in place through the table, step after step as their contexts grow:
    exactly the dense form's logits; restore gives back the logits it was handed."""
    rng = random.Random(seed)
    vocab = rng.choice([10, 100, 777])
    requests = _penalty_requests(12, vocab, rng)
    table = PenaltyTable()
    rows = [i for i in range(12) if i % 3]  # rows without penalties between them
    for step in range(4):
        logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(step)) * 3
        logits[0, :3] = 0.0  # zero logits: neither shrunk nor pushed
        expected = logits.clone()
        _apply_penalties(
            expected, [requests[i] if i in rows else _plain(requests[i]) for i in range(12)]
        )
        edited = logits.clone()
        edits = LogitEdits(edited.view(-1))
        chosen = [requests[i] for i in rows]
        table.penalise(edits, edited, rows, chosen, _params(chosen))
        assert torch.equal(edited, expected), step
        edits.restore()
        assert torch.equal(edited, logits), step
        for r in requests:
            r.context.extend(rng.randrange(-1, vocab + 1) for _ in range(step % 3))


def _plain(request: SampleRequest) -> SampleRequest:
    return replace(request, settings=SamplerSettings(), context=())


@pytest.mark.parametrize("window", [0, 1, 7, 40])
def test_table_windows_follow_appends_slides_rollbacks_and_growth(window):
    """Three jobs in one table (one a keyless request, counted per call): their counts after
    appends (some past the vocabulary), windows sliding (and the slot compacted), a window
    outgrowing the slot's capacity, a rollback and a changed last token."""
    # window 0: more ids than a slot first holds; 40 of 1000: many ids slide out (compacted)
    vocab = {0: 3 * MIN_CAPACITY, 40: 1000}.get(window, 30)
    rng = random.Random(window)
    settings = SamplerSettings(repetition_penalty=1.2, penalty_range=window)
    contexts = [[rng.randrange(-1, vocab + 2) for _ in range(10)] for _ in range(3)]
    requests = [
        SampleRequest(settings, random.Random(0), context=c, key=k)
        for c, k in zip(contexts, [7, 3, None], strict=True)
    ]
    table = PenaltyTable()

    def check():
        table.sync(requests, vocab)
        for request in requests[:2]:
            expected = _window_counts(request.context, vocab, window)
            assert table.counts(request.key) == expected

    check()
    for step in range(300):  # past the first capacity (window 0: ~all of 3 * 64 ids)
        for context in contexts:
            context.extend(rng.randrange(-1, vocab + 2) for _ in range(1 + step % 3))
        check()
    assert len(table) == 2
    del contexts[0][50:]  # a rollback, then different tokens
    contexts[0] += [9, 9]
    check()
    contexts[1][-1] = 1  # same length, different last token
    check()


def test_table_slots_are_reused_and_forgotten_jobs_counted_anew():
    vocab = 50
    settings = SamplerSettings(presence_penalty=0.5)
    table = PenaltyTable()
    requests = [
        SampleRequest(settings, random.Random(0), context=[k, k, 1], key=k) for k in range(20)
    ]
    table.sync(requests, vocab)
    assert len(table) == 20
    table.forget_except({3, 4})
    assert len(table) == 2
    fresh = SampleRequest(settings, random.Random(0), context=[5, 6, 6], key=40)
    keyless = SampleRequest(settings, random.Random(0), context=[8])
    for _ in range(3):  # the keyless request's slot goes back each call
        slots = table.sync([requests[3], fresh, keyless], vocab)
        assert len(set(slots.tolist())) == 3 and max(slots) < 20
    assert table.counts(40) == {5: 1, 6: 2} and table.counts(3) == {3: 2, 1: 1}
    requests[4].context[:] = [9]  # a forgotten key is not kept; a kept one recounted
    table.forget_except({4})
    table.sync([requests[3], requests[4]], vocab)
    assert table.counts(3) == {3: 2, 1: 1} and table.counts(4) == {9: 1}


def test_sampler_with_jobs_coming_and_going_matches_the_reference():
    """SamplerState over steps whose batch changes (jobs leave, new keys arrive, a key comes
    back after it was forgotten with a different context): every step's tokens are the
    reference's, and the table holds no more windows than the forgetting rule allows."""
    from engine.sampling import sample
    from engine.sampling_fast import SamplerState

    vocab = 300
    settings = SamplerSettings(top_k=10, repetition_penalty=1.3, presence_penalty=0.4)
    state = SamplerState()
    rng = random.Random(0)
    contexts: dict[int, list[int]] = {}
    live = list(range(20))
    for step in range(30):
        if step % 2 == 1:  # some leave, new ones come (and an old key returns, anew)
            back = step % 20
            contexts.pop(back, None)
            live = [k for k in live[8:] if k != back] + [1000 + 10 * step + i for i in range(8)]
            live.append(back)
        for key in live:
            contexts.setdefault(key, [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))])
        logits = torch.randn(len(live), vocab, generator=torch.Generator().manual_seed(step))
        reference = [
            SampleRequest(settings, random.Random(step * 1000 + k), contexts[k], key=k)
            for k in live
        ]
        fast = [
            SampleRequest(settings, random.Random(step * 1000 + k), contexts[k], key=k)
            for k in live
        ]
        assert state.sample(logits, fast, vocab).tokens == sample(logits, reference, vocab).tokens
        for key in live:
            contexts[key].append(rng.randrange(vocab))
        table = state._penalty_table
        assert table is not None and len(table) <= 3 * len(live) + 16
    assert len(table) < len(contexts) - 40  # (jobs long gone were forgotten)
