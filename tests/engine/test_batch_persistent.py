"""Generation with the persistent batch (the default) is token for token the generation with
the reference builder (``ENGINE_PERSISTENT_BATCH=0``): chunked prefills, prefix hits,
preemption in a tiny cache, cancellation, CFG pairs, n-gram speculation and seeded sampling."""

from __future__ import annotations

import random

import pytest

from engine import DynamicJob, SamplerSettings
from engine.model.runner import PERSISTENT_BATCH_ENV
from tests.engine.conftest import assert_no_pages_in_use, random_text

GREEDY = SamplerSettings.greedy()
SAMPLED = SamplerSettings(temperature=0.9, top_p=0.9)


def _prompts(tiny, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = random_text(rng, 12)  # prefix hits across jobs
    texts = [(shared + " " if i % 2 else "") + random_text(rng, 2 + i % 9) for i in range(count)]
    return [tiny.tokenizer.encode(t)[0].tolist() for t in texts]


def _jobs(tiny, scenario: str) -> list[DynamicJob]:
    prompts = _prompts(tiny, 10, seed=3)
    settings = SAMPLED if scenario == "sampled" else GREEDY
    jobs = [
        DynamicJob(p, 6 + i % 7, stop_conditions=[], gen_settings=settings, seed=i, identifier=i)
        for i, p in enumerate(prompts)
    ]
    if scenario == "cfg":
        cfg = SamplerSettings(temperature=0.0, cfg_scale=1.5)
        jobs += [
            DynamicJob([p, q], 9, stop_conditions=[], gen_settings=cfg, identifier=100 + i)
            for i, (p, q) in enumerate(zip(prompts[:3], prompts[5:8], strict=True))
        ]
    return jobs


GENERATORS = {
    "preempting": {"max_num_tokens": 16 * 4, "max_chunk_size": 24},
    "cfg": {"max_chunk_size": 16},
    "speculative": {"use_ngram_draft": True, "max_chunk_size": 48},
    "sampled": {"max_chunk_size": 32},
}


def _generate(tiny, monkeypatch, scenario: str, persistent: bool) -> tuple[list, dict]:
    monkeypatch.setenv(PERSISTENT_BATCH_ENV, "1" if persistent else "0")
    generator = tiny.generator(page_size=4, **GENERATORS[scenario])
    assert (generator.runner.persistent_batch is not None) == persistent
    jobs = _jobs(tiny, scenario)
    for job in jobs:
        generator.enqueue(job)
    steps = 0
    while generator.num_remaining_jobs():
        generator.iterate()
        steps += 1
        if steps == 5:  # a cancellation mid-run frees a row for the others
            generator.cancel(jobs[1])
    assert_no_pages_in_use(generator)
    if persistent:
        assert generator.runner.persistent_batch.table_entries_written > 0
    return [job.new_token_ids for job in jobs], generator.stats()


@pytest.mark.parametrize("scenario", list(GENERATORS))
def test_persistent_batch_generates_the_reference_tokens(tiny, monkeypatch, scenario):
    reference, ref_stats = _generate(tiny, monkeypatch, scenario, persistent=False)
    persistent, stats = _generate(tiny, monkeypatch, scenario, persistent=True)
    assert persistent == reference
    assert sum(map(len, persistent)) > 40
    if scenario == "preempting":
        assert stats["preemptions"] == ref_stats["preemptions"] > 0
