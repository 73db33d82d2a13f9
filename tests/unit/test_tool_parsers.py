"""``tool_choice: "auto"``: the calls a model writes, read back by the deployment's call syntax
(``deployments.tool_parsers``), as whole bodies and as streams that an OpenAI client
reassembles into the same message, whatever the chunking. No Ray, no model."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from deployments.choices import ChoiceState, OutputOptions, full_body
from deployments.messages import for_template, parse_messages
from deployments.preset import ServingPreset
from deployments.protocol import OpenAIError, parse_fields
from deployments.responses import ResponseFormat
from deployments.tool_parsers import CALL_SYNTAXES, HermesReader, Llama3JsonReader, MistralReader
from engine.job import DynamicJob
from engine.request import GenerationRequest

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "hi"}]
HERMES, LLAMA = CALL_SYNTAXES["hermes"], CALL_SYNTAXES["llama3_json"]
MISTRAL = CALL_SYNTAXES["mistral"]


def read(reader_class, pieces: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """Content and (name, arguments) calls of ``pieces`` fed one by one, then finished."""
    reader = reader_class(NAMES)
    content, calls = [], []
    for piece in [*pieces, None]:
        parsed = reader.feed(piece) if piece is not None else reader.finish()
        content.append(parsed.content)
        calls += [(c.name, json.loads(c.arguments)) for c in parsed.calls]
    return "".join(content), calls


PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_CASES = [
    # (output, content, calls)
    (PARIS, "", [("get_weather", {"city": "Paris"})]),
    ("The capital is Paris.\n", "The capital is Paris.\n", []),  # no call: the text as it is
    (f"Let me look.\n{PARIS}\n{PARIS}\nDone.", "Let me look.\nDone.",
     [("get_weather", {"city": "Paris"})] * 2),
    ('<tool_call>{"name": "get_time", "parameters": {}}</tool_call>', "", [("get_time", {})]),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "",
     [("get_time", {"tz": "UTC"})]),  # arguments written as JSON text
    ('<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),  # unclosed
    # not calls: the model's text, exactly
    ('<tool_call>{"name": "Hello", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "Hello", "arguments": {}}</tool_call>', []),  # not one of the tools
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": {}, "x": 1}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {}, "x": 1}</tool_call>', []),
    ('<tool_call>{"name": "get_ti', '<tool_call>{"name": "get_ti', []),  # cut by max_tokens
    ("<tool_call>" + "[" * 100 + "]" * 100 + "</tool_call>",
     "<tool_call>" + "[" * 100 + "]" * 100 + "</tool_call>", []),  # too deep to parse
    ("ends with <tool", "ends with <tool", []),
    ("  spaced  ", "  spaced  ", []),
]  # fmt: skip
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    (' {"name": "get_time", "arguments": {}} ; {"name": "get_time", "parameters": {"a": 1}}', "",
     [("get_time", {}), ("get_time", {"a": 1})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", {})]),
    ("The capital is Paris.", "The capital is Paris.", []),
    ('{"name": "Hello, who are you?"}', '{"name": "Hello, who are you?"}', []),
    ('{"name": "get_time", "parameters": {}} and more',
     '{"name": "get_time", "parameters": {}} and more', []),
    ('{"name": "get_time", "parameters": {}};', "", [("get_time", {})]),  # a trailing separator
    ('{"name": "get_ti', '{"name": "get_ti', []),
    ("   ", "   ", []),
]  # fmt: skip
MISTRAL_CASES = [
    ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Sure.",
     [("get_weather", {"city": "Paris"})]),  # v3
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "abcDEF123"}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "",
     [("get_time", {}), ("get_time", {"tz": "UTC"})]),  # v7, with the model's own id
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {})]),  # v11
    ("Hello there  ", "Hello there  ", []),
    ("[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]nope[ARGS]{}", []),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "short"}]',
     '[TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "short"}]', []),  # a bad id
    ('[TOOL_CALLS][{"name": "get_time", "argum', '[TOOL_CALLS][{"name": "get_time", "argum', []),
    ("x [TOOL", "x [TOOL", []),
]  # fmt: skip
CASES = [(HermesReader, *case) for case in HERMES_CASES]
CASES += [(Llama3JsonReader, *case) for case in LLAMA_CASES]
CASES += [(MistralReader, *case) for case in MISTRAL_CASES]


@pytest.mark.parametrize(("reader", "output", "content", "calls"), CASES)
def test_a_whole_output_reads_as_its_content_and_calls(reader, output, content, calls) -> None:
    assert read(reader, [output]) == (content, calls)


@pytest.mark.parametrize(("reader", "output", "content", "calls"), CASES)
def test_any_chunking_reads_the_same(reader, output, content, calls) -> None:
    for cut in range(len(output) + 1):  # every two-piece split
        assert read(reader, [output[:cut], output[cut:]]) == (content, calls), cut
    rng = random.Random(len(output))
    for _ in range(20):  # random splits into many pieces, empty ones included
        cuts = sorted(rng.randint(0, len(output)) for _ in range(rng.randint(1, 12)))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
        assert read(reader, pieces) == (content, calls), pieces


def test_content_streams_before_the_output_ends() -> None:
    reader = HermesReader(NAMES)
    assert reader.feed("Let me ").content == "Let me"  # the space may only separate a call
    assert reader.feed("look. <tool").content == " look."  # "<tool" may start a call
    assert reader.feed("_call>").content == ""
    reader = Llama3JsonReader(NAMES)
    assert reader.feed("  ").content == ""  # undecided
    assert reader.feed("Paris").content == "  Paris"


@pytest.mark.parametrize("syntax", [HERMES, LLAMA, MISTRAL])
def test_a_syntax_reads_what_it_writes_and_describes_itself(syntax) -> None:
    written = syntax.written("get_weather", {"city": "Zürich"})
    assert read(type(syntax.reader(NAMES)), [written]) == (
        "",
        [("get_weather", {"city": "Zürich"})],
    )
    assert '"get_weather"' in syntax.instructions([WEATHER])


def test_mistral_call_ids_are_what_its_templates_accept() -> None:
    reader = MistralReader(NAMES)
    reader.feed('[TOOL_CALLS][{"name": "get_time", "arguments": {}, "id": "abcDEF123"}, ')
    calls = reader.feed('{"name": "get_time", "arguments": {}}]').calls + reader.finish().calls
    assert calls[0].id == "abcDEF123"  # the model's own
    assert len(calls[1].id) == 9 and calls[1].id.isalnum() and calls[1].id != calls[0].id


def test_the_preset_names_a_known_syntax() -> None:
    assert ServingPreset.parse({"tool_call_parser": "hermes"}).tool_call_parser == "hermes"
    assert ServingPreset.parse({}).tool_call_parser is None
    with pytest.raises(ValueError, match=r"serving\.tool_call_parser 'pythonic' is not one of"):
        ServingPreset.parse({"tool_call_parser": "pythonic"})


# -- request fields --------------------------------------------------------------------------


def fields(body: dict[str, Any], syntax=HERMES):
    return parse_fields({"messages": USER, **body}, True, 100, syntax)


def test_auto_is_the_default_with_tools_when_the_deployment_has_a_syntax() -> None:
    for choice in (None, "auto"):
        tools = fields({"tools": [WEATHER], "tool_choice": choice}).tools
        assert tools.auto and not tools.forced and tools.parallel and tools.syntax is HERMES
    assert fields({"tools": [WEATHER], "tool_choice": "auto"}).constraint is None
    one = fields({"tools": [WEATHER], "parallel_tool_calls": False}).tools
    assert one.auto and not one.parallel
    forced = fields({"tools": [WEATHER], "tool_choice": "required"}).tools
    assert forced.forced and not forced.auto
    assert not fields({"tools": [WEATHER], "tool_choice": "none"}).tools.auto


@pytest.mark.parametrize(
    ("body", "syntax", "param", "says"),
    [
        ({"tools": [WEATHER]}, None, "tool_choice", "serving.tool_call_parser"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, HERMES,
         "response_format", "auto"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True}, HERMES,
         "parallel_tool_calls", "forced"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, HERMES, "parallel_tool_calls",
         "boolean"),
        ({"skip_special_tokens": 0}, HERMES, "skip_special_tokens", "boolean"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(body, syntax, param, says) -> None:
    with pytest.raises(OpenAIError) as info:
        fields(body, syntax)
    assert info.value.param == param and says in info.value.message


def test_skip_special_tokens_reaches_the_job() -> None:
    assert fields({}).skip_special_tokens
    shown = fields({"skip_special_tokens": False})
    request = shown.generation([1, 2], 4, [], decode_special_tokens=not shown.skip_special_tokens)
    assert request.decode_special_tokens
    assert DynamicJob.from_request(request).decode_special_tokens
    assert not DynamicJob.from_request(GenerationRequest((1, 2), 4)).decode_special_tokens
    with pytest.raises(ValueError, match="decode_special_tokens must be a bool"):
        GenerationRequest((1, 2), 4, decode_special_tokens=1)


# -- response shapes -------------------------------------------------------------------------


def replica_messages(pieces: list[str], reason: str) -> list[dict[str, Any]]:
    out = [{"index": 0, "text": p, "token_ids": [5], "eos": False} for p in pieces]
    out[-1].update(eos=True, eos_reason=reason, prompt_tokens=3, new_tokens=len(pieces))
    out[-1]["cached_tokens"] = 0
    return out


def state(body: dict[str, Any]) -> tuple[ChoiceState, ResponseFormat]:
    fmt = ResponseFormat.new(True, "demo")
    return ChoiceState(0, fmt, OutputOptions(tools=fields(body).tools)), fmt


def reassembled(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The message an OpenAI client builds from stream chunks: content concatenated, tool call
    parts merged by index (ids, names and argument pieces)."""
    content, calls, reason = None, {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"function": {"name": "", "arguments": ""}})
            call.update({k: part[k] for k in ("id", "type") if k in part})
            for key in ("name", "arguments"):
                call["function"][key] += part.get("function", {}).get(key, "")
        reason = choice["finish_reason"] or reason
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {"message": message, "finish_reason": reason}


@pytest.mark.parametrize(
    ("pieces", "reason", "content", "names", "finish"),
    [
        (["Let me look.\n<tool_", 'call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
          "\n</tool_call>\n", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'],
         "stop_token", "Let me look.", ["get_weather", "get_time"], "tool_calls"),
        ([PARIS, "\n<tool_call>{"], "max_new_tokens", "<tool_call>{", ["get_weather"],
         "length"),  # a call, then cut inside the next: shown as text
        (["The weather ", "is fine."], "stop_token", "The weather is fine.", [], "stop"),
        (['<tool_call>{"name": "nope", "arguments": {}}</tool_call>'], "stop_token",
         '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [], "stop"),
    ],
)  # fmt: skip
def test_stream_and_body_agree(pieces, reason, content, names, finish) -> None:
    streamed, _ = state({"tools": [WEATHER, TIME]})
    chunks = [c for m in replica_messages(pieces, reason) for c in streamed.chunks(m)]
    whole, fmt = state({"tools": [WEATHER, TIME]})
    for message in replica_messages(pieces, reason):
        whole.add(message)
    choice = full_body(fmt, [whole])["choices"][0]
    message = choice["message"]
    assert message["content"] == (content or None if names else content)
    assert [c["function"]["name"] for c in message.get("tool_calls", ())] == names
    assert choice["finish_reason"] == finish
    rebuilt = reassembled(chunks)
    assert rebuilt["finish_reason"] == finish
    assert rebuilt["message"]["content"] == (content or None)
    streamed_calls = rebuilt["message"].get("tool_calls", [])
    assert [c["function"] for c in streamed_calls] == [
        c["function"] for c in message.get("tool_calls", [])
    ]
    for calls in (streamed_calls, message.get("tool_calls", [])):
        ids = [c["id"] for c in calls]
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
        assert all(c["type"] == "function" for c in calls)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    one, fmt = state({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    later = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    chunks = [c for m in replica_messages([PARIS, later], "stop_token") for c in one.chunks(m)]
    calls = full_body(fmt, [one])["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert len(reassembled(chunks)["message"]["tool_calls"]) == 1


# -- earlier calls in the prompt -------------------------------------------------------------


def test_earlier_calls_are_written_in_the_deployments_syntax() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}  # fmt: skip
    messages = parse_messages(
        [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    )  # fmt: skip
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"  # reads no tool_calls
    shaped = for_template(messages, plain, HERMES)
    assert shaped[1]["content"] == HERMES.written("get_weather", {"city": "Rome"})
    assert read(HermesReader, [shaped[1]["content"]])[1] == [("get_weather", {"city": "Rome"})]
    assert for_template(messages, plain, LLAMA)[1]["content"] == (
        '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    )
    assert json.loads(for_template(messages, plain)[1]["content"])["arguments"] == {"city": "Rome"}


def test_special_token_markers_make_auto_responses_show_special_tokens(builder) -> None:
    body = {"messages": USER, "tools": [WEATHER]}
    saved = builder.call_syntax, builder.call_markers_special
    try:
        builder.call_syntax, builder.call_markers_special = HERMES, True
        fields_, request = builder.request(body, chat=True)
        assert fields_.tools.auto and request.decode_special_tokens
        builder.call_markers_special = False  # markers that are ordinary text
        assert not builder.request(body, chat=True)[1].decode_special_tokens
        forced = {**body, "tool_choice": "required"}
        builder.call_markers_special = True  # only "auto" reads the markers
        assert not builder.request(forced, chat=True)[1].decode_special_tokens
    finally:
        builder.call_syntax, builder.call_markers_special = saved


def test_a_marker_is_special_when_it_is_one_special_token(tmp_path) -> None:
    from deployments.ingress import _is_special_text
    from engine.tokenizer import Tokenizer
    from tests.tokenizer_builders import build_byte_level_bpe

    tokenizer = Tokenizer.from_pretrained(build_byte_level_bpe(tmp_path))
    assert _is_special_text(tokenizer, "<|im_start|>")
    assert not _is_special_text(tokenizer, "<tool_call>")
    assert not _is_special_text(tokenizer, "<|im_start|><|im_end|>")
