"""HTTP fields for log-probabilities, response_format and forced tool calls: parsing into the
``GenerationRequest``, 400s naming the field, and the OpenAI response shapes built from replica
messages (``ChoiceState``), without Ray or a model."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from deployments.choices import ChoiceState, OutputOptions, full_body
from deployments.protocol import OpenAIError, parse_fields
from deployments.responses import ResponseFormat
from deployments.structured import tools_system_message
from engine.constraints.spec import ConstraintSpec

VOCAB = 100
USER = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
JSON_MODE = {"type": "json_object"}


def fields(body: dict[str, Any], chat: bool = True):
    return parse_fields({"messages": USER, **body} if chat else body, chat, VOCAB)


def request(body: dict[str, Any], chat: bool = True):
    return fields(body, chat).generation([1, 2, 3], 8, [])


def refused(body: dict[str, Any], chat: bool = True) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        fields(body, chat)
    assert info.value.status == 400
    return info.value


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_fields_become_the_requests_k() -> None:
    assert request({}).logprobs is None
    assert request({"logprobs": True}).logprobs == 0
    assert request({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert request({"logprobs": False}).logprobs is None
    assert request({"logprobs": 3}, chat=False).logprobs == 3
    assert request({"logprobs": 0}, chat=False).logprobs == 0
    assert request({"logprobs": None}, chat=False).logprobs is None


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"logprobs": 2}, True, "logprobs"),
        ({"top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs"),
        ({"logprobs": True}, False, "logprobs"),
        ({"logprobs": 21}, False, "logprobs"),
        ({"logprobs": 1, "top_logprobs": 2}, False, "top_logprobs"),
    ],
)
def test_bad_logprobs_fields_are_refused_by_name(body, chat, param) -> None:
    assert refused(body, chat).param == param


# -- response_format -------------------------------------------------------------------------


@pytest.mark.parametrize("chat", [True, False])
def test_response_format_becomes_a_constraint(chat: bool) -> None:
    assert request({"response_format": {"type": "text"}}, chat).constraint is None
    assert request({"response_format": {"type": "json_object"}}, chat).constraint == (
        ConstraintSpec("json_object")
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = {"name": "answer", "schema": schema, "strict": True}
    got = request({"response_format": {"type": "json_schema", "json_schema": spec}}, chat)
    assert got.constraint == ConstraintSpec.json_schema(schema, strict=True)
    del spec["strict"]  # OpenAI's default: not strict
    got = request({"response_format": {"type": "json_schema", "json_schema": spec}}, chat)
    assert got.constraint == ConstraintSpec.json_schema(schema, strict=False)


@pytest.mark.parametrize(
    "value",
    [
        "json",
        {"type": "xml"},
        {"type": "json_object", "extra": 1},
        {"type": "json_object", "json_schema": {"name": "a", "schema": {}}},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "other": 1}},
    ],
)
def test_malformed_response_format_is_refused(value) -> None:
    assert refused({"response_format": value}).param == "response_format"


# -- tools -----------------------------------------------------------------------------------


def test_named_tool_constrains_to_its_arguments() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    got = fields({"tools": [WEATHER, TIME], "tool_choice": choice})
    parameters = WEATHER["function"]["parameters"]
    assert got.tools.single_name == "get_weather"
    assert got.generation([1], 4, []).constraint == ConstraintSpec.json_schema(parameters, False)
    call = got.tools.call(' {"city": "Paris"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")


def test_required_over_several_tools_is_an_any_of() -> None:
    got = fields({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert got.tools.single_name is None
    schema = json.loads(got.constraint.value)
    names = [v["properties"]["name"]["const"] for v in schema["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    call = got.tools.call('{"name": "get_time", "arguments": {}}')
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert got.tools.call('{"name": "get_ti') is None  # cut short: not a call
    one = fields({"tools": [WEATHER], "tool_choice": "required"})
    assert one.tools.single_name == "get_weather"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER]}, "tool_choice"),  # OpenAI's default with tools: auto
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": True},
         "parallel_tool_calls"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
         "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": JSON_MODE},
         "response_format"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)  # fmt: skip
def test_unimplemented_tool_use_is_refused_by_name(body, param) -> None:
    assert refused(body).param == param


def test_tools_and_top_logprobs_are_refused_on_completions() -> None:
    assert refused({"tools": [WEATHER], "prompt": "x"}, chat=False).param == "tools"
    fine = fields({"tools": [], "parallel_tool_calls": False, "tool_choice": "none"})
    assert fine.tools is None and fine.constraint is None


def test_tool_choice_none_lists_the_tools_and_leaves_the_output_free() -> None:
    shown = fields({"tools": [WEATHER], "tool_choice": "none"})
    assert shown.tools.tools == (WEATHER,) and not shown.tools.forced
    assert shown.constraint is None
    both = fields({"tools": [WEATHER], "tool_choice": "none", "response_format": JSON_MODE})
    assert both.constraint == ConstraintSpec("json_object")  # no call: the format is free to apply


def test_tools_system_message_lists_the_functions() -> None:
    message = tools_system_message(fields({"tools": [WEATHER, TIME], "tool_choice": "none"}).tools)
    assert message["role"] == "system" and '"get_weather"' in message["content"]


# -- response shapes -------------------------------------------------------------------------


class FakeTokens:
    """TokenBytes stand-in: token i is the bytes in PIECES[i]."""

    PIECES = (b"He", b"llo", b" \xe4\xb8", b"\x96", b"!", b"{}")

    def bytes_of(self, token: int) -> bytes:
        return self.PIECES[token]

    def text_of(self, token: int) -> str:
        try:
            return self.PIECES[token].decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.PIECES[token])


def _messages(final_reason: str = "max_new_tokens") -> list[dict[str, Any]]:
    first = {"index": 0, "text": "Hello", "token_ids": [0, 1], "eos": False}
    first["logprobs"] = [(0, -0.5, [0, 4], [-0.5, -2.0]), (1, -0.25, [1, 4], [-0.25, -3.0])]
    last = {"index": 0, "text": " \u4e16", "token_ids": [2, 3], "eos": True}
    last["logprobs"] = [(2, -math.inf, [4, 0], [-0.1, -2.5]), (3, -1.0, [3, 4], [-1.0, -2.0])]
    last.update(eos_reason=final_reason, prompt_tokens=3, new_tokens=4, cached_tokens=0)
    return [first, last]


def _state(chat: bool, **options) -> tuple[ChoiceState, ResponseFormat]:
    fmt = ResponseFormat.new(chat, "demo")
    return ChoiceState(0, fmt, OutputOptions(**options)), fmt


def test_completion_logprobs_shape() -> None:
    state, fmt = _state(chat=False, tokens=FakeTokens())
    for message in _messages():
        state.add(message)
    logprobs = full_body(fmt, [state])["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["He", "llo", "bytes:\\x20\\xe4\\xb8", "bytes:\\x96"]
    assert logprobs["token_logprobs"] == [-0.5, -0.25, -9999.0, -1.0]  # -inf: JSON has none
    assert logprobs["top_logprobs"][0] == {"He": -0.5, "!": -2.0}
    assert logprobs["top_logprobs"][2] == {"!": -0.1, "He": -2.5, "bytes:\\x20\\xe4\\xb8": -9999.0}
    assert logprobs["text_offset"] == [0, 2, 5, 6]  # a split character counts once complete
    json.dumps(logprobs, allow_nan=False)


def test_chat_logprobs_shape_and_streamed_chunks() -> None:
    state, fmt = _state(chat=True, tokens=FakeTokens())
    chunks = [c for m in _messages() for c in state.chunks(m)]
    content = [e for c in chunks if c["choices"][0]["logprobs"] for e in
               c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert [e["token"] for e in content] == ["He", "llo", "bytes:\\x20\\xe4\\xb8", "bytes:\\x96"]
    assert content[2]["bytes"] == [32, 0xE4, 0xB8] and content[2]["logprob"] == -9999.0
    assert content[0]["top_logprobs"] == [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
        {"token": "!", "logprob": -2.0, "bytes": [33]},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    body = full_body(fmt, [state])
    assert body["choices"][0]["logprobs"]["content"] == content
    assert body["choices"][0]["message"]["content"] == "Hello \u4e16"


def test_no_logprobs_unless_asked() -> None:
    state, fmt = _state(chat=True)
    for message in _messages():
        state.add(message)
    assert full_body(fmt, [state])["choices"][0]["logprobs"] is None


def _tool_messages(texts: list[str], reason: str) -> list[dict[str, Any]]:
    out = [{"index": 0, "text": t, "token_ids": [5], "eos": False} for t in texts]
    out[-1].update(eos=True, eos_reason=reason, prompt_tokens=3, new_tokens=len(texts))
    out[-1]["cached_tokens"] = 0
    return out


def test_forced_call_response_and_stream() -> None:
    tools = fields({"tools": [WEATHER], "tool_choice": "required"}).tools
    state, fmt = _state(chat=True, tools=tools)
    chunks = [c for m in _tool_messages(['{"city":', ' "Oslo"}'], "stop_token") for c in
              state.chunks(m)]  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks]
    first = deltas[0]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": '{"city":'}
    assert first["type"] == "function" and first["index"] == 0 and first["id"]
    assert deltas[1]["tool_calls"] == [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = full_body(fmt, [state])["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert call["id"] == first["id"]


def test_several_tools_stream_the_call_whole_and_a_cut_call_is_text() -> None:
    tools = fields({"tools": [WEATHER, TIME], "tool_choice": "required"}).tools
    state, fmt = _state(chat=True, tools=tools)
    text = ['{"name": "get_time", ', '"arguments": {}}']
    chunks = [c for m in _tool_messages(text, "end_filter") for c in state.chunks(m)]
    assert len(chunks) == 2
    call = chunks[0]["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls"
    cut, fmt = _state(chat=True, tools=tools)
    chunks = [c for m in _tool_messages(['{"name": "get_'], "max_new_tokens") for c in
              cut.chunks(m)]  # fmt: skip
    assert chunks[0]["choices"][0]["delta"] == {"content": '{"name": "get_'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert full_body(fmt, [cut])["choices"][0]["message"]["content"] == '{"name": "get_'


# -- the prompt builder and the batch job ----------------------------------------------------


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


def test_tools_reach_the_prompt(builder, monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required"}
    fields_, _ = builder.request(body, chat=True)
    decode = builder.tokenizer.decode
    # the demo template has no tools variable: a system message lists them
    assert '"get_weather"' in decode(builder.chat_ids(body, fields_.tools), True)
    monkeypatch.setattr(builder.tokenizer, "chat_template", TOOL_TEMPLATE)
    text = decode(builder.chat_ids(body, fields_.tools), True)
    assert text.startswith("TOOLS:get_weather;get_time;user: hi")  # (trim_blocks)


def test_batch_record_has_logprobs_and_tool_calls(builder) -> None:
    import asyncio

    from deployments.batch import Validator, generate_record
    from deployments.batch_records import Item

    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "logprobs": True}
    item = Item(1, "x", body, chat=True)
    request, options = Validator(builder).prepare(item)
    assert request.logprobs == 0 and request.constraint.kind == "json_schema"
    ids = builder.tokenizer.encode('{"city": "Rome"}')[0].tolist()

    async def generate(_request):
        entries = [(t, -0.5, [], []) for t in ids]
        yield {"index": 0, "text": '{"city": "Rome"}', "token_ids": ids, "eos": True,
               "logprobs": entries, "eos_reason": "end_filter", "prompt_tokens": 5,
               "new_tokens": len(ids), "cached_tokens": 0}  # fmt: skip

    record = asyncio.run(generate_record(item, request, generate, options))
    assert record["finish_reason"] == "tool_calls"
    (call,) = record["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    tokens = [e["token"] for e in record["logprobs"]["content"]]
    assert "".join(tokens) == '{"city": "Rome"}'
