"""OpenAI's Responses API (``deployments.responses_api``): requests translated into the chat
body they mean (and run through the demo prompt builder), chat choices read back as output
items, and the streamed events, each checked against the ``openai`` package's own event and
response models. No Ray, no model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deployments.protocol import OpenAIError
from deployments.responses_api import (
    ResponseEvents,
    ResponseShape,
    output_items,
    responses_error,
    translate,
)

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather now",
           "parameters": CITY}  # fmt: skip
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"}  # fmt: skip


def test_a_string_input_with_instructions_is_a_chat() -> None:
    wanted = translate({"model": "demo", "input": "Hi", "instructions": "Be brief.",
                        "max_output_tokens": 9, "temperature": 0.5, "stream": True})  # fmt: skip
    assert wanted.chat == {
        "model": "demo", "temperature": 0.5, "stream": True, "max_completion_tokens": 9,
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}],
    }  # fmt: skip
    assert wanted.stream and not wanted.logprobs


def test_items_sent_back_become_the_conversation() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        CALL,
        {**CALL, "call_id": "call_2", "id": "fc_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
    ]  # fmt: skip
    messages = translate({"input": items, "tools": [WEATHER]}).chat["messages"]
    assert messages[0] == {"role": "user", "content": "Weather in Oslo?"}
    assistant = messages[1]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "Look it up."
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]  # one turn
    assert assistant["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'
    }  # fmt: skip
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]


def test_tools_format_and_logprobs_take_the_chat_shape() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    named = {"type": "function", "name": "get_weather"}
    fmt = {"type": "json_schema", "name": "out", "schema": schema, "strict": True}
    wanted = translate({
        "input": "x", "tools": [WEATHER], "tool_choice": named, "text": {"format": fmt},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
    })  # fmt: skip
    chat = wanted.chat
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                               if k != "type"}}]  # fmt: skip
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}
    }  # fmt: skip
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2 and wanted.logprobs
    assert translate({"input": "x", "text": {"format": {"type": "text"}}}).chat.get(
        "response_format"
    ) == {"type": "text"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input"),
        ({"input": "x", "metadata": {"k": 5}}, "metadata"),
        ({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "high"}}, "text"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(body, param) -> None:
    with pytest.raises(OpenAIError) as info:
        translate(body)
    assert info.value.param == param and info.value.status == 400


def test_the_chat_path_validates_and_errors_name_the_responses_field(builder) -> None:
    prepared = builder.prepared(translate({"input": "Hi", "max_output_tokens": 3}).chat, True)
    assert prepared.generation.max_new_tokens == 3
    for body, param in (
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": "x" * 10**6}]}, "input"),
        ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text"),
        ({"input": [CALL, {"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input"),
    ):  # fmt: skip
        with pytest.raises(OpenAIError) as info:
            builder.prepared(translate(body).chat, True)
        shown = responses_error(info.value)
        assert shown.param == param, shown.message
        assert "max_completion_tokens" not in shown.message and "'messages'" not in shown.message


# -- output ----------------------------------------------------------------------------------


def choice(content: str | None, reasoning: str | None = None, calls=(), finish="stop"):
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = list(calls)
    return {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}


CHAT_CALL = {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
USAGE = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens": 3,
         "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 8}  # fmt: skip


def response(output, status="completed") -> Any:
    shape = ResponseShape(translate({"input": "x", "tools": [WEATHER]}), "demo")
    body = shape.response(output, status, USAGE)
    json.dumps(body)
    return openai.types.responses.Response.model_validate(body)


def test_a_choice_reads_back_as_output_items() -> None:
    out = response(output_items(choice(None, "Think.", [CHAT_CALL], "tool_calls"), False))
    assert [i.type for i in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text == "Think."
    call = out.output[1]
    assert (call.call_id, call.name, call.arguments) == (
        "call_9",
        "get_weather",
        '{"city": "Oslo"}',
    )
    text = response(output_items(choice("Hello."), False))
    assert text.output_text == "Hello." and text.status == "completed"
    cut = response(output_items(choice("Hel", finish="length"), False), "incomplete")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    empty = response(output_items(choice(""), False))
    assert [i.type for i in empty.output] == ["message"] and empty.output_text == ""


# -- streaming -------------------------------------------------------------------------------


def parsed_events(stream: str) -> list[Any]:
    """The SSE text as the openai package's event models (each checked)."""
    adapter = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    events = []
    for block in stream.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    return events


def test_streamed_events_build_the_same_output() -> None:
    shape = ResponseShape(translate({"input": "x", "tools": [WEATHER]}), "demo")
    events = ResponseEvents(shape)
    text = events.start()
    text += events.piece("Think", "", [])
    text += events.piece(" hard.", "Sure", [])
    text += events.piece("", ".", [CHAT_CALL])
    final = choice("Sure.", "Think hard.", [CHAT_CALL], "tool_calls")
    text += events.finish(final, USAGE, None)
    parsed = parsed_events(text)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    kinds = [e.type for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    reasoning = "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in parsed if e.type == "response.output_text.delta")
    assert (reasoning, answer) == ("Think hard.", "Sure.")
    done = parsed[-1].response
    assert [i.type for i in done.output] == ["reasoning", "message", "function_call"]
    assert done.output_text == "Sure." and done.output[2].arguments == '{"city": "Oslo"}'
    added = [e.item.id for e in parsed if e.type == "response.output_item.added"]
    assert added == [i.id for i in done.output]
    whole = output_items(final, False)
    assert [(i["type"], i.get("status")) for i in whole] == [
        (i.type, getattr(i, "status", None)) for i in done.output
    ]


def test_a_stream_cut_by_max_output_tokens_ends_incomplete() -> None:
    events = ResponseEvents(ResponseShape(translate({"input": "x"}), "demo"))
    text = events.start() + events.piece("", "Hel", [])
    text += events.finish(choice("Hel", finish="length"), USAGE, None)
    last = parsed_events(text)[-1]
    assert last.type == "response.incomplete" and last.response.output_text == "Hel"
    failed = ResponseEvents(ResponseShape(translate({"input": "x"}), "demo"))
    error = OpenAIError("boom", status=500, type_="server_error")
    (event,) = parsed_events(failed.failed(error))
    assert event.type == "response.failed" and event.response.error.message == "boom"
