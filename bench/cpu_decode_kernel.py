"""The CPU decode-attention kernel (engine/cpu/decode_attention.py) against its version at a git
ref, in one process: SmolLM2 (float32, ``--threads`` torch threads) decoding one token for
``--batch`` sequences of ``--context`` cached tokens each (random K/V written through the cache
write, as bench/kv_quant_decode.py fills them), per mode: the whole decode forward and the
30 layers' paged attention alone, each tree's op set in turn (engine/ops.py ``cpu_ops``, with
the baseline's kernel module), alternating which goes first, ``--repeats`` times; medians.

Why one process: across processes this box's timings drift by more than the change measured
(docs/history.md, stop 57). The baseline's module is its file at the ref, loaded beside this tree's
engine, so it must run on this tree's helpers (engine/cpu/simd.py, team.py, ...); its kernels
compile without Numba's cache (a module loaded from a temporary file has no cache of its own).

    python bench/cpu_decode_kernel.py --baseline 43bb0b6 [--modes q4 fp16] [--batch 32]
        [--context 4096] [--page-size 16]     # writes bench/results/cpu_decode_kernel.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import engine  # noqa: E402, F401  (before torch: engine/cpu/spin.py)
from bench import kv_quant_decode  # noqa: E402
from bench import kv_quant_quality as quality  # noqa: E402
from bench.record import write_record  # noqa: E402
from engine.batch import SequenceInput, build_forward_batch  # noqa: E402
from engine.ops import cpu_ops  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cpu_decode_kernel.json"
KERNEL = "engine/cpu/decode_attention.py"
MODES = ("fp16", "q8", "q6", "q4")
PARTS = ("forward", "attention")


def baseline_module(ref: str, folder: Path) -> tuple[ModuleType, str]:
    """(the kernel's module as it is at ``ref``, the ref's commit); SystemExit naming the ref
    where git has no such file there."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"--baseline {ref}: {done.stderr.strip()}")
        return done.stdout

    commit = git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()
    source = git("show", f"{commit}:{KERNEL}")
    # Numba's cache off for the baseline: a ref's kernel with ``cache=True`` (before stop 59)
    # or ``cached_njit`` (engine/numba_cache.py) compiles as plain njit
    source = source.replace("cache=True", "cache=False").replace(
        "from engine.numba_cache import cached_njit", "from numba import njit as cached_njit"
    )
    path = folder / f"decode_attention_{commit[:12]}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, commit


def decode_step(model, mode: str, batch: int, context: int, page_size: int) -> dict:
    """{"forward", "attention"}: callables running one decode forward of ``batch`` rows over
    ``context`` cached tokens each in ``mode`` pages, and every layer's paged attention of
    that step alone (on whatever op set the model holds when called)."""
    import torch  # (here: engine first, above, sets torch's OpenMP spinning before it loads)

    per_seq = -(-(context + 1) // page_size)
    pool = batch * per_seq
    kv = model.allocate_kv(pool, page_size, mode)
    kv_quant_decode.fill_pages(model, kv, pool, page_size)
    pages = kv_quant_decode.page_lists(batch, per_seq, 0)
    seqs = [SequenceInput([4 + b % 100], context, p) for b, p in enumerate(pages)]
    fwd = build_forward_batch(seqs, page_size, model.device)
    cfg = model.config
    q = torch.randn(
        (batch, cfg.num_heads, cfg.head_dim), generator=torch.Generator().manual_seed(0)
    )
    return dict(zip(PARTS, kv_quant_decode.decode_calls(model, kv, fwd, q), strict=True))


def seconds(step: Callable[[], None], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - started) / calls


def run_mode(model, trees: dict, mode: str, args: argparse.Namespace) -> dict:
    """Each tree's medians (ms) and every run, for ``mode``: the trees alternate which goes
    first; each run times ``--calls`` calls of each part."""
    steps = decode_step(model, mode, args.batch, args.context, args.page_size)
    runs = {name: {part: [] for part in PARTS} for name in trees}
    kept = model.ops
    try:
        for ops in trees.values():  # untimed: compiles or loads each tree's kernels
            model.ops = ops
            for step in steps.values():
                step()
        for i in range(args.repeats):
            for name in list(trees) if i % 2 == 0 else list(trees)[::-1]:
                model.ops = trees[name]
                for part, step in steps.items():
                    runs[name][part].append(seconds(step, args.calls) * 1e3)
    finally:
        model.ops = kept
    medians = {
        name: {p: statistics.median(r) for p, r in parts.items()} for name, parts in runs.items()
    }
    return {"mode": mode, "median_ms": medians, "runs_ms": runs}


def report(results: list[dict], batch: int) -> None:
    """One line per mode and part: each tree's ms and tokens/s, and the speedup."""
    for r in results:
        medians = r["median_ms"]
        for part in PARTS:
            cells = [
                f"{name} {m[part]:8.2f} ms {batch / m[part] * 1e3:7.1f} tok/s"
                for name, m in medians.items()
            ]
            if "baseline" in medians:
                cells.append(f"{medians['baseline'][part] / medians['this tree'][part]:.2f}x")
            print(f"{r['mode']:5} {part:9} " + "   ".join(cells))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", help="also time the kernel at git ref REF")
    parser.add_argument("--modes", nargs="+", default=["q4", "fp16"], choices=MODES)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, help="runs per tree and mode (5; --quick 1)")
    parser.add_argument("--calls", type=int, default=2, help="calls of each part per run")
    parser.add_argument("--quick", action="store_true", help="batch 2, 64 tokens, 1 call")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.calls = 2, 64, 1
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    for name in ("batch", "context", "page_size", "threads", "repeats", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        baseline = baseline_module(args.baseline, Path(folder)) if args.baseline else None
        loaded = quality.load_smollm2(args.threads)
        if loaded is None:
            return 2
        model, _, gguf = loaded
        trees = {"this tree": cpu_ops()}
        if baseline is not None:
            trees["baseline"] = cpu_ops(baseline[0])
        results = []
        for mode in args.modes:
            results.append(run_mode(model, trees, mode, args))
            gc.collect()  # (a mode's pages: up to 6 GB of float32 at 32 x 4096)
    report(results, args.batch)
    write_record(
        args.output, "cpu_decode_kernel",
        machine=f"{platform.machine()} CPU, {args.threads} torch threads, no GPU",
        model=gguf.name, batch=args.batch, context=args.context, page_size=args.page_size,
        repeats=args.repeats, calls=args.calls,
        baseline=None if baseline is None else {"ref": args.baseline, "commit": baseline[1]},
        results=results,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
