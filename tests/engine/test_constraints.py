"""Constrained decoding on the tiny random model (a real byte-level BPE vocabulary): JSON
Schema, regex, choice and Lark filters; EOS preference, errors, background evaluation,
preemption and prefix caching."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from engine import DynamicJob, GenerationRequest, SamplerSettings
from engine.constraints import (
    ChoiceFilter,
    ConstraintSpec,
    GrammarFilter,
    JSONObjectFilter,
    JSONSchemaFilter,
    RegexFilter,
)
from engine.constraints.matcher import FilterError
from tests.engine.conftest import assert_no_pages_in_use

PROMPT = "The quick brown fox"


def _run(generator, jobs) -> dict:
    """Drive ``jobs`` to the end; their final results by identifier."""
    for job in jobs:
        generator.enqueue(job)
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    return finals


def _job(tiny, filters, i=0, max_new_tokens=96, **kwargs) -> DynamicJob:
    ids = tiny.tokenizer.encode(PROMPT)[0]
    return DynamicJob(ids, max_new_tokens, filters=filters, seed=i, identifier=i, **kwargs)


# -- random JSON Schemas -----------------------------------------------------------------------


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A bounded schema: every string, array and object is short, so a random model ends."""
    kinds = ["string", "integer", "number", "enum", "boolean", "pattern"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,5}$", r"^\d{3}-\d{2}$"])}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -1.5, "maximum": rng.choice([2.25, 100, 1e4])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 3, None, True, "a b"], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {
            "type": "array",
            "items": _random_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    return _random_object(rng, depth)


def _random_object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "tags", "point", "ok", "size", "kind"], rng.randint(1, 4))
    properties = {n: _random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def test_twenty_random_json_schemas_validate(tiny):
    rng = random.Random(1234)
    schemas = [_random_object(rng, 0) for _ in range(20)]
    generator = tiny.generator()
    jobs = [_job(tiny, [JSONSchemaFilter(s)], i, max_new_tokens=160) for i, s in enumerate(schemas)]
    finals = _run(generator, jobs)
    for i, schema in enumerate(schemas):
        r = finals[i]
        assert r["eos_reason"] in ("end_filter", "stop_token"), (schema, r["full_completion"])
        jsonschema.validate(json.loads(r["full_completion"]), schema)
    assert generator.mask_engine().timings.rows > 0
    assert_no_pages_in_use(generator)


def test_json_object_mode(tiny):
    finals = _run(tiny.generator(), [_job(tiny, [JSONObjectFilter()], i) for i in range(3)])
    for r in finals.values():
        if r["eos_reason"] != "max_new_tokens":  # a free-form object may run long
            assert isinstance(json.loads(r["full_completion"]), dict)


# -- regex, choice, Lark ----------------------------------------------------------------------

LARK = r"""
start: "(" sum ")"
sum: NUM ("+" NUM)*
NUM: /[0-9]{1,3}/
"""
LARK_LANGUAGE = re.compile(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)")


@pytest.mark.parametrize(
    ("make", "check"),
    [
        (lambda: RegexFilter(r"[0-9]{3}-[a-z]{2,4}"), re.compile(r"[0-9]{3}-[a-z]{2,4}").fullmatch),
        (lambda: ChoiceFilter(["yes", "no", "maybe so"]), {"yes", "no", "maybe so"}.__contains__),
        (lambda: GrammarFilter(LARK), LARK_LANGUAGE.fullmatch),
    ],
    ids=["regex", "choice", "lark"],
)
def test_regex_choice_and_grammar(tiny, make, check):
    finals = _run(tiny.generator(), [_job(tiny, [make()], i) for i in range(6)])
    for r in finals.values():
        assert r["eos_reason"] in ("end_filter", "stop_token"), r["full_completion"]
        assert check(r["full_completion"]), r["full_completion"]


def test_unconstrained_rows_are_unaffected(tiny):
    """A job without filters samples the same tokens whether or not it shares its steps with
    constrained jobs."""
    alone = _run(tiny.generator(), [_job(tiny, None, 7, max_new_tokens=12)])
    mixed = _run(
        tiny.generator(),
        [_job(tiny, None, 7, max_new_tokens=12)]
        + [_job(tiny, [RegexFilter("[a-z ]+")], i) for i in range(3)],
    )
    assert mixed[7]["job"].new_token_ids == alone[7]["job"].new_token_ids


class _FailingMasks:
    def result(self):
        raise RuntimeError("grammar engine down")


def test_failed_masks_end_only_the_constrained_jobs(tiny):
    """When a step's masks fail, its constrained jobs end with an error and the others sample
    the tokens they would have sampled anyway; every page goes back."""
    alone = _run(tiny.generator(), [_job(tiny, None, 7, max_new_tokens=12)])
    generator = tiny.generator()
    jobs = [_job(tiny, None, 7, max_new_tokens=12), _job(tiny, [RegexFilter("[a-z ]+")], 1)]
    for job in jobs:
        generator.enqueue(job)
    generator._masks.launch = lambda sources: _FailingMasks()
    finals = _run(generator, [])
    assert finals[1]["eos_reason"] == "error" and "grammar engine down" in str(finals[1]["error"])
    assert finals[7]["job"].new_token_ids == alone[7]["job"].new_token_ids
    assert_no_pages_in_use(generator)


def test_several_filters_must_all_match(tiny):
    filters = [RegexFilter("[a-z]{1,8}"), RegexFilter("(ab|cd|e)+")]
    finals = _run(tiny.generator(), [_job(tiny, filters, i) for i in range(4)])
    for r in finals.values():
        text = r["full_completion"]
        assert re.fullmatch("[a-z]{1,8}", text) and re.fullmatch("(ab|cd|e)+", text), text


# -- EOS, min_new_tokens, errors --------------------------------------------------------------


def test_prefer_eos_stops_as_soon_as_allowed(tiny):
    eos = tiny.tokenizer.eos_token_id
    jobs = [_job(tiny, [RegexFilter("[a-z]+")], i, filter_prefer_eos=True) for i in range(3)]
    for r in _run(tiny.generator(), jobs).values():
        assert r["eos_reason"] == "stop_token" and r["eos_triggering_token_id"] == eos
        assert r["new_tokens"] == 2 and re.fullmatch("[a-z]+", r["full_completion"])


def test_min_new_tokens_with_a_filter(tiny):
    """EOS is banned (and not preferred) until min_new_tokens; a grammar that is complete and
    allows nothing more ends the job anyway (end_filter)."""
    open_ended = [
        _job(tiny, [RegexFilter("[a-z]+")], i, min_new_tokens=6, filter_prefer_eos=True)
        for i in range(3)
    ]
    for r in _run(tiny.generator(), open_ended).values():
        assert r["new_tokens"] >= 7 and r["eos_reason"] == "stop_token"
        assert re.fullmatch("[a-z]+", r["full_completion"])
    closed = [_job(tiny, [ChoiceFilter(["yes", "no"])], i, min_new_tokens=8) for i in range(2)]
    for r in _run(tiny.generator(), closed).values():
        assert r["eos_reason"] == "end_filter" and r["full_completion"] in ("yes", "no")


def test_filter_error_ends_only_its_job(tiny):
    generator = tiny.generator()
    jobs = [_job(tiny, [RegexFilter("[a-z]+")], i, max_new_tokens=8) for i in range(3)]
    for job in jobs:
        generator.enqueue(job)
    generator.iterate()  # started + prefill + first token
    broken = jobs[1]

    def refuse(token):
        raise FilterError(f"token {token} refused")

    broken.constraint.consume = refuse
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    assert finals[1]["eos_reason"] == "error" and isinstance(finals[1]["error"], FilterError)
    for i in (0, 2):
        assert finals[i]["eos_reason"] in ("max_new_tokens", "stop_token", "end_filter")
    assert_no_pages_in_use(generator)


def test_invalid_grammar_is_refused_at_enqueue(tiny):
    generator = tiny.generator()
    with pytest.raises(ValueError, match="regex"):
        generator.enqueue(_job(tiny, [RegexFilter("[a-z")]))
    with pytest.raises(ValueError, match="lark"):
        generator.enqueue(_job(tiny, [GrammarFilter("start: undefined_rule")]))
    assert generator.num_remaining_jobs() == 0


def test_job_options_are_checked(tiny):
    with pytest.raises(ValueError, match="needs filters"):
        _job(tiny, None, filter_prefer_eos=True)
    with pytest.raises(ValueError, match="token_healing"):
        _job(tiny, [RegexFilter("a")], token_healing=True)
    with pytest.raises(ValueError, match="Filter"):
        _job(tiny, ["[a-z]"])


# -- background evaluation, preemption, prefix cache ------------------------------------------


# a schema a random model finishes in a few dozen tokens (other test files use it too)
WORD_AND_NUMBER_SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["word", "n"],
    "additionalProperties": False,
}


def _schema_jobs(tiny, count=6, seed=0):
    schema = WORD_AND_NUMBER_SCHEMA
    return [_job(tiny, [JSONSchemaFilter(schema)], seed + i, 48) for i in range(count)]


def _completions(finals) -> dict:
    return {k: (r["full_completion"], r["job"].new_token_ids) for k, r in finals.items()}


def test_background_evaluation_changes_nothing(tiny):
    on = _run(tiny.generator(filter_background_eval=True), _schema_jobs(tiny))
    off_generator = tiny.generator(filter_background_eval=False)
    off = _run(off_generator, _schema_jobs(tiny))
    assert _completions(on) == _completions(off)
    assert off_generator.mask_engine().timings.wait_s == 0.0  # nothing ran in the background


def test_filters_survive_preemption(tiny):
    reference = _run(tiny.generator(), _schema_jobs(tiny))
    small = tiny.generator(max_num_tokens=64, page_size=4, max_chunk_size=64)
    preempted = _run(small, _schema_jobs(tiny))
    assert small.stats()["preemptions"] > 0
    assert _completions(preempted) == _completions(reference)
    assert_no_pages_in_use(small)


def test_filters_with_the_prefix_cache(tiny):
    generator = tiny.generator()
    first = _run(generator, _schema_jobs(tiny, count=2))
    again = _run(generator, _schema_jobs(tiny, count=2))
    assert all(r["cached_tokens"] > 0 for r in again.values())
    assert _completions(again) == _completions(first)


# -- the request contract and the matcher API -------------------------------------------------


def test_from_request_builds_the_filter(tiny):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    request = GenerationRequest(
        prompt_ids=tuple(tiny.tokenizer.encode(PROMPT)[0].tolist()),
        max_new_tokens=32,
        settings=SamplerSettings(),
        seed=3,
        constraint=ConstraintSpec.json_schema(schema),
    )
    job = DynamicJob.from_request(request)
    assert isinstance(job.filters[0], JSONSchemaFilter)
    (r,) = _run(tiny.generator(), [job]).values()
    jsonschema.validate(json.loads(r["full_completion"]), schema)


def test_try_consume_and_rollback_for_drafts(tiny):
    """The speculative-decoding API: a draft is consumed up to its first refused token, and
    rolled back to any point, after which the matcher goes on as if it never saw the rest."""
    engine = tiny.generator().mask_engine()
    constraint = engine.constraint([RegexFilter("[0-9]{3}-[a-z]{2}")], prefer_eos=False)
    encode = engine.tokenizer.tokenize_str
    good, bad = encode("123-"), encode("ab!")
    accepted = constraint.try_consume(good + bad)
    assert len(good) <= accepted < len(good + bad) and constraint.error is None
    constraint.rollback(accepted - len(good))
    assert constraint.num_consumed == len(good)
    for token in encode("xy"):
        constraint.consume(token)
    assert constraint.is_accepting() and constraint.error is None
    constraint.rollback(constraint.num_consumed)
    with pytest.raises(FilterError):
        constraint.consume(encode("x")[0])


def test_no_mask_row_is_ever_empty(tiny):
    """No row of a step's mask is ever empty (the sampler relies on it): a matcher in its
    error state allows at most EOS (else its row is left open); the job fails on consume."""
    engine = tiny.generator(filter_background_eval=False).mask_engine()
    broken = engine.constraint([RegexFilter("[0-9]+")], prefer_eos=False)
    with pytest.raises(FilterError):
        broken.consume(engine.tokenizer.tokenize_str("x")[0])
    fine = engine.constraint([RegexFilter("[0-9]+")], prefer_eos=False)
    bias = engine.launch([broken, fine, None]).result()
    assert bool((bias[0] == 0).any()) and bool((bias[2] == 0).all())
    assert 0 < int((bias[1] == 0).sum()) < bias.shape[1]


# -- a reasoning model's answer after its thinking --------------------------------------------


@pytest.mark.parametrize("opened", [False, True])
def test_a_constraint_after_thinking_holds_for_the_answer_only(tiny, opened):
    """``ConstraintSpec.thinking``: the thinking is free text up to ``</think>`` (which the
    grammar consumes), whitespace may follow, then the constraint holds; an answer that breaks
    it is refused token by token, as without thinking."""
    from engine.constraints.filters import AfterThinkingFilter, Filter

    masks = tiny.generator().mask_engine()
    spec = ConstraintSpec("regex", "[0-9]{3}", thinking="open" if opened else "optional")
    (filt,) = [Filter.from_spec(spec)]
    assert isinstance(filt, AfterThinkingFilter) and filt.opened == opened
    masks.validate([filt])
    start = "" if opened else "<think>"

    def consumed(text: str) -> tuple[int, int, bool]:
        constraint = masks.constraint([filt], prefer_eos=False)
        ids = tiny.tokenizer.encode(text)[0].tolist()
        return constraint.try_consume(ids), len(ids), constraint.is_accepting()

    for text in (f"{start}Let me count </think>\n\n123", f"{start}a</think>456"):
        taken, total, accepting = consumed(text)
        assert taken == total and accepting, text
    taken, total, _ = consumed(f"{start}hm</think> 12x")
    assert taken < total  # the answer breaks the regex
    taken, total, accepting = consumed("789")  # no thinking at all
    assert (taken == total and accepting) != opened  # only when the prompt opened none
    with pytest.raises(ValueError, match="thinking"):
        ConstraintSpec("regex", "a", thinking="yes")
