"""Backpressure on a real local Ray cluster: one LLMServer replica that runs one request and
lets one wait (``serving.max_ongoing_requests`` / ``max_queued_requests``). With both taken,
requests are refused at once with a 503, an OpenAI-style error body and a Retry-After header,
streamed or not; the accepted ones complete, and the replica ends idle. Traffic goes to
127.0.0.1 only, bounded in count and time."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from tests.serve.live import start_preset_app  # noqa: E402
from tests.serve.test_faults import assert_idle, wait_idle  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

REQUESTS = 6
FILLER_TOKENS = 400  # seconds of work on this CPU


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    preset = {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu"},
        "engine": {"max_num_tokens": 2048, "page_size": 16, "max_chunk_size": 256},
        "serving": {
            "num_replicas": 1,
            "torch_threads": 1,
            "max_ongoing_requests": 1,
            "max_queued_requests": 1,
        },
    }
    return start_preset_app(request, tmp_path_factory, preset, "busy")


def _complete(base_url: str, stream: bool, max_tokens: int = 8) -> tuple[int, Any, str]:
    body = {"prompt": "The sea", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def _assert_busy(outcome: tuple[int, Any, str]) -> None:
    status, headers, text = outcome
    assert status == 503, outcome
    error: dict[str, Any] = json.loads(text)["error"]
    assert error["code"] == "server_busy" and error["type"] == "server_error"
    assert "retry" in error["message"] and "Traceback" not in error["message"]
    assert int(headers.get("Retry-After")) >= 1  # (header names are case-insensitive)


def _open_stream(base_url: str, max_tokens: int):
    body = {"prompt": "The sky", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=120)


def test_requests_past_the_queue_get_a_503_to_retry(base_url: str) -> None:
    with (
        ThreadPoolExecutor(max_workers=REQUESTS) as pool,
        _open_stream(base_url, FILLER_TOKENS) as running,
    ):
        assert running.readline().startswith(b"data: {")  # it runs: the replica's one slot
        queued = pool.submit(_complete, base_url, False, FILLER_TOKENS)
        time.sleep(0.5)  # it reaches the queue's one place
        probes = [pool.submit(_complete, base_url, stream) for stream in (True, False, True)]
        for probe in probes:
            _assert_busy(probe.result(timeout=60))  # at once, streamed or not
        assert b"data: [DONE]" in running.read()
        status, _, text = queued.result(timeout=240)
        assert status == 200 and '"error"' not in text
    assert_idle(wait_idle(base_url))
    # once the queue has room again, requests are served
    assert _complete(base_url, stream=True)[0] == 200
