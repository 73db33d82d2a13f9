"""End to end: the Serve app (Ingress + 2 LLMServer replicas behind the prefix-aware router) on
a real local Ray cluster, driven with the ``openai`` client over HTTP. The demo model is built
into a tmp dir."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from deployments.app import build_app  # noqa: E402
from tests.serve.live import shared_serve, start_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


def _post(url: str, data: bytes) -> tuple[int, str, list[str]]:
    """POST raw bytes; (status, content type, non-empty body lines), errors included."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers["Content-Type"], _lines(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], _lines(e.read())


def _lines(body: bytes) -> list[str]:
    return [line for line in body.decode().splitlines() if line]


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest) -> str:
    return start_app(request, "configs/demo.yaml", "pagedserve")


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _check_usage(usage, max_tokens: int) -> None:
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= max_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_health_and_models(base_url: str, client: openai.OpenAI) -> None:
    with urllib.request.urlopen(f"{base_url}/health", timeout=30) as r:
        assert r.status == 200
    assert [m.id for m in client.models.list().data] == ["demo"]
    card = client.models.retrieve("demo")
    assert card.id == "demo" and card.object == "model" and card.owned_by == "pagedserve"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("org/other-model")
    assert info.value.body["code"] == "model_not_found"
    built = any(shared_serve().cache_dir.iterdir())
    assert built, "the demo model should be built under PAGEDSERVE_CACHE"


def test_several_prompts_in_one_completion(client: openai.OpenAI) -> None:
    """OpenAI's batched ``prompt``: prompt p's choice i is choice p * n + i, each as the prompt
    alone would give it (greedy), streamed too; usage counts each prompt once."""
    prompts = ["Once upon", "The cat sat on the"]
    alone = [
        client.completions.create(model="demo", prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    out = client.completions.create(model="demo", prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    expected = [a.choices[0].text for a in alone for _ in range(2)]
    assert [c.text for c in out.choices] == expected
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert out.usage.completion_tokens == 4 * 6
    texts = ["", "", "", ""]
    stream = client.completions.create(
        model="demo", prompt=prompts, max_tokens=6, temperature=0, n=2, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected


def test_echo_scores_the_prompt_as_generation_scores_tokens(client: openai.OpenAI) -> None:
    """lm-eval's loglikelihood request (token-id prompts, batched, ``echo`` with
    ``logprobs: 1`` and ``max_tokens: 1``): a prompt token's log-probability is the raw one the
    model gives that token when it is generated there (forced by ``logit_bias``, which the
    reported log-probabilities do not include)."""
    prompt = [5, 17, 42, 9, 3, 77]
    forced = client.completions.create(
        model="demo", prompt=prompt[:-1], max_tokens=1, logprobs=0,
        logit_bias={str(prompt[-1]): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    out = client.completions.create(
        model="demo", prompt=[prompt, [8, 8]], max_tokens=1, temperature=0, logprobs=1,
        extra_body={"echo": True, "ignore_eos": True},
    )  # fmt: skip
    scored = out.choices[0].logprobs
    assert len(scored.token_logprobs) == len(prompt) + 1  # the prompt's, then the new token's
    assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
    assert scored.token_logprobs[len(prompt) - 1] == pytest.approx(
        forced.choices[0].logprobs.token_logprobs[0], abs=1e-3
    )
    greedy = max(scored.top_logprobs[-1], key=scored.top_logprobs[-1].get)
    assert scored.tokens[-1] == greedy  # temperature 0: the new token is the top one
    assert out.choices[0].text.endswith(scored.tokens[-1])
    assert len(out.choices[1].logprobs.token_logprobs) == 3
    assert out.usage.prompt_tokens == len(prompt) + 2


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="demo", prompt="Once upon", max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert out.object == "text_completion"
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    _check_usage(out.usage, 12)
    # Greedy is deterministic; a stop string cuts the same text before its first occurrence.
    again = client.completions.create(
        model="demo", prompt="Once upon", max_tokens=12, temperature=0
    )
    assert again.choices[0].text == choice.text
    if len(choice.text) >= 6 and choice.finish_reason == "length":
        stop = choice.text[3:5]
        cut = client.completions.create(
            model="demo", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == choice.text[: choice.text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    texts = {
        client.completions.create(
            model="demo", prompt="Hello", max_tokens=10, temperature=1.0, seed=42
        )
        .choices[0]
        .text
        for _ in range(2)
    }
    assert len(texts) == 1


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert isinstance(out.choices[0].message.content, str)
    _check_usage(out.usage, 8)


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = {"model": "demo", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == full.choices[0].message.content
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_raw_sse_ends_with_done(base_url: str) -> None:
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 4, "stream": True}
    status, content_type, events = _post(f"{base_url}/v1/completions", json.dumps(body).encode())
    assert status == 200 and content_type.startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_n_choices(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="demo", prompt="The river", max_tokens=6, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    # completion tokens add up over the choices; the prompt counts once
    assert 3 <= out.usage.completion_tokens <= 18
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=5, n=2, stream=True, temperature=0
    )
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1]  # greedy: both choices agree


def test_cached_tokens_are_reported(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens >= 0.8 * first.usage.prompt_tokens


def test_token_id_prompt_logit_bias_and_ignore_eos(base_url: str) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "logit_bias": {"42": 100}, "ignore_eos": True}
    status, _, lines = _post(f"{base_url}/v1/completions", json.dumps(body).encode())
    assert status == 200, lines
    out = json.loads(lines[0])
    assert out["usage"]["prompt_tokens"] == 4 and out["usage"]["completion_tokens"] == 5


def test_tokenize_and_detokenize(base_url: str, client: openai.OpenAI) -> None:
    """vLLM's routes: the ids are the ones a request's usage counts; a wrong model is a 404."""
    status, _, lines = _post(f"{base_url}/tokenize", json.dumps({"messages": MESSAGES}).encode())
    assert status == 200, lines
    out = json.loads(lines[0])
    chat = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=1)
    assert out["count"] == len(out["tokens"]) == chat.usage.prompt_tokens
    back = json.dumps({"model": "demo", "tokens": out["tokens"]}).encode()
    status, _, lines = _post(f"{base_url}/detokenize", back)
    assert status == 200 and "Tell me about the sea." in json.loads(lines[0])["prompt"]
    wrong = json.dumps({"model": "other", "prompt": "x"}).encode()
    status, _, lines = _post(f"{base_url}/tokenize", wrong)
    assert status == 404 and json.loads(lines[0])["error"]["code"] == "model_not_found"


def test_stats_per_replica(base_url: str, client: openai.OpenAI) -> None:
    client.completions.create(model="demo", prompt="Hi", max_tokens=2)
    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=30) as r:
        stats = json.loads(r.read())
    replicas = stats["replicas"]
    assert len(replicas) == 2
    for replica in replicas:
        assert {"pages_total", "pages_in_use", "requests_served", "jobs_running"} <= set(replica)
    assert sum(r["requests_served"] for r in replicas) > 0


def test_errors(base_url: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=4)
    assert not_found.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="demo", prompt="Hi", max_tokens=-1)
    assert bad.value.status_code == 400
    assert bad.value.body["param"] == "max_tokens"
    for body, param in [
        ({"prompt": "Hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "Hi", "stop": [1]}, "stop"),
        ({"prompt": 5}, "prompt"),
    ]:
        status, _, lines = _post(f"{base_url}/v1/completions", json.dumps(body).encode())
        assert (status, json.loads(lines[0])["error"]["param"]) == (400, param)
    status, _, lines = _post(f"{base_url}/v1/chat/completions", b"{not json")
    assert status == 400
    assert set(json.loads(lines[0])["error"]) == {"message", "type", "param", "code"}
    long_prompt = json.dumps({"prompt": "word " * 5000}).encode()
    status, _, lines = _post(f"{base_url}/v1/completions", long_prompt)
    assert status == 400
    assert json.loads(lines[0])["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("completions", {}, "prompt"),
        ("completions", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
        ("completions", {"prompt": "Hi", "max_tokens": "5"}, "max_tokens"),
        ("completions", {"prompt": "Hi", "n": 0}, "n"),
        ("completions", {"prompt": "Hi", "top_p": 2}, "top_p"),
        ("completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
        ("completions", {"prompt": "Hi", "seed": 1.5}, "seed"),
        ("completions", {"prompt": [10**9]}, "prompt"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": "hi"}, "messages"),
        ("chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
        ("chat/completions", {"messages": MESSAGES, "presence_penalty": 9}, "presence_penalty"),
    ],
)
def test_bad_input_gets_400_and_server_stays_healthy(
    base_url: str, client: openai.OpenAI, route: str, body: dict, param: str
) -> None:
    status, _, lines = _post(f"{base_url}/v1/{route}", json.dumps(body).encode())
    error = json.loads(lines[0])["error"]
    assert (status, error["param"]) == (400, param), error
    assert set(error) == {"message", "type", "param", "code"}
    out = client.completions.create(model="demo", prompt="still fine", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("args", [{}, {"config": "configs/demo.yaml", "extra": 1}])
def test_build_app_rejects_bad_args(args: dict) -> None:
    with pytest.raises(ValueError, match=r"config|extra"):
        build_app(args)


def _stats(base_url: str) -> list[dict]:
    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=30) as r:
        return json.loads(r.read())["replicas"]


def test_client_disconnect_cancels_the_job_and_frees_pages(base_url: str) -> None:
    body = {"prompt": "Tell me a long story", "max_tokens": 3000, "stream": True}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    response = urllib.request.urlopen(req, timeout=60)
    assert response.readline().startswith(b"data: ")  # generation is under way
    assert sum(r["requests_active"] for r in _stats(base_url)) >= 1
    response.close()  # the client goes away mid-stream
    replicas = _wait_idle(base_url)
    assert all(r["pages_in_use"] == 0 for r in replicas), replicas
    assert all(r["requests_active"] == 0 for r in replicas), replicas


def _wait_idle(base_url: str, timeout_s: float = 30.0) -> list[dict]:
    """The replicas' stats once none has a request or a page in use (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = _stats(base_url)
        idle = all(r["requests_active"] == 0 and r["pages_in_use"] == 0 for r in replicas)
        if idle or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


# -- hostile input: every request gets a 4xx with an OpenAI error body and no internals -------

DEEP = b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
CHAT = {"messages": MESSAGES}
CHAT_ROUTE = "chat/completions"
J = "application/json"


def user(content: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]}


HOSTILE: list[tuple[str, str, bytes | dict | list | str, int]] = [
    # (route, content type, body, status)
    ("completions", J, b"", 400),
    ("completions", J, b"null", 400),
    ("completions", J, b"[]", 400),
    ("completions", J, b'"text"', 400),
    ("completions", J, b"\xff\xfe\x00", 400),
    ("completions", J, b'{"prompt": "Hi",}', 400),
    ("completions", J, b'{"prompt": NaN}', 400),
    ("completions", J, DEEP, 400),
    (CHAT_ROUTE, J, b"[" * 100_000, 400),
    ("completions", "text/plain", b"prompt=Hi", 400),
    ("completions", "application/x-www-form-urlencoded", b"prompt=Hi&max_tokens=2", 400),
    ("completions", J, {"prompt": "Hi", "top_k": 2**63}, 400),
    ("completions", J, {"prompt": "Hi", "top_k": 10**30}, 400),
    ("completions", J, {"prompt": "Hi", "top_k": -2}, 400),
    ("completions", J, {"prompt": "Hi", "seed": 2**64}, 400),
    ("completions", J, {"prompt": "Hi", "seed": -(2**70)}, 400),
    ("completions", J, {"prompt": "Hi", "seed": "1"}, 400),
    ("completions", J, {"prompt": "Hi", "n": 10**12}, 400),
    ("completions", J, {"prompt": "Hi", "n": True}, 400),
    ("completions", J, {"prompt": "Hi", "max_tokens": 2**100}, 400),
    ("completions", J, {"prompt": "Hi", "max_tokens": 0}, 400),
    ("completions", J, {"prompt": "Hi", "max_tokens": 1.0}, 400),
    ("completions", J, {"prompt": "Hi", "min_tokens": -1}, 400),
    ("completions", J, {"prompt": "Hi", "min_tokens": 2**40}, 400),
    ("completions", J, {"prompt": "Hi", "temperature": -1}, 400),
    ("completions", J, {"prompt": "Hi", "temperature": 1e308}, 400),
    ("completions", J, {"prompt": "Hi", "temperature": [1]}, 400),
    ("completions", J, {"prompt": "Hi", "top_p": 0}, 400),
    ("completions", J, {"prompt": "Hi", "min_p": 1}, 400),
    ("completions", J, {"prompt": "Hi", "repetition_penalty": 0}, 400),
    ("completions", J, {"prompt": "Hi", "frequency_penalty": 3}, 400),
    ("completions", J, {"prompt": "Hi", "stop": "x" * 10_000}, 400),
    ("completions", J, {"prompt": "Hi", "stop": ["a"] * 100}, 400),
    ("completions", J, {"prompt": "Hi", "stop": {"a": 1}}, 400),
    ("completions", J, {"prompt": "Hi", "stop": "\ud800"}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": [1, 2]}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": {"-1": 1}}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": {"1e3": 1}}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": {"5": 1000}}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": {"5": "up"}}, 400),
    ("completions", J, {"prompt": "Hi", "logit_bias": {"9" * 40: 1}}, 400),
    ("completions", J, {"prompt": "Hi", "ignore_eos": "yes"}, 400),
    ("completions", J, {"prompt": "Hi", "stream": 1}, 400),
    ("completions", J, {"prompt": "Hi", "stream_options": []}, 400),
    ("completions", J, {"prompt": "Hi", "stream_options": {"x": 1}}, 400),
    ("completions", J, {"prompt": "Hi", "logprobs": 50}, 400),
    ("completions", J, {"prompt": "Hi", "echo": 1}, 400),
    ("completions", J, {"prompt": "Hi", "best_of": 3}, 400),
    ("completions", J, {"prompt": "Hi", "suffix": "end"}, 400),
    ("completions", J, {"prompt": "Hi", "messages": MESSAGES}, 400),
    ("completions", J, {"prompt": "Hi", "frobnicate": 1}, 400),
    ("completions", J, {"prompt": "\ud800"}, 400),
    ("completions", J, {"prompt": ["a"] * 129}, 400),
    ("completions", J, {"prompt": ["a", {"text": "b"}]}, 400),
    ("completions", J, {"prompt": ["a", [-1]]}, 400),
    ("completions", J, {"prompt": [1, "a"]}, 400),
    ("completions", J, {"prompt": [-1]}, 400),
    ("completions", J, {"prompt": [True]}, 400),
    ("completions", J, {"prompt": ""}, 400),
    ("completions", J, {"prompt": {"text": "Hi"}}, 400),
    ("completions", J, {"prompt": "Hi", "model": 5}, 400),
    ("completions", J, {"prompt": "Hi", "model": "\ud800"}, 400),
    ("completions", J, {"prompt": "Hi", "model": "x" * 100_000}, 404),
    ("completions", J, {"prompt": "Hi", "user": ["me"]}, 400),
    ("completions", J, {"prompt": "x" * 3_000_000}, 400),
    ("completions", J, {"prompt": "x" * 5_000_000}, 413),
    (CHAT_ROUTE, J, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT_ROUTE, J, {"messages": [{"role": "tool", "content": "x"}]}, 400),
    (CHAT_ROUTE, J, {"messages": [{"role": "user"}], "tools": [{}]}, 400),
    (CHAT_ROUTE, J, {**CHAT, "logprobs": 3}, 400),
    (CHAT_ROUTE, J, {**CHAT, "top_logprobs": 3}, 400),
    (CHAT_ROUTE, J, {**CHAT, "functions": [{"name": "f"}]}, 400),
    (CHAT_ROUTE, J, {**CHAT, "response_format": {"type": "xml"}}, 400),
    (CHAT_ROUTE, J, {**CHAT, "tool_choice": "auto"}, 400),
    (CHAT_ROUTE, J, {**CHAT, "prompt": "Hi"}, 400),
    (CHAT_ROUTE, J, {**CHAT, "max_completion_tokens": -5}, 400),
    (CHAT_ROUTE, J, user("\udfff"), 400),
    (CHAT_ROUTE, J, user(5), 400),
    (CHAT_ROUTE, J, user([{"type": "image_url"}]), 400),
    (CHAT_ROUTE, J, {"messages": [{**MESSAGES[0], "name": "bob"}]}, 400),
    (CHAT_ROUTE, J, {"messages": [{"role": ["user"], "content": "x"}]}, 400),
    (CHAT_ROUTE, J, {"messages": MESSAGES * 2000}, 400),
    (CHAT_ROUTE, J, {"messages": [["user", "x"]]}, 400),
    (CHAT_ROUTE, J, {"messages": {"role": "user"}}, 400),
]  # fmt: skip
INTERNALS = ("Traceback", "pid=", "actor_id", "ray::", "ip=", 'File "', "Error(")


def _send(url: str, method: str, data: bytes | None, content_type: str) -> tuple[int, bytes]:
    headers = {"Content-Type": content_type}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _assert_clean_error(status: int, body: bytes, expected: int) -> None:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert not any(marker in error["message"] for marker in INTERNALS), error


@pytest.mark.parametrize(("route", "content_type", "body", "status"), HOSTILE)
def test_hostile_requests_get_clean_4xx(
    base_url: str, route: str, content_type: str, body: Any, status: int
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    _assert_clean_error(*_send(f"{base_url}/v1/{route}", "POST", data, content_type), status)


ASK = [{"role": "user", "content": "x"}]
HOSTILE_ELSEWHERE: list[tuple[str, bytes | dict, int]] = [
    # (path, body, status): the Responses and Messages APIs, /tokenize and /detokenize
    ("/v1/responses", b"", 400),
    ("/v1/responses", b"[]", 400),
    ("/v1/responses", {"input": "x", "store": True}, 400),
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, 400),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "nope",
                                  "output": "x"}]}, 400),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text",
                                                              "text": "\ud800"}]}]}, 400),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": [5]}]}, 400),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "a b"}]}, 400),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2**100}, 400),
    ("/v1/responses", {"input": "x" * 3_000_000}, 400),
    ("/v1/responses", {"input": "x", "model": "other"}, 404),
    ("/v1/messages", b"{", 400),
    ("/v1/messages", {"messages": ASK}, 400),
    ("/v1/messages", {"max_tokens": 5, "messages": "x"}, 400),
    ("/v1/messages", {"max_tokens": 2**70, "messages": ASK}, 400),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "y"}]}]}, 400),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]}, 400),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "system": [{"type": "image"}]}, 400),
    ("/v1/messages", {"max_tokens": 5, "messages": ASK, "model": "other"}, 404),
    ("/v1/messages/count_tokens", {"messages": [{"role": "system", "content": "x"}]}, 400),
    ("/tokenize", {"prompt": ["a"]}, 400),
    ("/tokenize", {"messages": "x"}, 400),
    ("/tokenize", {"prompt": "x" * 5_000_000}, 413),
    ("/detokenize", {"tokens": [[1]]}, 400),
    ("/detokenize", {"tokens": list(range(100_000))}, 400),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status"), HOSTILE_ELSEWHERE)
def test_hostile_requests_to_the_other_apis_get_clean_4xx(
    base_url: str, path: str, body: Any, status: int
) -> None:
    """Each API answers in its own error shape (Anthropic's for /v1/messages), without
    internals, and the server keeps serving."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, raw = _send(base_url + path, "POST", data, "application/json")
    if not path.startswith("/v1/messages"):
        _assert_clean_error(got, raw, status)
        return
    assert got == status, raw[:300]
    shown = json.loads(raw)
    assert shown["type"] == "error" and set(shown["error"]) == {"type", "message"}
    assert not any(marker in shown["error"]["message"] for marker in INTERNALS), shown


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/completions", 405),
        ("PUT", "/v1/chat/completions", 405),
        ("DELETE", "/v1/models", 405),
        ("POST", "/v1/nothing", 404),
        ("GET", "/../../etc/passwd", 404),
    ],
)
def test_wrong_methods_and_paths(base_url: str, method: str, path: str, status: int) -> None:
    data = b"{}" if method in ("POST", "PUT") else None
    _assert_clean_error(*_send(base_url + path, method, data, "application/json"), status)


def test_health_answers_while_big_prompts_are_refused(base_url: str) -> None:
    """/health keeps answering while big prompts are parsed and refused (that the parse runs off
    the event loop is checked structurally in tests/unit/test_ingress_off_loop.py, not timed)."""
    big = json.dumps({"prompt": "word " * 700_000, "max_tokens": 2}).encode()  # ~3.5 MB
    results: list[tuple[int, bytes]] = []

    def send() -> None:
        results.append(_send(f"{base_url}/v1/completions", "POST", big, J))

    senders = [threading.Thread(target=send) for _ in range(3)]
    for sender in senders:
        sender.start()
    answered = 0
    while any(s.is_alive() for s in senders):
        with urllib.request.urlopen(f"{base_url}/health", timeout=30) as r:
            assert r.status == 200
        answered += 1
        time.sleep(0.02)
    for sender in senders:
        sender.join()
    assert [status for status, _ in results] == [400] * 3
    assert answered >= 1


@pytest.fixture(scope="module")
def library(base_url: str):
    """The replicas' demo model in this process, to compare served output with the library's
    (``base_url`` first: it sets the cache folder the demo model is built in)."""
    from deployments.preset import Preset
    from engine import DynamicGenerator, Model, PagedCache, Tokenizer

    path = Preset.load("configs/demo.yaml").model.resolve_path()
    model = Model.from_pretrained(path, device="cpu", dtype="float32")
    tokenizer = Tokenizer.from_pretrained(path)
    return model, tokenizer, DynamicGenerator(model, PagedCache(model, 1024), tokenizer)


def _library_greedy(library, input_ids: list[int], max_new_tokens: int, embeddings=()) -> str:
    from engine import DynamicJob, SamplerSettings

    generator = library[2]
    job = DynamicJob(
        input_ids,
        max_new_tokens,
        stop_conditions=[],
        gen_settings=SamplerSettings.greedy(),
        embeddings=list(embeddings),
    )
    generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    return job.full_completion


def _random_rows(hidden_size: int, n: int, seed: int):
    import torch

    return torch.randn(n, hidden_size, generator=torch.Generator().manual_seed(seed))


def test_prompt_embeds_give_the_librarys_greedy_tokens(
    client: openai.OpenAI, library, base_url: str
) -> None:
    """The same rows through HTTP (``prompt_embeds``) and through the library's job API give the
    same greedy completion; the second request reuses the first one's pages (content hashes)."""
    from deployments.prompt_embeds import encode_rows
    from engine import MMEmbedding

    model = library[0]
    # 136 rows: 8 full pages of 16. (With 2 pages, a stale load report sent the second
    # request to the other replica, CI twice, until reports listed their requests; see
    # test_follow_ups_on_a_short_prompt_stay_on_its_replica.)
    rows = _random_rows(model.config.hidden_size, 136, seed=3)
    embedding = MMEmbedding(rows.to(model.dtype), model=model)
    expected = _library_greedy(library, list(embedding.placeholder_ids), 8, [embedding])
    body = {"prompt_embeds": encode_rows(rows), "ignore_eos": True}
    # the router weighs a replica's in-flight requests against uncached pages: a request still
    # finishing from an earlier test could send the second request elsewhere
    assert all(r["requests_active"] == 0 for r in _wait_idle(base_url))
    served = [
        client.completions.create(
            model="demo", prompt=None, max_tokens=8, temperature=0, extra_body=body
        )
        for _ in range(2)
    ]
    assert served[0].choices[0].text == expected
    assert served[1].choices[0].text == expected
    assert served[1].usage.prompt_tokens == 136
    assert served[1].usage.prompt_tokens_details.cached_tokens == 128  # 8 full pages of 16


def test_follow_ups_on_a_short_prompt_stay_on_its_replica(
    client: openai.OpenAI, base_url: str
) -> None:
    """A 2-page prompt sent again and again reuses its pages every time after the first. The
    replica that just served it must not look busy to the router: a report taken while the
    previous request ran, arriving after it ended, kept that replica loaded for up to a
    second, and a request's load (4 pages) outweighs this prompt's 2 cached pages."""
    rng = random.Random(11)
    prompt = [rng.randrange(4, 4096) for _ in range(40)]  # 2 full pages of 16, and 8 more
    assert all(r["requests_active"] == 0 for r in _wait_idle(base_url))
    cached = []
    for _ in range(12):
        served = client.completions.create(model="demo", prompt=prompt, max_tokens=4)
        cached.append(served.usage.prompt_tokens_details.cached_tokens)
    assert cached[1:] == [32] * 11, cached


def test_chat_input_embeds_give_the_librarys_greedy_tokens(client: openai.OpenAI, library) -> None:
    """An ``input_embeds`` content part gives the library's greedy text for the same rows at
    the same place of the same rendered chat; other rows under the same text give other text."""
    from deployments.prompt_embeds import encode_rows
    from engine import MMEmbedding

    model, tokenizer, _ = library
    texts = []
    for seed in (5, 6):
        rows = _random_rows(model.config.hidden_size, 24, seed)
        embedding = MMEmbedding(rows.to(model.dtype), model=model)
        chat = [{"role": "user", "content": f"Describe {embedding.text_alias} in a word."}]
        ids = tokenizer.encode_chat(chat, embeddings=[embedding])
        expected = _library_greedy(library, ids, 8, [embedding])
        content = [
            {"type": "text", "text": "Describe "},
            {"type": "input_embeds", "input_embeds": encode_rows(rows)},
            {"type": "text", "text": " in a word."},
        ]
        served = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert served.choices[0].message.content == expected
        assert served.usage.prompt_tokens == len(ids)
        texts.append(expected)
    assert texts[0] != texts[1]


def test_cfg_scale_one_is_the_plain_request(client: openai.OpenAI) -> None:
    """Classifier-free guidance at ``cfg_scale=1`` samples the positive prompt alone: the same
    greedy text as the plain request, on both routes; half a pair is a 400."""
    completion = {"model": "demo", "prompt": "Once upon", "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**completion, extra_body={"ignore_eos": True})
    guidance = {"ignore_eos": True, "cfg_scale": 1.0, "negative_prompt": "The end"}
    guided = client.completions.create(**completion, extra_body=guidance)
    assert guided.choices[0].text == plain.choices[0].text
    kwargs = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain_chat = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    negative = [{"role": "user", "content": "Say nothing."}]
    guided_chat = client.chat.completions.create(
        **kwargs, extra_body={"ignore_eos": True, "cfg_scale": 1.0, "negative_messages": negative}
    )
    assert guided_chat.choices[0].message.content == plain_chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs, extra_body={"cfg_scale": 2.0})
    assert caught.value.body["param"] == "cfg_scale"


def test_stop_token_ids_banned_strings_and_token_healing(client: openai.OpenAI, library) -> None:
    """vLLM's ``stop_token_ids`` ends the text before the token; tabbyAPI's ``banned_strings``
    keeps a word the greedy text had out of it (case-insensitive); ``token_healing`` runs."""
    import re

    from engine import DynamicJob, SamplerSettings

    prompt = [5, 6, 7, 8]
    job = DynamicJob(prompt, 12, stop_conditions=[], gen_settings=SamplerSettings.greedy())
    library[2].enqueue(job)
    while library[2].num_remaining_jobs():
        library[2].iterate()
    ids = job.new_token_ids
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])
    args = {"model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    stopped = client.completions.create(
        **args, extra_body={"stop_token_ids": [ids[k]], "ignore_eos": True}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == library[1].decode(ids[:k])

    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    assert full == job.full_completion
    word = re.search("[A-Za-z]{3,}", full).group()
    banned = client.completions.create(
        **args, extra_body={"ignore_eos": True, "banned_strings": [word.upper()]}
    )
    assert word.lower() not in banned.choices[0].text.lower()
    assert banned.choices[0].text != full

    healed = client.completions.create(
        model="demo", prompt="Once upon a ti", max_tokens=4, extra_body={"token_healing": True}
    )
    assert healed.choices[0].finish_reason in ("stop", "length")


def test_responses_api_answers_as_chat_does(client: openai.OpenAI) -> None:
    """``client.responses``: the same greedy text as the chat route, whole and streamed (the
    SDK's own event parsing); what a stateless server cannot do is a 400 naming the field."""
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=6, temperature=0
    )
    args = {"model": "demo", "input": MESSAGES[0]["content"], "max_output_tokens": 6,
            "temperature": 0}  # fmt: skip
    out = client.responses.create(**args)
    assert out.output_text == chat.choices[0].message.content
    finished = {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    assert out.status == finished
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens

    events = list(client.responses.create(**args, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type == f"response.{finished}"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == out.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**args, store=True)
    assert info.value.body["param"] == "store"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{**args, "max_output_tokens": 10**7})
    assert info.value.body["param"] == "max_output_tokens"
