"""Paged-attention kernel microbenchmark (GPU only): achieved bandwidth vs a device copy.

Llama-3-8B attention shape: 32 query heads, 8 KV heads, head_dim 128, page size 16, fp16.
Main row: decode at batch 64 x 4096-token context. Also: the split-count sweep at that shape,
decode at batch 1 and 16 (where flash-decoding splits matter), a 2k-token prefill, and the
torch reference at the main shape.

    achieved GB/s = (K/V bytes read + q bytes read + out bytes written) / kernel time

K/V pages are placed at shuffled page ids so reads are not one contiguous stream. The copy
bandwidth is a torch ``copy_`` of a 1 GiB buffer (read + write counted). Kernel times are CUDA
event times of a CUDA graph of repeated launches when capture works (pure GPU time), otherwise
of eager launches (which then include any launch gaps; the table says which).

Prints a table and writes JSON to bench/results/attention_kernel.json.

    python bench/attention_kernel.py [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "attention_kernel.json"
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DTYPE = torch.float16


def require_gpu() -> None:
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        sys.exit("attention_kernel: NUMBA_ENABLE_CUDASIM=1 is set; this benchmark needs a real GPU")
    if not torch.cuda.is_available():
        sys.exit("attention_kernel: no CUDA device; this benchmark runs on a GPU only")


def make_decode_case(batch: int, context: int, prefill: int = 1, seed: int = 0):
    """``batch`` sequences of ``context`` tokens, the last ``prefill`` of them new."""
    from engine.batch import SequenceInput, build_forward_batch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq
    ids = torch.randperm(num_pages, device="cuda", generator=gen).tolist()
    seqs = [
        SequenceInput(
            token_ids=[1] * prefill,
            num_cached=context - prefill,
            pages=ids[i * pages_per_seq : (i + 1) * pages_per_seq],
        )
        for i in range(batch)
    ]
    fb = build_forward_batch(seqs, PAGE, "cuda")
    shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
    q = torch.randn(fb.num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    k = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    return q, k, v, fb


def time_ms(fn, iters: int) -> tuple[float, str]:
    """Mean milliseconds per call: a CUDA graph of ``iters`` calls if capture works."""
    fn()  # compile, load, per-forward plan
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()  # warm
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters, "graph"
    except Exception as exc:  # capture unsupported: fall back to eager launches
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {exc}; timing eager)")
        torch.cuda.synchronize()
    for _ in range(3):
        fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, "eager"


def pick_modes(text: str, known: tuple[str, ...]) -> list[str]:
    """A --modes argument (comma-separated) as a list; exits naming any unknown mode."""
    modes = text.split(",")
    unknown = sorted(set(modes) - set(known))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; known: {', '.join(known)}")
    return modes


def copy_bandwidth_gbs(iters: int = 20) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds / 1e9  # read + write


def useful_bytes(fb, q: torch.Tensor) -> int:
    element = q.element_size()
    kv = sum(fb.seq_lens_host) * KV_HEADS * HEAD_DIM * element * 2
    return kv + 2 * q.numel() * element


def causal_flops(fb) -> float:
    """QK^T and PV multiply-adds over the visible (query, key) pairs, all heads."""
    pairs = sum(
        sum(cached + i + 1 for i in range(new))
        for new, cached in ((n, s - n) for n, s in zip(fb.q_lens, fb.seq_lens_host, strict=True))
    )
    return 4.0 * pairs * HEADS * HEAD_DIM


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["torch_cuda"] = torch.version.cuda
    for dist in ("numba", "numba-cuda", "cuda-bindings", "cuda-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def bench_case(name, batch, context, prefill, iters, copy_gbs, splits=None, reference=False):
    from engine.cuda.attention import paged_attention_cuda, paged_attention_reference

    torch.cuda.empty_cache()  # the previous case's buffers and graph pool are gone by now
    q, k, v, fb = make_decode_case(batch, context, prefill)
    scale = HEAD_DIM**-0.5
    if reference:

        def fn():
            return paged_attention_reference(q, k, v, fb, scale)
    else:

        def fn():
            return paged_attention_cuda(q, k, v, fb, scale, num_splits=splits)

    ms, how = time_ms(fn, iters)
    plans = list(fb.attention.kernel.values())
    nbytes = useful_bytes(fb, q)
    gbs = nbytes / (ms / 1e3) / 1e9
    row = {
        "case": name,
        "impl": "torch reference" if reference else "numba kernel",
        "batch": batch,
        "context": context,
        "new_tokens_per_seq": prefill,
        "num_splits": plans[0].num_splits if plans else None,
        "q_tile": plans[0].q_tile if plans else None,
        "time_ms": round(ms, 4),
        "timing": how,
        "useful_bytes": nbytes,
        "achieved_gbs": round(gbs, 1),
        "fraction_of_copy_bw": round(gbs / copy_gbs, 3),
        "tflops": round(causal_flops(fb) / (ms / 1e3) / 1e12, 2),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    require_gpu()
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")

    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}: {props.multi_processor_count} SMs; copy bandwidth {copy_gbs:.0f} GB/s")
    it = args.iters
    rows = [
        bench_case("decode b64 ctx4k", 64, 4096, 1, it, copy_gbs),
        *(
            bench_case(f"decode b64 ctx4k splits={s}", 64, 4096, 1, it, copy_gbs, splits=s)
            for s in (1, 2, 4, 8)
        ),
        bench_case("decode b16 ctx4k", 16, 4096, 1, it, copy_gbs),
        bench_case("decode b1 ctx4k", 1, 4096, 1, it, copy_gbs),
        bench_case("decode b1 ctx4k splits=1", 1, 4096, 1, it, copy_gbs, splits=1),
        bench_case("prefill 2k", 1, 2048, 2048, max(5, it // 10), copy_gbs),
        bench_case("decode b64 ctx4k", 64, 4096, 1, max(5, it // 10), copy_gbs, reference=True),
    ]
    header = (
        f"{'case':<30} {'impl':<16} {'splits':>6} {'ms':>9} {'GB/s':>8} {'of copy':>8} "
        f"{'TFLOP/s':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<30} {r['impl']:<16} {r['num_splits'] or '-':>6} {r['time_ms']:>9.3f} "
            f"{r['achieved_gbs']:>8.0f} {r['fraction_of_copy_bw']:>8.1%} {r['tflops']:>8.2f}"
            f"  ({r['timing']})"
        )
    result = {
        "benchmark": "paged attention kernel",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "versions": versions(),
        "shape": {
            "heads": HEADS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "page_size": PAGE,
            "dtype": str(DTYPE),
        },
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
