"""The prompt-chunk route's context gather per KV-cache mode (GPU only): the kv_gather kernel
against the torch gather it replaced, side by side, and both against the copy bandwidth.

A batch with prompt chunks over quantized pages attends with SDPA over its sequences'
context, dequantized into one buffer per K and V (engine/ops.py ``by_query_length``,
engine/cuda/kv_gather.py). This times that gather for one layer's K at Llama-3-8B's shape
(8 KV heads x 128, pages of 16, fp16 output) for --seqs sequences of --context tokens on
shuffled pages, per mode and route:

    mode    q4 / q8: codes; +rows: each sequence's first block and last two on sink and
            recent pages (read from their fp16 rows); +rot: pages rotated, gathered back
            into the model's basis (the route's default)
    route   kernel (engine/cuda/kv_gather.py) or torch (quant_reference.gather_context)
    time    us per call (a CUDA graph of --iters calls, CUDA events)
    GB/s    (codes + scales + rows read, fp16 written) / time, against the device copy's

Every kernel output is checked against the torch one first (equal without rotation, within
fp16 rounding with it). Prints a table and writes JSON to
bench/results/kv_gather_kernel.json (--output).

    python bench/kv_gather_kernel.py [--modes q4+rows+rot,q8+rot] [--seqs 4] [--context 4096]
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_kernel import (
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    copy_bandwidth_gbs,
    pick_modes,
    require_gpu,
    time_ms,
    versions,
)
from record import write_record

RESULTS = Path(__file__).parent / "results" / "kv_gather_kernel.json"
MODES = ("q4", "q4+rot", "q4+rows+rot", "q8", "q8+rot", "q8+rows+rot")
ROUTES = ("kernel", "torch")
ROWS_BLOCKS = 3  # blocks per sequence on rows pages with +rows: a sink block, 2 recent


@dataclass(frozen=True)
class GatherRow:
    mode: str
    route: str
    seqs: int
    context: int
    time_us: float
    moved_bytes: int  # read (codes, scales, rows) + written (fp16)
    achieved_gbs: float
    vs_torch: float | None  # the torch route's time / this one's (same mode)


def gather_case(
    mode: str, seqs: int, context: int, device: str = "cuda", kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM, seed: int = 0,
):  # fmt: skip
    """(pages, index [seqs, blocks], unrotate, moved bytes) for ``mode``: random rows written
    through the cache's own quantization onto shuffled pages; with +rows the first and last
    two blocks of each sequence on pages that keep their rows."""
    from engine.cache.quant import QUANT_BITS, allocate_quant_pages, write_slots

    quant, *flags = mode.split("+")
    rotate, with_rows = "rot" in flags, "rows" in flags
    blocks = -(-context // PAGE)
    exact = [0, blocks - 2, blocks - 1] if with_rows and blocks >= ROWS_BLOCKS else []
    rows = seqs * len(exact)
    num_pages = seqs * blocks
    pages = allocate_quant_pages(num_pages, PAGE, kv_heads, head_dim, QUANT_BITS[quant][0],
                                 rotate, device, None, rows, torch.float16)  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(num_pages * PAGE, kv_heads, head_dim, generator=gen, device=device)
    write_slots(pages, values.half(), torch.arange(num_pages * PAGE, device=device))
    ordinary = iter((rows + torch.randperm(num_pages - rows, generator=torch.Generator()
                     .manual_seed(seed))).tolist())  # fmt: skip
    index = [[s * len(exact) + exact.index(j) if j in exact else next(ordinary)
              for j in range(blocks)] for s in range(seqs)]  # fmt: skip
    codes_per_row = pages.data[0, 0].numel() + pages.scales[0, 0].numel() * 2
    per_row = kv_heads * head_dim * 2  # fp16
    tokens, exact_tokens = num_pages * PAGE, rows * PAGE
    moved = (tokens - exact_tokens) * codes_per_row + exact_tokens * per_row + tokens * per_row
    return pages, torch.tensor(index, dtype=torch.int32, device=device), rotate, moved


def check_equal(pages, index, unrotate: bool) -> None:
    """The kernel's gather against the torch one (the route's contract)."""
    from engine.cuda import quant_reference
    from engine.cuda.kv_gather import gather_context

    got = gather_context(pages, index, torch.float16, unrotate=unrotate)
    want = quant_reference.gather_context(pages, index, torch.float16, unrotate=unrotate)
    if unrotate:  # (float32 sums in another order, then one fp16 rounding)
        torch.testing.assert_close(got, want, atol=2e-3 * float(want.abs().max()), rtol=0)
    elif not torch.equal(got, want):
        raise AssertionError("kv_gather's kernel and the torch gather differ")


def time_routes(pages, index, unrotate: bool, iters: int) -> dict[str, tuple[float, str]]:
    """Each route's (us per call, how timed) on one case."""
    from engine.cuda import quant_reference
    from engine.cuda.kv_gather import gather_context

    routes = {"kernel": gather_context, "torch": quant_reference.gather_context}
    times = {}
    for route in ROUTES:
        call = functools.partial(routes[route], pages, index, torch.float16, unrotate=unrotate)
        ms, how = time_ms(call, iters)
        times[route] = (1000 * ms, how)
    return times


def measure(modes: list[str], seqs: int, context: int, iters: int, copy_gbs: float):
    rows: list[GatherRow] = []
    for mode in modes:
        pages, index, unrotate, moved = gather_case(mode, seqs, context)
        check_equal(pages, index, unrotate)
        times = time_routes(pages, index, unrotate, iters)
        for route, (us, how) in times.items():
            gbs = moved / (us / 1e6) / 1e9
            print(f"  {mode:<12} {route:<6} {us:9.1f} us  {gbs:7.1f} GB/s "
                  f"({100 * gbs / copy_gbs:4.1f}% of copy; {how})")  # fmt: skip
            ratio = round(times["torch"][0] / us, 2) if route == "kernel" else None
            rows.append(GatherRow(mode, route, seqs, context, round(us, 1), moved,
                                  round(gbs, 1), ratio))  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    modes = pick_modes(args.modes, MODES)
    require_gpu()
    name = torch.cuda.get_device_properties(0).name
    copy_gbs = copy_bandwidth_gbs()
    print(f"{name}: context gather, {args.seqs} x {args.context} tokens, {KV_HEADS} KV heads x "
          f"{HEAD_DIM}, fp16 out; copy {copy_gbs:.0f} GB/s")  # fmt: skip
    rows = measure(modes, args.seqs, args.context, args.iters, copy_gbs)
    write_record(
        args.output,
        "kv_gather_kernel",
        device=name,
        versions=versions(),
        copy_gbs=round(copy_gbs, 1),
        shape={"kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page": PAGE},
        rows=[asdict(r) for r in rows],
    )


if __name__ == "__main__":
    main()
