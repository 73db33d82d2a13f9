"""Prefix routing while the replica set grows: 1 -> ``--scale-to`` replicas mid-run.

The app starts with one LLMServer replica (demo model, CPU). After the first third of the
workload (conversations that start and end during the run, each reusing its own long prefix;
see ``session_workload``) LLMServer is scaled up with
a lightweight Serve update (only its replica count changes: the ingress and its router keep
their state) while requests keep flowing. Each request counts in the phase it was sent in:
``one`` (one replica), ``scaling`` (the update in progress), ``all`` (every replica up). Per
phase: cache reuse vs one ideal cache, balance (max/min requests per replica, from /v1/stats
deltas, so a request is counted when it finishes) and p50/p99 TTFT; prefix router and Ray
Serve's power-of-two side by side, alternating runs. JSON: bench/results/routing_scaling.json.

    python bench/routing_scaling.py [--scale-to 3] [--groups 18] [--per-group 4] [--repeats 2]

Ray is started with as many logical CPUs as the largest replica set needs; on a 2-core machine
three replicas share two cores (the comparison is side by side, not absolute).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve
from routing import (  # bench/routing.py (a script: python bench/routing_scaling.py)
    ROUTERS,
    _free_port,
    _percentile,
    ideal_cached_tokens,
    machine_info,
    preset,
    start_ray,
    stream_completion,
)

RESULTS = Path(__file__).parent / "results" / "routing_scaling.json"
PHASES = ("one", "scaling", "all")


def session_workload(args: argparse.Namespace) -> list[list[int]]:
    """Conversations that start and end during the run: ``--sessions`` at a time, each with a
    prefix of its own that ``--per-group`` requests reuse, a new one starting when one ends. So
    every phase brings new prefixes (where a new replica should get its share at once) and
    reuse of running ones (where the router should keep them on their replica)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 4096) for _ in range(n)]  # ids 0-3 are special tokens

    waiting = [tokens(args.shared_tokens) for _ in range(args.groups)]
    active: list[tuple[list[int], list[int]]] = []  # (prefix, [requests left])
    prompts: list[list[int]] = []
    while waiting or active:
        while waiting and len(active) < args.sessions:
            active.append((waiting.pop(0), [args.per_group]))
        i = rng.randrange(len(active))
        prefix, left = active[i]
        prompts.append(prefix + tokens(args.tail_tokens))
        left[0] -= 1
        if not left[0]:
            active.pop(i)
    return prompts


def _deploy(config: Path, replicas: int) -> None:
    """Deploy the app from a config, as ``serve deploy`` does, with ``replicas`` engine
    replicas, and wait until it runs. A config deploy that changes only the replica count is a
    lightweight update (running replicas keep their caches); an imperative ``serve.run`` would
    version the app anew and replace every replica, which is not what scaling out means.
    Private API, Ray 2.60 (``_get_global_client().deploy_apps``): the CLI's path without a
    dashboard."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    app = {
        "name": "scaling",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": {"config": str(config)},
        "deployments": [{"name": "LLMServer", "num_replicas": replicas}],
    }
    _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]), _blocking=True)


def _served(base_url: str) -> dict[str, int]:
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=60) as r:
        replicas = json.loads(r.read())["replicas"]
    return {s["replica_id"]: int(s["requests_served"]) for s in replicas}


class PhaseClock:
    """Which phase a request sent now belongs to; the scale-up runs in its own thread
    (``serve.run`` returns once the new replicas are healthy)."""

    def __init__(self) -> None:
        self.phase = "one"
        self.snapshots: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def enter(self, phase: str, served: dict[str, int]) -> None:
        with self._lock:
            self.snapshots[phase] = served
            self.phase = phase


def run_router(router: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config = folder / f"{router}.yaml"
    raw = preset(router, args)
    raw["serving"]["num_replicas"] = 1
    config.write_text(yaml.safe_dump(raw))
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        _deploy(config, 1)
        stream_completion(base_url, [5, 6, 7], 2)  # warm up (not counted)
        return _measure(router, args, config, base_url)
    finally:
        serve.shutdown()


def _measure(router: str, args: argparse.Namespace, config: Path, base_url: str) -> dict[str, Any]:
    prompts = session_workload(args)
    clock = PhaseClock()
    clock.enter("one", _served(base_url))
    scale_at, last_third = len(prompts) // 3, 2 * len(prompts) // 3
    sent = 0
    lock = threading.Lock()
    scaled = threading.Event()

    def scale_up() -> None:
        clock.enter("scaling", _served(base_url))
        _deploy(config, args.scale_to)
        clock.enter("all", _served(base_url))
        scaled.set()

    scaler = threading.Thread(target=scale_up)

    def one(prompt: list[int]) -> tuple[str, dict[str, Any]]:
        nonlocal sent
        with lock:
            sent += 1
            index = sent
            if index == scale_at + 1:
                scaler.start()
                time.sleep(0.2)  # the phase is "scaling" from here on
        if index > last_third:  # the last third runs on the grown replica set
            scaled.wait()
        return clock.phase, stream_completion(base_url, prompt, args.max_tokens)

    with ThreadPoolExecutor(args.concurrency) as pool:
        outs = list(pool.map(one, prompts))
    scaler.join()
    final = _served(base_url)
    return summarize(router, prompts, outs, clock, final)


def summarize(
    router: str,
    prompts: list[list[int]],
    outs: list[tuple[str, dict[str, Any]]],
    clock: PhaseClock,
    final: dict[str, int],
) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    boundaries = [*(clock.snapshots.get(p, final) for p in PHASES[1:]), final]
    for i, phase in enumerate(PHASES):
        picked = [k for k, (p, _) in enumerate(outs) if p == phase]
        if not picked:
            continue
        first, last = picked[0], picked[-1] + 1
        rows = [outs[k][1] for k in picked]
        ideal = ideal_cached_tokens(prompts[:last]) - ideal_cached_tokens(prompts[:first])
        cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in rows)
        before, after = clock.snapshots.get(phase, {}), boundaries[i]
        # Every replica up at the phase's end counts, idle ones too (an idle new replica is
        # the failure to catch); ids shortened for the table.
        by_replica = {r[-6:]: after[r] - before.get(r, 0) for r in after}
        per_replica = list(by_replica.values())
        ttfts = [o["ttft"] for o in rows if o["ttft"] is not None]
        phases[phase] = {
            "requests": len(rows),
            "cached_tokens": cached,
            "ideal_cached_tokens": ideal,
            "vs_ideal": cached / ideal if ideal else None,
            "requests_per_replica": by_replica,
            "imbalance": _imbalance(per_replica),
            "idle_replicas": per_replica.count(0),
            "ttft_p50_s": _percentile(ttfts, 50) if len(ttfts) > 1 else None,
            "ttft_p99_s": _percentile(ttfts, 99) if len(ttfts) > 1 else None,
        }
    return {"router": router, "phases": phases}


def _imbalance(counts: list[int]) -> float | None:
    """max/min requests per replica; None when a replica got none (see ``idle_replicas``)."""
    if not counts or min(counts) == 0:
        return None
    return max(counts) / min(counts)


def print_table(runs: dict[str, list[dict[str, Any]]]) -> None:
    print(
        f"{'router':7s} {'phase':8s} {'requests':>8s} {'vs ideal':>9s} {'imbalance':>9s} "
        f"{'TTFT p50':>9s} {'TTFT p99':>9s} {'idle':>4s}  requests per replica"
    )

    def cell(value: float | None, fmt: str) -> str:
        return format(value, fmt) if value is not None else "-"

    for router, results in runs.items():
        for run in results:
            for phase, row in run["phases"].items():
                p50 = row["ttft_p50_s"] and row["ttft_p50_s"] * 1000
                p99 = row["ttft_p99_s"] and row["ttft_p99_s"] * 1000
                print(
                    f"{router:7s} {phase:8s} {row['requests']:8d} "
                    f"{cell(row['vs_ideal'], '9.1%')} {cell(row['imbalance'], '9.2f')} "
                    f"{cell(p50, '7.0f')}ms {cell(p99, '7.0f')}ms {row['idle_replicas']:4d}  "
                    f"{row['requests_per_replica']}"
                )


def medians(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for phase in PHASES:
        rows = [r["phases"][phase] for r in results if phase in r["phases"]]
        out[phase] = {
            key: statistics.median(v)
            if (v := [r[key] for r in rows if r[key] is not None])
            else None
            for key in ("vs_ideal", "imbalance", "ttft_p50_s", "ttft_p99_s")
        }
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale-to", type=int, default=3)
    parser.add_argument("--groups", type=int, default=18, help="conversations (prefixes)")
    parser.add_argument("--per-group", type=int, default=4, help="requests per conversation")
    parser.add_argument("--sessions", type=int, default=4, help="conversations at a time")
    parser.add_argument("--shared-tokens", type=int, default=512)
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-num-tokens", type=int, default=6144, help="KV cache per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs per router, alternating")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-scaling-bench-"))
    start_ray(num_cpus=args.scale_to)
    runs: dict[str, list[dict[str, Any]]] = {router: [] for router in ROUTERS}
    try:
        for _ in range(args.repeats):
            for router in ROUTERS:
                runs[router].append(run_router(router, args, folder))
    finally:
        serve.shutdown()
        ray.shutdown()
    print_table(runs)
    report = {
        "benchmark": "routing_scaling",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "setup": {"replicas": f"1 -> {args.scale_to}", "device": "cpu", "model": "demo"},
        "workload": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": {
            router: {"median": medians(runs[router]), "runs": runs[router]} for router in ROUTERS
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
