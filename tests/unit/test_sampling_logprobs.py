"""Probabilities the sampler returns: the model's log-probabilities (``logprobs``, raw logits,
for greedy and sampled rows alike), the sampling distribution's probabilities
(``return_probs``: what a greedy row reports), and all-banned rows (never NaN)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.sampling import BANNED_ROW, SampleRequest, SamplerSettings, sample

P = [0.10, 0.40, 0.01, 0.15, 0.03, 0.25, 0.01, 0.05]
LOGITS = [math.log(p) for p in P]


def _batch(n: int) -> torch.Tensor:
    return torch.tensor([LOGITS] * n, dtype=torch.float32)


def test_logprobs_are_the_models_whatever_the_settings() -> None:
    """Temperature, truncation, penalties and bias change the draw, not the reported logprobs."""
    settings = [
        SamplerSettings.greedy(),
        SamplerSettings(temperature=1.7, top_p=0.5),
        SamplerSettings(top_k=2, token_bias={5: 3.0}),
        SamplerSettings(temperature=0.3, repetition_penalty=1.5),
    ]
    reqs = [
        SampleRequest(s, random.Random(i), context=(1, 1, 3), logprobs=3)
        for i, s in enumerate(settings)
    ]
    out = sample(_batch(len(reqs)), reqs)
    for i in range(len(reqs)):
        assert out.logprobs[i] == pytest.approx(math.log(P[out.tokens[i]]), abs=1e-5)
        assert out.top_logprob_ids[i] == [1, 5, 3]
        assert out.top_logprobs[i] == pytest.approx([math.log(p) for p in (0.4, 0.25, 0.15)])
    assert out.tokens[0] == 1  # greedy: the chosen logprob is the model's, not 0.0 (p = 1)


def test_logprobs_only_for_rows_that_ask_and_k_zero() -> None:
    reqs = [
        SampleRequest(SamplerSettings(), random.Random(0)),
        SampleRequest(SamplerSettings(), random.Random(1), logprobs=0),
        SampleRequest(SamplerSettings(), random.Random(2), logprobs=20),  # k > vocab
    ]
    out = sample(_batch(3), reqs)
    assert out.logprobs[0] is None and out.top_logprob_ids[0] == []
    assert out.logprobs[1] == pytest.approx(math.log(P[out.tokens[1]]), abs=1e-5)
    assert out.top_logprob_ids[1] == [] and out.top_logprobs[1] == []
    assert len(out.top_logprob_ids[2]) == len(P)
    assert sum(math.exp(v) for v in out.top_logprobs[2]) == pytest.approx(1.0, abs=1e-5)
    plain = sample(_batch(1), reqs[:1])
    assert plain.logprobs is None


def test_logprobs_exclude_ids_past_the_vocabulary() -> None:
    """Padded embedding rows are not tokens: the distribution is over the first ``limit``."""
    row = [*LOGITS, 5.0, 5.0]  # two padded ids with the largest logits
    req = SampleRequest(SamplerSettings.greedy(), random.Random(0), logprobs=2)
    out = sample(torch.tensor([row]), [req], vocab_limit=len(P))
    assert out.tokens == [1]
    assert out.top_logprob_ids[0] == [1, 5]
    assert out.logprobs[0] == pytest.approx(math.log(0.4), abs=1e-5)


def test_greedy_return_probs_is_the_processed_probability() -> None:
    """The library's return_probs for greedy rows: softmax at temperature 1 after bias (not
    ExLlamaV2's 1.0), whether greedy comes from temperature 0 or from top_k=1."""
    reqs = [
        SampleRequest(SamplerSettings.greedy(), random.Random(0), return_probs=True),
        SampleRequest(SamplerSettings(top_k=1), random.Random(1), return_probs=True),
        SampleRequest(
            SamplerSettings(temperature=0.0, token_bias={1: -math.inf}),
            random.Random(2),
            return_probs=True,
        ),
    ]
    out = sample(_batch(3), reqs)
    assert out.tokens == [1, 1, 5]
    assert out.probs[0] == pytest.approx(0.40, abs=1e-6)
    assert out.probs[1] == pytest.approx(0.40, abs=1e-6)
    assert out.probs[2] == pytest.approx(0.25 / 0.6, abs=1e-6)  # renormalised without token 1


@pytest.mark.parametrize("greedy", [True, False])
def test_all_banned_row_is_marked_never_nan(greedy: bool) -> None:
    settings = SamplerSettings.greedy() if greedy else SamplerSettings(top_p=0.9)
    everything = dict.fromkeys(range(len(P)), -math.inf)
    reqs = [
        SampleRequest(
            SamplerSettings(**{**_fields(settings), "token_bias": everything}),
            random.Random(0),
            return_probs=True,
            top_k_return=2,
            logprobs=2,
        ),
        SampleRequest(settings, random.Random(1), banned_tokens=range(len(P)), return_probs=True),
        SampleRequest(settings, random.Random(2), banned_tokens=(1,), return_probs=True),
    ]
    out = sample(_batch(3), reqs)
    assert out.tokens[:2] == [BANNED_ROW, BANNED_ROW]
    assert out.probs[:2] == [0.0, 0.0]
    assert out.tokens[2] != 1 and 0 < out.probs[2] <= 1
    values = [*out.probs, *out.top_probs[0], out.logprobs[0], *out.top_logprobs[0]]
    assert not any(math.isnan(v) for v in values)


def _fields(settings: SamplerSettings) -> dict:
    return {name: getattr(settings, name) for name in SamplerSettings.__dataclass_fields__}
