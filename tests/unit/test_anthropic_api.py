"""Anthropic's Messages API (``deployments.anthropic_api``): requests translated into the chat
body they mean (and run through the demo prompt builder), chat choices read back as content
blocks, the streamed events, and errors, each checked against the ``anthropic`` package's own
models. No Ray, no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deployments.anthropic_api import (
    MessageEvents,
    content_blocks,
    error_body,
    message_object,
    stop_of,
    translate,
    usage,
)
from deployments.protocol import OpenAIError

anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")

TOOL = {"name": "get_weather", "description": "Weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"}}  # fmt: skip
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}


def test_a_conversation_with_a_tool_loop_becomes_a_chat() -> None:
    body = {
        "model": "demo", "max_tokens": 64, "temperature": 0.2, "stop_sequences": ["\n\n"],
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                {"type": "text", "text": "Checking."}, USE]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    }  # fmt: skip
    chat = translate(body)
    assert chat["max_completion_tokens"] == 64 and chat["stop"] == ["\n\n"]
    assert chat["temperature"] == 0.2 and chat["tool_choice"] == "auto"
    assert chat["parallel_tool_calls"] is False
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": TOOL["input_schema"],
                "description": "Weather now",
            },
        }
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "get_weather"},
         {"type": "function", "function": {"name": "get_weather"}}),
    ],
)  # fmt: skip
def test_tool_choices_map_to_chat(choice, chat_choice) -> None:
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}
    assert translate({**body, "tool_choice": choice})["tool_choice"] == chat_choice


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "max_tokens"),
        ({"max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "x"}}]}]}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"max_tokens": 8, "mcp_servers": [{}]}, "mcp_servers"),
        ({"max_tokens": 8, "tool_choice": {"type": "auto"}}, "tool_choice"),
        ({"max_tokens": 8, "metadata": {"user_id": "u", "x": 1}}, "metadata"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(body, param) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(OpenAIError) as info:
        translate(body)
    assert info.value.param == param and info.value.status == 400


def test_the_chat_path_runs_it_and_errors_speak_anthropic(builder) -> None:
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    assert builder.prepared(translate(body), True).generation.max_new_tokens == 3
    with pytest.raises(OpenAIError) as info:
        builder.prepared(translate({**body, "max_tokens": 10**7}), True)
    shown = anthropic.types.ErrorResponse.model_validate(error_body(info.value))
    assert shown.error.type == "invalid_request_error" and "max_tokens=" in shown.error.message
    busy = error_body(OpenAIError("busy", status=503, type_="server_error"))
    assert busy["error"]["type"] == "overloaded_error"


# -- the answer ------------------------------------------------------------------------------

CALL = {"id": "call_9", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
FINAL = {"prompt_tokens": 10, "cached_tokens": 4, "new_tokens": 3, "eos_reason": "stop_token"}


def choice(content, reasoning=None, calls=(), finish="stop") -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = list(calls)
    return {"index": 0, "message": message, "finish_reason": finish}


def test_a_choice_reads_back_as_content_blocks() -> None:
    chosen = choice(None, "Think.", [CALL], "tool_calls")
    body = message_object("msg_1", "demo", content_blocks(chosen), stop_of(chosen, FINAL),
                          usage(FINAL))  # fmt: skip
    out = anthropic.types.Message.model_validate(body)
    assert [b.type for b in out.content] == ["thinking", "tool_use"]
    assert out.content[1].input == {"city": "Oslo"} and out.stop_reason == "tool_use"
    assert (out.usage.input_tokens, out.usage.cache_read_input_tokens) == (6, 4)
    cut = choice("Hel", finish="length")
    assert stop_of(cut, FINAL) == ("max_tokens", None)
    stopped = {**FINAL, "eos_reason": "stop_string", "stop_string": "\n\n"}
    assert stop_of(choice("Hi"), stopped) == ("stop_sequence", "\n\n")
    assert stop_of(choice("Hi"), FINAL) == ("end_turn", None)


def test_streamed_events_are_anthropics() -> None:
    events = MessageEvents("msg_1", "demo")
    text = events.start(10)
    text += events.piece("Think", "", [])
    text += events.piece(" more.", "Sure", [])
    text += events.piece("", ".", [CALL])
    text += events.finish(("tool_use", None), usage(FINAL))
    adapter = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    parsed = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        parsed.append(event)
    kinds = [e.type for e in parsed]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in parsed if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    stops = [e.index for e in parsed if e.type == "content_block_stop"]
    assert stops == [0, 1, 2]
    deltas = [e.delta for e in parsed if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == "Think more."
    assert "".join(d.text for d in deltas if d.type == "text_delta") == "Sure."
    (args,) = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert json.loads(args) == {"city": "Oslo"}
    assert parsed[-2].delta.stop_reason == "tool_use"
