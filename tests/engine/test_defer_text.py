"""``defer_text``: a step's text (detokenizing, stop strings) is made while the next step's
forward runs. Every job gets the same tokens, texts, end reasons and final results as with
the text made at once; results come one ``iterate()`` later; a stop string found a step late
drops the token sampled past it and returns the job's pages."""

from __future__ import annotations

import pytest

from engine import DynamicJob, SamplerSettings
from tests.engine.conftest import assert_no_pages_in_use
from tests.engine.test_generator import _prompts

GREEDY = SamplerSettings.greedy()
FINAL_KEYS = ("eos_reason", "full_completion", "new_tokens", "eos_triggering_string")


def _free_text(tiny, ids: list[int], tokens: int = 16) -> tuple[list[int], str]:
    generator = tiny.generator()
    job = DynamicJob(ids, tokens, stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    return job.new_token_ids, job.full_completion


def _stop_string_inside(tiny, ids: list[int]) -> str:
    """Three characters the free greedy text holds after its first few tokens."""
    tokens, _ = _free_text(tiny, ids)
    pieces = [tiny.tokenizer.decode([t]) for t in tokens]
    start = len("".join(pieces[:4]))
    text = "".join(pieces)
    assert len(text) >= start + 3, text
    return text[start : start + 3]


def _mixed_jobs(tiny) -> list[DynamicJob]:
    """Stop strings (one that ends a job mid-stream), a stop token, min/max tokens, seeded
    sampling, penalties and a CFG pair, in one batch."""
    prompts = _prompts(tiny.tokenizer, count=6, seed=21)
    stop = _stop_string_inside(tiny, prompts[0])
    first_token = _free_text(tiny, prompts[1], 4)[0][1]
    warm = SamplerSettings(temperature=0.9, top_p=0.9, repetition_penalty=1.2)
    cfg = SamplerSettings(temperature=0.0, cfg_scale=1.5)
    return [
        DynamicJob(prompts[0], 16, stop_conditions=[stop], gen_settings=GREEDY, identifier=0),
        DynamicJob(
            prompts[1],
            16,
            stop_conditions=[first_token],
            min_new_tokens=1,
            gen_settings=GREEDY,
            identifier=1,
        ),
        DynamicJob(prompts[2], 7, stop_conditions=[], gen_settings=GREEDY, identifier=2),
        DynamicJob(
            prompts[3], 12, stop_conditions=["zzzz"], gen_settings=warm, seed=5, identifier=3
        ),
        DynamicJob([prompts[4], prompts[5]], 9, stop_conditions=[], gen_settings=cfg, identifier=4),
        DynamicJob(prompts[5], 1, stop_conditions=[], seed=9, identifier=5),
    ]


def _stream(generator, jobs: list[DynamicJob]) -> dict[int, list[dict]]:
    for job in jobs:
        generator.enqueue(job)
    results: dict[int, list[dict]] = {job.identifier: [] for job in jobs}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            results[result["identifier"]].append(result)
    assert_no_pages_in_use(generator)
    return results


def _summary(results: list[dict]) -> tuple:
    streamed = [r for r in results if r["stage"] == "streaming"]
    final = results[-1]
    assert final["eos"] and all(not r["eos"] for r in results[:-1])
    texts = tuple(r.get("text", "") for r in streamed)
    tokens = tuple(tuple(r["token_ids"][0].tolist()) for r in streamed if "token_ids" in r)
    return texts, tokens, tuple(final.get(k) for k in FINAL_KEYS)


def test_deferred_text_gives_the_same_results(tiny):
    inline = _stream(tiny.generator(defer_text=False), _mixed_jobs(tiny))
    deferred = _stream(tiny.generator(defer_text=True), _mixed_jobs(tiny))
    assert inline[0][-1]["eos_reason"] == "stop_string"  # the case that needs the drop
    assert inline[1][-1]["eos_reason"] == "stop_token"
    for identifier in inline:
        assert _summary(deferred[identifier]) == _summary(inline[identifier]), identifier


def test_text_comes_one_step_later(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=22)[0]
    counts = {}
    for defer in (False, True):
        generator = tiny.generator(defer_text=defer)
        generator.enqueue(DynamicJob(ids, 3, stop_conditions=[], gen_settings=GREEDY))
        steps = []
        while generator.num_remaining_jobs():
            results = generator.iterate()
            steps.append(sum(r["stage"] == "streaming" for r in results))
        counts[defer] = steps
    # the prompt's step samples the first token: at once, or with the next step
    assert counts[False] == [1, 1, 1]
    assert counts[True] == [0, 1, 1, 1]


def test_a_late_stop_string_drops_the_token_past_it(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=23)[0]
    stop = _stop_string_inside(tiny, ids)
    generator = tiny.generator(defer_text=True)
    job = DynamicJob(ids, 16, stop_conditions=[stop], gen_settings=GREEDY)
    generator.enqueue(job)
    texts, final = [], None
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            texts.append(result.get("text", ""))
            final = result
            if result["eos"]:
                # the job ended in the step that already ran its next token: nothing of it
                # is taken, and its pages are back before that step's results are read
                assert generator.stats()["pages_in_use"] == 0
    assert final["eos_reason"] == "stop_string" and stop not in "".join(texts)
    assert final["new_tokens"] == len(job.new_token_ids) == len(job.seq.tokens) - len(ids)
    assert_no_pages_in_use(generator)


def test_cancel_delivers_the_pending_text_first(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=24)[0]
    _, free = _free_text(tiny, ids, 6)
    generator = tiny.generator(defer_text=True)
    job = DynamicJob(ids, 16, stop_conditions=[], gen_settings=GREEDY)
    generator.enqueue(job)
    texts = []
    while len(job.new_token_ids) < 6:
        texts += [r.get("text", "") for r in generator.iterate()]
    assert generator.cancel(job)
    results = generator.iterate()
    texts += [r.get("text", "") for r in results]
    assert results[-1]["eos_reason"] == "cancelled"
    assert "".join(texts) == job.full_completion and free.startswith(job.full_completion)
    assert len(job.full_completion) >= len(tiny.tokenizer.decode(job.new_token_ids[:5]))
    assert_no_pages_in_use(generator)


def test_jobs_with_banned_strings_make_their_text_at_once(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=25)[0]
    job = DynamicJob(ids, 8, stop_conditions=[], gen_settings=GREEDY, banned_strings=["qqq"])
    assert not job.defers_text
    generator = tiny.generator(defer_text=True)
    generator.enqueue(job)
    first = generator.iterate()
    assert any(r["stage"] == "streaming" for r in first)


@pytest.mark.parametrize("value", ["yes", 1])
def test_defer_text_must_be_a_bool(tiny, value):
    with pytest.raises(ValueError, match="defer_text"):
        tiny.generator(defer_text=value)


def test_defer_text_refuses_speculation(tiny):
    with pytest.raises(ValueError, match="speculative"):
        tiny.generator(defer_text=True, use_ngram_draft=True)


def test_default_is_off_on_the_cpu(tiny):
    assert tiny.generator().defer_text is False
