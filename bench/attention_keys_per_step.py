"""Decode attention per KV-cache mode vs keys per step and register cap (GPU only).

The attention kernel's key groups take ``keys_per_step`` keys per step, reading all of them
before using any, so more loads are in flight per warp; ``min_blocks`` is the launch bound the
register cap is set for (4 resident 128-thread blocks per SM: 128 registers; 2: 255); ``lanes``
per key group: 16 or 32; ``sums``: the row sums (transposed or a butterfly per row; ``auto``:
the kernel's rule); ``splits``: the flash-decoding split count (0: the kernel's rule);
``unpack``: how 4-bit word codes become floats (``affine``: one byte permute each,
kv_load.word_affine; ``codes``: a permute and an add; ``auto``: the kernel's default). Modes:
the cache formats, ``q4+sinks`` (q4 pages whose every sequence's first page is a sink page,
read from unquantized rows: engine/cache/quant.py), and ``fp16-mma`` / ``q8-mma`` /
``q6-mma`` / ``q4-mma`` (those pages through the tensor-core decode kernel,
engine/cuda/attention_mma.py: its split rule, then 4, 8 and 16 splits; the configs do not
apply; q4-mma's error includes q's rounding to bytes; ``q4-mma-pipe0``: under that load
pipeline, attention_mma._PIPELINE; ``q4-mma+sinks``: q4+sinks' pages on tensor cores;
``+sinks+recent``: each sequence's last RECENT_BLOCKS blocks on unquantized recent pages too,
as the engine's recent pages lay them out: every decode reads a sink block, codes, then two
exact blocks).
This sweeps them at Llama-3-8B's attention shape, decode at batch 32 x 4096-token context
(issue "Quantized KV cache": q4's decode attention vs fp16's), and checks each output against
the torch reference of its mode.

    time   one paged-attention op per call (quantized: the kernel rotates q and the output),
           a CUDA graph of --iters calls, CUDA events; kernel_ms: the attention launches alone
    GB/s   K/V bytes of the mode read (values + scales) / time
    error  max |out - reference| / max |reference|

Prints a table and writes JSON to bench/results/attention_keys_per_step.json (--output).

    python bench/attention_keys_per_step.py [--iters 50] [--configs 1:4,2:4,4:2:32,2:4:16:auto:8]
    python bench/attention_keys_per_step.py --modes q4 --configs 4:4:16:auto:0:codes,4:4
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention_kernel import (
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    copy_bandwidth_gbs,
    make_decode_case,
    require_gpu,
    time_ms,
    versions,
)

RESULTS = Path(__file__).parent / "results" / "attention_keys_per_step.json"
# the comparison first (a run cut short by its time cap keeps those)
MODES = (
    "fp16",
    "q4",
    "q4-mma",
    "fp16-mma",
    "q4-mma+sinks+recent",  # (the layout that meets the quality goal: stop 40)
    "q8",
    "q6",
    "q4+sinks",
    "q8-mma",
    "q6-mma",
    "q4-mma-pipe0",
    "q8-mma-pipe0",
    "q6-mma-pipe0",
    "q4-mma-pipe2",
    "q4-mma+sinks",
    "q4+sinks+recent",
    "q8-mma+sinks+recent",
)
# row sums: the kernel's rule (transposed for quantized word pages), or forced either way
SUMS = {"auto": None, "transposed": True, "butterfly": False}
UNPACK = {"auto": None, "affine": True, "codes": False}  # 4-bit word codes (kv_load)


@dataclass(frozen=True)
class SweepRow:
    mode: str
    keys_per_step: int
    min_blocks: int
    lanes: int
    sums: str
    unpack: str
    splits: int  # the split count the kernel ran with
    time_ms: float
    kernel_ms: float  # the attention (+ merge) launches alone: no input checks
    kv_bytes: int
    achieved_gbs: float
    fraction_of_copy_bw: float
    vs_fp16_default: float | None
    max_rel_error: float


def quantized_case(mode: str, batch: int, context: int):
    """The fp16 case's q and batch, its K/V written into ``mode``'s pages (default rotation;
    ``+sinks``: pages 0..batch-1 are sink pages and every sequence's first page one of them;
    ``+sinks+recent``: and its last RECENT_BLOCKS blocks on the unquantized pages after them).
    """
    from engine.cache.page_table import RECENT_BLOCKS
    from engine.cache.quant import QUANT_BITS, allocate_quant_pages, check_quant, write_slots

    q, k, v, fb = make_decode_case(batch, context)
    mode, _, extra = mode.partition("+")
    if QUANT_BITS[mode] is None:
        return q, k, v, fb
    if extra not in ("", "sinks", "sinks+recent"):
        raise ValueError(f"unknown page layout +{extra!r}: expected +sinks or +sinks+recent")
    recent = extra == "sinks+recent"
    sinks = batch * (1 + RECENT_BLOCKS * recent) if extra else 0  # (unquantized pages)
    if sinks:
        fb.block_tables.copy_(first_pages_first(fb.block_tables, k.shape[0], recent))
    rotate = check_quant(mode, None)
    pool = k.shape[0]
    slots = torch.arange(pool * PAGE, device=k.device)
    pages = []
    for bits, x in zip(QUANT_BITS[mode], (k, v), strict=True):
        p = allocate_quant_pages(pool, PAGE, KV_HEADS, HEAD_DIM, bits, rotate, k.device,
                                 num_sink_pages=sinks, sink_dtype=x.dtype)  # fmt: skip
        write_slots(p, x.reshape(-1, KV_HEADS, HEAD_DIM), slots)
        pages.append(p)
    return q, pages[0], pages[1], fb


def first_pages_first(table: torch.Tensor, num_pages: int, recent: bool = False) -> torch.Tensor:
    """``table`` with its page ids renamed so that sequence i's first page is page i and, with
    ``recent``, its last RECENT_BLOCKS blocks pages B + RECENT_BLOCKS i ... (B sequences; the
    others keep their order): a bijection, so every sequence still reads distinct pages."""
    from engine.cache.page_table import RECENT_BLOCKS

    firsts = table[:, 0].long()
    if recent:  # (every row holds more than RECENT_BLOCKS blocks here)
        firsts = torch.cat((firsts, table[:, -RECENT_BLOCKS:].long().reshape(-1)))
    rest = torch.ones(num_pages, dtype=torch.bool, device=table.device)
    rest[firsts] = False
    order = torch.cat((firsts, torch.nonzero(rest).flatten()))  # new id -> old id
    rename = torch.empty_like(order)
    rename[order] = torch.arange(num_pages, device=table.device)
    return rename[table.long()].to(table.dtype)


def kv_bytes(k, v, fb) -> int:
    """K/V bytes the op reads: every context token's values and scales, both sides."""
    tokens = sum(fb.seq_lens_host)
    total = 0
    for p in (k, v):
        if isinstance(p, torch.Tensor):
            total += tokens * p[0, 0].numel() * p.element_size()
        else:
            total += tokens * p.bytes_per_slot()
    return total


def attention_op(mode: str, q, k, v, fb, splits: int | None = None):
    from engine.cuda.attention import paged_attention_cuda
    from engine.cuda.quant_kernels import paged_attention_quant_cuda

    scale = HEAD_DIM**-0.5
    op = paged_attention_cuda if mode == "fp16" else paged_attention_quant_cuda
    return lambda: op(q, k, v, fb, scale, num_splits=splits)


def kernel_op(mode: str, q, k, v, fb, splits: int | None = None):
    """The launches alone, without the op's input checks (the kernel rotates q and the
    output of rotated word pages itself: before 2026-11-27, torch launches around it did,
    and ``time_ms`` minus this was their cost)."""
    from engine.cuda.attention import KVArgs, launch_attention

    if mode == "fp16":
        return attention_op(mode, q, k, v, fb, splits)
    scale = HEAD_DIM**-0.5
    args = KVArgs(k.data, v.data, k.scales, v.scales, k.bits, v.bits, k.shape[2], k.sinks,
                  v.sinks, k.rotate)  # fmt: skip
    return lambda: launch_attention(q, args, fb, scale, None, splits)


def reference(mode: str, q, k, v, fb) -> torch.Tensor:
    from engine.cuda.attention import paged_attention_reference
    from engine.cuda.quant_reference import quant_paged_attention_reference

    scale = HEAD_DIM**-0.5
    if mode == "fp16":
        return paged_attention_reference(q.float(), k.float(), v.float(), fb, scale)
    return quant_paged_attention_reference(q.float(), k, v, fb, scale)


def mma_rows(mode, batch, context, iters, copy_gbs) -> list[SweepRow]:
    """The tensor-core decode kernel (``q4-mma``, ``q6-mma``, ``q8-mma``: rotated quantized
    pages; ``fp16-mma``: fp16 pages; ``q4-mma-pipe1``: 4-bit pages under that load pipeline,
    attention_mma._PIPELINE): splits by its rule, then forced to 4, 8 and 16."""
    from engine.cuda import attention_mma

    shipped = attention_mma._PIPELINE
    kernel, _, pipe = mode.partition("-pipe")
    attention_mma._PIPELINE = int(pipe) if pipe else shipped
    base = kernel.replace("-mma", "")  # (q4-mma+sinks: the q4+sinks case)
    try:
        return _mma_rows(mode, base, batch, context, iters, copy_gbs)
    finally:
        attention_mma._PIPELINE = shipped


def _mma_rows(mode, base, batch, context, iters, copy_gbs) -> list[SweepRow]:
    from engine.cuda.attention_mma import (
        _auto_splits,
        decode_attention_mma,
        decode_attention_mma_fp16,
    )

    torch.cuda.empty_cache()
    q, k, v, fb = quantized_case(base, batch, context)
    ref = reference(base, q, k, v, fb).float()
    nbytes = kv_bytes(k, v, fb)
    rows = []
    for forced in (None, 4, 8, 16):

        def fn(forced=forced):
            if base == "fp16":
                return decode_attention_mma_fp16(q, k, v, fb, HEAD_DIM**-0.5, num_splits=forced)
            return decode_attention_mma(q, k.data, v.data, k.scales, v.scales, fb,
                                        HEAD_DIM**-0.5, rotate=k.rotate, k_bits=k.bits,
                                        v_bits=v.bits, k_sinks=k.sinks, v_sinks=v.sinks,
                                        num_splits=forced)  # fmt: skip

        err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
        ms, _ = time_ms(fn, iters)
        gbs = nbytes / (ms / 1e3) / 1e9
        splits = forced or _auto_splits(batch, KV_HEADS, fb.max_seq_len, q.device)
        print(f"  {mode:<8} tensor cores, splits {splits}: {ms:8.3f} ms {gbs:7.0f} GB/s  "
              f"err {err:.1e}", flush=True)  # fmt: skip
        rows.append(SweepRow(mode, 16, 0, 32, "mma", "mma", splits, round(ms, 4),
                             round(ms, 4), nbytes, round(gbs, 1), round(gbs / copy_gbs, 3),
                             None, float(f"{err:.3g}")))  # fmt: skip
    return rows


def sweep_mode(mode, configs, batch, context, iters, copy_gbs) -> list[SweepRow]:
    from engine.cuda import attention_mma

    if "-mma" in mode:
        return mma_rows(mode, batch, context, iters, copy_gbs)
    # the CUDA-core kernel (attention.py), also inside the timing's CUDA graph, where the op
    # set would send decode batches to the tensor cores by default
    shipped = attention_mma.MODE
    attention_mma.MODE = "0"
    try:
        return _cuda_core_rows(mode, configs, batch, context, iters, copy_gbs)
    finally:
        attention_mma.MODE = shipped


def _cuda_core_rows(mode, configs, batch, context, iters, copy_gbs) -> list[SweepRow]:
    from engine.cuda import attention

    torch.cuda.empty_cache()
    q, k, v, fb = quantized_case(mode, batch, context)
    ref = reference(mode, q, k, v, fb).float()
    nbytes = kv_bytes(k, v, fb)
    rows = []
    for keys, blocks, lanes, sums, splits, unpack in configs:
        attention._FORCE_KEYS_PER_STEP, attention._FORCE_MIN_BLOCKS = keys, blocks
        attention._FORCE_LANES = lanes
        attention._FORCE_TRANSPOSED_SUMS = SUMS[sums]
        attention._FORCE_WORD_AFFINE = UNPACK[unpack]
        fb.attention.kernel.clear()  # the plan holds the lanes
        try:
            fn = attention_op(mode, q, k, v, fb, splits or None)
            err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
            ran_splits = next(iter(fb.attention.kernel.values())).num_splits
            ms, _ = time_ms(fn, iters)
            kernel_fn = kernel_op(mode, q, k, v, fb, splits or None)
            kernel_ms = ms if mode == "fp16" else time_ms(kernel_fn, iters)[0]
        finally:
            attention._FORCE_KEYS_PER_STEP = attention._FORCE_MIN_BLOCKS = None
            attention._FORCE_LANES = attention._FORCE_TRANSPOSED_SUMS = None
            attention._FORCE_WORD_AFFINE = None
        gbs = nbytes / (ms / 1e3) / 1e9
        row = SweepRow(mode, keys, blocks, lanes, sums, unpack, ran_splits, round(ms, 4),
                       round(kernel_ms, 4),
                       nbytes, round(gbs, 1),
                       round(gbs / copy_gbs, 3), None, float(f"{err:.3g}"))  # fmt: skip
        print(f"  {mode:<8} keys/step {keys:>2} min_blocks {blocks} lanes {lanes} sums {sums} "
              f"unpack {unpack} splits {ran_splits}: "
              f"{ms:8.3f} ms (kernel {kernel_ms:.3f}) {gbs:7.0f} GB/s  err {err:.1e}",
              flush=True)  # fmt: skip
        rows.append(row)
    return rows


def parse_configs(text: str) -> list[tuple[int, int, int, str, int, str]]:
    """``keys:min_blocks:lanes:sums:splits:unpack`` items (left out: 4 blocks, 16 lanes, sums
    ``auto``, splits 0 = the kernel's rule, unpack ``auto``)."""
    out = []
    for item in text.split(","):
        keys, blocks, lanes, sums, splits, unpack = ([*item.split(":"), *[""] * 5])[:6]
        sums, unpack = sums or "auto", unpack or "auto"
        if sums not in SUMS:
            raise SystemExit(f"sums must be one of {', '.join(SUMS)}, got {sums!r}")
        if unpack not in UNPACK:
            raise SystemExit(f"unpack must be one of {', '.join(UNPACK)}, got {unpack!r}")
        out.append((int(keys), int(blocks or 4), int(lanes or 16), sums, int(splits or 0), unpack))
    return out


def with_vs_fp16(rows: list[SweepRow], configs) -> list[SweepRow]:
    """``rows`` with their speed relative to fp16's first config (once that row exists)."""
    base = [r.time_ms for r in rows if r.mode == "fp16" and (r.keys_per_step, r.min_blocks,
            r.lanes, r.sums) == configs[0][:4]]  # fmt: skip
    if not base:
        return rows
    return [SweepRow(**{**asdict(r), "vs_fp16_default": round(base[0] / r.time_ms, 3)})
            for r in rows]  # fmt: skip


def write_result(args, props, copy_gbs: float, configs, rows: list[SweepRow]) -> None:
    result = {
        "benchmark": "attention keys per step",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": props.name,
        "versions": versions(),
        "shape": {"heads": 32, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE},
        "batch": args.batch,
        "context": args.context,
        "copy_bandwidth_gbs": round(copy_gbs, 1),
        "baseline": dict(
            zip(
                ("keys_per_step", "min_blocks", "lanes", "sums", "splits", "unpack"),
                configs[0],
                strict=True,
            )
        ),
        "rows": [asdict(r) for r in rows],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--configs",
        default="4:4,2:4,4:4:16:auto:0:codes,1:4,2:4:32",  # the default (4 keys) first
        help="keys_per_step:min_blocks:lanes:sums:splits:unpack items; the first: the baseline",
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    require_gpu()
    configs = parse_configs(args.configs)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}: copy bandwidth {copy_gbs:.0f} GB/s; batch {args.batch} x {args.context}")
    rows: list[SweepRow] = []
    for mode in args.modes.split(","):
        rows += sweep_mode(mode, configs, args.batch, args.context, args.iters, copy_gbs)
        # after every mode: a run cut short by a device time cap keeps what it measured
        rows = with_vs_fp16(rows, configs)
        write_result(args, props, copy_gbs, configs, rows)
    print(f"{'mode':<8} {'keys':>4} {'blocks':>6} {'lanes':>5} {'sums':>10} {'unpack':>6} "
          f"{'splits':>6} "
          f"{'ms':>8} {'kernel':>8} {'GB/s':>7} {'vs fp16':>8} {'err':>8}")  # fmt: skip
    for r in rows:
        vs = f"{r.vs_fp16_default:.2f}x" if r.vs_fp16_default else "-"
        print(f"{r.mode:<8} {r.keys_per_step:>4} {r.min_blocks:>6} {r.lanes:>5} {r.sums:>10} "
              f"{r.unpack:>6} {r.splits:>6} "
              f"{r.time_ms:>8.3f} {r.kernel_ms:>8.3f} "
              f"{r.achieved_gbs:>7.0f} {vs:>8} {r.max_rel_error:>8.1e}")  # fmt: skip
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
