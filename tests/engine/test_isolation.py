"""One job must never end another: faults injected into one job's sampling settings, its sample
request, its detokenizer, its stop-string matcher, and into the forward itself. The faulty job
ends with ``eos_reason`` "error" (its pages freed); the others finish exactly as they would have
alone, and the generator keeps serving. Also: values no step can take are refused at enqueue,
and cache salts keep tenants' pages apart."""

from __future__ import annotations

import asyncio

import pytest

from engine import DynamicGeneratorAsync, DynamicJob, DynamicJobAsync, SamplerSettings
from tests.engine.conftest import assert_no_pages_in_use

GREEDY = SamplerSettings.greedy()
PROMPTS = [[5 + i, 17, 42, 99, 7 + i, 3] for i in range(4)]
NEW_TOKENS = 8


def _jobs(prompts=PROMPTS, stop_conditions=(), **kwargs) -> list[DynamicJob]:
    return [
        DynamicJob(
            ids,
            NEW_TOKENS,
            identifier=i,
            gen_settings=GREEDY,
            stop_conditions=list(stop_conditions),
            **kwargs,
        )
        for i, ids in enumerate(prompts)
    ]


def _drive(generator, jobs: list[DynamicJob], before_step=None) -> dict[int, dict]:
    for job in jobs:
        generator.enqueue(job)
    finals: dict[int, dict] = {}
    steps = 0
    while generator.num_remaining_jobs():
        if before_step is not None:
            before_step(steps)
        for result in generator.iterate():
            if result["eos"]:
                finals[result["identifier"]] = result
        steps += 1
    assert_no_pages_in_use(generator)
    return finals


@pytest.fixture
def expected(tiny) -> dict[int, list[int]]:
    finals = _drive(tiny.generator(), _jobs())
    return {i: finals[i]["job"].new_token_ids for i in finals}


def _check(finals: dict[int, dict], expected: dict[int, list[int]], culprit: int) -> None:
    assert finals[culprit]["eos_reason"] == "error"
    assert isinstance(finals[culprit]["error"], Exception)
    for i, tokens in expected.items():
        if i != culprit:
            assert finals[i]["eos_reason"] == "max_new_tokens", finals[i]
            assert finals[i]["job"].new_token_ids == tokens


def test_settings_no_sampler_can_take_end_only_their_job(tiny, expected) -> None:
    """A top_k that overflows inside the sampler (set after enqueue's checks)."""
    generator, jobs = tiny.generator(), _jobs()

    def poison(step: int) -> None:
        if step == 2:
            jobs[1].gen_settings = SamplerSettings(temperature=1.0, top_k=2**63)

    _check(_drive(generator, jobs, poison), expected, culprit=1)


def test_a_failing_sample_request_ends_only_its_job(tiny, expected) -> None:
    generator, jobs = tiny.generator(), _jobs()

    def broken():
        raise RuntimeError("corrupt job state")

    def poison(step: int) -> None:
        if step == 3:
            jobs[2].sample_request = broken

    finals = _drive(generator, jobs, poison)
    _check(finals, expected, culprit=2)
    assert "corrupt job state" in str(finals[2]["error"])


@pytest.mark.parametrize("part", ["detokenizer", "stop strings"])
def test_a_failing_detokenizer_or_matcher_ends_only_its_job(tiny, expected, part: str) -> None:
    # (a stop string no text holds: the matcher only runs for jobs that have one)
    generator, jobs = tiny.generator(), _jobs(stop_conditions=["\x00never"])

    def broken(*args):
        raise UnicodeError(f"{part} broke")

    def poison(step: int) -> None:
        if step == 2 and part == "detokenizer":
            jobs[0]._detok.add = broken
        if step == 2 and part == "stop strings":
            jobs[0]._matcher.find = broken

    finals = _drive(generator, jobs, poison)
    _check(finals, expected, culprit=0)
    assert f"{part} broke" in str(finals[0]["error"])


def test_a_failing_forward_ends_its_step_and_the_generator_goes_on(tiny, expected) -> None:
    generator, jobs = tiny.generator(), _jobs()
    real = generator.runner.forward_plan
    calls = {"n": 0}

    def flaky(plan, token_patch=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(plan, token_patch)

    generator.runner.forward_plan = flaky
    finals = _drive(generator, jobs)
    assert all(f["eos_reason"] == "error" for f in finals.values())
    assert all("device lost" in str(f["error"]) for f in finals.values())
    later = _drive(generator, _jobs())  # the next jobs run as if nothing happened
    assert {i: f["job"].new_token_ids for i, f in later.items()} == expected


def test_values_no_step_can_take_are_refused_at_enqueue(tiny) -> None:
    generator = tiny.generator()
    vocab = tiny.model.config.vocab_size
    with pytest.raises(ValueError, match=f"top_k={vocab + 1} exceeds the vocabulary"):
        generator.enqueue(DynamicJob([1, 2], 4, gen_settings=SamplerSettings(top_k=vocab + 1)))
    with pytest.raises(ValueError, match="token_bias ids"):
        bias = SamplerSettings(token_bias={vocab: 1.0})
        generator.enqueue(DynamicJob([1, 2], 4, gen_settings=bias))
    assert_no_pages_in_use(generator)


def test_async_consumer_of_a_failed_job_raises_and_others_finish(tiny, expected) -> None:
    async def scenario() -> tuple[list, BaseException | None]:
        generator = DynamicGeneratorAsync(tiny.model, tiny.generator().cache, tiny.tokenizer)
        jobs = _jobs()
        jobs[3].sample_request = lambda: (_ for _ in ()).throw(RuntimeError("bad row"))

        async def consume(job: DynamicJob):
            finals = [r async for r in DynamicJobAsync(generator, job=job) if r["eos"]]
            return finals[0]["job"].new_token_ids

        outcomes = await asyncio.gather(*(consume(j) for j in jobs), return_exceptions=True)
        await generator.close()
        return outcomes, None

    outcomes, _ = asyncio.run(scenario())
    assert isinstance(outcomes[3], RuntimeError) and "bad row" in str(outcomes[3])
    assert outcomes[:3] == [expected[i] for i in range(3)]


def test_cache_salt_keeps_tenants_pages_apart(tiny) -> None:
    prompt = list(range(5, 45))  # 10 full pages of 4

    def cached(generator, salt: str | None) -> int:
        job = DynamicJob(prompt, 2, gen_settings=GREEDY, cache_salt=salt, identifier=0)
        return _drive(generator, [job])[0]["cached_tokens"]

    generator = tiny.generator()
    assert cached(generator, "alice") == 0
    assert cached(generator, "alice") > 30  # the same tenant hits its own pages
    assert cached(generator, "bob") == 0
    assert cached(generator, None) == 0
    assert cached(generator, None) > 30
