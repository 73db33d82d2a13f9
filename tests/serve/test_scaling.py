"""Autoscaling on a live app: a load ramp takes the engine replicas from 1 to 2 and back to 1
within the configured delays, no request is lost across either change, and the new replica
gets traffic of its own (new prefixes go to it at once, not only spill-over).

Reduced size for CI (demo model, 1..2 replicas on 2 CPUs); ``PAGEDSERVE_SCALING_FULL=1`` runs a
longer ramp with more streams.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from tests.serve.live import start_preset_app
from tests.serve.test_faults import Outcome, replica_stats, stream_chat

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

FULL = os.environ.get("PAGEDSERVE_SCALING_FULL") == "1"
STREAMS = 12 if FULL else 6  # concurrent streams while the load is on
LOAD_S = 40.0 if FULL else 15.0  # how long new streams keep starting after the scale-up
SCALE_TIMEOUT_S = 90.0
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 1,
    "downscale_delay_s": 3,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 1,
}


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    preset = {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu"},
        "engine": {"max_num_tokens": 4096, "page_size": 16, "max_chunk_size": 256},
        "serving": {"torch_threads": 1, "stream_interval_s": 0.05, "autoscaling": AUTOSCALING},
    }
    return start_preset_app(request, tmp_path_factory, preset, "autoscale")


def wait_for_replicas(base_url: str, count: int, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = replica_stats(base_url)
        if len(replicas) == count or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


class Load:
    """Keeps ``streams`` streaming chats running (each a new prefix) until stopped."""

    def __init__(self, base_url: str, streams: int) -> None:
        self.base_url = base_url
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]
        self._sent = 0

    def _run(self, worker: int) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._sent += 1
                n = self._sent
            topic = f"topic {n} " * 12  # a prefix of its own, several pages long
            outcome = stream_chat(self.base_url, f"{topic} from worker {worker}", 64)
            with self._lock:
                self.outcomes.append(outcome)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)


def test_load_ramp_scales_up_and_down_without_losing_a_request(base_url: str) -> None:
    assert len(wait_for_replicas(base_url, 1, SCALE_TIMEOUT_S)) == 1
    with Load(base_url, STREAMS) as load:
        scaled = wait_for_replicas(base_url, 2, SCALE_TIMEOUT_S)
        assert len(scaled) == 2, "no scale-up under load"
        served_before = {r["replica_id"]: r["requests_served"] for r in scaled}
        time.sleep(LOAD_S)  # traffic across both replicas
        during = {r["replica_id"]: r["requests_served"] for r in replica_stats(base_url)}
    # Every stream ended cleanly, across the scale-up and the drain that follows.
    assert load.outcomes and all(o.done and not o.errors and o.status == 200 for o in load.outcomes)
    newcomer = min(served_before, key=served_before.get)
    assert during.get(newcomer, 0) - served_before[newcomer] >= 3, (served_before, during)
    # The load is gone: back to one replica, and nothing is left referenced.
    replicas = wait_for_replicas(base_url, 1, SCALE_TIMEOUT_S)
    assert len(replicas) == 1, "no scale-down after the load ended"
    assert replicas[0]["pages_in_use"] == 0 and replicas[0]["requests_active"] == 0
    # Requests keep being served after the scale-down.
    after = stream_chat(base_url, "after the scale-down", 8)
    assert after.done and not after.errors
