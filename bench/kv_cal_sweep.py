"""EXPERIMENT (bench only): pick +cal's statistic and exponents (bench/kv_balance.py) on a
reduced size before the full bench/kv_quant_quality.py run. Loads the model once, measures the
fp32 reference once, then for each (stat, alpha, query_alpha) and each mode: the mean KL
divergence of every text position's next-token distribution from fp32's, the fraction of
positions whose argmax equals fp32's, the perplexity change, the mean per-layer attention error
and the greedy agreement (bench/kv_quant_quality.py's definitions).

    python bench/kv_cal_sweep.py --tokens 1024 --prompts 8 --threads 1 --output /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import kv_quant_quality as kq  # noqa: E402
from engine import Model, Tokenizer  # noqa: E402
from engine.batch import SequenceInput, build_forward_batch  # noqa: E402

logger = logging.getLogger("kv_cal_sweep")


def text_logits(model: Model, ids: list[int], mode: kq.Mode) -> torch.Tensor:
    """Every position's next-token log-probabilities over ``ids`` (chunked as the bench)."""
    pages = -(-len(ids) // kq.PAGE_SIZE)
    kv = kq.allocate(model, pages, mode)
    out = []
    with kq.mode_ops(model, mode):
        for start in range(0, len(ids) - 1, kq.CHUNK):
            end = min(start + kq.CHUNK, len(ids) - 1)
            row = SequenceInput(ids[start:end], start, range(pages), logits_rows=end - start)
            batch = build_forward_batch([row], kq.PAGE_SIZE, model.device)
            out.append(model.forward(batch, kv).float().log_softmax(dim=-1))
    return torch.cat(out)


def scores(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    kl = (ref.exp() * (ref - got)).sum(dim=-1).mean().item()
    top1 = (ref.argmax(dim=-1) == got.argmax(dim=-1)).float().mean().item()
    nll_ref = -ref.gather(1, targets[:, None]).mean().item()
    nll = -got.gather(1, targets[:, None]).mean().item()
    return {"kl": kl, "top1": top1, "ppl_vs_fp32": math.exp(nll - nll_ref) - 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", default="q8,q8+rot,q4+rot")
    parser.add_argument("--configs", default="rms:0.5:0.5,rms:1:0,absmax:1:0,p99:1:0")
    parser.add_argument("--baselines", action="store_true", help="the modes without +cal too")
    parser.add_argument("--ctr", action="store_true", help="+ctr+cal instead of +cal")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    gguf = kq.smollm2_file()
    model = Model.from_pretrained(gguf, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer.from_pretrained(gguf)
    ids = kq.text_ids(tokenizer, args.tokens)
    kq.CALIBRATION_IDS[:] = kq.text_ids(
        tokenizer, kq.CALIBRATION_TOKENS, kq.fixed_text(kq.CALIBRATION_TEXT)
    )
    prompts = kq.prompts_from(ids, args.prompts)
    targets = torch.tensor(ids[1:])
    fp32 = kq.MODES["fp32"]
    ref = text_logits(model, ids, fp32)
    ref_greedy = kq.greedy(model, tokenizer, prompts, fp32, kq.NEW_TOKENS)
    suffix = "+ctr+cal" if args.ctr else "+cal"
    runs = [(None, m) for m in args.modes.split(",")] if args.baselines else []
    for config in args.configs.split(","):
        runs += [(config, m + suffix) for m in args.modes.split(",")]
    rows = []
    for config, name in runs:
        t0 = time.perf_counter()
        if config is not None:
            stat, alpha, query_alpha, *pairs = config.split(":")  # "...:pairs": --cal-pairs
            kq.CALIBRATION.update(
                stat=stat,
                alpha=float(alpha),
                query_alpha=float(query_alpha),
                pairs=pairs == ["pairs"],
            )
        mode = {**kq.MODES, **kq.EXPERIMENT_MODES}[name]
        row = {"config": config, "mode": name}
        row |= scores(ref, text_logits(model, ids, mode), targets)
        errors = kq.attention_errors(model, ids[: min(1024, len(ids))], mode)
        row["attn_mean"] = sum(errors) / len(errors)
        got = kq.greedy(model, tokenizer, prompts, mode, kq.NEW_TOKENS)
        row["agreement"], row["exact"] = kq.agreement(ref_greedy, got)
        row["seconds"] = time.perf_counter() - t0
        logger.info("%s", row)
        rows.append(row)
        args.output.write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(
            f"{r['config']!s:14} {r['mode']:14} kl={r['kl']:.5f} top1={r['top1']:.4f} "
            f"ppl={r['ppl_vs_fp32']:+.4%} attn={r['attn_mean']:.4f} agr={r['agreement']:.3f} "
            f"exact={r['exact']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
