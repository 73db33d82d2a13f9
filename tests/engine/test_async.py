"""DynamicGeneratorAsync: a step thread off the event loop, cancellation, failures, close.

Every wait is bounded: a hung step thread fails the test with what it was waiting for, and
no test relies on a fixed sleep for its timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from engine import DynamicGeneratorAsync, DynamicJob, DynamicJobAsync, PagedCache, SamplerSettings
from tests.engine.test_generator import GREEDY, _prompts, _run


def _async_generator(tiny, **kwargs) -> DynamicGeneratorAsync:
    cache = PagedCache(tiny.model, kwargs.pop("max_num_tokens", 4096), page_size=4)
    return DynamicGeneratorAsync(tiny.model, cache, tiny.tokenizer, **kwargs)


DEADLINE_S = 60.0  # far above any healthy run on a slow CI machine


async def _within(awaitable: Awaitable, what: str, timeout: float = DEADLINE_S):
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}", pytrace=False)


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = DEADLINE_S):
    """Poll ``check`` until it is true; fail the test once ``timeout`` has passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}", pytrace=False)
        await asyncio.sleep(0.005)


async def _stats(gen: DynamicGeneratorAsync) -> dict[str, int]:
    """A consistent read, made by the step thread between two steps."""
    return await _within(gen.call(lambda g: g.stats()), "a stats read")


async def _collect(job: DynamicJobAsync) -> list[dict]:
    async def results() -> list[dict]:
        return [r async for r in job]

    return await _within(results(), f"the results of job {job.job.identifier!r}")


async def _close(gen: DynamicGeneratorAsync) -> None:
    await _within(gen.close(), "the step thread to stop")


def test_64_concurrent_async_jobs_match_sync(tiny):
    prompts = _prompts(tiny.tokenizer, count=64, seed=20)
    sync = [r["job"].new_token_ids for r in _run(tiny.generator(max_chunk_size=64), prompts, 8)]

    async def main():
        gen = _async_generator(tiny, max_chunk_size=64)

        async def one(ids):
            job = DynamicJobAsync(gen, ids, 8, gen_settings=GREEDY, stop_conditions=[])
            results = await _collect(job)
            assert results[-1]["eos"] and results[-1]["eos_reason"] == "max_new_tokens"
            text = "".join(r.get("text", "") for r in results)
            assert text == results[-1]["full_completion"]
            return job.job.new_token_ids

        # jobs are created from many tasks at once
        out = await asyncio.gather(*(one(ids) for ids in prompts))
        assert (await _stats(gen))["pages_in_use"] == 0
        await _close(gen)
        return out

    assert asyncio.run(main()) == sync


def test_iterate_runs_off_the_event_loop(tiny):
    async def main():
        gen = _async_generator(tiny)
        loop_thread = threading.get_ident()
        seen = []
        original = gen.generator.iterate

        def spy():
            seen.append(threading.get_ident())
            return original()

        gen.generator.iterate = spy
        await _collect(DynamicJobAsync(gen, [5, 6, 7], 4, stop_conditions=[]))
        await _close(gen)
        assert seen and loop_thread not in seen

    asyncio.run(main())


def test_cancel_from_another_task_wakes_the_consumer(tiny):
    async def main():
        gen = _async_generator(tiny)
        job = DynamicJobAsync(gen, [5, 6, 7, 8], 480, stop_conditions=[])
        consumer = asyncio.create_task(_collect(job))

        async def running() -> bool:
            return (await _stats(gen))["jobs_running"] == 1

        await _until(running, "the job to start running")
        await _within(job.cancel(), "the cancellation")
        assert (await _stats(gen))["pages_in_use"] == 0  # freed by the time cancel returns
        results = await consumer
        assert results[-1]["eos_reason"] == "cancelled"
        assert len(job.job.new_token_ids) < 480  # cancelled mid-generation, not finished
        await _within(job.cancel(), "a second cancellation")  # harmless on a finished job
        await _close(gen)

    asyncio.run(main())


def test_engine_error_fails_running_jobs_and_keeps_serving(tiny):
    async def main():
        gen = _async_generator(tiny)
        runner = gen.generator.runner
        original = runner.forward_plan
        calls = {"n": 0}

        def flaky(plan, token_patch=None):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return original(plan, token_patch)

        runner.forward_plan = flaky  # the step thread waits: no job yet
        try:
            doomed = DynamicJobAsync(gen, [5, 6, 7, 8, 9], 50, stop_conditions=[])
            with pytest.raises(RuntimeError, match="boom"):
                await _collect(doomed)
            assert (await _stats(gen))["pages_in_use"] == 0
            healthy = DynamicJobAsync(gen, [5, 6, 7], 4, stop_conditions=[])
            results = await _collect(healthy)
            assert results[-1]["eos_reason"] == "max_new_tokens"
        finally:
            runner.forward_plan = original
            await _close(gen)

    asyncio.run(main())


def test_invalid_job_raises_in_the_caller(tiny):
    async def main():
        gen = _async_generator(tiny, max_num_tokens=64)
        with pytest.raises(ValueError, match="exceeds max_seq_len"):
            DynamicJobAsync(gen, [1] * 60, 10)
        with pytest.raises(ValueError, match="max_new_tokens"):
            DynamicJobAsync(gen, [1], -3)
        ok = await _collect(DynamicJobAsync(gen, [1, 2], 2, stop_conditions=[]))
        assert ok[-1]["eos"]
        await _close(gen)

    asyncio.run(main())


def test_close_cancels_everything(tiny):
    async def main():
        gen = _async_generator(tiny)
        jobs = [DynamicJobAsync(gen, [5, 6, i], 480, stop_conditions=[]) for i in range(3)]
        consumers = [asyncio.create_task(_collect(j)) for j in jobs]

        async def all_running() -> bool:
            return (await _stats(gen))["jobs_running"] == len(jobs)

        await _until(all_running, "all jobs to start running")
        await _close(gen)
        for consumer in consumers:
            results = await consumer
            assert results[-1]["eos_reason"] == "cancelled"
        assert gen.stats()["pages_in_use"] == 0  # the step thread has stopped: a stable read
        with pytest.raises(RuntimeError, match="closed"):
            DynamicJobAsync(gen, [1, 2], 2)

    asyncio.run(main())


def test_shared_settings_object_is_not_shared_state(tiny):
    settings = SamplerSettings(temperature=0.7, token_bias={5: 1.0})
    a, b = DynamicJob([1], 2, gen_settings=settings), DynamicJob([1], 2, gen_settings=settings)
    a.gen_settings.token_bias[6] = 2.0
    assert b.gen_settings.token_bias == {5: 1.0} and settings.token_bias == {5: 1.0}


def test_published_views_are_read_without_waiting_for_a_step(tiny):
    """A view the step thread publishes is readable while a long step runs (a poller with a
    deadline, like the router's stats, never waits for the forward), and refreshes when idle."""

    async def main():
        gen = _async_generator(tiny)
        real = gen.generator.runner.forward_plan
        in_step, release = threading.Event(), threading.Event()

        def slow_forward(plan, token_patch=None):
            in_step.set()
            release.wait(DEADLINE_S)
            return real(plan, token_patch)

        gen.publish("pages", lambda g: g.stats()["pages_in_use"], period_s=0.01)
        await _until(lambda: _ready(gen.published("pages") == 0), "the first view")
        gen.generator.runner.forward_plan = slow_forward
        job = DynamicJobAsync(gen, [5, 6, 7, 8, 9], 4, gen_settings=GREEDY, stop_conditions=[])
        await _within(asyncio.to_thread(in_step.wait, DEADLINE_S), "the slow step to start")
        assert gen.published("pages") == 0  # answered at once, mid-step
        release.set()
        gen.generator.runner.forward_plan = real
        await _collect(job)
        await _until(lambda: _ready(gen.published("pages") == 0), "a refresh while idle")
        assert gen.published("missing") is None
        await _close(gen)

    asyncio.run(main())


async def _ready(value: bool) -> bool:
    return value
