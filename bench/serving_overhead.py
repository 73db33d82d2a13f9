"""Serving overhead: one workload through the bare engine and through the served app, side by side.

The workload: ``--streams`` concurrent streams (64) of unique completion prompts of mixed
length, greedy, ``ignore_eos`` with a fixed ``max_tokens``, so both paths generate exactly the
same tokens. It runs

- ``bare``: in a child process, on ``deployments.llm_server.build_generator(preset)`` (the
  function every replica builds its engine with), each request turned into its job by the
  ingress's own ``PromptBuilder`` and consumed with ``DynamicJobAsync``;
- ``served`` (one per ``--served NAME=ROOT``, default this checkout): the app of that checkout
  (Ray Serve: HTTP proxy, ingress, one ``LLMServer`` replica) in a child process with its own
  Ray cluster and temp dir, on 127.0.0.1 only, read over HTTP streaming (SSE) by the same
  clients as ``bench/load.py``; stopped with SIGTERM afterwards.

Each path runs in a process session of its own (the kernel's autogroup scheduler shares the
CPU between sessions, so on a shared machine both get the same terms). Both start with one
short warm-up request; the served app is first left to go idle. Per path: generated tokens/s,
TTFT p50/p90, inter-token latency p50/p90 (gaps between content deliveries: an SSE chunk, or
an engine result with text; coalescing shows as fewer, longer gaps), time per output token
p50/p90, tokens per delivery and CPU ms per token of the path's processes; per served run the
ratios to bare and whether its greedy texts equal the bare engine's. JSON under
``bench/results/``.

    flock /work/ray.lock python bench/serving_overhead.py --config configs/demo.yaml
    flock /work/ray.lock python bench/serving_overhead.py --config configs/smollm2.yaml \\
        --served main=/work/main --served branch=.
    python bench/serving_overhead.py --no-served --bare-also main=/work/main  # engines only
    # the engine on core 1 (bare and served), the rest of the app and the clients on core 0
    flock /work/ray.lock python bench/serving_overhead.py --set serving.engine_cpus=[1] \
        --host-cpus 0

On a 2-core machine the served app's proxy, ingress and Ray processes otherwise run on the
replica's core whenever they wake, which the bare engine never pays (deployments/cpu_affinity.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from loadgen.app_process import AppProcess, cpu_used
from loadgen.client import RequestResult, run_load, run_request
from loadgen.stats import percentile, tpot
from loadgen.workload import LoadRequest, WorkloadSpec, make_workload

from deployments.cpu_affinity import parse_cpu_list

logger = logging.getLogger("bench.serving_overhead")

RESULTS = Path(__file__).parent / "results"
REPO_ROOT = Path(__file__).resolve().parents[1]
GOAL_THROUGHPUT = 0.9  # served tokens/s at least this share of bare
GOAL_ITL = 1.2  # served p50 inter-token latency at most this multiple of bare


# -- arguments ------------------------------------------------------------------------------------


def _variant(value: str) -> tuple[str, Path]:
    name, sep, root = value.partition("=")
    if not sep or not name or not root:
        raise argparse.ArgumentTypeError(f"--served takes NAME=ROOT, got {value!r}")
    path = Path(root).resolve()
    if not (path / "deployments" / "app.py").is_file():
        raise argparse.ArgumentTypeError(f"--served {name}: {path} has no deployments/app.py")
    return name, path


def _override(value: str) -> tuple[str, str, Any]:
    key, sep, raw = value.partition("=")
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        raise argparse.ArgumentTypeError(f"--set takes SECTION.KEY=VALUE, got {value!r}")
    try:
        return section, name, yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise argparse.ArgumentTypeError(f"--set {key}: {raw!r} is not YAML ({e})") from None


def _word_range(value: str) -> tuple[int, int]:
    low, sep, high = value.partition(":")
    try:
        pair = (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"word range must be LOW:HIGH, got {value!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"word range must be 1 <= LOW <= HIGH, got {value!r}")
    return pair


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml", help="model preset (both paths)")
    p.add_argument(
        "--served",
        type=_variant,
        action="append",
        metavar="NAME=ROOT",
        help="serve the app of this checkout (repeatable; default: this=<this checkout>)",
    )
    p.add_argument(
        "--set",
        type=_override,
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a preset value for every path, e.g. serving.stream_interval_s=0.2 "
        "(VALUE is YAML; repeatable)",
    )
    p.add_argument(
        "--bare-also",
        type=_variant,
        action="append",
        default=[],
        metavar="NAME=ROOT",
        help="also run the bare engine of this checkout, after this one's (repeatable; e.g. "
        "main before an engine change: its ratios to bare are the change's speed-up)",
    )
    p.add_argument("--no-bare", action="store_true", help="skip the bare engine run")
    p.add_argument("--no-served", action="store_true", help="bare engines only (no Ray)")
    p.add_argument(
        "--bare-last", action="store_true", help="run bare after the served runs (order check)"
    )
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--requests", type=int, help="requests in all (default: --streams)")
    p.add_argument("--max-tokens", type=int, default=32, help="new tokens of every request")
    p.add_argument(
        "--prompt-words", type=_word_range, default=(8, 200), help="prompt length range LOW:HIGH"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--name", help="result file stem (default serving-overhead-<UTC time>)")
    p.add_argument("--output-dir", type=Path, default=RESULTS)
    p.add_argument("--note", default="", help="free text kept in the JSON (e.g. the machine)")
    p.add_argument(
        "--host-cpus",
        type=_cpu_list,
        help="Linux cores (cpulist, e.g. 0) for the served app's processes and the HTTP "
        "clients; the LLM replica moves to serving.engine_cpus (give those with --set "
        "serving.engine_cpus=[1]; the bare engine runs there too)",
    )
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--bare-child", type=Path, help=argparse.SUPPRESS)  # internal: see run_bare
    args = p.parse_args(argv)
    for name in ("streams", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.requests = args.streams if args.requests is None else args.requests
    if args.requests < 1:
        p.error("--requests must be >= 1")
    if args.no_served and (args.served or args.no_bare):
        p.error("--no-served runs the bare engines only: drop --served / --no-bare")
    args.served = [] if args.no_served else args.served or [("this", REPO_ROOT)]
    names = [name for name, _ in args.served + args.bare_also]
    if len(set(names)) != len(names) or "bare" in names:
        p.error(f"--served/--bare-also names must be distinct and not 'bare', got {names}")
    if args.bare_also and args.no_bare:
        p.error("--bare-also compares with this checkout's bare run: drop --no-bare")
    engine_set = any((section, key) == ("serving", "engine_cpus") for section, key, _ in args.set)
    if args.host_cpus is not None and not engine_set:
        p.error(
            "--host-cpus keeps the app off the engine's cores: give them with --set "
            "serving.engine_cpus=[...]"
        )
    args.name = args.name or "serving-overhead-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    return args


def _cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text, "--host-cpus")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextmanager
def cpus_of_this_thread(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """Run the block on ``cpus`` (this thread, and the processes and threads it starts:
    they inherit it); None: unchanged."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def workload(args: argparse.Namespace) -> list[LoadRequest]:
    """Unique greedy completions of mixed length, every one generating ``max_tokens``."""
    spec = WorkloadSpec(
        seed=args.seed,
        shared_fraction=0.0,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        temperature=0.0,
        ignore_eos=True,
    )
    return make_workload(spec, args.requests)


# -- statistics -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathSummary:
    """One path's run in numbers (seconds; latencies over requests that finished ``ok``)."""

    requests: int
    ok: int
    errors: int
    seconds: float
    generated_tokens: int
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    itl_p50_s: float | None
    itl_p90_s: float | None
    tpot_p50_s: float | None
    tpot_p90_s: float | None
    tokens_per_delivery: float | None
    cpu_s: float | None  # CPU seconds of the engine's process(es) during the run
    cpu_ms_per_token: float | None


@dataclass
class PathRun:
    """What one path produced: per-request results, the run's wall time and the CPU seconds
    its processes used meanwhile, by process (bare: the one process)."""

    results: list[RequestResult]
    seconds: float
    cpu: dict[str, float]


def summarize_path(
    results: list[RequestResult], seconds: float, cpu: dict[str, float] | None = None
) -> PathSummary:
    if seconds <= 0:
        raise ValueError(f"run seconds must be > 0, got {seconds}")
    ok = [r for r in results if r.outcome == "ok"]
    generated = sum(r.completion_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    tpots = [t for t in map(tpot, ok) if t is not None]
    deliveries = sum(len(r.chunk_s) for r in ok)
    cpu_s = sum(cpu.values()) if cpu else None
    return PathSummary(
        requests=len(results),
        ok=len(ok),
        errors=len(results) - len(ok),
        seconds=seconds,
        generated_tokens=generated,
        tokens_per_s=generated / seconds,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        itl_p50_s=percentile(itls, 50),
        itl_p90_s=percentile(itls, 90),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p90_s=percentile(tpots, 90),
        tokens_per_delivery=generated / deliveries if deliveries else None,
        cpu_s=cpu_s,
        cpu_ms_per_token=cpu_s * 1000 / generated if cpu_s is not None and generated else None,
    )


RATIO_KEYS = (
    "tokens_per_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "itl_p50_s",
    "itl_p90_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "cpu_ms_per_token",
)


def ratios(served: PathSummary, bare: PathSummary) -> dict[str, float | None]:
    """served / bare for each figure (None where either is missing or bare is 0)."""
    out: dict[str, float | None] = {}
    for key in RATIO_KEYS:
        a, b = getattr(served, key), getattr(bare, key)
        out[key] = None if a is None or not b else a / b
    return out


def goals(r: dict[str, float | None]) -> dict[str, bool | None]:
    """The issue's goals: throughput >= 90% of bare, p50 ITL within 1.2x (and p50 TPOT, the
    per-token view of the same latency, which coalescing does not stretch)."""

    def check(value: float | None, ok: Any) -> bool | None:
        return None if value is None else bool(ok(value))

    return {
        "throughput_ge_90pct": check(r["tokens_per_s"], lambda v: v >= GOAL_THROUGHPUT),
        "itl_p50_within_1_2x": check(r["itl_p50_s"], lambda v: v <= GOAL_ITL),
        "tpot_p50_within_1_2x": check(r["tpot_p50_s"], lambda v: v <= GOAL_ITL),
    }


def text_agreement(results: list[RequestResult], reference: list[RequestResult]) -> dict:
    """How many requests produced the same text as the reference run (by request index)."""
    texts = {r.index: r.text for r in reference if r.outcome == "ok"}
    compared = [r for r in results if r.outcome == "ok" and r.index in texts]
    same = sum(r.text == texts[r.index] for r in compared)
    return {"compared": len(compared), "same": same}


# -- the bare engine ------------------------------------------------------------------------------


async def _bare_request(generator, request: BareRequest, start: float) -> RequestResult:
    from engine import DynamicJob, DynamicJobAsync

    result = RequestResult(request.index, "completion", False, time.perf_counter() - start)
    sent = time.perf_counter()
    try:
        job = DynamicJobAsync(generator, job=DynamicJob.from_request(request.generation))
        async for item in job:
            if item.get("text"):
                result.chunk_s.append(time.perf_counter() - sent)
                result.text += item["text"]
            if item["eos"]:
                result.prompt_tokens = item["prompt_tokens"]
                result.completion_tokens = item["new_tokens"]
                result.cached_tokens = item["cached_tokens"]
    except Exception as e:  # counted as an error, like a failed HTTP request
        result.fail(type(e).__name__, e)
    result.end_s = time.perf_counter() - start
    return result


async def _bare_run(generator, requests: list[BareRequest], clients: int):
    pending = iter(requests)
    results: list[RequestResult] = []
    start = time.perf_counter()

    async def client() -> None:
        for request in pending:
            results.append(await _bare_request(generator, request, start))

    cpu = time.process_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu
    await generator.close()
    return PathRun(sorted(results, key=lambda r: r.index), seconds, {"bare": cpu})


@dataclass(frozen=True)
class BareRequest:
    """A workload request as the ingress would send it to a replica (tokenized up front: the
    bare engine is measured from token ids on, as a replica sees them)."""

    index: int
    generation: Any  # engine.request.GenerationRequest


def bare_in_child(
    args: argparse.Namespace, config: Path, folder: Path, root: Path = REPO_ROOT
) -> PathRun:
    """The bare run in a child process of its own session, like the served app's: with the
    kernel's autogroup scheduling a session shares the CPU as one, so both paths compete
    with the rest of the machine on the same terms (in this process's session the bare
    engine would share its slice with whatever else runs there)."""
    out = folder / f"bare-{len(list(folder.glob('bare-*.json')))}.json"
    command = [
        sys.executable,
        str(root / "bench" / "serving_overhead.py"),
        *("--config", str(config), "--streams", str(args.streams)),
        *("--requests", str(args.requests), "--max-tokens", str(args.max_tokens)),
        *("--prompt-words", "{}:{}".format(*args.prompt_words), "--seed", str(args.seed)),
        *("--log-level", args.log_level, "--bare-child", str(out)),
    ]
    env = {**os.environ, "PYTHONPATH": str(root)}
    child = subprocess.Popen(command, cwd=root, env=env, start_new_session=True)
    try:
        code = child.wait(args.request_timeout * 2)
    finally:
        if child.poll() is None:  # the parent was interrupted or the child hangs: stop it
            child.send_signal(signal.SIGTERM)
            child.wait(30)
    if code != 0:
        raise RuntimeError(f"the bare run failed (exit {code})")
    return load_path_run(out)


def dump_path_run(run: PathRun, path: Path) -> None:
    body = {"results": [asdict(r) for r in run.results], "seconds": run.seconds, "cpu": run.cpu}
    path.write_text(json.dumps(body))


def load_path_run(path: Path) -> PathRun:
    body = json.loads(path.read_text())
    results = [RequestResult(**r) for r in body["results"]]
    return PathRun(results, body["seconds"], body["cpu"])


def run_bare(config: Path, requests: list[LoadRequest], clients: int, warm_up: LoadRequest):
    from deployments.ingress import PromptBuilder
    from deployments.llm_server import build_generator
    from deployments.preset import Preset

    preset = Preset.load(str(config))
    prompts = PromptBuilder(preset)

    def bare(request: LoadRequest) -> BareRequest:
        return BareRequest(request.index, prompts.request(request.body, chat=False)[1])

    async def go():
        generator = build_generator(preset)
        first = await _bare_request(generator, bare(warm_up), time.perf_counter())
        if first.outcome != "ok":
            raise RuntimeError(f"bare warm-up failed: {first.error_detail}")
        return await _bare_run(generator, [bare(r) for r in requests], clients)

    return asyncio.run(go())


# -- the served app -------------------------------------------------------------------------------


def run_served(
    config: Path,
    root: Path,
    requests: list[LoadRequest],
    clients: int,
    timeout_s: float,
    host_cpus: tuple[int, ...] | None = None,
):
    async def go(url: str):
        import aiohttp

        warm = warm_up_request(requests)
        async with aiohttp.ClientSession() as session:
            first = await run_request(session, url, warm, timeout_s, time.perf_counter())
        if first.outcome != "ok":
            raise RuntimeError(f"served warm-up failed: {first.error_kind}: {first.error_detail}")
        before = app.cpu()
        run = await run_load(url, requests, clients, float("inf"), timeout_s)
        return PathRun(run.results, run.seconds, cpu_used(before, app.cpu()))

    app = AppProcess(config, root)
    with cpus_of_this_thread(host_cpus), app as url:  # (the app's processes inherit it)
        waited = app.settle()
        logger.info("served %s: the app went idle after %.1f s", root, waited)
        return asyncio.run(go(url))


def warm_up_request(requests: list[LoadRequest]) -> LoadRequest:
    body = {**requests[0].body, "prompt": "Warm up.", "max_tokens": 2}
    return LoadRequest(-1, "completion", requests[0].path, body)


def served_preset(config: str, folder: Path, overrides: list[tuple[str, str, Any]] = ()) -> Path:
    """The preset with ``overrides`` and one replica (the bare run is one engine too), as a
    file (validated here: a bad override fails before anything starts)."""
    from deployments.preset import Preset, resolve_config_path

    raw = yaml.safe_load(resolve_config_path(config).read_text(encoding="utf-8"))
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    raw.setdefault("serving", {})["num_replicas"] = 1
    Preset.parse(raw, source=f"{config} with overrides")
    path = folder / "preset.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# -- report ---------------------------------------------------------------------------------------


def machine(note: str) -> dict[str, Any]:
    import torch

    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "note": note,
    }


def build_report(
    args: argparse.Namespace,
    runs: dict[str, PathRun],
    machine_info: dict[str, Any],
) -> dict[str, Any]:
    summaries = {name: summarize_path(r.results, r.seconds, r.cpu) for name, r in runs.items()}
    report: dict[str, Any] = {
        "benchmark": "serving_overhead",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_info,
        "config": args.config,
        "overrides": {f"{section}.{key}": value for section, key, value in args.set},
        "host_cpus": list(args.host_cpus) if args.host_cpus is not None else None,
        "workload": {
            "streams": args.streams,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "prompt_words": list(args.prompt_words),
            "seed": args.seed,
            "greedy": True,
        },
        "order": list(runs),
        "served_roots": {name: str(root) for name, root in args.served},
        "bare_roots": {"bare": str(REPO_ROOT), **{n: str(r) for n, r in args.bare_also}},
        "paths": {name: asdict(s) for name, s in summaries.items()},
        "cpu_s_by_process": {name: _rounded(r.cpu) for name, r in runs.items()},
        "vs_bare": {},
    }
    bare = summaries.get("bare")
    for name, summary in summaries.items():
        if name == "bare" or bare is None:
            continue
        r = ratios(summary, bare)
        served = name not in report["bare_roots"]  # the goals are about serving, not engines
        report["vs_bare"][name] = {
            "ratios": r,
            "goals": goals(r) if served else None,
            "text": text_agreement(runs[name].results, runs["bare"].results),
        }
    return report


def _rounded(cpu: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.001}


def _ms(value: float | None) -> str:
    return "      -" if value is None else f"{value * 1000:7.1f}"


def _x(value: float | None) -> str:
    return "    -" if value is None else f"{value:5.2f}"


def table(report: dict[str, Any]) -> list[str]:
    """The report as printed lines (a bench's table, not logging)."""
    head = (
        "path          tok/s  TTFT p50   p90 ms  ITL p50   p90 ms  TPOT p50  p90 ms  tok/dlv"
        "  CPU ms/tok"
    )
    lines = [head]
    for name, s in report["paths"].items():
        per = s["tokens_per_delivery"]
        lines.append(
            f"{name:10s} {s['tokens_per_s']:8.1f} {_ms(s['ttft_p50_s'])} {_ms(s['ttft_p90_s'])}"
            f"  {_ms(s['itl_p50_s'])} {_ms(s['itl_p90_s'])}  {_ms(s['tpot_p50_s'])}"
            f" {_ms(s['tpot_p90_s'])}  {'-' if per is None else f'{per:5.2f}'}"
            f"  {_x(s['cpu_ms_per_token'])}" + (f"   ({s['errors']} errors)" if s["errors"] else "")
        )
    for name, vs in report["vs_bare"].items():
        r, g, t = vs["ratios"], vs["goals"], vs["text"]
        lines.append(
            f"{name} / bare: tok/s {_x(r['tokens_per_s'])}  TTFT p50 {_x(r['ttft_p50_s'])}"
            f"  ITL p50 {_x(r['itl_p50_s'])}  TPOT p50 {_x(r['tpot_p50_s'])}"
            f"  CPU/tok {_x(r['cpu_ms_per_token'])}"
            f"  goals {g}  same text {t['same']}/{t['compared']}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("PAGEDSERVE_CACHE", str(Path(tempfile.gettempdir()) / "pagedserve"))
    requests = workload(args)
    if args.bare_child is not None:
        warm = warm_up_request(requests)
        dump_path_run(run_bare(Path(args.config), requests, args.streams, warm), args.bare_child)
        return 0
    runs: dict[str, PathRun] = {}
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as folder:
        config = served_preset(args.config, Path(folder), args.set)
        if not args.no_bare and not args.bare_last:
            runs["bare"] = bare_in_child(args, config, Path(folder))
        for name, root in args.bare_also:
            runs[name] = bare_in_child(args, config, Path(folder), root)
        for name, root in args.served:
            runs[name] = run_served(
                config, root, requests, args.streams, args.request_timeout, args.host_cpus
            )
        if not args.no_bare and args.bare_last:
            runs["bare"] = bare_in_child(args, config, Path(folder))
    report = build_report(args, runs, machine(args.note))
    for line in table(report):
        print(line)
    path = args.output_dir / f"{args.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
