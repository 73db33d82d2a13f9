"""One decode attention call per KV-cache mode inside a profiler range, for Nsight Compute
(GPU only): the 8B attention shape at batch 32 x 4096 (bench/attention_keys_per_step.py's
case), each mode's kernels compiled and run once before the range.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section WarpStateStats python bench/attention_ncu.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_keys_per_step import attention_op, quantized_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp16,q4")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_ncu needs a CUDA device")
    for mode in args.modes.split(","):
        q, k, v, fb = quantized_case(mode, args.batch, args.context)
        op = attention_op(mode, q, k, v, fb)
        op()  # compile, plan
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        op()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{mode}: one call profiled", flush=True)


if __name__ == "__main__":
    main()
