"""Classifier-free guidance on a tiny random model: a [positive, negative] job against plain
jobs and a two-forward reference; the pair through batching, preemption and cancel."""

from __future__ import annotations

import math

import pytest
import torch

from engine import DynamicJob, GenerationRequest, SamplerSettings
from tests.engine.conftest import assert_no_pages_in_use

PAGE = 4
POSITIVE = "the quick red fox jumps over the slow river stone"
NEGATIVE = "blue window at night"


def _ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text)[0].tolist()


def _settings(cfg_scale=None, **kwargs) -> SamplerSettings:
    kwargs.setdefault("temperature", 0.0)
    return SamplerSettings(cfg_scale=cfg_scale, **kwargs)


def _run(generator, jobs: list[DynamicJob], on_step=None) -> list[DynamicJob]:
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
        if on_step is not None:
            on_step(generator)
    assert_no_pages_in_use(generator)
    return jobs


def _job(ids, settings, n=8, **kwargs) -> DynamicJob:
    return DynamicJob(ids, n, stop_conditions=[], gen_settings=settings, **kwargs)


def _pair(tiny):
    return [_ids(tiny, POSITIVE), _ids(tiny, NEGATIVE)]


@pytest.mark.parametrize("sampled", [False, True])
def test_scale_one_is_the_positive_prompt_and_zero_the_negative(tiny, sampled):
    extra = {"temperature": 0.8, "top_p": 0.9} if sampled else {}
    pos, neg = _pair(tiny)
    for scale, plain_ids in ((1.0, pos), (0.0, neg)):
        generator = tiny.generator(page_size=PAGE)
        guided, plain = _run(
            generator,
            [
                _job([pos, neg], _settings(scale, **extra), seed=7),
                _job(plain_ids, _settings(**extra), seed=7),
            ],
        )
        assert guided.new_token_ids == plain.new_token_ids, scale


def _reference(tiny, pos, neg, scale: float, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy guided tokens from two plain full forwards per step; and the first guided row."""
    tokens: list[int] = []
    first = None
    for _ in range(steps):
        l0 = tiny.model.logits(pos + tokens)[-1]
        l1 = tiny.model.logits(neg + tokens)[-1]
        guided = scale * torch.log_softmax(l0, -1) + (1 - scale) * torch.log_softmax(l1, -1)
        first = guided if first is None else first
        tokens.append(int(guided[: tiny.tokenizer.vocab_size].argmax()))
    return tokens, first


@pytest.mark.parametrize("scale", [0.5, 1.5, 3.0])
def test_guided_tokens_match_two_plain_forwards(tiny, scale):
    pos, neg = _pair(tiny)
    want, first = _reference(tiny, pos, neg, scale, steps=6)
    generator = tiny.generator(page_size=PAGE, max_chunk_size=8)  # chunked prefills
    job = _job([pos, neg], _settings(scale), n=6, return_logits=True)
    logits = []
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        logits += [r["logits"] for r in generator.iterate() if "logits" in r]
    assert job.new_token_ids == want
    assert torch.allclose(logits[0].reshape(-1), first, atol=1e-4, rtol=1e-4)
    assert_no_pages_in_use(generator)


def test_penalties_look_at_the_positive_row(tiny):
    """With a repetition penalty the guided job equals a plain one at scale 1: the penalty
    counted the positive prompt's tokens, not the negative's."""
    pos, neg = _pair(tiny)
    settings = {"repetition_penalty": 1.8, "penalty_range": 0}
    guided, plain = _run(
        tiny.generator(page_size=PAGE),
        [_job([pos, neg], _settings(1.0, **settings)), _job(pos, _settings(**settings))],
    )
    assert guided.new_token_ids == plain.new_token_ids


def test_pairs_count_two_against_max_batch_size_and_survive_preemption(tiny):
    pos, neg = _pair(tiny)
    prompts = [
        ([pos, neg], 1.5),
        ([neg, pos[:7]], 2.0),
        (_ids(tiny, "a plain job among pairs"), None),
        ([pos[:9], neg[:3]], 0.3),
    ]

    def jobs():
        return [_job(ids, _settings(scale), n=10) for ids, scale in prompts]

    largest = []
    roomy = _run(tiny.generator(page_size=PAGE, max_batch_size=16), jobs())
    narrow = tiny.generator(page_size=PAGE, max_batch_size=3)
    few = _run(narrow, jobs(), on_step=lambda g: largest.append(len(g.scheduler.running)))
    assert max(largest) == 3  # a pair and a plain job, never two pairs at once
    assert [j.new_token_ids for j in few] == [j.new_token_ids for j in roomy]
    small = tiny.generator(max_num_tokens=16 * PAGE, page_size=PAGE, max_batch_size=6)
    tight = _run(small, jobs())
    assert small.stats()["preemptions"] > 0
    assert [j.new_token_ids for j in tight] == [j.new_token_ids for j in roomy]


def test_cancel_frees_both_rows(tiny):
    pos, neg = _pair(tiny)
    generator = tiny.generator(page_size=PAGE)
    job = _job([pos, neg], _settings(2.0), n=50)
    generator.enqueue(job)
    for _ in range(3):
        generator.iterate()
    assert generator.stats()["pages_in_use"] > -(-len(pos) // PAGE)  # both rows hold pages
    assert generator.cancel(job)
    finals = [r for r in generator.iterate() if r["eos"]]
    assert [r["eos_reason"] for r in finals] == ["cancelled"]
    assert_no_pages_in_use(generator)


def test_validation(tiny):
    pos, neg = _pair(tiny)
    with pytest.raises(ValueError, match=r"needs gen_settings\.cfg_scale"):
        _job([pos, neg], _settings())
    with pytest.raises(ValueError, match="needs input_ids=\\[positive, negative\\]"):
        _job(pos, _settings(1.5))
    with pytest.raises(ValueError, match="must be \\[positive, negative\\]"):
        _job([pos, neg, pos], _settings(1.5))
    with pytest.raises(ValueError, match="cfg_scale"):
        SamplerSettings(cfg_scale=math.nan)
    with pytest.raises(ValueError, match="go together"):
        GenerationRequest(tuple(pos), 4, settings=_settings(1.5))
    with pytest.raises(ValueError, match="go together"):
        GenerationRequest(tuple(pos), 4, settings=_settings(), negative_prompt_ids=tuple(neg))
    with pytest.raises(ValueError, match="negative_prompt_ids is empty"):
        GenerationRequest(tuple(pos), 4, settings=_settings(1.5), negative_prompt_ids=())
    with pytest.raises(ValueError, match="max_batch_size is 1"):
        tiny.generator(page_size=PAGE, max_batch_size=1).enqueue(_job([pos, neg], _settings(1)))
    generator = tiny.generator(page_size=PAGE, max_seq_len=len(pos) + 4)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        generator.enqueue(_job([neg, pos], _settings(1.5), n=6))  # the negative is too long
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generator.enqueue(_job([neg, [10**7]], _settings(1.5), n=2))
    with pytest.raises(ValueError, match="two rows need"):
        small = tiny.generator(max_num_tokens=12 * PAGE, page_size=PAGE)
        small.enqueue(_job([pos, neg], _settings(1.5), n=12))  # each row fits, both do not
    assert_no_pages_in_use(generator)


def test_a_request_with_a_negative_prompt_is_a_cfg_job_per_choice(tiny):
    """``GenerationRequest.negative_prompt_ids`` (the HTTP ``negative_prompt``): each choice is
    a [positive, negative] job, token for token the library's own pair."""
    pos, neg = _pair(tiny)
    request = GenerationRequest(
        tuple(pos),
        6,
        settings=_settings(2.0),
        n=2,
        seed=1,
        stop_on_eos=False,
        negative_prompt_ids=tuple(neg),
    )
    jobs = [DynamicJob.from_request(request, i) for i in range(2)]
    assert all(j.input_ids == pos and j.cfg_input_ids == neg for j in jobs)
    generator = tiny.generator(page_size=PAGE)
    library = _job([pos, neg], _settings(2.0), n=6, seed=1)
    _run(generator, [*jobs, library])
    assert jobs[0].new_token_ids == jobs[1].new_token_ids == library.new_token_ids
