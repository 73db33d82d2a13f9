"""End to end with the official ``openai`` client against the served demo app: parsed
``logprobs`` objects (completions and chat, streaming and not, n > 1), a JSON-mode answer and a
json_schema answer that parse (and validate), a forced tool call whose arguments validate
against the function's schema, the call and its result sent back for the next turn, and
unimplemented tool use refused with a 400 naming the field.

The demo model's weights are random: strings never end by themselves, so the schemas bound
them (``maxLength``, enums, integer ranges), and the JSON-mode test biases ``}`` so the object
closes (the grammar still decides what may follow)."""

from __future__ import annotations

import json
import re

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.serve.live import start_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

MESSAGES = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -50, "maximum": 50},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "temp", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def client(request: pytest.FixtureRequest) -> openai.OpenAI:
    base = start_app(request, "configs/demo.yaml", "structured")
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo", prompt="Once upon", max_tokens=6, temperature=0, logprobs=3, n=2
    )
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert value <= 0 and 3 <= len(top) <= 4 and top[token] == value
            assert value == pytest.approx(max(top.values()))  # greedy: the most likely token
        if not any(t.startswith("bytes:") for t in lp.tokens):
            assert "".join(lp.tokens) == choice.text


def test_chat_logprobs_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    args = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "n": 2}
    out = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    entries = out.choices[0].logprobs.content
    assert 0 < len(entries) <= 8
    if not any(e.token.startswith("<|") for e in entries):  # special tokens are not text
        text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
        assert text == out.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**args, logprobs=True, top_logprobs=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed[choice.index] += choice.logprobs.content
    for index in (0, 1):  # the same tokens; the values may differ in the last float bits
        # (the two requests share forwards with different batch compositions)
        expected = out.choices[index].logprobs.content
        assert [e.token for e in streamed[index]] == [e.token for e in expected]
        assert [e.logprob for e in streamed[index]] == pytest.approx(
            [e.logprob for e in expected], abs=1e-4
        )
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].logprobs is None


def test_json_mode_and_json_schema(client: openai.OpenAI) -> None:
    close = client.chat.completions.create(  # "}" biased: the demo model closes at once
        model="demo",
        messages=MESSAGES,
        max_tokens=50,
        response_format={"type": "json_object"},
        logit_bias={"96": 100},
    )
    assert isinstance(json.loads(close.choices[0].message.content), dict)
    schema = {"name": "weather", "schema": WEATHER, "strict": True}
    out = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=100,
        n=2,
        seed=5,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), WEATHER)
        assert choice.finish_reason == "stop"
    text = client.completions.create(
        model="demo",
        prompt="Weather:",
        max_tokens=100,
        extra_body={"response_format": {"type": "json_schema", "json_schema": schema}},
    )
    jsonschema.validate(json.loads(text.choices[0].text), WEATHER)


def test_vllm_guided_fields(client: openai.OpenAI) -> None:
    """vLLM's ``guided_choice`` / ``structured_outputs``: the output is one of the choices, or
    matches the regex; a grammar that does not compile is a 400 before any replica runs it."""
    choice = client.completions.create(
        model="demo", prompt="Sentiment:", max_tokens=20, n=3, seed=1,
        extra_body={"guided_choice": ["positive", "negative", "neutral"]},
    )  # fmt: skip
    for c in choice.choices:
        assert c.text in {"positive", "negative", "neutral"} and c.finish_reason == "stop"
    regex = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", regex.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="demo", prompt="x", max_tokens=5, extra_body={"guided_grammar": "start: foo"}
        )
    assert info.value.body["param"] == "guided_grammar"


def test_forced_tool_calls(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=100, tools=TOOLS, tool_choice=named
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # "required" over two tools, streamed: the deltas add up to one call of either
    parts: dict[str, str] = {"name": "", "arguments": ""}
    finish = None
    stream = client.chat.completions.create(
        model="demo",
        messages=MESSAGES,
        max_tokens=100,
        tools=TOOLS,
        tool_choice="required",
        stream=True,
        seed=3,
        temperature=1.0,
    )
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            parts["name"] += part.function.name or ""
            parts["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    tool = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[parts["name"]]
    jsonschema.validate(json.loads(parts["arguments"]), tool)


def test_a_tool_loop_sends_the_call_and_its_result_back(client: openai.OpenAI) -> None:
    """The OpenAI tool loop: the call the server made goes back in the history with its
    result, and the next turn (``tool_choice`` "none": the tools stay in the prompt) answers
    in text; a result naming no call of the history is refused."""
    named = {"type": "function", "function": {"name": "get_time"}}
    first = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=40, tools=TOOLS, tool_choice=named
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    out = client.chat.completions.create(
        model="demo", messages=history, max_tokens=6, tools=TOOLS, tool_choice="none"
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens > first.usage.prompt_tokens
    history[-1] = {**history[-1], "tool_call_id": "call_unknown"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=history, max_tokens=4)
    assert info.value.body["param"] == "messages" and "call_unknown" in info.value.message


def test_unimplemented_tool_use_is_refused(client: openai.OpenAI) -> None:
    for extra in ({"tool_choice": "auto"}, {}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="demo", messages=MESSAGES, max_tokens=4, tools=TOOLS, **extra
            )
        assert info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            max_tokens=4,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=True,
        )
    assert info.value.body["param"] == "parallel_tool_calls"
