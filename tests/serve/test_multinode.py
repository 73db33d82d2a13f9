"""Two Ray nodes on this machine (two ``ray start`` raylets, one CPU each): the app deployed with
``serve deploy`` places one engine replica per node, requests are routed across both nodes, a
batch job is submitted to the head, and when the second node is killed mid-load its requests end
with clean errors while the app recovers on the head node.

Reduced size for CI; ``PAGEDSERVE_MULTINODE_FULL=1`` sends more and longer streams.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.serve.live import free_port
from tests.serve.test_batch import (
    REPO_ROOT,
    Head,
    ray_cli,
    stop_head,
    wait_for_dashboard,
    write_lines,
)
from tests.serve.test_faults import Outcome, replica_stats, stream_chat

pytestmark = pytest.mark.ray

FULL = os.environ.get("PAGEDSERVE_MULTINODE_FULL") == "1"
SPREAD_STREAMS = 16 if FULL else 8  # short streams that must reach both nodes
LOSS_STREAMS, LOSS_TOKENS = (12, 800) if FULL else (6, 400)  # in flight when the node dies

# What a client must never see in an error (the reliability issue's rule): Ray internals.
LEAKS = re.compile(r"ray::|pid=|actor_id|Traceback|ip=\d", re.IGNORECASE)


@dataclass
class TwoNodes:
    head: Head
    worker: subprocess.Popen
    base_url: str


def _agent_ports() -> list[str]:
    ports = {
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--metrics-export-port": free_port(),
        "--runtime-env-agent-port": free_port(),
    }
    return [str(x) for pair in ports.items() for x in pair]


def _start(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen:
    # Its own process group, so that one node can be killed alone.
    return subprocess.Popen(
        command,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
    )


def _wait_for_nodes(head: Head, count: int, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            url = f"{head.dashboard}/nodes?view=summary"
            with urllib.request.urlopen(url, timeout=5) as r:
                nodes = json.loads(r.read())["data"]["summary"]
            if sum(1 for n in nodes if n["raylet"]["state"] == "ALIVE") >= count:
                return
        time.sleep(1)
    raise TimeoutError(f"fewer than {count} nodes after {timeout_s} s")


def _serve_config(tmp: Path, port: int) -> Path:
    preset = yaml.safe_load((REPO_ROOT / "configs/demo.yaml").read_text())
    preset["engine"]["max_num_tokens"] = 4096
    preset["serving"].update(num_replicas=2, torch_threads=1, stream_interval_s=0.05)
    (tmp / "preset.yaml").write_text(yaml.safe_dump(preset))
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "pagedserve",
                "route_prefix": "/",
                "import_path": "deployments.app:build_app",
                "args": {"config": str(tmp / "preset.yaml")},
                "deployments": [
                    # The ingress stays on the head (the node that is never killed).
                    {
                        "name": "Ingress",
                        "ray_actor_options": {"num_cpus": 0, "resources": {"head_node": 0.01}},
                    },
                    # One CPU each on one-CPU nodes: one replica per node.
                    {"name": "LLMServer", "ray_actor_options": {"num_cpus": 1}},
                ],
            }
        ],
    }
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait_for_app(base_url: str, replicas: int, timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    stats: list[dict] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            stats = replica_stats(base_url)
            if len(stats) == replicas:
                return stats
        time.sleep(1)
    raise TimeoutError(f"app at {base_url} has {len(stats)} replicas, not {replicas}")


@pytest.fixture(scope="module")
def nodes(request: pytest.FixtureRequest) -> TwoNodes:
    tmp = Path(tempfile.mkdtemp(prefix="rnodes", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        PAGEDSERVE_CACHE=str(tmp / "cache"),
        PYTHONPATH=str(REPO_ROOT),
    )
    gcs, dash = free_port(), free_port()
    head_command = [
        *ray_cli("ray"),
        *("start", "--head", "--block", "--num-cpus", "1", "--include-dashboard=true"),
        *("--resources", json.dumps({"head_node": 1}), "--port", str(gcs)),
        *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)),
        *("--ray-client-server-port", str(free_port()), "--disable-usage-stats"),
        *("--temp-dir", str(tmp), *_agent_ports()),
    ]
    head_proc = _start(head_command, env, tmp / "head.log", tmp)
    request.addfinalizer(lambda: stop_head(head_proc))
    head = Head(f"http://127.0.0.1:{dash}", env, tmp)
    wait_for_dashboard(head.dashboard, head_proc)
    worker_command = [
        *ray_cli("ray"),
        *("start", "--block", "--address", f"127.0.0.1:{gcs}", "--num-cpus", "1"),
        *("--resources", json.dumps({"second_node": 1}), "--disable-usage-stats"),
        *_agent_ports(),
    ]
    worker = _start(worker_command, env, tmp / "worker.log", tmp)
    request.addfinalizer(lambda: stop_head(worker))
    _wait_for_nodes(head, 2)
    port = free_port()
    deploy = head.cli("serve", "deploy", "--address", head.dashboard, str(_serve_config(tmp, port)))
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    base_url = f"http://127.0.0.1:{port}"
    _wait_for_app(base_url, 2)
    return TwoNodes(head, worker, base_url)


def _streams(base_url: str, count: int, max_tokens: int) -> list[Outcome]:
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [
            pool.submit(stream_chat, base_url, f"prefix {i} " * 10, max_tokens)
            for i in range(count)
        ]
        return [f.result(timeout=300) for f in futures]


def test_two_nodes_serve_route_batch_and_survive_losing_one(nodes: TwoNodes) -> None:
    stats = _wait_for_app(nodes.base_url, 2)
    assert len({r["node_id"] for r in stats}) == 2, "both replicas on one node"

    # Requests are routed across both nodes (new prefixes spread over the replicas).
    outcomes = _streams(nodes.base_url, SPREAD_STREAMS, 8)
    assert all(o.done and not o.errors for o in outcomes)
    served = {r["node_id"]: r["requests_served"] for r in replica_stats(nodes.base_url)}
    assert all(count > 0 for count in served.values()), served

    # A batch job submitted to the head runs against the running two-node app.
    src = write_lines(
        nodes.head.tmp / "in.jsonl",
        [{"id": f"b{i}", "prompt": f"batch {i}", "max_tokens": 4} for i in range(4)],
    )
    out = nodes.head.tmp / "out.jsonl"
    job = nodes.head.submit("--input", str(src), "--output", str(out))
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-2000:]
    assert "4 ok, 0 invalid, 0 failed" in job.stdout
    assert "using the running app 'pagedserve'" in job.stdout

    # The second node dies mid-load: its streams end with clean errors, none hangs, and the
    # app keeps serving from the head.
    with ThreadPoolExecutor(max_workers=1) as pool:
        load = pool.submit(_streams, nodes.base_url, LOSS_STREAMS, LOSS_TOKENS)
        time.sleep(3)
        os.killpg(nodes.worker.pid, signal.SIGKILL)
        outcomes = load.result(timeout=300)
    failed = [o for o in outcomes if o.errors or not o.done]
    assert len(failed) < len(outcomes), "every stream failed: the head's replica did not serve"
    for outcome in failed:
        for message in outcome.errors or []:
            assert not LEAKS.search(message), message
    deadline = time.monotonic() + 120
    while True:  # Serve notices the dead replica; the router forgets it
        after = stream_chat(nodes.base_url, "after the node loss", 8)
        if (after.done and not after.errors) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert after.done and not after.errors, after
    live = _wait_for_app(nodes.base_url, 1)  # /v1/stats answers with the live replica alone
    assert live[0]["pages_in_use"] == 0, live
