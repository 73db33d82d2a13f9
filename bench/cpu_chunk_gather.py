"""Prefill time on the CPU over a quantized cache: prompt chunks attending through the Numba
context gather (engine/cpu/kv_gather.py, the CPU op set's route since stop 51) against the
torch reference's gather (engine/cuda/quant_reference.py ``gather_context``, attention in the
pages' basis with q and the output rotated by a matmul: the route before), in one process.

Across processes this box's prefill moves by 5-10% from run to run, more than the change
measured; here one loaded SmolLM2 (float32, ``--threads`` torch threads) runs both routes,
alternating which goes first, ``--repeats`` times each: ``--batch`` prompts of ``--context``
tokens prefilled in forwards of ``--chunk`` tokens (bench/kv_cpu_decode.py's ``measure``),
then one decode step. fp16 runs ``--fp16-repeats`` times after them, for the gap that is
left. The reference route is as it was at c0d3e61, its own rows rotated by the matmul.

    python bench/cpu_chunk_gather.py [--modes q4 q8] [--repeats 6]
        # writes bench/results/cpu_chunk_gather.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import platform
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

import engine  # noqa: E402, F401  (before torch: engine/cpu/spin.py)
from bench import kv_cpu_decode  # noqa: E402
from bench import kv_quant_quality as quality  # noqa: E402
from bench.record import write_record  # noqa: E402
from engine.cache.quant import QuantPages, rotate_groups  # noqa: E402
from engine.cpu.decode_attention import quant_decode_attention_cpu, supports  # noqa: E402
from engine.cuda import quant_reference  # noqa: E402
from engine.ops import OpSet, decode_rows_on  # noqa: E402

RESULTS = REPO / "bench" / "results" / "cpu_chunk_gather.json"
ROUTES = ("reference", "kernel")


def reference_route(ops: OpSet) -> OpSet:
    """``ops`` with quantized pages' prompt chunks on the torch reference (the decode rows
    still on the decode kernel), as the CPU op set routed them before stop 51."""
    quantized = decode_rows_on(
        quant_decode_attention_cpu, quant_reference.quant_paged_attention_reference, supports
    )
    plain = ops.paged_attention

    def attention(q, k_pages, v_pages, batch, scale, sliding_window=None):
        chosen = quantized if isinstance(k_pages, QuantPages) else plain
        return chosen(q, k_pages, v_pages, batch, scale, sliding_window)

    return dataclasses.replace(ops, paged_attention=attention)


@contextlib.contextmanager
def matmul_own_rows() -> Iterator[None]:
    """The torch gather's own rows rotated by the matmul, as before stop 51 (the kernel
    route never calls it)."""
    saved = quant_reference._butterflies
    quant_reference._butterflies = rotate_groups
    try:
        yield
    finally:
        quant_reference._butterflies = saved


def prefill_seconds(model, tokenizer, mode: str, args: argparse.Namespace) -> float:
    shape = (args.batch, args.context, 1, False, args.chunk)
    return kv_cpu_decode.measure(model, tokenizer, mode, *shape).prefill_s


def run_mode(model, tokenizer, mode: str, args: argparse.Namespace) -> dict:
    """Both routes' prefill seconds for ``mode``, alternating which runs first."""
    kernel_ops = model.ops
    routes = {"reference": reference_route(kernel_ops), "kernel": kernel_ops}
    seconds: dict[str, list[float]] = {name: [] for name in ROUTES}
    try:
        for i in range(args.repeats):
            for name in ROUTES if i % 2 == 0 else ROUTES[::-1]:
                model.ops = routes[name]
                seconds[name].append(prefill_seconds(model, tokenizer, mode, args))
    finally:
        model.ops = kernel_ops
    medians = {name: statistics.median(runs) for name, runs in seconds.items()}
    return {
        "mode": mode,
        "runs_s": seconds,
        "median_s": medians,
        "speedup": medians["reference"] / medians["kernel"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["q4"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=512, help="tokens per forward")
    parser.add_argument("--repeats", type=int, default=6, help="runs per route and mode")
    parser.add_argument("--fp16-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for mode in args.modes:
        if kv_cpu_decode.parse_mode(mode)[0] == "fp16":
            parser.error(f"--modes {mode}: a quantized mode (fp16 runs as the reference point)")
    if min(args.repeats, args.chunk, args.context, args.batch) < 1 or args.fp16_repeats < 0:
        parser.error("--repeats, --chunk, --context and --batch: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = quality.load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, tokenizer, gguf = loaded
    # an untimed run first: a process's first prefill makes each matmul shape's kernels
    kv_cpu_decode.measure(model, tokenizer, args.modes[0], 1, min(args.context, 1024), 1, False,
                          args.chunk)  # fmt: skip
    with matmul_own_rows():
        results = [run_mode(model, tokenizer, mode, args) for mode in args.modes]
    fp16 = [prefill_seconds(model, tokenizer, "fp16", args) for _ in range(args.fp16_repeats)]
    print(f"{'mode':8} {'reference s':>12} {'kernel s':>9} {'speedup':>8} {'fp16 s':>7}")
    fp16_median = statistics.median(fp16) if fp16 else None
    for r in results:
        m = r["median_s"]
        fp16_text = f"{fp16_median:7.2f}" if fp16 else "      -"
        print(f"{r['mode']:8} {m['reference']:12.2f} {m['kernel']:9.2f} {r['speedup']:7.2f}x "
              f"{fp16_text}")  # fmt: skip
    write_record(
        args.output, "cpu_chunk_gather",
        machine=f"{platform.machine()} CPU, {args.threads} torch threads, no GPU",
        model=gguf.name, batch=args.batch, context=args.context, chunk=args.chunk,
        repeats=args.repeats, results=results,
        fp16={"runs_s": fp16, "median_s": fp16_median},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
