"""The KV-cache modes at the issue's benchmark shape on the CPU: bench/kv_quant_decode.py's rows
(bytes per token, decode forward and decode attention tok/s, the cache write, a prompt chunk,
a mixed step) for the installed SmolLM2 (float32, ``--threads`` torch threads), at ``--batch``
sequences of ``--context`` cached tokens each (default 32 x 4096, as bench/gpu_decode.py runs
on a GPU), every step eager. The pages hold random K/V written through the cache-write op.

Decode attention alone is where the page format counts (the decode kernel,
engine/cpu/decode_attention.py, reads a quantized cache's codes in place, and since stop 53 fp16
pages' rows too); the forward adds the model's matmuls, the same for every mode. Pages hold 256
slots unless ``--page-size`` says (the cache's own default is 16), which keeps this bench's
earlier results comparable; bench/cpu_decode_kernel.py compares two kernels in one process.

    python bench/kv_cpu_attention.py [--modes fp16 q8 q4] [--batch 32] [--context 4096]
        # writes bench/results/kv_cpu_attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import engine  # noqa: E402
from bench import kv_quant_decode  # noqa: E402
from bench import kv_quant_quality as quality  # noqa: E402
from bench.gpu_decode import Timer, Workload  # noqa: E402
from bench.record import write_record  # noqa: E402

RESULTS = REPO / "bench" / "results" / "kv_cpu_attention.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["fp16", "q8", "q4"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--chunk", type=int, default=512, help="the prompt chunk's tokens")
    parser.add_argument("--page-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.modes or args.modes[0] != "fp16":
        parser.error("--modes must start with fp16 (the others' ratios are to it)")
    unknown = sorted(set(args.modes) - set(kv_quant_decode.MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(kv_quant_decode.MODES)}")
    for name in ("batch", "context", "steps", "chunk", "page_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    return args


def workload(args: argparse.Namespace) -> Workload:
    return dataclasses.replace(
        Workload(),
        decode_steps=args.steps,
        warmup_steps=args.warmup,
        prefill_len=args.chunk,
        chunk_size=args.chunk,
        page_size=args.page_size,
        quant_batch=args.batch,
        quant_context=args.context,
        quant_modes=tuple(args.modes),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = quality.load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, _, gguf = loaded
    rows = kv_quant_decode.measure_kv_quant(
        model, workload(args), Timer(torch.device("cpu")), gc.collect
    )
    write_record(
        args.output, "kv_cpu_attention",
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
        engine=str(Path(engine.__file__).parent), model=gguf.name,
        batch=args.batch, context=args.context, steps=args.steps, warmup=args.warmup,
        page_size=args.page_size, modes=rows, goals=kv_quant_decode.kv_quant_goals(rows),
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
