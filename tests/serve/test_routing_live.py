"""Prefix-aware routing on a real local Ray cluster: 2 LLMServer replicas (demo model, CPU),
groups of requests sharing long prefixes sent over HTTP, a few at a time. The prefix router must
reach >= 80% of one ideal cache's hits with balanced replicas; Ray's power-of-two router runs
the same workload for comparison (reported, not asserted)."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from deployments.app import build_app  # noqa: E402
from tests.serve.live import shared_serve  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

PAGE_SIZE = 16
GROUPS, PER_GROUP = 4, 6
SHARED_TOKENS, TAIL_TOKENS = 280, 20
MAX_TOKENS = 4
CONCURRENCY = 3


def preset(router: str) -> dict[str, Any]:
    return {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu"},
        "engine": {"max_num_tokens": 8192, "page_size": PAGE_SIZE, "max_chunk_size": 256},
        "serving": {"num_replicas": 2, "torch_threads": 1, "router": router},
    }


def workload(seed: int = 0) -> list[list[int]]:
    """Token-id prompts: rounds of one request per group, each round in a shuffled order."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 4096) for _ in range(n)]  # ids 0-3 are special tokens

    shared = [tokens(SHARED_TOKENS) for _ in range(GROUPS)]
    return [
        prefix + tokens(TAIL_TOKENS)
        for _ in range(PER_GROUP)
        for prefix in rng.sample(shared, GROUPS)
    ]


def ideal_cached_tokens(prompts: list[list[int]]) -> int:
    """One unbounded cache: each prompt reuses the full pages of its longest prefix shared
    with any earlier prompt."""
    total = 0
    for i, prompt in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            while n < min(len(prompt), len(earlier)) and prompt[n] == earlier[n]:
                n += 1
            best = max(best, n)
        total += best // PAGE_SIZE * PAGE_SIZE
    return total


def _complete(base_url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _replica_requests(base_url: str) -> list[int]:
    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=60) as r:
        return sorted(int(s["requests_served"]) for s in json.loads(r.read())["replicas"])


def run_workload(router: str, tmp_path: Path) -> dict[str, Any]:
    """Deploy the app with ``router``, send the workload, report cache hits and balance."""
    config = tmp_path / f"{router}.yaml"
    config.write_text(yaml.safe_dump(preset(router)))
    base_url = shared_serve().base_url
    try:
        serve.run(build_app({"config": str(config)}), name="routing", route_prefix="/")
        prompts = workload()
        start = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            outs = list(pool.map(lambda p: _complete(base_url, p), prompts))
        seconds = time.perf_counter() - start
        requests = _replica_requests(base_url)
    finally:
        serve.delete("routing")
    cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    ideal = ideal_cached_tokens(prompts)
    return {
        "router": router,
        "cached_tokens": cached,
        "ideal_cached_tokens": ideal,
        "vs_ideal": cached / ideal,
        "prompt_tokens": sum(o["usage"]["prompt_tokens"] for o in outs),
        "replica_requests": requests,
        "seconds": round(seconds, 2),
    }


def _report(result: dict[str, Any], record_property: Any, capsys: Any) -> None:
    for key, value in result.items():
        record_property(f"{result['router']}_{key}", value)
    with capsys.disabled():
        print(
            f"\n{result['router']}: cached {result['cached_tokens']} / ideal "
            f"{result['ideal_cached_tokens']} tokens ({result['vs_ideal']:.0%}) of "
            f"{result['prompt_tokens']} prompt tokens; requests per replica "
            f"{result['replica_requests']}; {result['seconds']} s"
        )


def test_prefix_router_hits_the_cache_and_balances(
    tmp_path: Path, record_property: Any, capsys: Any
) -> None:
    result = run_workload("prefix", tmp_path)
    _report(result, record_property, capsys)
    assert result["cached_tokens"] >= 0.8 * result["ideal_cached_tokens"]
    low, high = result["replica_requests"]
    assert low + high == GROUPS * PER_GROUP
    assert high <= 1.5 * low


def test_pow2_router_for_comparison(tmp_path: Path, record_property: Any, capsys: Any) -> None:
    """Same workload on Ray's power-of-two router: numbers reported, not asserted."""
    result = run_workload("pow2", tmp_path)
    _report(result, record_property, capsys)
    assert sum(result["replica_requests"]) == GROUPS * PER_GROUP
