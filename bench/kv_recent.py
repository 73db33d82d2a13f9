"""EXPERIMENT (bench only, not an engine format): a sequence's most recent tokens read exactly.

With ``exact_chunks`` a prompt chunk reads its own K/V exactly, but a decoded token reads every
earlier token through its code. This asks how much a window of recent tokens kept exact would
buy at decode time (KIVI keeps such a "residual" in fp16): a query at position p reads the
keys and values of positions p - W < j <= p exactly and the rest as the engine's codes store
them (rotated groups, the 4-bit scale search, keys centered), per query, so the result does
not depend on how the text is chunked. ``--page`` instead keeps exact only the keys in the
query's own page (0 to 15 earlier tokens): what mirroring a sequence's last page would give.

The emulation scores the fixed text of bench/kv_quant_quality.py (one sequence over pages
0.., so a slot is a position) with a dense attention per layer; no greedy runs.

    python bench/kv_recent.py            # writes bench/results/kv_recent_window.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import kv_quant_quality as quality  # noqa: E402
from bench.kv_zero_point import engine_round_trip  # noqa: E402
from engine.cuda.rotary import rotary_reference  # noqa: E402
from engine.ops import OpSet  # noqa: E402

logger = logging.getLogger("kv_recent")
RESULTS = REPO / "bench" / "results" / "kv_recent_window.json"
WINDOWS = (0, 16, 64, 256)  # 0: every earlier token through its code (the engine's decode)


@dataclasses.dataclass
class LayerRows:
    """One layer's rows of the scored sequence, by position: exact and through the codes."""

    exact_k: torch.Tensor
    exact_v: torch.Tensor
    code_k: torch.Tensor
    code_v: torch.Tensor


def recent_ops(
    ops: OpSet, centers: list[torch.Tensor], tokens: int, window: int, page: int | None, bits
) -> OpSet:
    """``ops`` whose attention reads, for each query, the rows of the ``window`` most recent
    positions (with ``page``: of the query's own page) exactly and the rest through the codes
    of ``bits`` = (K bits, V bits). One sequence of at most ``tokens`` over pages 0..."""
    kv_heads, head_dim = centers[0].shape
    layers = [
        LayerRows(*(torch.zeros(tokens, kv_heads, head_dim) for _ in range(4))) for _ in centers
    ]
    state = {"calls": 0, "rows": None, "positions": None}

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        layer = state["calls"] % len(layers)
        state["calls"] += 1
        rows = layers[layer]
        q, k = rotary_reference(q, k, cos, sin)
        k = k.float() - centers[layer]
        rows.exact_k[slots], rows.exact_v[slots] = k, v.float()
        rows.code_k[slots] = engine_round_trip(k, bits[0]).float()
        rows.code_v[slots] = engine_round_trip(v.float(), bits[1]).float()
        state["rows"], state["positions"] = rows, slots
        return q

    def attention(q, k_pages, v_pages, batch, scale, sliding_window=None):
        return attend(q, state["rows"], state["positions"], scale, window, page)

    return dataclasses.replace(ops, rotary_cache_write=write, paged_attention=attention)


def attend(
    q: torch.Tensor, rows: LayerRows, positions: torch.Tensor, scale: float, window, page
) -> torch.Tensor:
    """Causal attention of q [T, H, D] at ``positions`` over rows 0..last position, each query
    reading its recent rows exactly and the others through their codes."""
    end = int(positions[-1]) + 1
    query, key = positions[:, None], torch.arange(end)[None, :]
    causal = key <= query
    recent = (key // page == query // page) if page else (query - key) < window
    recent = recent & causal
    groups = q.shape[1] // rows.exact_k.shape[1]
    k_exact, k_code, v_exact, v_code = (
        t[:end].repeat_interleave(groups, 1)
        for t in (rows.exact_k, rows.code_k, rows.exact_v, rows.code_v)
    )
    qf = q.float()
    scores = torch.where(
        recent[None],
        torch.einsum("thd,shd->hts", qf, k_exact),
        torch.einsum("thd,shd->hts", qf, k_code),
    )
    weights = (scores * scale).masked_fill(~causal[None], float("-inf")).softmax(-1)
    near = weights * recent[None]
    out = torch.einsum("hts,shd->thd", near, v_exact)
    out += torch.einsum("hts,shd->thd", weights - near, v_code)
    return out.to(q.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quant", default="q4", choices=["q8", "q6", "q4"])
    parser.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    parser.add_argument("--tokens", type=int, default=quality.TEXT_TOKENS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    loaded = quality.load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, tokenizer, gguf = loaded
    ids = quality.text_ids(tokenizer, args.tokens)
    quality.CHUNK = args.chunk
    reference_mode = quality.BASELINES[quality.REFERENCE]
    base_ppl, _, reference = quality.text_scores(
        model, ids, reference_mode, None, quality.KL_TOKENS
    )
    bits = quality.QUANT_BITS[args.quant]
    variants = [(f"w{w}", w, None) for w in map(int, args.windows.split(","))]
    variants.append(("page", 0, quality.PAGE_SIZE))
    rows = []
    original = model.ops
    for name, window, page in variants:
        t0 = time.perf_counter()
        model.ops = recent_ops(original, model.key_centers(), len(ids), window, page, bits)
        try:
            ppl, kl, _ = quality.text_scores(
                model, ids, reference_mode, reference, quality.KL_TOKENS
            )
        finally:
            model.ops = original
        row = {
            "variant": name,
            "window": window,
            "page": page,
            "perplexity": ppl,
            "perplexity_vs_fp32": ppl / base_ppl - 1,
            "kl_vs_fp32": kl,
            "seconds": time.perf_counter() - t0,
        }
        change = row["perplexity_vs_fp32"]
        print(f"{args.quant}+rot {name:5s} ppl {ppl:.3f} ({change:+.2%}) KL {kl:.5f}", flush=True)
        rows.append(row)
    report = {
        "benchmark": "kv_recent",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} CPU, {args.threads} torch threads, no GPU",
        "model": gguf.name,
        "quant": f"{args.quant}+rot (keys centered), emulated",
        "text": quality.display_path(quality.TEXT),
        "text_tokens": len(ids),
        "chunk": args.chunk,
        "kl_tokens": quality.KL_TOKENS,
        "fp32_perplexity": base_ppl,
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {quality.display_path(args.output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
