"""Faults and soak on a real local Ray cluster (2 LLMServer replicas, demo model, CPU) with a KV
cache far too small for the load: streams that disconnect (one a batched completion),
preemption, a poison request among healthy streams, many sequential requests, and a replica
killed mid-load.

Reduced size by default (CI); ``PAGEDSERVE_FAULTS_FULL=1`` runs the full size. Traffic goes to
127.0.0.1 only; every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from engine.request import GenerationRequest, SamplerSettings  # noqa: E402
from tests.serve.live import start_preset_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

FULL = os.environ.get("PAGEDSERVE_FAULTS_FULL") == "1"
STREAMS = 100 if FULL else 24
SEQUENTIAL = 1000 if FULL else 120
RSS_TOLERANCE_BYTES = 48 * 2**20  # allocator noise after warm-up, per replica
CACHE_TOKENS = 1024  # per replica: 64 pages of 16, far too few for the load below
INTERNALS = ("Traceback", "pid=", "actor_id", "ray::", "ip=", 'File "', "Error(")
APP = "faults"


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    preset = {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu"},
        "engine": {"max_num_tokens": CACHE_TOKENS, "page_size": 16, "max_chunk_size": 256},
        "serving": {"num_replicas": 2, "torch_threads": 1, "stream_interval_s": 0.02},
    }
    return start_preset_app(request, tmp_path_factory, preset, APP)


# -- a small streaming client --------------------------------------------------------------------


@dataclass
class Outcome:
    chunks: int = 0
    done: bool = False  # saw data: [DONE]
    errors: list[str] | None = None
    status: int = 200
    disconnected: bool = False


def stream_chat(base_url: str, content: str, max_tokens: int, hang_up_after: int = 0) -> Outcome:
    """One streaming chat; ``hang_up_after`` > 0 closes the connection after that many chunks."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0.7,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    outcome = Outcome(errors=[])
    try:
        response = urllib.request.urlopen(req, timeout=120)
    except urllib.error.HTTPError as e:
        outcome.status = e.code
        outcome.errors.append(e.read().decode())
        return outcome
    with response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                outcome.done = True
                break
            event = json.loads(data)
            if "error" in event:
                outcome.errors.append(event["error"]["message"])
            outcome.chunks += 1
            if hang_up_after and outcome.chunks >= hang_up_after:
                outcome.disconnected = True
                break
    return outcome


def replica_stats(base_url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=30) as r:
        return json.loads(r.read())["replicas"]


def wait_idle(base_url: str, timeout_s: float = 60) -> list[dict[str, Any]]:
    """Poll until no replica has a job, an active request or a referenced page."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = replica_stats(base_url)
        busy = [
            r
            for r in replicas
            if r["pages_in_use"] or r["jobs_running"] or r["jobs_waiting"] or r["requests_active"]
        ]
        if not busy or time.monotonic() > deadline:
            return replicas
        time.sleep(0.25)


def assert_idle(replicas: list[dict[str, Any]]) -> None:
    for r in replicas:
        assert r["pages_in_use"] == 0, replicas
        assert r["jobs_running"] == r["jobs_waiting"] == r["requests_active"] == 0, replicas


def run_streams(base_url: str, jobs: list[tuple[str, int, int]]) -> list[Outcome]:
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(stream_chat, base_url, *job) for job in jobs]
        return [f.result(timeout=240) for f in futures]


# -- the tests -----------------------------------------------------------------------------------


def test_streams_with_a_quarter_disconnecting_leave_nothing_behind(base_url: str) -> None:
    jobs = [
        (f"Stream {i}: tell me about the sea and the sky.", 40, 2 if i % 4 == 0 else 0)
        for i in range(STREAMS)
    ]
    outcomes = run_streams(base_url, jobs)
    kept = [o for o, job in zip(outcomes, jobs, strict=True) if not job[2]]
    assert all(o.done and not o.errors and o.chunks > 0 for o in kept), kept
    assert sum(o.disconnected for o in outcomes) == STREAMS // 4
    assert_idle(wait_idle(base_url))


def test_a_batched_completion_that_hangs_up_stops_every_prompt(base_url: str) -> None:
    """Each prompt of a batched completion runs as its own request (its own Serve call id,
    so Ray's cancellation of the HTTP request's calls does not reach them): a client that goes
    away must still cancel all of them, running and waiting. Together they ask for ~5,400
    tokens, several times what the two small caches hold at once: tens of seconds of work
    if they ran on, so the replicas going idle within 10 s shows the cancellation."""
    body = {
        "prompt": [f"Prompt {i}: the sea and the sky" for i in range(6)],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as response:
        for raw in response:
            if raw.startswith(b"data: {"):
                break  # the first token: every prompt is submitted; hang up
    assert_idle(wait_idle(base_url, timeout_s=10))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "The sea and the sky", "max_output_tokens": 900}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "The sea and the sky"}],
                          "max_tokens": 900}),
    ],
    ids=["responses", "messages"],
)  # fmt: skip
def test_the_other_apis_streams_cancel_when_the_client_hangs_up(
    base_url: str, path: str, body: dict[str, Any]
) -> None:
    """The Responses and Messages streams run over the chat path's handle: six streams of
    900 greedy tokens (the demo model writes no end token in them: 6.6 s for one alone; ~5,400
    tokens together, several times what the two small caches hold at once) whose clients leave
    after the first text event leave the replicas idle within 10 s."""

    def hang_up() -> bool:
        request = urllib.request.Request(
            base_url + path,
            data=json.dumps({**body, "stream": True, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            for raw in response:
                if b"delta" in raw:  # the first text: the request runs; leave
                    return True
        return False

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert all(pool.map(lambda _: hang_up(), range(6)))
    assert_idle(wait_idle(base_url, timeout_s=10))


def test_a_cache_far_too_small_completes_everything_by_preempting(base_url: str) -> None:
    before = sum(r["preemptions"] for r in replica_stats(base_url))
    # Each request grows to ~320 tokens; 16 of them want ~5k tokens of cache, of 2 x 1024.
    long_prompt = "The history of the lighthouse keeper and the storm. " * 12
    outcomes = run_streams(base_url, [(f"{i} {long_prompt}", 160, 0) for i in range(16)])
    assert all(o.done and not o.errors for o in outcomes), outcomes
    after = wait_idle(base_url)
    assert_idle(after)
    assert sum(r["preemptions"] for r in after) > before


def test_a_poison_request_ends_only_itself(base_url: str) -> None:
    """A request that fails inside a replica's step (here a top_k no sampler can take, sent
    past the ingress's checks straight to the replicas) fails alone: the streams sharing its
    steps complete."""
    handle = serve.get_deployment_handle("LLMServer", app_name=APP)
    generate = handle.options(method_name="generate", stream=True)
    with ThreadPoolExecutor(max_workers=8) as pool:
        healthy = [
            pool.submit(stream_chat, base_url, f"Healthy {i}: a long story please.", 48)
            for i in range(6)
        ]
        time.sleep(0.5)  # the healthy streams are decoding
        poison = GenerationRequest(
            prompt_ids=tuple(range(5, 40)),
            max_new_tokens=16,
            settings=SamplerSettings(top_k=2**63),
        )
        with pytest.raises(Exception) as failure:
            for _ in generate.remote(poison):
                pass
        outcomes = [f.result(timeout=240) for f in healthy]
    assert "top_k" in str(failure.value)
    assert all(o.done and not o.errors for o in outcomes), outcomes
    assert_idle(wait_idle(base_url))


def test_sequential_requests_return_memory_and_pages(base_url: str) -> None:
    def one(i: int) -> None:
        body = {"prompt": f"Request number {i} says", "max_tokens": 4, "temperature": 0}
        req = urllib.request.Request(
            f"{base_url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200

    for i in range(30):  # warm-up: allocator pools, compiled paths, caches fill
        one(i)
    start = {r["replica_id"]: r["rss_bytes"] for r in wait_idle(base_url)}
    t0 = time.monotonic()
    for i in range(SEQUENTIAL):
        one(1000 + i)
    elapsed = time.monotonic() - t0
    after = wait_idle(base_url)
    assert_idle(after)
    growth = {r["replica_id"]: r["rss_bytes"] - start.get(r["replica_id"], 0) for r in after}
    print(f"{SEQUENTIAL} sequential requests in {elapsed:.1f} s; RSS growth {growth}")
    assert all(g < RSS_TOLERANCE_BYTES for g in growth.values()), growth


def _llm_replica_actors() -> list[str]:
    names = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in names if "LLMServer" in a["name"] and "REPLICA" in a["name"]]


def test_a_replica_killed_mid_load_gives_clean_errors_and_recovers(base_url: str) -> None:
    victims = _llm_replica_actors()
    assert len(victims) == 2, victims
    with ThreadPoolExecutor(max_workers=8) as pool:
        streams = [
            pool.submit(stream_chat, base_url, f"Killed {i}: a very long story.", 200)
            for i in range(8)
        ]
        time.sleep(1.0)
        ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
        outcomes = [f.result(timeout=240) for f in streams]
    failed = [o for o in outcomes if o.errors or not o.done]
    for outcome in failed:  # a clean error, nothing of the cluster's internals
        assert outcome.errors and outcome.done, outcome
        assert not any(m in e for e in outcome.errors for m in INTERNALS), outcome.errors
    assert stream_chat(base_url, "Still there?", 4).done  # the other replica serves at once
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(_llm_replica_actors()) < 2:
        time.sleep(1)
    assert len(_llm_replica_actors()) == 2, "the replica was not replaced"
