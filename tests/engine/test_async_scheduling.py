"""``async_scheduling``: a step's sampled tokens stay on the device and become the next
step's input ids there; the host reads them one step later. Every job gets the same tokens,
texts, end reasons and final results as with tokens read at once (on a CPU the path runs
serially, so these tests check its bookkeeping: placeholders, input patches, late stops,
preemption, cancellation, rows only the reference sampler can pick)."""

from __future__ import annotations

import asyncio
import math

import pytest

from engine import (
    DynamicGeneratorAsync,
    DynamicJob,
    DynamicJobAsync,
    PagedCache,
    SamplerSettings,
)
from engine.inflight import PENDING_TOKEN
from engine.model.runner import PERSISTENT_BATCH_ENV
from engine.sampling_fast import SamplerState
from tests.engine.conftest import assert_no_pages_in_use
from tests.engine.test_batch_persistent import _prompts as short_prompts
from tests.engine.test_defer_text import _free_text, _mixed_jobs, _stream, _summary
from tests.engine.test_generator import _prompts

GREEDY = SamplerSettings.greedy()
PENALISED = SamplerSettings(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)


def _same_results(tiny, make_jobs, **generator_kwargs) -> dict:
    """Stream the jobs with tokens read at once and one step later; both must agree."""
    at_once = _stream(tiny.generator(async_scheduling=False, **generator_kwargs), make_jobs())
    generator = tiny.generator(async_scheduling=True, **generator_kwargs)
    late = _stream(generator, make_jobs())
    for identifier in at_once:
        assert _summary(late[identifier]) == _summary(at_once[identifier]), identifier
    return {"results": at_once, "generator": generator}


def test_async_scheduling_gives_the_same_results(tiny):
    run = _same_results(tiny, lambda: _mixed_jobs(tiny))
    results = run["results"]
    assert results[0][-1]["eos_reason"] == "stop_string"  # found a step late: its row dropped
    assert results[1][-1]["eos_reason"] == "stop_token"
    assert run["generator"].stats()["async_steps"] > 5


def _greedy_jobs(tiny) -> list[DynamicJob]:
    prompts = _prompts(tiny.tokenizer, count=20, seed=31)
    return [
        DynamicJob(
            p,
            5 + i % 9,
            stop_conditions=[],
            gen_settings=PENALISED if i % 3 == 0 else GREEDY,
            identifier=i,
        )
        for i, p in enumerate(prompts)
    ]


def test_greedy_steps_sample_on_the_device_without_the_host_sampler(tiny):
    """All-greedy batches (penalties included, 16+ rows: the block-maxima path) never call
    the host sampler: their tokens come back as a device tensor."""
    at_once = _stream(tiny.generator(max_chunk_size=256), _greedy_jobs(tiny))
    generator = tiny.generator(async_scheduling=True, max_chunk_size=256)
    host_calls = []
    host_sample = generator._sampler.sample

    def spy(*args, **kwargs):
        host_calls.append(len(args[1]))
        return host_sample(*args, **kwargs)

    generator._sampler.sample = spy
    late = _stream(generator, _greedy_jobs(tiny))
    for identifier in at_once:
        assert _summary(late[identifier]) == _summary(at_once[identifier]), identifier
    assert generator.stats()["async_steps"] > 5
    assert host_calls == [] and generator._sampler.reference_calls == 0


def test_sampled_batches_through_the_sampling_kernels(tiny):
    """Seeded top-k / top-p jobs with penalties sampled on the kernels (the CUDA simulator
    here) without the host sampler: the host sampler's tokens, read a step later."""
    prompts = short_prompts(tiny, 3, seed=41)
    warm = SamplerSettings(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2)

    def tokens(late: bool) -> list[list[int]]:
        generator = tiny.generator(async_scheduling=late)
        if late:
            generator._sampler = SamplerState(kernels=True)
            generator._sampler.sample = None  # the host sampler must not run
        jobs = [
            DynamicJob(p, 5, stop_conditions=[], gen_settings=warm, seed=i)
            for i, p in enumerate(prompts)
        ]
        _stream(generator, jobs)
        return [job.new_token_ids for job in jobs]

    assert tokens(True) == tokens(False)


def test_results_come_one_step_later(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=22)[0]
    counts = {}
    for late in (False, True):
        generator = tiny.generator(async_scheduling=late)
        generator.enqueue(DynamicJob(ids, 3, stop_conditions=[], gen_settings=GREEDY))
        steps = []
        while generator.num_remaining_jobs():
            results = generator.iterate()
            steps.append(sum(1 for r in results if r["stage"] == "streaming"))
        counts[late] = steps
    assert counts[False] == [1, 1, 1]
    assert counts[True] == [0, 1, 1, 1]


def test_the_next_forward_takes_the_pending_token_from_the_device(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=23)[0]
    expected, _ = _free_text(tiny, ids, 6)
    generator = tiny.generator(async_scheduling=True)
    patches = []
    real = generator.runner.forward_plan

    def spy(plan, token_patch=None):
        patches.append(token_patch)
        return real(plan, token_patch)

    generator.runner.forward_plan = spy
    job = DynamicJob(ids, 6, stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    generator.iterate()  # the prefill: its token is sampled, not read
    assert job.seq.tokens[-1] == PENDING_TOKEN and job.new_token_ids == []
    generator.iterate()
    patch = patches[-1]
    assert patch is not None and patch.positions.tolist() == [0]
    assert job.new_token_ids == expected[:1]
    assert patch.values.tolist() == expected[:1]  # the input id the forward got
    while generator.num_remaining_jobs():
        generator.iterate()
    assert job.new_token_ids == expected
    assert PENDING_TOKEN not in job.seq.tokens
    assert patches[0] is None and all(p is not None for p in patches[1:])
    assert_no_pages_in_use(generator)


def test_a_late_stop_token_frees_the_pages_and_takes_nothing_past_it(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=24)[0]
    free, _ = _free_text(tiny, ids, 12)
    stop = free[3]
    generator = tiny.generator(async_scheduling=True)
    job = DynamicJob(ids, 12, stop_conditions=[stop], gen_settings=GREEDY)
    generator.enqueue(job)
    final = None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            final = result
            if result["eos"]:
                # read in the step that already ran a forward past it: its pages are back
                assert generator.stats()["pages_in_use"] == 0
    assert final["eos_reason"] == "stop_token"
    assert job.new_token_ids == free[: free.index(stop) + 1]
    assert len(job.seq.tokens) == len(ids) + len(job.new_token_ids)
    assert_no_pages_in_use(generator)


def _many_jobs(tiny) -> list[DynamicJob]:
    prompts = short_prompts(tiny, 10, seed=33)
    sampled = SamplerSettings(temperature=0.9, top_k=20, top_p=0.9)
    return [
        DynamicJob(
            p,
            6 + i % 7,
            stop_conditions=[],
            gen_settings=sampled if i % 4 == 1 else GREEDY,
            seed=i,
            identifier=i,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("persistent", ["1", "0"])
def test_preemption_with_tokens_in_flight(tiny, monkeypatch, persistent):
    """A tiny cache preempts sequences whose last token is still on the device; they resume
    with its value (both batch builders)."""
    monkeypatch.setenv(PERSISTENT_BATCH_ENV, persistent)
    run = _same_results(
        tiny, lambda: _many_jobs(tiny), max_num_tokens=16 * 4, max_chunk_size=24, page_size=4
    )
    stats = run["generator"].stats()
    assert stats["preemptions"] > 0 and stats["async_steps"] > 5


def test_cancel_reads_the_in_flight_token_first(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=25)[0]
    free, free_text = _free_text(tiny, ids, 12)
    generator = tiny.generator(async_scheduling=True)
    job = DynamicJob(ids, 16, stop_conditions=[], gen_settings=GREEDY)
    other = DynamicJob(ids, 8, stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    generator.enqueue(other)
    texts = []
    while len(job.new_token_ids) < 4:
        texts += [r.get("text", "") for r in generator.iterate() if r["job"] is job]
    assert job.seq.tokens[-1] == PENDING_TOKEN
    assert generator.cancel(job)
    assert job.new_token_ids == free[:5]  # the token in flight was read, none after it
    results = [r for r in generator.iterate() if r["job"] is job]
    texts += [r.get("text", "") for r in results]
    assert results[-1]["eos_reason"] == "cancelled"
    assert "".join(texts) == job.full_completion and free_text.startswith(job.full_completion)
    while generator.num_remaining_jobs():
        generator.iterate()
    assert other.new_token_ids == free[:8]  # the other job was not disturbed
    assert_no_pages_in_use(generator)


def _poisoned(generator, step: int, value: float):
    """Make row 0's logits at forward ``step`` hold ``value`` at id 5 (NaN) or everywhere."""
    real = generator.runner.forward_plan
    calls = {"n": 0}

    def forward(plan, token_patch=None):
        logits = real(plan, token_patch)
        calls["n"] += 1
        if calls["n"] == step:
            logits = logits.clone()
            if math.isnan(value):
                logits[0, 5] = value
            else:
                logits[0] = value
        return logits

    generator.runner.forward_plan = forward


@pytest.mark.parametrize("count", [2, 18])  # one whole-row max; block maxima
def test_rows_the_device_cannot_pick_get_the_reference_token(tiny, count):
    """A NaN logit: the reference's pick (the NaN's id), the same as tokens read at once."""
    prompts = _prompts(tiny.tokenizer, count=count, seed=26)
    tokens = {}
    for late in (False, True):
        generator = tiny.generator(async_scheduling=late)
        _poisoned(generator, 3, math.nan)
        jobs = [DynamicJob(p, 6, stop_conditions=[], gen_settings=GREEDY) for p in prompts]
        _stream(generator, jobs)
        tokens[late] = [j.new_token_ids for j in jobs]
    assert 5 in tokens[False][0]
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("temperature", [0.0, 0.8])  # the device path; the host sampler
def test_a_row_with_every_token_banned_ends_its_job_alone(tiny, temperature):
    """Greedy: the device path flags the row and the reference finds no token; sampled: the
    host sampler marks it. Only that job ends."""
    prompts = _prompts(tiny.tokenizer, count=2, seed=27)
    everything = dict.fromkeys(range(tiny.tokenizer.vocab_size), -math.inf)
    banned = SamplerSettings(temperature=temperature, token_bias=everything)
    generator = tiny.generator(async_scheduling=True)
    jobs = [
        DynamicJob(prompts[0], 6, stop_conditions=[], gen_settings=banned, identifier=0),
        DynamicJob(prompts[1], 6, stop_conditions=[], gen_settings=GREEDY, identifier=1),
    ]
    results = _stream(generator, jobs)
    assert [r["eos_reason"] for r in results[0] if r["eos"]] == ["error"]
    assert "every token is banned" in str(results[0][-1]["error"])
    assert results[1][-1]["eos_reason"] == "max_new_tokens" and len(jobs[1].new_token_ids) == 6
    assert generator.stats()["async_steps"] > 0


def test_steps_with_jobs_that_need_their_token_at_once_are_not_async(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=28)[0]
    wanting = [
        {"return_probs": True},
        {"return_logprobs": 2},
        {"return_top_tokens": 3},
        {"return_logits": True},
        {"banned_strings": ["qqqq"]},
    ]
    expected, _ = _free_text(tiny, ids, 4)
    for options in wanting:
        generator = tiny.generator(async_scheduling=True)
        job = DynamicJob(ids, 4, stop_conditions=[], gen_settings=GREEDY, **options)
        assert not job.reads_late
        _stream(generator, [job])
        assert generator.stats()["async_steps"] == 0, options
        assert job.new_token_ids == expected


def test_the_async_wrapper_streams_async_scheduled_jobs(tiny):
    prompts = _prompts(tiny.tokenizer, count=6, seed=29)
    expected = [_free_text(tiny, p, 7) for p in prompts]

    async def main():
        cache = PagedCache(tiny.model, 4096, page_size=4)
        gen = DynamicGeneratorAsync(tiny.model, cache, tiny.tokenizer, async_scheduling=True)
        try:
            jobs = [
                DynamicJobAsync(gen, p, 7, stop_conditions=[], gen_settings=GREEDY) for p in prompts
            ]

            async def collect(job):
                return [r async for r in job]

            results = await asyncio.wait_for(asyncio.gather(*map(collect, jobs)), 60)
        finally:
            await asyncio.wait_for(gen.close(), 60)
        return results

    for (tokens, text), results in zip(expected, asyncio.run(main()), strict=True):
        assert results[-1]["eos_reason"] == "max_new_tokens"
        assert "".join(r.get("text", "") for r in results) == text
        assert results[-1]["new_tokens"] == len(tokens)


@pytest.mark.parametrize("value", ["yes", 1])
def test_async_scheduling_must_be_a_bool(tiny, value):
    with pytest.raises(ValueError, match="async_scheduling"):
        tiny.generator(async_scheduling=value)


def test_async_scheduling_refuses_speculation(tiny):
    with pytest.raises(ValueError, match="speculative"):
        tiny.generator(async_scheduling=True, use_ngram_draft=True)
    assert tiny.generator(use_ngram_draft=True).async_scheduling is False


def test_default_is_off_on_the_cpu(tiny):
    assert tiny.generator().async_scheduling is False
