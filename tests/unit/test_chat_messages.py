"""Chat messages (``deployments.messages``): the OpenAI tool loop's history (assistant
``tool_calls``, ``tool`` results) and the ``developer`` role, validated with 400s naming the
field, and shaped for templates that know tools (checked against transformers' rendering)
and for templates that do not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deployments.messages import for_template, parse_messages, text_length
from deployments.protocol import OpenAIError
from engine.tokenizer import Tokenizer
from tests.tokenizer_builders import build_byte_level_bpe

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
WEATHER_ARGS = '{"city": "Oslo"}'
TIME_ARGS = '{"zone": "CET"}'
TOOL_LOOP = [
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": "Weather and time in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": WEATHER_ARGS}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": TIME_ARGS}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14:05"}]},
]  # fmt: skip
# A template that renders calls and results (written for these tests, in the shape tool-aware
# templates use: arguments through tojson, results with their call's id).
TOOL_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls or [] %}"
    "<call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>"
    "{%- endfor %}"
    "{%- if m.role == 'tool' %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n"
    "{%- endfor %}<|im_start|>assistant\n"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def refused(messages: list[Any]) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_messages(messages)
    assert info.value.status == 400 and info.value.param == "messages"
    return info.value


def test_a_tool_loop_parses_with_each_result_naming_its_function() -> None:
    parsed = parse_messages(TOOL_LOOP)
    assert [m["role"] for m in parsed] == ["developer", "user", "assistant", "tool", "tool"]
    assert parsed[2]["content"] is None and len(parsed[2]["tool_calls"]) == 2
    assert parsed[3] == {"role": "tool", "content": "-3 C", "tool_call_id": "call_1",
                         "name": "get_weather"}  # fmt: skip
    assert parsed[4]["content"] == "14:05" and parsed[4]["name"] == "get_time"
    assert text_length(parsed) == sum(map(len, [
        "Use the tools.", "Weather and time in Oslo?", "get_weather", WEATHER_ARGS, "get_time",
        TIME_ARGS, "-3 C", "14:05"]))  # fmt: skip


def _with_call(**change: Any) -> list[dict[str, Any]]:
    call = {**CALL, **change}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "tool", "tool_call_id": "call_1", "content": "1"}],
         "must follow an assistant message with 'tool_calls'"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
          {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
         "must follow an assistant message with 'tool_calls'"),
        ([*_with_call(), {"role": "tool", "tool_call_id": "call_9", "content": "1"}],
         "tool_call_id 'call_9' names no call"),
        ([*_with_call(), {"role": "user", "content": "x"},
          {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
         "must follow an assistant message"),
        (_with_call(function={"name": "f", "arguments": "\ud800"}), "not valid Unicode"),
        ([*_with_call(), {"role": "tool", "content": "1"}], "tool_call_id must be a string"),
        ([*_with_call(), {"role": "tool", "tool_call_id": "call_1"}],
         "messages[2].content must be a string"),
        ([*_with_call(), {"role": "tool", "tool_call_id": "call_1", "content": "1", "name": "f"}],
         "messages[2].name is not supported"),
        (_with_call(id=""), "tool_calls[0].id must be a string of 1 to"),
        (_with_call(id=7), "tool_calls[0].id must be a string of 1 to"),
        (_with_call(type="retrieval"), "tool_calls[0] must be a function call"),
        (_with_call(function={"name": "a b", "arguments": "{}"}), "function.name must match"),
        (_with_call(function={"name": "f", "arguments": {}}), "arguments must be a string"),
        (_with_call(function={"name": "f", "arguments": "{}", "x": 1}), "unexpected key 'x'"),
        (_with_call(extra=1), "unexpected key 'extra'"),
        ([{"role": "assistant", "tool_calls": []}], "must be a list of 1 to 128 calls"),
        ([{"role": "assistant", "tool_calls": [CALL, CALL]}], "two calls with the same id"),
        ([{"role": "user", "content": "hi", "tool_calls": [CALL]}],
         "messages[0].tool_calls is not supported"),
        ([{"role": "function", "content": "hi"}], "is not one of"),
    ],
)  # fmt: skip
def test_malformed_tool_history_is_refused_by_place(messages, says) -> None:
    assert says in refused(messages).message


def test_without_tool_support_calls_are_json_lines_and_results_one_user_turn() -> None:
    shaped = for_template(parse_messages(TOOL_LOOP), PLAIN_TEMPLATE)
    assert [m["role"] for m in shaped] == ["system", "user", "assistant", "user"]
    calls = [json.loads(line) for line in shaped[2]["content"].split("\n")]
    assert calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                     {"name": "get_time", "arguments": {"zone": "CET"}}]  # fmt: skip
    assert shaped[3]["content"] == "get_weather returned: -3 C\nget_time returned: 14:05"
    # text beside the calls comes first; arguments that do not parse stay text
    cut = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Os'}}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "Checking.", "tool_calls": [cut]},
               {"role": "tool", "tool_call_id": "call_1", "content": "?"},
               {"role": "user", "content": "And?"}]  # fmt: skip
    shaped = for_template(parse_messages(history), PLAIN_TEMPLATE)
    assert (
        shaped[1]["content"]
        == 'Checking.\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Os"}'
    )
    assert [m["role"] for m in shaped] == ["user", "assistant", "user", "user"]


def test_developer_stays_for_a_template_that_names_it() -> None:
    messages = parse_messages([{"role": "developer", "content": "d"}])
    assert for_template(messages, PLAIN_TEMPLATE)[0]["role"] == "system"
    template = "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{% endfor %}"
    assert for_template(messages, template)[0]["role"] == "developer"


def test_tool_aware_template_renders_as_transformers_does(tmp_path: Path) -> None:
    """transformers is handed the calls with their arguments as objects (how tool-aware chat
    templates expect them); ours parses the clients' JSON strings into the same."""
    transformers = pytest.importorskip("transformers")
    folder = build_byte_level_bpe(tmp_path / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer = Tokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOL_TEMPLATE
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in TOOL_LOOP[2]["tool_calls"]
    ]
    conversation = [
        {"role": "system", "content": "Use the tools."},  # it names no developer role
        TOOL_LOOP[1],
        {"role": "assistant", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "14:05"},
    ]
    theirs = hf.apply_chat_template(conversation, chat_template=TOOL_TEMPLATE, tokenize=False)
    shaped = for_template(parse_messages(TOOL_LOOP), TOOL_TEMPLATE)
    rendered = tokenizer.apply_chat_template(shaped)
    assert rendered == theirs
    assert '<call>get_weather {"city": "Oslo"}</call>' in rendered
    assert "-3 C [call_1]" in rendered and "<|im_start|>developer" not in rendered


def test_deeply_nested_arguments_stay_text() -> None:
    """As for the body: nothing parses JSON nested past MAX_JSON_DEPTH (Python's parser would
    recurse until it fails)."""
    deep = "[" * 5000 + "]" * 5000
    call = {**CALL, "function": {"name": "f", "arguments": deep}}
    messages = parse_messages([{"role": "assistant", "tool_calls": [call]}])
    line = for_template(messages, PLAIN_TEMPLATE)[0]["content"]
    assert json.loads(line) == {"name": "f", "arguments": deep}
    structured = for_template(messages, TOOL_TEMPLATE)[0]["tool_calls"][0]
    assert structured["function"]["arguments"] == deep


def test_the_ingress_renders_a_tool_loop_and_tool_choice_none(builder) -> None:
    """The demo template knows no tools: the calls and results reach the prompt as text, and
    with ``tool_choice`` "none" the tools are listed while the output stays free text."""
    tools = [
        {"type": "function", "function": {"name": name}} for name in ("get_weather", "get_time")
    ]
    body = {"messages": TOOL_LOOP, "tools": tools, "tool_choice": "none", "max_tokens": 4}
    fields, request = builder.request(body, chat=True)
    assert request.constraint is None and builder.output_options(fields).tools is None
    text = builder.tokenizer.decode(list(request.prompt_ids), True)
    assert '"name": "get_weather"' in text  # the tools' listing
    assert '{"name": "get_time", "arguments": {"zone": "CET"}}' in text
    assert (
        "<|im_start|>user\nget_weather returned: -3 C\nget_time returned: 14:05<|im_end|>" in text
    )
    assert "<|im_start|>system\nUse the tools." in text
    forced = builder.request({**body, "tool_choice": "required"}, chat=True)[0]
    assert builder.output_options(forced).tools is forced.tools
