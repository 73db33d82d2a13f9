"""Load generator: concurrent streaming clients against the OpenAI API, to check reliability.

N asyncio clients (aiohttp) stream requests for ``--duration`` seconds or ``--requests``
requests, whichever comes first: a seeded mix of shared-prefix chats (a few long system prompts,
varied user turns) and unique completions (``--shared-fraction``), some of which hang up after a
few chunks (``--disconnect-fraction``). Loopback only.

It targets a running server (``--url http://127.0.0.1:8000``) or, by default, starts the app
itself on a free port (local Ray cluster, ``--config`` preset with ``--replicas`` replicas) and
shuts it down at the end. Reports requests ok / errors by kind, requests/s and generated tokens/s
(from the usage chunks), p50/p99 time to first token and between content chunks, and each
replica's ``/v1/stats`` after the run (nothing should stay in use). Prints a table; writes
``bench/results/<name>.json`` and ``<name>.png`` (TTFT and ITL over the run).

    python bench/load.py --clients 16 --duration 60 --requests 200 \\
        --shared-fraction 0.5 --disconnect-fraction 0.25
    python bench/load.py --url http://127.0.0.1:8000 --clients 4 --requests 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from loadgen.app_process import free_port
from loadgen.client import LoadRun, RequestResult, check_loopback_url, run_load, run_request
from loadgen.plot import plot_latencies
from loadgen.report import build_report, print_table, write_json
from loadgen.server_stats import get_json, replica_stats, settle
from loadgen.stats import summarize
from loadgen.workload import COMPLETION_PATH, LoadRequest, WorkloadSpec, make_workload

logger = logging.getLogger("bench.load")

RESULTS = Path(__file__).parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = p.add_argument_group("target")
    target.add_argument("--url", help="a running server (loopback only); default: start one")
    target.add_argument("--config", default="configs/demo.yaml", help="preset of the own app")
    target.add_argument("--replicas", type=int, default=2, help="LLMServer replicas (own app)")
    target.add_argument("--max-num-tokens", type=int, help="KV cache per replica (own app)")
    target.add_argument("--model", help="the request's model field; default: /v1/models' first")
    load = p.add_argument_group("load")
    load.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    load.add_argument("--duration", type=float, default=60.0, help="seconds to start requests")
    load.add_argument("--requests", type=int, default=200, help="requests in all (at most)")
    load.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    load.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the replicas to go idle after the run",
    )
    mix = p.add_argument_group("workload")
    mix.add_argument("--shared-fraction", type=float, default=0.5, help="shared-prefix chats")
    mix.add_argument(
        "--disconnect-fraction",
        type=float,
        default=0.0,
        help="requests the client drops after 1-3 content chunks",
    )
    mix.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    mix.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    mix.add_argument("--system-words", type=int, default=300, help="words per system prompt")
    mix.add_argument("--temperature", type=float, default=0.8)
    mix.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate max_tokens every time (stable token counts)",
    )
    mix.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--name", help="result file stem (default load-<UTC time>)")
    out.add_argument("--output-dir", type=Path, default=RESULTS)
    out.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a request failed or a replica did not go idle",
    )
    out.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    if args.url is not None:
        try:
            args.url = check_loopback_url(args.url)
        except ValueError as e:
            p.error(str(e))
    for name in ("clients", "requests", "replicas", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.name = args.name or "load-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return args


def workload_spec(args: argparse.Namespace, model: str | None) -> WorkloadSpec:
    return WorkloadSpec(
        seed=args.seed,
        shared_fraction=args.shared_fraction,
        disconnect_fraction=args.disconnect_fraction,
        max_tokens=args.max_tokens,
        systems=args.systems,
        system_words=args.system_words,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        model=model,
    )


# -- the own app --------------------------------------------------------------------------------


def app_preset(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` preset with the replica count (and cache size) of this run."""
    from deployments.preset import resolve_config_path

    raw = yaml.safe_load(resolve_config_path(args.config).read_text(encoding="utf-8"))
    raw.setdefault("serving", {})["num_replicas"] = args.replicas
    if args.max_num_tokens is not None:
        raw.setdefault("engine", {})["max_num_tokens"] = args.max_num_tokens
    return raw


@contextlib.contextmanager
def own_app(args: argparse.Namespace) -> Iterator[str]:
    """Start the app on a local Ray cluster (loopback, a free port); shut both down after."""
    import ray
    from ray import serve

    from deployments.app import build_app

    folder = Path(tempfile.mkdtemp(prefix="pagedserve-load-"))
    config = folder / "preset.yaml"
    config.write_text(yaml.safe_dump(app_preset(args)))
    # Before Ray starts, so the replicas inherit them (the demo model is built there once).
    os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(tempfile.gettempdir()) / "pagedserve"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # address="local": a cluster of our own, never one a `ray start` elsewhere left running.
    ray.init(
        address="local",
        num_cpus=max(2, args.replicas),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"config": str(config)}), name="load", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


# -- one measured run ---------------------------------------------------------------------------


async def _model_id(base_url: str, model: str | None) -> str:
    if model is not None:
        return model
    async with aiohttp.ClientSession() as session:
        body = await get_json(session, f"{base_url}/v1/models")
    return body["data"][0]["id"]


async def _stats_or_none(base_url: str) -> list[dict[str, Any]] | None:
    """The replicas' stats; None from a server without ``/v1/stats`` (not this project's)."""
    try:
        async with aiohttp.ClientSession() as session:
            return await replica_stats(session, base_url)
    except (aiohttp.ClientError, TimeoutError) as e:
        logger.warning("no /v1/stats from %s (%s): no leak check", base_url, e)
        return None


async def _warm_up(base_url: str, model: str, timeout_s: float) -> None:
    """One short request, not counted: the first forward's allocations happen outside the run."""
    body = {
        "model": model,
        "prompt": "Warm up.",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = LoadRequest(-1, "completion", COMPLETION_PATH, body)
    async with aiohttp.ClientSession() as session:
        result = await run_request(session, base_url, request, timeout_s, time.perf_counter())
    if result.outcome != "ok":
        raise RuntimeError(f"warm-up request failed: {result.error_kind}: {result.error_detail}")


async def _server_after(base_url: str, args: argparse.Namespace, before: list | None) -> dict:
    if before is None:
        return {"before": None, "after": None, "settled": None, "settle_wait_s": 0.0, "held": {}}
    settled = await settle(base_url, args.settle_timeout)
    return {
        "before": before,
        "after": settled.replicas,
        "settled": settled.settled,
        "settle_wait_s": settled.waited_s,
        "held": settled.held,
    }


async def measure(
    base_url: str, args: argparse.Namespace, target: dict[str, Any]
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Warm up, run the load, wait for the replicas to go idle: the report (not yet written)
    and the requests' results."""
    model = await _model_id(base_url, args.model)
    await _warm_up(base_url, model, args.request_timeout)
    before = await _stats_or_none(base_url)
    requests = make_workload(workload_spec(args, model), args.requests)
    run = await run_load(base_url, requests, args.clients, args.duration, args.request_timeout)
    server = await _server_after(base_url, args, before)
    report = build_report(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=_machine(),
        target={**target, "url": base_url, "model": model},
        workload=_workload_record(args, requests, run),
        summary=summarize(run.results, run.seconds),
        results=run.results,
        server=server,
    )
    return report, run.results


def _workload_record(args: argparse.Namespace, requests: list[LoadRequest], run: LoadRun) -> dict:
    ran = {r.index for r in run.results}
    done = [q for q in requests if q.index in ran]
    spec = asdict(workload_spec(args, None))
    spec.pop("model")
    return {
        **spec,
        "clients": args.clients,
        "duration_s": args.duration,
        "max_requests": args.requests,
        "request_timeout_s": args.request_timeout,
        "ran": {
            "requests": len(done),
            "shared_chats": sum(q.shared for q in done),
            "unique_completions": sum(not q.shared for q in done),
            "planned_disconnects": sum(q.disconnect_after is not None for q in done),
        },
    }


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _machine() -> dict[str, Any]:
    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        **{name: _version(name) for name in ("torch", "ray", "aiohttp")},
    }


# -- main ---------------------------------------------------------------------------------------


def _target(args: argparse.Namespace) -> dict[str, Any]:
    if args.url is not None:
        return {"started_here": False}
    return {
        "started_here": True,
        "config": args.config,
        "replicas": args.replicas,
        "max_num_tokens": args.max_num_tokens,
    }


def _run(args: argparse.Namespace) -> tuple[dict[str, Any], list[RequestResult]]:
    if args.url is not None:
        return asyncio.run(measure(args.url, args, _target(args)))
    with own_app(args) as base_url:
        return asyncio.run(measure(base_url, args, _target(args)))


def write_outputs(
    report: dict[str, Any], results: list[RequestResult], folder: Path, name: str
) -> tuple[Path, Path | None]:
    """``<name>.json`` and, when matplotlib is installed, ``<name>.png`` in ``folder``."""
    json_path = write_json(report, folder / f"{name}.json")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return json_path, None
    w = report["workload"]
    title = (
        f"{name}: {w['clients']} clients, shared {w['shared_fraction']:.0%}, "
        f"disconnect {w['disconnect_fraction']:.0%}, max_tokens {w['max_tokens']}"
    )
    return json_path, plot_latencies(results, folder / f"{name}.png", title)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through own_app's shutdown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report, results = _run(args)
    print_table(report)
    json_path, png_path = write_outputs(report, results, args.output_dir, args.name)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    failed = report["summary"]["errors"] > 0 or report["server"]["settled"] is False
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
