"""Reasoning models: the thinking split from the answer (``serving.reasoning_parser: think``),
streamed and whole alike, together with tool calls the answer makes; the request's
``include_reasoning`` and ``chat_template_kwargs``, an earlier turn's ``reasoning_content``
and the preset's ``model.chat_template``. No Ray, no model (the prompt builder uses the demo
model's tokenizer)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deployments.choices import ChoiceState, OutputOptions, full_body
from deployments.messages import for_template, parse_messages
from deployments.output_reader import Reasoning
from deployments.preset import ModelPreset, ServingPreset
from deployments.protocol import OpenAIError, parse_fields
from deployments.reasoning import ThinkReader, opens_thinking
from deployments.responses import ResponseFormat
from deployments.tool_parsers import CALL_SYNTAXES

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def split(opened: bool, pieces: list[str]) -> tuple[str, str]:
    reader = ThinkReader(opened)
    reasoning, content = [], []
    for piece in [*pieces, None]:
        part = reader.feed(piece) if piece is not None else reader.finish()
        reasoning.append(part.reasoning)
        content.append(part.content)
    return "".join(reasoning), "".join(content)


CASES = [
    # (the prompt opened a block, output, reasoning, content)
    (False, "<think>\nThe user asks.\n</think>\n\nParis.", "The user asks.", "Paris."),  # Qwen3
    (True, "Let me see.\n</think>\n\nParis.", "Let me see.", "Paris."),  # DeepSeek-R1
    (True, "<think>x</think>y", "x", "y"),  # a block the prompt opened, opened again
    (False, "  Paris.", "", "  Paris."),  # no thinking: the answer exactly as written
    (False, "Paris </think> x", "", "Paris </think> x"),
    (False, "<think>\nhmm, cut ", "hmm, cut", ""),  # max_tokens while thinking
    (False, "<thi", "", "<thi"),
    (True, "<thi", "<thi", ""),
    (True, " \n", "", ""),
    (False, "<think></think>", "", ""),
    (False, "<think>a\n\nb</think>\n<think>c</think>", "a\n\nb", "<think>c</think>"),
]


@pytest.mark.parametrize(("opened", "output", "reasoning", "content"), CASES)
def test_thinking_splits_from_the_answer_whatever_the_chunking(
    opened, output, reasoning, content
) -> None:
    assert split(opened, [output]) == (reasoning, content)
    for cut in range(len(output) + 1):
        assert split(opened, [output[:cut], output[cut:]]) == (reasoning, content), cut
    rng = random.Random(len(output))
    for _ in range(20):
        cuts = sorted(rng.randint(0, len(output)) for _ in range(rng.randint(1, 10)))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
        assert split(opened, pieces) == (reasoning, content), pieces


def test_thinking_streams_as_it_comes() -> None:
    reader = ThinkReader(False)
    assert reader.feed("<think>Step one. ").reasoning == "Step one."
    assert reader.feed("Step two.</th").reasoning == " Step two."
    part = reader.feed("ink>\n\nThe answer")
    assert (part.reasoning, part.content) == ("", "The answer")


def test_a_prompt_opens_thinking_when_it_ends_inside_a_block() -> None:
    assert opens_thinking("<｜Assistant｜><think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")


def test_the_preset_names_a_reasoning_parser() -> None:
    assert ServingPreset.parse({"reasoning_parser": "think"}).reasoning_parser == "think"
    with pytest.raises(ValueError, match="reasoning_parser 'r1' is not one of"):
        ServingPreset.parse({"reasoning_parser": "r1"})


# -- responses -------------------------------------------------------------------------------


def replica_messages(pieces: list[str], reason: str) -> list[dict[str, Any]]:
    out = [{"index": 0, "text": p, "token_ids": [5], "eos": False} for p in pieces]
    out[-1].update(eos=True, eos_reason=reason, prompt_tokens=3, new_tokens=len(pieces))
    out[-1]["cached_tokens"] = 0
    return out


def respond(pieces: list[str], reason: str, **options) -> tuple[dict, list[dict]]:
    """The whole response's choice and the streamed deltas (with finish reasons)."""
    fmt = ResponseFormat.new(True, "demo")
    whole = ChoiceState(0, fmt, OutputOptions(**options))
    for message in replica_messages(pieces, reason):
        whole.add(message)
    streamed = ChoiceState(0, fmt, OutputOptions(**options))
    chunks = [c for m in replica_messages(pieces, reason) for c in streamed.chunks(m)]
    deltas = [{**c["choices"][0]["delta"], "finish": c["choices"][0]["finish_reason"]}
              for c in chunks]  # fmt: skip
    return full_body(fmt, [whole])["choices"][0], deltas


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_reasoning_content_in_the_body_and_the_stream() -> None:
    pieces = ["<think>\nThe user", " asks.\n</thi", "nk>\n\nPar", "is."]
    choice, deltas = respond(pieces, "stop_token", reasoning=Reasoning(False))
    assert choice["message"] == {
        "role": "assistant", "content": "Paris.", "reasoning_content": "The user asks."
    }  # fmt: skip
    assert choice["finish_reason"] == "stop"
    assert joined(deltas, "reasoning_content") == "The user asks."
    assert joined(deltas, "content") == "Paris." and deltas[-1]["finish"] == "stop"
    hidden, deltas = respond(pieces, "stop_token", reasoning=Reasoning(False, shown=False))
    assert hidden["message"] == {"role": "assistant", "content": "Paris."}
    assert not joined(deltas, "reasoning_content") and joined(deltas, "content") == "Paris."


def test_thinking_cut_by_max_tokens_has_no_answer() -> None:
    choice, _ = respond(["Still thinking"], "max_new_tokens", reasoning=Reasoning(True))
    assert choice["message"]["reasoning_content"] == "Still thinking"
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
    plain, _ = respond(["Paris."], "stop_token", reasoning=Reasoning(False))
    assert plain["message"]["reasoning_content"] is None


def test_the_answer_after_thinking_may_call_tools() -> None:
    tools = parse_fields({"messages": USER, "tools": [WEATHER]}, True, 100, CALL_SYNTAXES["hermes"])
    pieces = ["<think>I need the weather.</think>\n", '<tool_call>{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}</tool_call>']  # fmt: skip
    choice, deltas = respond(pieces, "stop_token", reasoning=Reasoning(False), tools=tools.tools)
    message = choice["message"]
    assert message["reasoning_content"] == "I need the weather." and message["content"] is None
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Oslo"}']
    assert choice["finish_reason"] == "tool_calls" and deltas[-1]["finish"] == "tool_calls"
    assert joined(deltas, "reasoning_content") == "I need the weather."
    assert [p["function"]["name"] for d in deltas for p in d.get("tool_calls", ())] == [
        "get_weather"
    ]


# -- requests and prompts --------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}\n{% endfor %}"
    "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% else %}<think>\n{% endif %}"
)


@pytest.fixture
def thinking(builder, monkeypatch: pytest.MonkeyPatch):
    """The demo builder with a reasoning parser and a template that opens a block (unless
    ``enable_thinking`` is false)."""
    monkeypatch.setattr(builder.tokenizer, "chat_template", THINKING_TEMPLATE)
    monkeypatch.setattr(builder, "reasoning_parser", "think")
    return builder


def test_the_prompt_decides_whether_the_output_starts_thinking(thinking) -> None:
    options = thinking.prepared({"messages": USER}, chat=True).options
    assert options.reasoning == Reasoning(opened=True, shown=True)
    off = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    prepared = thinking.prepared(off, chat=True)
    assert prepared.options.reasoning == Reasoning(opened=False, shown=True)
    text = thinking.tokenizer.decode(list(prepared.generation.prompt_ids), True)
    assert text.endswith("<think></think>")
    hidden = thinking.prepared({"messages": USER, "include_reasoning": False}, chat=True)
    assert hidden.options.reasoning == Reasoning(opened=True, shown=False)


def test_a_constrained_answer_comes_after_the_thinking(thinking) -> None:
    """With a reasoning parser, ``response_format`` (or a guided field) holds for the answer
    after the thinking (``ConstraintSpec.thinking``); a forced tool call is constrained from
    its first token and does not think; completions are never split."""
    body = {"messages": USER, "response_format": {"type": "json_object"}}
    prepared = thinking.prepared(body, chat=True)
    assert prepared.generation.constraint.thinking == "open"  # the template opened the block
    assert prepared.options.reasoning == Reasoning(opened=True)
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    assert thinking.prepared(off, chat=True).generation.constraint.thinking == "optional"
    text = {"prompt": "x", "guided_regex": "[0-9]+"}
    assert thinking.prepared(text, chat=False).generation.constraint.thinking is None
    thinking.call_syntax = CALL_SYNTAXES["hermes"]
    try:
        forced = {"messages": USER, "tools": [WEATHER], "tool_choice": "required"}
        prepared = thinking.prepared(forced, chat=True)
        assert prepared.generation.constraint.thinking is None
        assert prepared.options.reasoning is None
    finally:
        thinking.call_syntax = None
    pieces = ["Cold, I", " think.</think>\n", '{"temp"', ": -3}"]
    choice, deltas = respond(pieces, "end_filter", reasoning=Reasoning(True))
    assert choice["message"]["reasoning_content"] == "Cold, I think."
    assert choice["message"]["content"] == '{"temp": -3}'
    assert joined(deltas, "content") == '{"temp": -3}'


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"enable_search": True}, "does not use 'enable_search'"),
        ({"add_generation_prompt": False}, "is set by the server"),
        ({"bos_token": "x"}, "is set by the server"),
        ({"not a name": 1}, "is not a variable name"),
        ([1], "must be an object"),
        ({f"v{i}": 1 for i in range(17)}, "at most 16"),
    ],
)
def test_chat_template_kwargs_the_template_cannot_use_are_refused(thinking, kwargs, says) -> None:
    with pytest.raises(OpenAIError) as info:
        thinking.request({"messages": USER, "chat_template_kwargs": kwargs}, chat=True)
    assert info.value.param == "chat_template_kwargs" and says in info.value.message


def test_include_reasoning_needs_a_reasoning_parser(builder) -> None:
    builder.prepared({"messages": USER, "include_reasoning": True}, chat=True)  # the default
    with pytest.raises(OpenAIError) as info:
        builder.prepared({"messages": USER, "include_reasoning": False}, chat=True)
    assert info.value.param == "include_reasoning" and "serving.reasoning_parser" in str(info.value)
    with pytest.raises(OpenAIError, match="unknown field 'include_reasoning'"):
        builder.prepared({"prompt": "x", "include_reasoning": False}, chat=False)


def test_an_earlier_turns_thinking_reaches_only_a_template_that_reads_it(thinking) -> None:
    sent_back = [*USER, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
                 {"role": "user", "content": "And?"}]  # fmt: skip
    messages = parse_messages(sent_back)
    assert messages[1]["reasoning_content"] == "Greet."
    assert "reasoning_content" not in for_template(messages, "{{ messages }}")[1]
    ids = thinking.chat_ids({"messages": sent_back})
    assert "Hello.[Greet.]" in thinking.tokenizer.decode(ids, True)
    with pytest.raises(OpenAIError, match="reasoning_content"):
        parse_messages([{"role": "user", "content": "x", "reasoning_content": "y"}])


def test_the_preset_can_replace_the_chat_template(tmp_path) -> None:
    file = tmp_path / "template.jinja"
    file.write_text(THINKING_TEMPLATE)
    assert ModelPreset.parse({"demo": {}, "chat_template": str(file)}).chat_template == (
        THINKING_TEMPLATE
    )
    with pytest.raises(ValueError, match=r"model\.chat_template .* cannot be read"):
        ModelPreset.parse({"demo": {}, "chat_template": str(tmp_path / "missing.jinja")})
    file.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"model\.chat_template .* is not a valid template"):
        ModelPreset.parse({"demo": {}, "chat_template": str(file)})


def test_a_batch_record_shows_the_answer_the_thinking_and_the_calls(thinking, monkeypatch) -> None:
    import asyncio

    from deployments.batch import Validator, generate_record
    from deployments.batch_records import Item

    monkeypatch.setattr(thinking, "call_syntax", CALL_SYNTAXES["hermes"])
    body = {"messages": USER, "tools": [WEATHER]}
    item = Item(1, "x", body, chat=True)
    request, options = Validator(thinking).prepare(item)
    assert options.tools.auto and options.reasoning == Reasoning(opened=True)
    text = 'Cold?</think><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'

    async def generate(_request):
        yield {"index": 0, "text": text, "token_ids": [1, 2], "eos": True,
               "eos_reason": "stop_token", "prompt_tokens": 5, "new_tokens": 2,
               "cached_tokens": 0}  # fmt: skip

    record = asyncio.run(generate_record(item, request, generate, options))
    assert record["text"] == "" and record["reasoning_content"] == "Cold?"
    assert [c["function"]["name"] for c in record["tool_calls"]] == ["get_weather"]
    assert record["finish_reason"] == "tool_calls"
