"""The KV-cache-mode section of bench/gpu_decode.py: bytes per token and decode speed per mode.

For each cache mode (fp16, q8, q6, q4; quantized modes with their default rotation) on a model
already built by gpu_decode:

    bytes_per_token      real K/V footprint (values + scales, all layers)
    tokens_vs_fp16       tokens the same bytes hold, relative to fp16
    decode_forward       Model.forward on one decode batch of B sequences x C cached tokens
                         (tok/s), as gpu_decode's decode-fwd row
    decode_attention     the op set's paged_attention alone on the same batch and pages, once
                         per layer per step (tok/s): the part the page format changes
    cache_write_ms       the op set's rotary + cache write of the step's B tokens, once per
                         layer (ms per step): quantized pages pick scales and pack codes here
    prefill_chunk_ms     one prompt chunk (min(chunk_size, prefill_len) new tokens after the
                         C cached ones of one sequence): cache write + attention, once per
                         layer, eager; per route: "reference" (the op set's choice for a
                         prompt chunk: dequantize the batch's pages + SDPA, the chunk's own
                         rows exact with exact_chunks) and on CUDA "kernel" (the Numba
                         attention kernel, ENGINE_PREFILL_ATTENTION=kernel)
    mixed_step_ms        the attention of one step holding the B decode rows and a new
                         prompt's chunk (min(chunk_size, prefill_len) tokens), once per layer,
                         eager; per route: "op_set" (the op set's paged_attention: on CUDA the
                         decode rows on the kernel, the chunk on the reference) and on CUDA
                         "reference_all" (the whole step through the torch reference, as the
                         CUDA op set ran such steps before it split them)
    verify_step_ms       the attention of one step in which each of the B sequences verifies
                         VERIFY_DRAFTS drafts (1 + VERIFY_DRAFTS query tokens at the end of its
                         context), once per layer, eager; per route: "op_set" (as shipped),
                         "gather" (the prompt-chunk route: dequantize the sequences' pages +
                         SDPA) and "kernel_rows" (every query token a decode row with its own
                         causal limit, on the decode kernel: what the CPU op set does for
                         quantized pages, and since stop 60 the CUDA op set for sequences of
                         up to engine/ops.py CUDA_VERIFY_ROWS tokens, after the H200 timed
                         q4 53.5 -> 20.9 ms and fp16 31.9 -> 27.3 at 8B, 32 x 4k, 5 tokens),
                         and on CUDA "kernel_tiles" (the whole step on the kernel as a prefill:
                         a block per tile of a sequence's query tokens, reading its context
                         once per tile, not once per row; ENGINE_PREFILL_ATTENTION=kernel)

Pages hold random K/V written through the cache-write op (quantized pages with real scales).
On CUDA each timed step is captured once in a CUDA graph and replayed (``timing``:
"cuda_graph"), so the rows measure the GPU, not Python's launches: eager rows of the same
run swung by 30% with the host's load (H200, 2026-11-27: q8 attention 2947 vs 2111 tok/s in
two runs, while the graph-timed sweep of bench/attention_keys_per_step.py held within 1%).
Where capture fails the step runs eagerly ("eager"; always on CPU).
Kept apart from gpu_decode.py (already long); it imports this module when it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def torch_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The torch references' paged attention (fp16 or quantized pages) on any batch."""
    from engine.ops import TORCH_OPS

    return TORCH_OPS.paged_attention(*args, **kwargs)


# "q4+sinks": q4 with sink pages (PagedCache(sink_pages=...)): each sequence's first page
# unquantized, laid out as the page table lays it out (first pages 0..B-1, the rest after);
# "q4+sinks+recent": and recent pages (PagedCache(recent_pages=...)), each sequence's last
# RECENT_BLOCKS blocks unquantized too (pages B..B + RECENT_BLOCKS * B - 1)
MODES = ("fp16", "q8", "q6", "q4", "q4+sinks", "q4+sinks+recent")
VERIFY_DRAFTS = 4  # drafts each sequence verifies in verify_step_ms (the generator's default)
GOAL_ATTENTION_SPEEDUP = 1.5  # q4 decode attention tok/s / fp16's, batch 32 x 4k context
GOAL_TOKENS_PER_BYTE = 3.5  # q4 tokens in fp16's bytes


def fill_pages(model: Any, kv: list, pages: int, page_size: int, chunk: int = 8192) -> None:
    """Random K/V in every slot of every layer, through the op set's cache write (so the
    quantized pages hold real scales), ``chunk`` slots per call to bound the scratch memory."""
    cfg, device, dtype = model.config, model.device, model.dtype
    gen = torch.Generator(device=device).manual_seed(0)
    total = pages * page_size
    for start in range(0, total, chunk):
        n = min(chunk, total - start)
        slots = torch.arange(start, start + n, device=device)
        q = torch.zeros((n, cfg.num_heads, cfg.head_dim), dtype=dtype, device=device)
        cos = torch.ones((n, cfg.head_dim // 2), dtype=dtype, device=device)
        sin = torch.zeros_like(cos)
        for k_pages, v_pages in kv:
            k, v = torch.randn((2, n, cfg.num_kv_heads, cfg.head_dim), generator=gen, device=device)
            k, v = k.to(dtype), v.to(dtype)
            model.ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)


def _timed(
    step: Callable[[], None], steps: int, warmup: int, timer: Any, graph: bool = True
) -> tuple[float, str]:
    """Seconds for ``steps`` runs of ``step`` after ``warmup`` eager ones, and how they ran
    (``graph``: captured in a CUDA graph where the device allows)."""
    for _ in range(warmup):
        step()
    graph = _captured(step) if graph and torch.cuda.is_available() and timer.cuda else None
    run = graph.replay if graph is not None else step
    with timer.measure() as elapsed:
        for _ in range(steps):
            run()
    return elapsed.seconds, "eager" if graph is None else "cuda_graph"


def _captured(step: Callable[[], None]) -> Any:
    """``step`` captured in a CUDA graph (after one run on a side stream, as torch asks), or
    None where capture fails (the step then runs eagerly)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        return graph
    except Exception as exc:  # (torch's RuntimeError, Numba's CudaAPIError, ...): time eagerly
        logger.warning("CUDA graph capture failed, timing eagerly: %s", exc)
        torch.cuda.synchronize()
        return None


def decode_calls(
    model: Any, kv: list, fwd: Any, q: torch.Tensor
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one decode forward of the batch ``fwd`` over ``kv``, and every layer's paged attention
    of that step alone for queries ``q``, on whatever op set the model holds when called),
    each planning the batch afresh, as a new step's batch is."""
    from engine.batch import AttentionPlan

    scale = model.config.head_dim**-0.5

    def forward() -> None:
        fwd.attention = AttentionPlan()
        with torch.inference_mode():
            model.forward(fwd, kv)

    def attention() -> None:
        fwd.attention = AttentionPlan()
        for k_pages, v_pages in kv:
            model.ops.paged_attention(q, k_pages, v_pages, fwd, scale)

    return forward, attention


def measure_mode(model: Any, quant: str, batch: int, context: int, wl: Any, timer: Any) -> dict:
    from engine.batch import SequenceInput, build_forward_batch
    from engine.cache.kv_cache import kv_bytes_per_token, recent_pages_for

    size = wl.page_size
    per_seq = -(-(context + 1) // size)
    mode, quant = quant, quant.removesuffix("+recent").removesuffix("+sinks")
    sinks = batch if mode != quant else 0
    recent = recent_pages_for(batch) if mode.endswith("+recent") else 0
    chunk = min(wl.chunk_size, wl.prefill_len)
    chunk_pages = -(-chunk // size)  # after the decode rows' pages: the mixed step's prompt
    pool = batch * per_seq + chunk_pages + recent  # (recent pages: beside the ordinary ones)
    kv = model.allocate_kv(pool, size, quant, num_sink_pages=sinks + recent)
    fill_pages(model, kv, pool, size)
    seqs = [
        SequenceInput([4 + b % 100], num_cached=context, pages=pages)
        for b, pages in enumerate(page_lists(batch, per_seq, sinks, recent))
    ]
    fwd = build_forward_batch(seqs, size, model.device)
    cfg = model.config
    q = torch.randn((batch, cfg.num_heads, cfg.head_dim), device=model.device).to(model.dtype)
    forward, attention = decode_calls(model, kv, fwd, q)
    write = _cache_write_step(model, kv, fwd.slot_mapping.to(model.device))

    tokens = batch * wl.decode_steps
    forward_s, forward_timing = _timed(forward, wl.decode_steps, wl.warmup_steps, timer)
    attention_s, attention_timing = _timed(attention, wl.decode_steps, wl.warmup_steps, timer)
    write_s, write_timing = _timed(write, wl.decode_steps, wl.warmup_steps, timer)
    prefill = measure_prefill(model, quant, context, chunk, wl, timer)
    prompt_pages = list(range(batch * per_seq, batch * per_seq + chunk_pages))
    prompt = SequenceInput([5] * chunk, 0, prompt_pages, prompt_chunk=True)
    mixed = measure_mixed(model, kv, [*seqs, prompt], wl, timer)
    verify = [  # (the same pages and total length as the decode rows)
        SequenceInput([4 + b % 100] * (1 + VERIFY_DRAFTS), context - VERIFY_DRAFTS, s.pages)
        for b, s in enumerate(seqs)
    ]
    verify_ms = measure_verify(model, quant, kv, verify, wl, timer)
    return {
        "quant": mode,
        "sink_pages": sinks,
        "recent_pages": recent,
        "batch": batch,
        "context": context,
        "steps": wl.decode_steps,
        "bytes_per_token": kv_bytes_per_token(cfg, model.dtype, quant),
        "decode_forward_tokens_per_s": tokens / forward_s,
        "decode_attention_tokens_per_s": tokens / attention_s,
        "attention_ms_per_step": 1000 * attention_s / wl.decode_steps,
        "cache_write_ms_per_step": 1000 * write_s / wl.decode_steps,
        "timing": {"forward": forward_timing, "attention": attention_timing, "write": write_timing},
        "prefill_chunk_tokens": prefill.pop("tokens"),
        "prefill_chunk_ms": prefill,
        "mixed_step_ms": mixed,
        "verify_tokens_per_sequence": 1 + VERIFY_DRAFTS,
        "verify_step_ms": verify_ms,
    }


def measure_mixed(
    model: Any, kv: list, seqs: list, wl: Any, timer: Any, routes: dict | None = None
) -> dict:
    """ms of the attention (every layer) of one step over ``seqs`` (decode rows and a prompt
    chunk), per route (eager: the reference's masks follow host values); ``routes``: name ->
    paged attention (default: the op set's, and on CUDA the torch reference's)."""
    from engine.batch import AttentionPlan, build_forward_batch

    fwd = build_forward_batch(seqs, wl.page_size, model.device)
    cfg = model.config
    q = torch.randn((fwd.num_tokens, cfg.num_heads, cfg.head_dim), device=model.device)
    q, scale = q.to(model.dtype), cfg.head_dim**-0.5

    def step(attention: Callable) -> Callable[[], None]:
        def run() -> None:
            fwd.attention = AttentionPlan()
            for k_pages, v_pages in kv:
                attention(q, k_pages, v_pages, fwd, scale)

        return run

    if routes is None:
        routes = {"op_set": model.ops.paged_attention}
        if model.device.type == "cuda":
            routes["reference_all"] = torch_attention
    return _route_ms(routes, step, wl, timer)


def measure_verify(model: Any, quant: str, kv: list, seqs: list, wl: Any, timer: Any) -> dict:
    """ms of the attention (every layer) of one step in which every sequence of ``seqs``
    verifies drafts, per route (``verify_step_ms`` in the module's docstring)."""
    from engine.ops import decode_rows_on

    kernel, gather, takes = _decode_kernel_and_gather(model.device.type, quant)
    rows = decode_rows_on(kernel, gather, takes, short=1 + VERIFY_DRAFTS)
    routes = {"op_set": model.ops.paged_attention, "gather": gather, "kernel_rows": rows}
    if model.device.type == "cuda":  # (the CPU kernels take decode rows only)
        routes["kernel_tiles"] = kernel
    return measure_mixed(model, kv, seqs, wl, timer, routes)


def _decode_kernel_and_gather(device: str, quant: str) -> tuple[Callable, Callable, Any]:
    """(decode attention kernel, prompt-chunk route, ``takes``: which calls the kernel takes,
    None for all; see ``decode_rows_on``) for pages of ``quant`` on ``device``, as the op set
    of that device pairs them."""
    from engine.cuda.attention import paged_attention_reference

    if device == "cuda":
        from engine.cuda.kv_gather import quant_chunk_attention_cuda

        gather = paged_attention_reference if quant == "fp16" else quant_chunk_attention_cuda
        return _attention_kernel(quant), gather, None
    from engine.cpu.decode_attention import (
        decode_attention_cpu,
        quant_decode_attention_cpu,
        supports,
    )
    from engine.cpu.kv_gather import quant_chunk_attention_cpu

    if quant == "fp16":
        return decode_attention_cpu, paged_attention_reference, supports
    return quant_decode_attention_cpu, quant_chunk_attention_cpu, supports


def _route_ms(routes: dict, step: Callable, wl: Any, timer: Any) -> dict[str, float]:
    """ms per run of ``step(attention)`` for each route's attention (eager: the reference's
    masks follow host values, so no graph)."""
    out = {}
    for name, attention in routes.items():
        seconds, _ = _timed(step(attention), wl.decode_steps, wl.warmup_steps, timer, graph=False)
        out[name] = 1000 * seconds / wl.decode_steps
    return out


def measure_prefill(model: Any, quant: str, context: int, chunk: int, wl: Any, timer: Any) -> dict:
    """ms of one prompt chunk's cache write + attention over every layer, per attention route
    (eager: the reference's masks follow host values, so no graph)."""
    from engine.batch import AttentionPlan, SequenceInput, build_forward_batch

    size = wl.page_size
    pages = -(-(context + chunk) // size)
    kv = model.allocate_kv(pages, size, quant)
    fill_pages(model, kv, pages, size)
    row = SequenceInput([5] * chunk, context, list(range(pages)), 1, prompt_chunk=True)
    fwd = build_forward_batch([row], size, model.device)
    q, k, v, cos, sin = _random_rows(model, chunk, seed=2)
    scale = model.config.head_dim**-0.5

    def step(attention: Callable) -> Callable[[], None]:
        def run() -> None:
            fwd.attention = AttentionPlan()
            for k_pages, v_pages in kv:
                rotated = model.ops.rotary_cache_write(
                    q, k, v, cos, sin, k_pages, v_pages, fwd.slot_mapping
                )
                attention(rotated, k_pages, v_pages, fwd, scale)

        return run

    routes = {"reference": model.ops.paged_attention}
    if model.device.type == "cuda":
        routes["kernel"] = _attention_kernel(quant)
    return {"tokens": chunk, **_route_ms(routes, step, wl, timer)}


def _attention_kernel(quant: str) -> Callable:
    """The Numba attention kernel for pages of ``quant`` (what ENGINE_PREFILL_ATTENTION=kernel
    runs for every batch)."""
    if quant == "fp16":
        from engine.cuda.attention import paged_attention_cuda

        return paged_attention_cuda
    from engine.cuda.quant_kernels import paged_attention_quant_cuda

    return paged_attention_quant_cuda


def _cache_write_step(model: Any, kv: list, slots: torch.Tensor) -> Callable[[], None]:
    """One decode step's rotary + cache writes (every layer) of random K/V at ``slots``."""
    q, k, v, cos, sin = _random_rows(model, slots.numel(), seed=1)

    def write() -> None:
        for k_pages, v_pages in kv:
            model.ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)

    return write


def _random_rows(model: Any, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random q, k, v and rotary tables (cos, sin) for ``n`` tokens, in the model's dtype."""
    cfg, device, dtype = model.config, model.device, model.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((n, cfg.num_heads, cfg.head_dim), generator=gen, device=device).to(dtype)
    k, v = torch.randn((2, n, cfg.num_kv_heads, cfg.head_dim), generator=gen, device=device)
    angle = torch.rand((n, cfg.head_dim // 2), generator=gen, device=device)
    return q, k.to(dtype), v.to(dtype), angle.cos().to(dtype), angle.sin().to(dtype)


def page_lists(batch: int, per_seq: int, sinks: int, recent: int = 0) -> list[list[int]]:
    """Each sequence's pages: consecutive runs, or with sink pages its first page below
    ``sinks`` and the rest after them, and with recent pages its last RECENT_BLOCKS blocks on
    pages sinks..sinks + recent - 1 (as engine/cache/page_table.py hands them out)."""
    from engine.cache.page_table import RECENT_BLOCKS

    if not sinks:
        return [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    rest = per_seq - 1
    base = sinks + recent
    lists = [[b, *range(base + b * rest, base + (b + 1) * rest)] for b in range(batch)]
    if recent:
        tail = min(RECENT_BLOCKS, per_seq - 1)
        for b, pages in enumerate(lists):
            pages[per_seq - tail :] = range(
                sinks + b * RECENT_BLOCKS, sinks + b * RECENT_BLOCKS + tail
            )
    return lists


def measure_kv_quant(model: Any, wl: Any, timer: Any, free: Callable[[], None]) -> dict:
    """Rows per mode plus the ratios to fp16; prints one line per mode."""
    rows = {}
    unknown = sorted(set(wl.quant_modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown KV-cache modes {unknown}; choose from {MODES}")
    for quant in wl.quant_modes:
        rows[quant] = measure_mode(model, quant, wl.quant_batch, wl.quant_context, wl, timer)
        free()
    base = rows["fp16"]
    for row in rows.values():
        row["tokens_vs_fp16"] = base["bytes_per_token"] / row["bytes_per_token"]
        row["attention_vs_fp16"] = (
            row["decode_attention_tokens_per_s"] / base["decode_attention_tokens_per_s"]
        )
        print(
            f"  kv {row['quant']:5s} batch {row['batch']} ctx {row['context']}: "
            f"{row['bytes_per_token']} B/token ({row['tokens_vs_fp16']:.2f}x tokens), "
            f"forward {row['decode_forward_tokens_per_s']:.1f} tok/s, attention "
            f"{row['decode_attention_tokens_per_s']:.1f} tok/s ({row['attention_vs_fp16']:.2f}x), "
            f"cache write {row['cache_write_ms_per_step']:.2f} ms/step, prefill chunk of "
            f"{row['prefill_chunk_tokens']}: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in row["prefill_chunk_ms"].items())
            + ", mixed step: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in row["mixed_step_ms"].items())
            + f", verifying {row['verify_tokens_per_sequence']} tokens: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in row["verify_step_ms"].items()),
            flush=True,
        )
    return rows


def kv_quant_goals(rows: dict | None) -> dict:
    q4 = (rows or {}).get("q4")
    speedup = None if q4 is None else q4["attention_vs_fp16"]
    capacity = None if q4 is None else q4["tokens_vs_fp16"]
    return {
        "q4_decode_attention_vs_fp16": (GOAL_ATTENTION_SPEEDUP, speedup),
        "q4_tokens_in_fp16_bytes": (GOAL_TOKENS_PER_BYTE, capacity),
    }
