"""Prefix-aware routing vs Ray Serve's power-of-two router on the live app.

Starts a local Ray cluster, deploys the app (2 LLMServer replicas, demo model, CPU) per run,
sends the same shared-prefix workload over HTTP (groups of requests sharing a long prefix,
interleaved in shuffled rounds, streaming so first tokens can be timed, ``concurrency`` at a
time), and prints a table: cache hit rate (cached / prompt tokens, and vs one ideal cache),
throughput (requests/s, output tokens/s) and p50/p99 time to first token. Writes JSON to
bench/results/routing.json.

    python bench/routing.py [--groups 8] [--per-group 8] [--concurrency 4] [--repeats 3]
    python bench/routing.py --routers prefix --baseline REF  # beside the router of a git ref

Each router runs ``--repeats`` times, alternating; the table shows every run and the medians.
``--baseline REF`` also runs the prefix router with the code of git ref REF (a temporary
worktree; this script in a subprocess whose PYTHONPATH puts that tree first, so its Ray cluster
and replicas import that tree's ``deployments`` and ``engine``), once after each repeat.

The KV cache per replica (``--max-num-tokens``) is smaller than all prefixes together but
larger than half of them: the case where placement decides what stays cached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ray
import torch
import yaml
from ray import serve

sys.path.append(str(Path(__file__).resolve().parents[1]))  # (last: a baseline's tree first)

import deployments
from bench.host_overhead import baseline_tree
from bench.loadgen.app_process import free_port
from deployments.app import build_app

RESULTS = Path(__file__).parent / "results" / "routing.json"
PAGE_SIZE = 16
ROUTERS = ("prefix", "pow2")


def preset(router: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu"},
        "engine": {
            "max_num_tokens": args.max_num_tokens,
            "page_size": PAGE_SIZE,
            "max_chunk_size": 256,
        },
        "serving": {"num_replicas": 2, "torch_threads": 1, "router": router},
    }


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Token-id prompts: ``per_group`` rounds, one request per group in a shuffled order."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, 4096) for _ in range(n)]  # ids 0-3 are special tokens

    shared = [tokens(args.shared_tokens) for _ in range(args.groups)]
    return [
        prefix + tokens(args.tail_tokens)
        for _ in range(args.per_group)
        for prefix in rng.sample(shared, len(shared))
    ]


def ideal_cached_tokens(prompts: list[list[int]]) -> int:
    """One unbounded cache: full pages of each prompt's longest prefix seen before."""
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


def stream_completion(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming request: time to first token, total time and the usage chunk."""
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if ttft is None and any(c.get("text") for c in event.get("choices", [])):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    if usage is None:
        raise RuntimeError("no usage chunk in the stream")
    return {"ttft": ttft, "seconds": time.perf_counter() - start, "usage": usage}


def _replica_requests(base_url: str) -> list[int]:
    with urllib.request.urlopen(f"{base_url}/v1/stats", timeout=60) as r:
        return sorted(int(s["requests_served"]) for s in json.loads(r.read())["replicas"])


def run_router(router: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config = folder / f"{router}.yaml"
    config.write_text(yaml.safe_dump(preset(router, args)))
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"config": str(config)}), name="routing", route_prefix="/")
        stream_completion(base_url, [5, 6, 7], 2)  # warm up (not counted, shares nothing)
        prompts = workload(args)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(
                pool.map(lambda p: stream_completion(base_url, p, args.max_tokens), prompts)
            )
        seconds = time.perf_counter() - start
        requests = _replica_requests(base_url)
    finally:
        serve.shutdown()
    return summarize(router, prompts, outs, seconds, requests)


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def summarize(
    router: str, prompts: list[list[int]], outs: list[dict], seconds: float, requests: list[int]
) -> dict[str, Any]:
    cached = sum(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    prompt_tokens = sum(o["usage"]["prompt_tokens"] for o in outs)
    output_tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    ideal = ideal_cached_tokens(prompts)
    ttfts = [o["ttft"] for o in outs if o["ttft"] is not None]
    return {
        "router": router,
        "requests": len(outs),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "ideal_cached_tokens": ideal,
        "hit_rate": cached / prompt_tokens,
        "vs_ideal": cached / ideal if ideal else None,
        "seconds": seconds,
        "requests_per_s": len(outs) / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "replica_requests": requests,  # from /v1/stats: includes the one warm-up request
    }


NUMERIC = (
    "hit_rate",
    "vs_ideal",
    "requests_per_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
)


def median_row(router: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeated runs (timings on a shared 2-core machine are noisy)."""
    row: dict[str, Any] = {"router": f"{router} med"}
    for key in NUMERIC:
        row[key] = statistics.median(r[key] for r in runs)
    row["replica_requests"] = ""
    return row


def results_of(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per router: the medians and every run."""
    return {
        router: {"median": {k: median_row(router, rs)[k] for k in NUMERIC}, "runs": rs}
        for router, rs in runs.items()
        if rs
    }


def table_rows(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every run, then each router's medians (routers with no runs left out)."""
    rows = [run for rs in runs.values() for run in rs]
    return rows + [median_row(router, rs) for router, rs in runs.items() if rs]


def run_baseline(args: argparse.Namespace, tree: Path, label: str) -> dict[str, Any]:
    """One run of the prefix router with the code of ``tree``: this script in a subprocess
    (its own Ray cluster) whose PYTHONPATH puts that tree first."""
    flags = [*workload_flags(args), "--routers", "prefix", "--repeats", "1"]
    # (imported here: the baseline's own process runs this script with the tree's ``bench``
    # first on its path, and an older tree has no ``run_in_tree``)
    from bench.host_overhead import run_in_tree

    report = run_in_tree(str(Path(__file__).resolve()), flags, tree)
    run = report["results"]["prefix"]["runs"][0]
    return {**run, "router": label, "deployments": report.get("deployments")}  # (its tree's)


def workload_flags(args: argparse.Namespace) -> list[str]:
    """The command-line flags that give another run this run's workload and cache."""
    names = ("groups", "per_group", "shared_tokens", "tail_tokens", "max_tokens")
    names += ("concurrency", "max_num_tokens", "seed")
    return [part for n in names for part in (f"--{n.replace('_', '-')}", str(getattr(args, n)))]


def print_table(rows: list[dict[str, Any]]) -> None:
    width = max([11, *(len(r["router"]) for r in rows)])
    header = (
        f"{'router':{width}s} {'hit rate':>9s} {'vs ideal':>9s} {'req/s':>7s} {'out tok/s':>10s} "
        f"{'TTFT p50':>9s} {'TTFT p99':>9s}  requests per replica (incl. warm-up)"
    )
    print(header)
    for r in rows:
        print(
            f"{r['router']:{width}s} {r['hit_rate']:9.1%} {r['vs_ideal']:9.1%} "
            f"{r['requests_per_s']:7.2f} {r['output_tokens_per_s']:10.1f} "
            f"{r['ttft_p50_s'] * 1000:7.0f}ms {r['ttft_p99_s'] * 1000:7.0f}ms  "
            f"{r['replica_requests']}"
        )


def source_commit() -> str | None:
    """The git commit of this checkout ("-dirty" when it has changes), or None outside git."""
    repo = Path(deployments.__file__).resolve().parents[1]
    found = subprocess.run(
        ["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=40"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode:
        return None
    return found.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
    }


def start_ray(num_cpus: int) -> None:
    """A local Ray for the benchmark's apps; the demo model's cache folder is set before Ray
    starts, so the replicas inherit it (the model is built there once)."""
    os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(tempfile.gettempdir()) / "pagedserve"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--tail-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-num-tokens", type=int, default=6144, help="KV cache per replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per router, alternating")
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    parser.add_argument(
        "--baseline",
        metavar="REF",
        help="also run the prefix router with the code of git ref REF (a temporary worktree)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(tempfile.mkdtemp(prefix="pagedserve-routing-bench-"))
    runs: dict[str, list[dict[str, Any]]] = {router: [] for router in args.routers}
    label = f"prefix@{args.baseline}" if args.baseline else ""
    baseline_runs: list[dict[str, Any]] = []
    no_tree = contextlib.nullcontext((None, None))
    with baseline_tree(args.baseline) if args.baseline else no_tree as (tree, commit):
        for _ in range(args.repeats):  # alternate, so slow phases of the machine hit all
            start_ray(num_cpus=2)
            try:
                for router in args.routers:
                    runs[router].append(run_router(router, args, folder))
            finally:
                serve.shutdown()
                ray.shutdown()
            if tree is not None:  # (its own Ray cluster, after ours is down)
                baseline_runs.append(run_baseline(args, tree, label))
    print_table(table_rows({**runs, label: baseline_runs}))
    report = {
        "benchmark": "routing",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "setup": {"replicas": 2, "device": "cpu", "torch_threads": 1, "model": "demo"},
        "workload": {k: v for k, v in vars(args).items() if k not in ("output", "baseline")},
        "deployments": str(Path(deployments.__file__).parent),
        "commit": source_commit(),
        "results": results_of(runs),
    }
    if args.baseline:
        report["baseline"] = {
            "ref": args.baseline,
            "commit": commit,
            "router": "prefix",
            "results": results_of({"prefix": baseline_runs}),
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
