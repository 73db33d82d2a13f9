"""Banned strings (rollback and resample) and token healing on the tiny random model."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import DynamicJob, SamplerSettings
from engine.constraints import ChoiceFilter, RegexFilter
from tests.engine.conftest import assert_no_pages_in_use

PROMPT = "The quick brown fox"
MAX_NEW = 24


def _drive(generator, job) -> list[dict]:
    """All streaming results of one job."""
    generator.enqueue(job)
    results = []
    while generator.num_remaining_jobs():
        results += [r for r in generator.iterate() if r["stage"] == "streaming"]
    return results


def _check_stream(tiny, job, results) -> None:
    """What was emitted is exactly the final output: no rolled-back token or text leaked, no
    held token lost (the reference generator's rollback bug)."""
    ids = [t for r in results if "token_ids" in r for t in r["token_ids"][0].tolist()]
    assert ids == job.new_token_ids
    text = "".join(r.get("text", "") for r in results)
    assert text == job.full_completion
    detok = tiny.tokenizer.detokenizer(job.input_ids[-8:])
    expected = "".join(detok.add(t) for t in job.new_token_ids) + detok.flush()
    assert text == expected


_REFERENCES: dict[tuple[int, int], tuple[str, tuple[int, ...]]] = {}


def _reference(tiny, seed: int) -> tuple[str, tuple[int, ...]]:
    """The unconstrained output of seed ``seed`` (computed once per model)."""
    key = (id(tiny.model), seed)
    if key not in _REFERENCES:
        job = _job(tiny, seed)
        _drive(tiny.generator(), job)
        _REFERENCES[key] = job.full_completion, tuple(job.new_token_ids)
    return _REFERENCES[key]


def _job(tiny, seed, **kwargs) -> DynamicJob:
    ids = tiny.tokenizer.encode(PROMPT)[0]
    return DynamicJob(ids, MAX_NEW, seed=seed, identifier=seed, **kwargs)


def _case_mix(text: str, rng: random.Random) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c for c in text)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 40), where=st.floats(0, 1), length=st.integers(2, 6), flip=st.randoms())
def test_banned_substring_never_appears(tiny, seed, where, length, flip):
    reference, _ = _reference(tiny, seed)
    stripped = reference.strip()
    if len(stripped) < length:
        return
    start = int(where * (len(stripped) - length))
    banned = _case_mix(stripped[start : start + length], flip)
    if not banned.strip():
        return
    job = _job(tiny, seed, banned_strings=[banned])
    generator = tiny.generator()
    results = _drive(generator, job)
    assert banned.lower() not in job.full_completion.lower()
    assert any("suppressed_tokens" in r for r in results)  # it was in the reference output
    _check_stream(tiny, job, results)
    assert_no_pages_in_use(generator)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 40), banned=st.text("qzxjkQZXJK", min_size=3, max_size=6))
def test_output_without_banned_strings_is_unchanged(tiny, seed, banned):
    reference, tokens = _reference(tiny, seed)
    if banned.lower() in reference.lower():
        return
    job = _job(tiny, seed, banned_strings=[banned, reference[:2] + "\x00"])
    results = _drive(tiny.generator(), job)
    assert (job.full_completion, tuple(job.new_token_ids)) == (reference, tokens)
    _check_stream(tiny, job, results)


def test_rollback_keeps_text_held_before_the_banned_string(tiny):
    """Text held for a partial stop string when a banned string begins after it is kept
    through the rollback, with its tokens (the reference lost held tokens here)."""
    job = DynamicJob([1, 2, 3], 50, stop_conditions=["hel!"], banned_strings=["lo wor"])
    job.bind(0, tiny.tokenizer, default_stop_tokens=())
    encode = lambda text: tiny.tokenizer.encode(text)[0].tolist()  # noqa: E731
    results = [job.receive_token(t) for t in encode("ab hel")]
    held_ids = list(job.new_token_ids)
    rolled = [job.receive_token(t) for t in encode("lo wor")]
    assert "suppressed_tokens" in rolled[-1]
    assert job.new_token_ids == held_ids  # back to where "lo" began; "hel" is kept
    assert job.rewind_to == 3 + len(held_ids)
    banned_first = encode("lo wor")[0]
    assert banned_first in job.sample_request().banned_tokens
    results += rolled + [job.receive_token(t) for t in encode("p me")]
    results.append(job.cancel_result())
    assert job.full_completion == "ab help me"
    _check_stream(tiny, job, results)


@pytest.mark.parametrize("ending", ["max_new_tokens", "stop_token"])
def test_a_banned_string_completed_by_the_final_flush_is_rolled_back(tiny, ending):
    """A job that ends with an incomplete character flushes it as U+FFFD: that text counts,
    so a banned string it completes is taken back like any other (hypothesis found the job
    emitting one: the check had only seen the text before the flush)."""
    encode = lambda text: tiny.tokenizer.encode(text)[0].tolist()  # noqa: E731
    lead_byte = encode("\u00e9")[0]  # the first of its two bytes: an incomplete character
    stop = tiny.tokenizer.eos_token_id
    length = 3 if ending == "max_new_tokens" else 50
    job = DynamicJob([1, 2, 3], length, banned_strings=["b\ufffd"], stop_conditions=[stop])
    job.bind(0, tiny.tokenizer, default_stop_tokens=())
    tokens = encode("a") + encode("b") + [lead_byte] + ([stop] if ending == "stop_token" else [])
    results = [job.receive_token(t) for t in tokens]
    assert "suppressed_tokens" in results[-1] and not results[-1]["eos"]
    assert job.new_token_ids == encode("a") and job.rewind_to == 3 + 1
    results += [job.receive_token(t) for t in encode("cd")]
    if ending == "stop_token":
        results.append(job.receive_token(stop))
    assert results[-1]["eos"] and results[-1]["eos_reason"] == ending
    assert job.full_completion == "acd"
    _check_stream(tiny, job, results)


def test_banned_strings_with_a_filter_and_min_new_tokens(tiny):
    """The filter's matcher rolls back with the job: the banned choice is never produced."""
    generator = tiny.generator()
    for seed in range(3):
        job = _job(
            tiny, seed, filters=[ChoiceFilter(["hello world", "goodbye"])], banned_strings=["HELLO"]
        )
        results = _drive(generator, job)
        assert job.full_completion == "goodbye"
        _check_stream(tiny, job, results)
    for seed in range(3):
        job = _job(
            tiny,
            seed,
            filters=[RegexFilter("[a-z ]+")],
            banned_strings=["the", "a"],
            min_new_tokens=10,
        )
        results = _drive(generator, job)
        assert len(job.new_token_ids) >= 10
        assert "the" not in job.full_completion.lower() and "a" not in job.full_completion
        assert re.fullmatch("[a-z ]+", job.full_completion)
    assert_no_pages_in_use(generator)


def test_a_grammar_that_forces_a_banned_string_ends_the_job(tiny):
    """ "hello" is emitted before " world" can be seen; once every way to write "world" is
    banned the job ends with an error instead of looping."""
    generator = tiny.generator()
    job = _job(tiny, 0, filters=[ChoiceFilter(["hello world"])], banned_strings=["world"])
    results = _drive(generator, job)
    assert results[-1]["eos_reason"] == "error" and "banned" in str(results[-1]["error"])
    assert "world" not in job.full_completion
    assert_no_pages_in_use(generator)


# -- token healing -----------------------------------------------------------------------------


@pytest.mark.parametrize("healing", [True, False])
def test_token_healing_completes_a_word_cut_in_the_prompt(tiny, healing):
    """ "Hello, wor" ends in the token " wor"; the model prefers " world" (a bias stands in for
    a trained model). With healing the prompt's " wor" is re-generated as " world" and the
    text continues with "ld"; without it, " world" follows " wor"."""
    world = tiny.tokenizer.token_to_id("Ġworld")
    settings_ = SamplerSettings(temperature=0.0, token_bias={world: 100.0})
    ids = tiny.tokenizer.encode("Hello, wor")[0]
    job = DynamicJob(ids, 1, gen_settings=settings_, token_healing=healing)
    generator = tiny.generator()
    results = _drive(generator, job)
    assert job.new_token_ids == [world]
    if healing:
        assert job.input_ids == ids[:-1].tolist()
        assert job.full_completion == "ld"
        assert "Hello, wor" + job.full_completion == "Hello, world"
    else:
        assert job.full_completion == " world"
    assert "".join(r.get("text", "") for r in results) == job.full_completion


def test_token_healing_restricts_the_first_token_only(tiny):
    ids = tiny.tokenizer.encode("Hello, wor")[0]
    generator = tiny.generator()
    for seed in range(6):
        job = DynamicJob(ids, 6, seed=seed, token_healing=True)
        _drive(generator, job)
        first = tiny.tokenizer.decode([job.new_token_ids[0]])
        assert first.startswith(" wor")
        # the completion continues the prompt: no repeated " wor"
        detok = tiny.tokenizer.detokenizer(job.input_ids[-8:])
        full = "".join(detok.add(t) for t in job.new_token_ids) + detok.flush()
        assert full == " wor" + job.full_completion
    assert_no_pages_in_use(generator)
