"""Where a decode forward's GPU time goes, per KV-cache mode (GPU only).

Builds the Llama-3-8B shape with random fp16 weights (bench/gpu_decode.py), then for each
mode runs eager decode forwards of batch B x C cached tokens under torch.profiler and prints
the kernels with the most CUDA time (per forward: total time, calls, mean). This is how the
quantized cache write's ~57 us per layer (one thread per group searching 4-bit scales) was
found on the H200 on 2026-11-27. Writes the tables to --output (text).

``--mixed``: instead, the attention (every layer, the op set's) of one eager mixed step, the
B decode rows beside a new prompt's chunk of --chunk tokens, with the decode rows on the
CUDA-core kernel and then on the tensor-core kernel (ENGINE_TENSOR_CORE_DECODE 0 and 1), CPU
and CUDA activity both: on the H200 such a step took 28.2 instead of 18.2 ms (fp16) and 57.9
instead of 41.0 (q4) with the tensor-core kernel, which alone is faster (stop 37). Quantized
modes run the prompt chunk both ways (``--chunk-gathers``): through the kv_gather kernel (the
op set's since stop 41) and through the torch gather before it, each with a wall time per step.

    python bench/kv_forward_profile.py [--modes fp16,q4,q4+sinks] [--batch 32] [--context 4096]
    python bench/kv_forward_profile.py --mixed --modes fp16,q4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_decode
import kv_quant_decode

RESULTS = Path(__file__).parent / "results" / "kv_forward_profile.txt"
PAGE = 16


def profile_mode(model, mode: str, batch: int, context: int, forwards: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    from engine.batch import AttentionPlan, SequenceInput, build_forward_batch

    quant = mode.removesuffix("+sinks")
    sinks = batch if mode != quant else 0
    per_seq = -(-(context + 1) // PAGE)
    kv = model.allocate_kv(batch * per_seq, PAGE, quant, num_sink_pages=sinks)
    pages = kv_quant_decode.page_lists(batch, per_seq, sinks)
    seqs = [SequenceInput([4 + b], num_cached=context, pages=p) for b, p in enumerate(pages)]
    fwd = build_forward_batch(seqs, PAGE, model.device)

    def forward() -> None:
        fwd.attention = AttentionPlan()
        with torch.inference_mode():
            model.forward(fwd, kv)

    for _ in range(3):  # compile and warm up
        forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(forwards):
            forward()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
    )
    return f"===== {mode}: batch {batch} x {context}, {forwards} forwards\n{table}\n"


def chunk_routes(model, quant: str, gathers: list[str]) -> dict[str, object]:
    """The attention op per prompt-chunk route over quantized pages: ``kernel``, the op set's
    (engine/cuda/kv_gather.py: the context gathered by one launch per K and V, in the model's
    basis); ``torch``, the baseline before stop 41 (the torch gather, q and the output rotated
    by float32 matmuls). fp16 pages have one route."""
    from engine.cuda.quant_kernels import paged_attention_quant_cuda
    from engine.cuda.quant_reference import by_storage, quant_paged_attention_reference
    from engine.ops import by_query_length

    if quant == "fp16":
        return {"": model.ops.paged_attention}
    routes = {"kernel": model.ops.paged_attention}
    routes["torch"] = by_storage(
        model.ops.paged_attention,
        by_query_length(paged_attention_quant_cuda, quant_paged_attention_reference),
        pages_arg=1,
    )
    return {name: routes[name] for name in gathers}


def profile_mixed(
    model, mode: str, batch: int, context: int, chunk: int, rows: int, gathers: list[str]
) -> str:
    """The op set's attention over every layer of one mixed step, per tensor-core routing and
    per prompt-chunk route (``chunk_routes``)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.batch import AttentionPlan, SequenceInput, build_forward_batch
    from engine.cuda import attention_mma

    quant = mode.removesuffix("+sinks")
    sinks = batch if mode != quant else 0
    per_seq = -(-(context + 1) // PAGE)
    chunk_pages = -(-chunk // PAGE)
    kv = model.allocate_kv(batch * per_seq + chunk_pages, PAGE, quant, num_sink_pages=sinks)
    pages = kv_quant_decode.page_lists(batch, per_seq, sinks)
    seqs = [SequenceInput([4 + b], num_cached=context, pages=p) for b, p in enumerate(pages)]
    prompt_pages = list(range(batch * per_seq, batch * per_seq + chunk_pages))
    seqs.append(SequenceInput([5] * chunk, 0, prompt_pages, prompt_chunk=True))
    fwd = build_forward_batch(seqs, PAGE, model.device)
    cfg = model.config
    q = torch.randn((fwd.num_tokens, cfg.num_heads, cfg.head_dim), device=model.device)
    q, scale = q.to(model.dtype), cfg.head_dim**-0.5

    def step(attention) -> None:
        fwd.attention = AttentionPlan()
        for k_pages, v_pages in kv:
            attention(q, k_pages, v_pages, fwd, scale)

    tables = []
    shipped = attention_mma.MODE
    try:
        for routing in ("0", "1"):
            attention_mma.MODE = routing
            for gather, attention in chunk_routes(model, quant, gathers).items():
                for _ in range(3):  # compile and warm up
                    step(attention)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(5):  # host and device together, as a serving step sees them
                    step(attention)
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - start) / 5 * 1e3
                activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
                with profile(activities=activities) as prof:
                    step(attention)
                    torch.cuda.synchronize()
                table = prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
                )
                route = f", chunk gather {gather}" if gather else ""
                tables.append(
                    f"===== {mode} mixed step: {batch} decode rows x {context} + a {chunk}-token "
                    f"chunk, ENGINE_TENSOR_CORE_DECODE={routing}{route}: {wall_ms:.2f} ms per "
                    f"step (wall, 5 steps)\n{table}\n"
                )
    finally:
        attention_mma.MODE = shipped
    return "".join(tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="fp16,q8,q6,q4,q4+sinks")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--forwards", type=int, default=2)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--mixed", action="store_true", help="profile a mixed step's attention")
    parser.add_argument("--chunk", type=int, default=2048, help="--mixed: prompt chunk tokens")
    parser.add_argument(
        "--chunk-gathers",
        default="kernel,torch",
        help="--mixed, quantized modes: the prompt chunk's routes (chunk_routes)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not set(args.chunk_gathers.split(",")) <= {"kernel", "torch"}:
        raise SystemExit(f"--chunk-gathers takes kernel and/or torch, got {args.chunk_gathers!r}")
    if not torch.cuda.is_available():
        raise SystemExit("kv_forward_profile needs a CUDA device")
    spec = gpu_decode.gpu_specs()["llama3-8b"]
    config, network = gpu_decode.build_network(spec, torch.float16, torch.device("cuda"))
    model = gpu_decode.make_model(config, network, PAGE)
    header = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n"
    tables = []
    for mode in args.modes.split(","):
        if args.mixed:
            tables.append(
                profile_mixed(
                    model,
                    mode,
                    args.batch,
                    args.context,
                    args.chunk,
                    args.rows,
                    args.chunk_gathers.split(","),
                )
            )
        else:
            tables.append(
                profile_mode(model, mode, args.batch, args.context, args.forwards, args.rows)
            )
        torch.cuda.empty_cache()  # (the mode's pages went with profile_mode)
    text = header + "".join(tables)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
