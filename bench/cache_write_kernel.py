"""The rotary + cache-write kernel per KV-cache mode (GPU only): where a quantized step's
write time goes.

On the H200 (2026-11-27, bench/gpu_decode.py, Llama-3-8B, 32 decode tokens per step) the q4
write took 1.18 ms per step over 32 layers (37 us per call) against fp16's 0.27 ms. This
times one call of the op set's write (engine/cuda/quant_kernels.py for quantized pages,
engine/cuda/rotary.py for fp16) at that shape per mode and token count, so the phases can be
told apart: ``-norot`` modes skip the Hadamard rotation and, for 4 bits, the scale search
(one absmax scale per group instead of eight trials).

    time   one write per call, a CUDA graph of --iters calls, CUDA events (us per call)
    GB/s   K/V bytes the call stores (codes + scales, both sides) / time

Prints a table and writes JSON to bench/results/cache_write_kernel.json (--output).

    python bench/cache_write_kernel.py [--modes fp16,q8,q4,q4-norot] [--tokens 32,2048]
        [--threads auto,64,128]   # quantized modes also at blocks of 64 and 128 threads

``--threads``: the quantized write's threads per block, ``auto`` its rule (a warp per group
of 32 values, 256 at this shape, and 64 from 8 blocks per SM up: engine/cuda/quant_kernels.py
``write_warps``, since stop 60). Fewer warps take the groups in turn: whether smaller
blocks pay is what the extra rows time (fp16's write is rotary.py's, auto only). Stop 54's
figures (H200, 2026-11-30, before stop 55's warp per group) are in
bench/results/cache_write_kernel_h200_2026-11-30.json.
    ncu --kernel-name regex:kernel --launch-skip 2 --launch-count 1 \\
        python bench/cache_write_kernel.py --modes q4 --tokens 32 --iters 1
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_kernel import HEAD_DIM, KV_HEADS, PAGE, pick_modes, require_gpu, time_ms, versions
from record import write_record

RESULTS = Path(__file__).parent / "results" / "cache_write_kernel.json"
HEADS = 32  # Llama-3-8B's query heads (KV_HEADS, HEAD_DIM and PAGE: its attention shape)
MODES = ("fp16", "q8", "q6", "q4", "q8-norot", "q4-norot")
POOL_PAGES = 4096  # 64k slots: the writes land on distinct pages, as a batch's do
DEVICE = "cuda"  # (the CUDA simulator's dry check sets "cpu")
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)  # --threads


@dataclass(frozen=True)
class WriteRow:
    mode: str
    tokens: int
    threads: str  # threads per block: "auto" (the kernel's rule) or the forced count
    time_us: float
    stored_bytes: int
    achieved_gbs: float
    vs_fp16: float | None  # fp16's time / this mode's at the same token count


def write_case(mode: str, tokens: int):
    """``(write, stored_bytes)``: a call of the op set's rotary + cache write of ``tokens``
    random rows into ``mode``'s pages (one layer), and the K/V bytes it stores."""
    from engine.cache.quant import QUANT_BITS, allocate_quant_pages, check_quant
    from engine.ops import cuda_ops

    quant, _, variant = mode.partition("-")
    device, dtype = torch.device(DEVICE), torch.float16
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    q = rand(tokens, HEADS, HEAD_DIM)
    k, v = rand(tokens, KV_HEADS, HEAD_DIM), rand(tokens, KV_HEADS, HEAD_DIM)
    angle = torch.rand((tokens, HEAD_DIM // 2), generator=gen, device=device) * 6.28
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    # every token on its own page: the spread a decode batch writes
    slots = torch.randperm(POOL_PAGES, generator=gen, device=device)[:tokens] * PAGE
    if QUANT_BITS[quant] is None:
        k_pages = torch.zeros((POOL_PAGES, PAGE, KV_HEADS, HEAD_DIM), dtype=dtype, device=device)
        v_pages = torch.zeros_like(k_pages)
        stored = 2 * tokens * KV_HEADS * HEAD_DIM * 2
    else:
        rotate = check_quant(quant, False if variant == "norot" else None)
        k_pages, v_pages = (
            allocate_quant_pages(POOL_PAGES, PAGE, KV_HEADS, HEAD_DIM, bits, rotate, device)
            for bits in QUANT_BITS[quant]
        )
        per_token = sum(
            p.data[0, 0].numel() * p.data.element_size() + p.scales[0, 0].numel() * 2
            for p in (k_pages, v_pages)
        )
        stored = tokens * per_token

    ops = cuda_ops()

    def write() -> None:
        ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)

    return write, stored


def parse_threads(text: str) -> list[str]:
    """``--threads``: ``auto`` and powers of two from 32 to 1024, comma-separated."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    for item in items:
        if item != "auto" and (
            not item.isdigit() or int(item) not in (32, 64, 128, 256, 512, 1024)
        ):
            raise ValueError(f"--threads: auto or a power of two from 32 to 1024, got {item!r}")
    if not items:
        raise ValueError("--threads: name at least one block size")
    return items


def measure(
    modes: list[str], token_counts: list[int], iters: int, threads: list[str] = ("auto",)
) -> list[WriteRow]:
    from engine.cuda import quant_kernels

    rows: list[WriteRow] = []
    for tokens in token_counts:
        fp16_us = None
        for mode in modes:
            for block in threads if mode != "fp16" else ("auto",):
                forced = None if block == "auto" else int(block)
                quant_kernels._FORCE_WRITE_THREADS = forced
                try:
                    write, stored = write_case(mode, tokens)
                    ms, how = time_ms(write, iters)
                finally:
                    quant_kernels._FORCE_WRITE_THREADS = None
                us = 1000 * ms
                fp16_us = us if mode == "fp16" else fp16_us
                gbs = stored / (us / 1e6) / 1e9
                ratio = None if fp16_us is None else round(fp16_us / us, 3)
                print(
                    f"  {mode:<9} {tokens:>5} tokens, {block:>4} threads: {us:8.2f} us  "
                    f"{gbs:7.1f} GB/s  ({how})"
                )
                row = WriteRow(mode, tokens, block, round(us, 2), stored, round(gbs, 1), ratio)
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tokens", default="32,2048", help="tokens per write, comma-separated")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--threads", default="auto", help="quantized write's block sizes")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    modes = pick_modes(args.modes, MODES)
    try:
        threads = parse_threads(args.threads)
    except ValueError as e:
        parser.error(str(e))
    require_gpu()
    name = torch.cuda.get_device_properties(0).name
    print(f"{name}: rotary + cache write, {HEADS} heads, {KV_HEADS} KV heads x {HEAD_DIM}")
    rows = measure(modes, [int(t) for t in args.tokens.split(",")], args.iters, threads)
    write_record(
        args.output,
        "cache_write_kernel",
        device=name,
        versions=versions(),
        shape={"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page": PAGE},
        rows=[asdict(r) for r in rows],
    )


if __name__ == "__main__":
    main()
