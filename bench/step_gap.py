"""The device's idle time between two decode forwards, with and without async scheduling.

Issue "Host overhead per step", acceptance on a GPU: at batch 64 on the Llama-3.2-1B shape,
the time between two consecutive decode forwards on the device is < 5% of the forward itself.

A ``DynamicGenerator`` (random fp16 weights in GPU memory, ``bench/gpu_decode.py``'s recipe)
prefills B jobs of ``--context`` tokens, then runs ``--steps`` decode ``iterate()`` calls. The
runner's ``forward_plan`` is wrapped with two CUDA events, one recorded when the host starts a
forward (batch upload, input patch, graph replay or eager launches: all queued work) and one
when it has queued the last of it. In stream order:

    forward_ms  = elapsed(start_k, end_k): the forward on the device (its host launch time too
                  when the host queues slower than the device runs, e.g. eager at batch 1);
    gap_ms      = elapsed(end_k, start_k+1): everything between two forwards on the device:
                  the sampling kernels, and the time the device waits for the host to queue
                  the next forward.

Without async scheduling the host reads each step's tokens (waiting for the forward) before it
plans the next one, so ``gap_ms`` holds all of its per-step work. With it, the next forward is
queued while the device still runs the previous step, so the gap shrinks to the sampling.
Greedy tokens must be the same both ways (checked). ``--trace DIR`` also writes a torch
profiler (Chrome) trace of a few steps per mode, to look at the timeline itself.

Without a GPU it exits with status 2 unless ``--dry-run`` (CPU, a tiny float32 model, the
torch ops: the same code path, serial, so its numbers say nothing about a GPU).

    python bench/step_gap.py                        # llama3.2-1b, batch 64, both modes
    python bench/step_gap.py --batches 1 64 256 --sampling greedy topk_topp
    python bench/step_gap.py --dry-run --output /tmp/step_gap.json
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode  # (the bench folder: model building shared with gpu_decode.py)

logger = logging.getLogger("step_gap")

RESULTS = Path(__file__).parent / "results" / "step_gap.json"
DRY_RUN_RESULTS = Path(tempfile.gettempdir()) / "step_gap_dry_run.json"
GOAL_GAP_FRACTION = 0.05  # gap / forward at batch 64 on the 1B shape
GOAL_BATCH = 64
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "topk_topp": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    # temperature alone (an OpenAI client's default): the kernels draw from the whole row
    "temperature": {"temperature": 1.0},
}


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    sampling: str
    async_scheduling: bool


@dataclass(frozen=True)
class CaseResult:
    model: str
    batch: int
    sampling: str
    async_scheduling: bool
    steps: int
    forward_ms: float  # median
    gap_ms: float  # median
    gap_fraction: float  # median gap / median forward
    step_ms: float  # wall time per iterate() over the timed steps
    async_steps: int
    graph_steps: int  # timed steps replayed as captured decode CUDA graphs


class ForwardClock:
    """Marks around each ``forward_plan`` call: CUDA events on a GPU (device timestamps in
    stream order), perf_counter on a CPU (where everything is serial)."""

    def __init__(self, runner: Any, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[Any, Any]] = []
        self.recording = False
        real = runner.forward_plan

        def forward_plan(plan, token_patch=None):
            if not self.recording:
                return real(plan, token_patch)
            start = self._mark()
            logits = real(plan, token_patch)
            self.marks.append((start, self._mark()))
            return logits

        runner.forward_plan = forward_plan

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else 1000.0 * (b - a)

    def intervals(self) -> tuple[list[float], list[float]]:
        """(forward ms per step, gap ms between consecutive steps)."""
        if self.cuda:
            torch.cuda.synchronize()
        forwards = [self._ms(s, e) for s, e in self.marks]
        ends = [end for _, end in self.marks[:-1]]
        starts = [start for start, _ in self.marks[1:]]
        gaps = [self._ms(e, s) for e, s in zip(ends, starts, strict=True)]
        return forwards, gaps


def run_case(case: Case, model: Any, tokenizer: Any, args: argparse.Namespace) -> tuple:
    """(CaseResult, the jobs' tokens)."""
    from engine import DynamicGenerator, DynamicJob, PagedCache, SamplerSettings

    new_tokens = args.steps + args.warmup_steps + 4 + -(-case.batch * args.context // 2048)
    per_seq = args.context + new_tokens
    pages = case.batch * -(-per_seq // args.page_size) + 1
    cache = PagedCache(model, max_num_tokens=pages * args.page_size, page_size=args.page_size)
    generator = DynamicGenerator(
        model,
        cache,
        tokenizer,
        max_batch_size=case.batch,
        max_chunk_size=2048,
        async_scheduling=case.async_scheduling,
    )
    clock = ForwardClock(generator.runner, model.device.type == "cuda")
    settings = SamplerSettings(**SAMPLING[case.sampling])
    prompts = gpu_decode.random_prompts(case.batch, args.context, tokenizer.vocab_size, case.batch)
    jobs = [
        DynamicJob(p, new_tokens, gen_settings=settings, stop_conditions=[], seed=i)
        for i, p in enumerate(prompts)
    ]
    for job in jobs:
        generator.enqueue(job)
    while any(not job.new_token_ids for job in jobs):
        generator.iterate()
    for _ in range(args.warmup_steps):
        generator.iterate()
    clock.recording = True
    graph_steps = generator.runner.decode_graph_replays
    began = time.perf_counter()
    for _ in range(args.steps):
        generator.iterate()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    graph_steps = generator.runner.decode_graph_replays - graph_steps
    clock.recording = False
    if args.trace is not None:
        write_trace(generator, case, args.trace)
    while generator.num_remaining_jobs():
        generator.iterate()
    forwards, gaps = clock.intervals()
    forward_ms, gap_ms = statistics.median(forwards), statistics.median(gaps)
    result = CaseResult(
        model=case.model,
        batch=case.batch,
        sampling=case.sampling,
        async_scheduling=case.async_scheduling,
        steps=args.steps,
        forward_ms=forward_ms,
        gap_ms=gap_ms,
        gap_fraction=gap_ms / forward_ms if forward_ms > 0 else float("nan"),
        step_ms=1000.0 * seconds / args.steps,
        async_steps=generator.async_steps,
        graph_steps=graph_steps,
    )
    return result, [job.new_token_ids for job in jobs]


def write_trace(generator: Any, case: Case, folder: Path) -> None:
    """A Chrome trace of a few decode steps (the timeline the gap figures summarise)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    folder.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities) as prof:
        for _ in range(4):
            generator.iterate()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    name = (
        f"{case.model}-b{case.batch}-{case.sampling}-{'async' if case.async_scheduling else 'sync'}"
    )
    prof.export_chrome_trace(str(folder / f"{name}.json"))


def goal(results: list[CaseResult], model: str) -> dict[str, Any]:
    rows = [
        r
        for r in results
        if r.model == model
        and r.batch == GOAL_BATCH
        and r.async_scheduling
        and r.sampling == "greedy"
    ]
    measured = rows[0].gap_fraction if rows else None
    return {
        "what": f"gap / forward, batch {GOAL_BATCH}, greedy, async scheduling, {model}",
        "target": GOAL_GAP_FRACTION,
        "measured": measured,
        "met": None if measured is None else measured < GOAL_GAP_FRACTION,
    }


def print_row(r: CaseResult) -> None:
    mode = "async" if r.async_scheduling else "sync"
    print(
        f"{r.model:12s} {r.batch:5d} {r.sampling:10s} {mode:5s} {r.forward_ms:10.3f} "
        f"{r.gap_ms:9.3f} {100 * r.gap_fraction:7.1f}% {r.step_ms:9.3f} {r.async_steps:6d} "
        f"{r.graph_steps:6d}",
        flush=True,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny model (a code check)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--sampling", nargs="+", choices=list(SAMPLING), default=["greedy"])
    p.add_argument("--context", type=int, default=None, help="prompt tokens per job")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps")
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--trace", type=Path, default=None, help="write Chrome traces here")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--cache-dir", type=Path, default=gpu_decode.DEFAULT_CACHE_DIR)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    if args.dry_run:
        args.batches = args.batches or [1, 4]
        args.context = args.context or 16
        args.steps = args.steps or 4
        args.warmup_steps = min(args.warmup_steps, 1)
        args.output = args.output or DRY_RUN_RESULTS
    else:
        args.batches = args.batches or [GOAL_BATCH]
        args.context = args.context or 1024
        args.steps = args.steps or 64
        args.output = args.output or RESULTS
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --dry-run for a CPU code check")
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    name, spec = next(iter((gpu_decode.dry_specs() if args.dry_run else _one_b()).items()))
    dtype = torch.float32 if args.dry_run else torch.float16
    ops = "torch" if args.dry_run else "default"
    with gpu_decode.ops_env(ops):
        config, network = gpu_decode.build_network(spec, dtype, device)
        model = gpu_decode.make_model(config, network, args.page_size)
    tokenizer = gpu_decode.load_tokenizer(spec.vocab_size, args.cache_dir)
    print(
        f"{'model':12s} {'batch':>5s} {'sampling':10s} {'mode':5s} {'forward ms':>10s} "
        f"{'gap ms':>9s} {'gap/fwd':>8s} {'step ms':>9s} {'async':>6s} {'graphs':>6s}"
    )
    results: list[CaseResult] = []
    mismatches: list[str] = []
    for batch in args.batches:
        for sampling in args.sampling:
            tokens = {}
            for late in (False, True):
                result, tokens[late] = run_case(
                    Case(name, batch, sampling, late), model, tokenizer, args
                )
                results.append(result)
                print_row(result)
            if sampling == "greedy" and tokens[False] != tokens[True]:
                mismatches.append(f"batch {batch}: greedy tokens differ with async scheduling")
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "machine": gpu_decode.device_info(device) | {"host": platform.node()},
        "context": args.context,
        "results": [asdict(r) for r in results],
        "goal": goal(results, name),
        "greedy_mismatches": mismatches,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"goal: {report['goal']}")
    print(f"wrote {args.output}")
    if mismatches:
        print("\n".join(mismatches))
        return 1
    return 0


def _one_b() -> dict[str, Any]:
    specs = gpu_decode.gpu_specs()
    return {"llama3.2-1b": specs["llama3.2-1b"]}


if __name__ == "__main__":
    sys.exit(main())
