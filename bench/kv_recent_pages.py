"""Decode-time perplexity of the engine's quantized caches, with and without recent pages.

A decoded token reads every earlier token through its code unless its block is a sink page
or one of the sequence's last RECENT_BLOCKS blocks on recent pages (engine/cache/page_table.py).
This scores that path as the generator runs it: the first ``--prefill`` tokens of the fixed
text of bench/kv_quant_quality.py go in as one prompt chunk, then each later token is decoded
through the real scheduler (pages placed and settled, page moves made, one token per step)
and the next token of the text is scored on its logits (teacher forcing). The perplexity is
over the decoded positions only; fp32 (the unquantized cache in float32) is the reference.
With ``--prompts N`` (default 32) it also runs bench/kv_quant_quality.py's greedy agreement:
N prompts of the text decoded together by the generator with the engine's defaults, each
mode's continuations compared with fp32's (the mean fraction of positions before the first
divergence, and the prompts whose continuation is identical), with the fp16 cache's (the
issue's reference: an unquantized cache whose rows are rounded to fp16) and, per diverging
prompt, fp32's top-2 logit margin where it diverged: a near-tie that any rounding may flip.

    python bench/kv_recent_pages.py     # writes bench/results/kv_recent_pages.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import kv_quant_quality as quality  # noqa: E402
from bench.record import write_record  # noqa: E402
from engine import DynamicGenerator, DynamicJob, SamplerSettings  # noqa: E402
from engine.cache.kv_cache import PagedCache, recent_pages_for  # noqa: E402
from engine.cache.page_table import RECENT_BLOCKS  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.scheduler import Scheduler, SchedulerConfig, SeqState  # noqa: E402

logger = logging.getLogger("kv_recent_pages")
RESULTS = REPO / "bench" / "results" / "kv_recent_pages.json"


@dataclasses.dataclass(frozen=True)
class CacheMode:
    name: str
    quant: str
    sinks: bool = False  # a sink page per sequence (its first block)
    recent: bool = False  # recent pages for every sequence's last RECENT_BLOCKS blocks
    # an unquantized cache whose written rows are rounded to this dtype (fp16, bf16 storage
    # in this float32 run: the floor a lossless-looking cache already sits at)
    round_to: torch.dtype | None = None

    def cache(self, model, num_tokens: int, rows: int, **kwargs) -> PagedCache:
        """A cache of this mode for ``rows`` sequences of up to ``num_tokens`` in all."""
        sink_pages = rows if self.sinks else 0
        recent_pages = recent_pages_for(rows) if self.recent else 0
        pages = -(-num_tokens // quality.PAGE_SIZE) + rows + sink_pages + recent_pages
        return PagedCache(
            model,
            pages * quality.PAGE_SIZE,
            quality.PAGE_SIZE,
            self.quant,
            sink_pages=sink_pages,
            recent_pages=recent_pages,
            **kwargs,
        )


MODES = {
    mode.name: mode
    for mode in (
        CacheMode("fp32", "fp16"),
        CacheMode("fp16", "fp16", round_to=torch.float16),
        CacheMode("bf16", "fp16", round_to=torch.bfloat16),
        CacheMode("q8+rot", "q8"),
        CacheMode("q8+rot+recent", "q8", recent=True),
        CacheMode("q8+rot+sinkpage+recent", "q8", sinks=True, recent=True),
        CacheMode("q6+rot", "q6"),
        CacheMode("q6+rot+sinkpage+recent", "q6", sinks=True, recent=True),
        CacheMode("q4+rot", "q4"),
        CacheMode("q4+rot+sinkpage", "q4", sinks=True),
        CacheMode("q4+rot+recent", "q4", recent=True),
        CacheMode("q4+rot+sinkpage+recent", "q4", sinks=True, recent=True),
    )
}


@contextlib.contextmanager
def storage_rounding(model, mode: CacheMode) -> Iterator[None]:
    """``mode``'s cache writes installed on the model while inside (rows rounded to
    ``mode.round_to``; nothing to do without it)."""
    original = model.ops
    if mode.round_to is not None:
        model.ops = quality.rounded_writes(original, mode.round_to)
    try:
        yield
    finally:
        model.ops = original


def decode_perplexity(model, ids: list[int], mode: CacheMode, prefill: int) -> float:
    """exp(mean NLL) of ids[prefill + 1:], each predicted by a decode step of the engine."""
    exact_chunks = False if mode.quant != "fp16" else None  # (the prefill through codes too)
    cache = mode.cache(model, len(ids), 1, exact_chunks=exact_chunks)
    config = SchedulerConfig(max_batch_size=1, max_chunk_size=max(prefill, 1))
    scheduler = Scheduler(config, cache.page_table)
    seq = SeqState(list(ids[:prefill]))
    scheduler.add(seq)
    total, count = 0.0, 0
    # (a runner takes the model's ops when made: the rounding goes in first)
    with torch.inference_mode(), storage_rounding(model, mode):
        runner = ModelRunner(
            model, cache.kv, quality.PAGE_SIZE, max_batch_size=1, max_seq_len=len(ids),
            cuda_graphs=False,
        )  # fmt: skip
        for position in tqdm(range(prefill, len(ids)), desc=mode.name, leave=False):
            plan = scheduler.schedule()
            cache.move_pages(scheduler.take_page_moves())
            logits = runner.forward_plan(plan)
            scheduler.commit(plan)
            if position > prefill:  # (the prefill's logits predict ids[prefill])
                target = torch.tensor([ids[position]])
                total += torch.nn.functional.cross_entropy(logits[-1:], target).item()
                count += 1
            seq.tokens.append(ids[position])
    return math.exp(total / count)


def greedy(model, tokenizer, prompts, mode: CacheMode, new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation, all decoded together by the generator."""
    cache = mode.cache(model, sum(len(p) + new_tokens for p in prompts), len(prompts))
    settings = SamplerSettings.greedy()
    jobs = [DynamicJob(p, new_tokens, gen_settings=settings, stop_conditions=[]) for p in prompts]
    with storage_rounding(model, mode):  # (before the generator's runner takes the ops)
        generator = DynamicGenerator(model, cache, tokenizer, max_chunk_size=2048)
        for job in jobs:
            generator.enqueue(job)
        while generator.num_remaining_jobs():
            generator.iterate()
    return [job.new_token_ids for job in jobs]


def compare(row: dict, continuations, reference, fp16, margins) -> None:
    """``row``'s agreement with fp32's continuations (``reference``), with the fp16 cache's
    (``fp16``, the issue's reference, when it ran) and fp32's top-2 logit margin where each
    diverging prompt leaves fp32 (``margins``: small ones are near-ties, which any rounding
    of the cache may flip)."""
    row["agreement"], row["exact_prompts"] = quality.agreement(reference, continuations)
    if fp16 is not None and row["mode"] != "fp16":
        row["agreement_vs_fp16"], row["exact_prompts_vs_fp16"] = quality.agreement(
            fp16, continuations
        )
    firsts = quality.first_divergences(reference, continuations)
    row["divergence_margins"] = sorted(
        round(margins[i][f], 4) for i, f in enumerate(firsts) if f is not None
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES)
    )
    parser.add_argument("--tokens", type=int, default=quality.TEXT_TOKENS, help="text tokens")
    parser.add_argument("--prefill", type=int, default=3072, help="tokens before decoding")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--prompts", type=int, default=quality.NUM_PROMPTS, help="0: none")
    parser.add_argument("--new-tokens", type=int, default=quality.NEW_TOKENS)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=quality.PROMPT_TOKENS,
        help="agreement prompt length (48: bench/kv_quant_quality.py's; a window of recent "
        "pages then covers much of a short context)",
    )
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    modes = [MODES[name] for name in args.modes.split(",")]
    if not 1 <= args.prefill < args.tokens - 1:
        raise SystemExit(f"--prefill must be in [1, {args.tokens - 2}], got {args.prefill}")
    loaded = quality.load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, tokenizer, gguf = loaded
    ids = quality.text_ids(tokenizer, args.tokens)
    prompts = quality.prompts_from(ids, args.prompts, args.prompt_tokens) if args.prompts else []
    rows = []
    baseline, reference, fp16, margins = None, None, None, None
    for mode in modes:
        start = time.perf_counter()
        row = {"mode": mode.name}
        if not args.skip_perplexity:
            ppl = decode_perplexity(model, ids, mode, args.prefill)
            baseline = ppl if mode.name == "fp32" else baseline
            row["perplexity"] = ppl
            row["perplexity_vs_fp32"] = None if baseline is None else ppl / baseline - 1
        if prompts:
            continuations = greedy(model, tokenizer, prompts, mode, args.new_tokens)
            if mode.name == "fp32":
                reference = continuations
                margins = quality.continuation_margins(model, prompts, continuations)
                row["margin_quantiles"] = quality.margin_quantiles(margins)
            fp16 = continuations if mode.name == "fp16" else fp16
            if reference is not None:
                compare(row, continuations, reference, fp16, margins)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(
            " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        )
    write_record(
        args.output,
        "kv_recent_pages",
        machine=f"{platform.machine()} CPU, {args.threads} torch threads, no GPU",
        model=gguf.name,
        text=quality.display_path(quality.TEXT),
        text_tokens=len(ids),
        prefill=args.prefill,
        exact_chunks_note="perplexity: the prefill reads through codes too (exact_chunks off); "
        "agreement: the engine's defaults (exact chunks on)",
        prompts=len(prompts),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        decoded=len(ids) - args.prefill - 1,
        page_size=quality.PAGE_SIZE,
        recent_blocks=RECENT_BLOCKS,
        results=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
