"""vLLM's guided decoding fields over HTTP (``structured_outputs`` and the older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``): parsed into the
request's ``ConstraintSpec``, checked at the door (a grammar that does not compile is the
client's 400, never a failed job on a replica), one constraint per request. No Ray."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.protocol import OpenAIError, parse_fields
from deployments.tool_parsers import CALL_SYNTAXES
from engine.constraints.spec import ConstraintSpec

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def fields(body: dict[str, Any], chat: bool = False):
    full = {"messages": USER, **body} if chat else {"prompt": "x", **body}
    return parse_fields(full, chat, 100, CALL_SYNTAXES["hermes"])


@pytest.mark.parametrize(
    ("body", "spec", "source"),
    [
        ({"guided_json": SCHEMA}, ConstraintSpec.json_schema(SCHEMA), "guided_json"),
        ({"guided_json": '{"type": "integer"}'}, ConstraintSpec.json_schema({"type": "integer"}),
         "guided_json"),
        ({"guided_regex": "[0-9]{3}"}, ConstraintSpec("regex", "[0-9]{3}"), "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, ConstraintSpec("choice", choices=("yes", "no")),
         "guided_choice"),
        ({"guided_grammar": 'start: "a"+'}, ConstraintSpec("lark", 'start: "a"+'),
         "guided_grammar"),
        ({"structured_outputs": {"choice": ["A", "B"]}},
         ConstraintSpec("choice", choices=("A", "B")), "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, ConstraintSpec("json_object"),
         "structured_outputs.json_object"),
        ({"structured_outputs": {"json": SCHEMA, "regex": None}},
         ConstraintSpec.json_schema(SCHEMA), "structured_outputs.json"),
    ],
)  # fmt: skip
def test_each_form_becomes_the_requests_constraint(body, spec, source) -> None:
    for chat in (False, True):
        got = fields(body, chat)
        assert got.constraint == spec and got.constraint_source == source
        assert got.generation([1, 2], 4, []).constraint == spec


def test_a_gbnf_grammar_is_converted_to_lark() -> None:
    spec = fields({"guided_grammar": 'root ::= "yes" | "no"'}).constraint
    assert spec.kind == "lark" and "start" in spec.value and '"yes"' in spec.value


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex", "invalid 'guided_regex'"),
        ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "invalid 'guided_grammar'"),
        ({"guided_json": "{not json"}, "guided_json", "invalid 'guided_json'"),
        ({"guided_json": [1]}, "guided_json", "must be an object"),
        ({"guided_json": "[" * 100_000}, "guided_json", "nested deeper"),
        ({"guided_choice": []}, "guided_choice", "1 to 1024"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
        ({"guided_regex": 5}, "guided_regex", "must be a string"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported"),
        ({"structured_outputs": "json"}, "structured_outputs", "must be an object"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "must be true"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
         "give one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "not both"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "unknown field"),
        ({"guided_regex": "a", "cfg_scale": 1.5, "negative_prompt": "x"}, "guided_regex",
         "cfg_scale"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(body, param, says) -> None:
    with pytest.raises(OpenAIError) as info:
        fields(body)
    assert info.value.param == param and says in info.value.message and info.value.status == 400


def test_a_constraint_and_tools_that_call_conflict() -> None:
    for choice in ("auto", "required"):
        with pytest.raises(OpenAIError) as info:
            fields({"guided_regex": "a", "tools": [WEATHER], "tool_choice": choice}, chat=True)
        assert info.value.param == "guided_regex"
    free = fields({"guided_regex": "a", "tools": [WEATHER], "tool_choice": "none"}, chat=True)
    assert free.constraint == ConstraintSpec("regex", "a")


def test_a_schema_feature_the_grammar_cannot_enforce_is_refused_at_the_door() -> None:
    odd = {"type": "string", "format": "no-such-format"}
    with pytest.raises(OpenAIError) as info:
        fields({"guided_json": odd})
    assert info.value.param == "guided_json"
    lenient = {"type": "json_schema", "json_schema": {"name": "x", "schema": odd}}
    assert fields({"response_format": lenient}).constraint.kind == "json_schema"  # non-strict
