"""CPU throughput: our DynamicGenerator vs transformers' continuous batching (generate_batch).

Same random Llama model (about 30M parameters, float32, CPU), same 64 prompts, greedy, 64 new
tokens each (EOS ignored so both produce every token). Two workloads:

    unique   64 prompts of 48-160 random tokens
    shared   4 system prompts of 256 tokens, each followed by a unique 16-48 token question

Prints a table and writes JSON to bench/results/cpu_vs_transformers.json.

    python bench/cpu_vs_transformers.py [--threads 2] [--prompts 64] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings
from engine.demo import DemoModelSpec, ensure_demo_model

RESULTS = Path(__file__).parent / "results" / "cpu_vs_transformers.json"
# ~30M parameters: 8 layers of 512 with GQA 8/4 and a 4096-token vocabulary.
SPEC = DemoModelSpec(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
)


def make_prompts(kind: str, count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]

    if kind == "unique":
        return [tokens(rng.randint(48, 160)) for _ in range(count)]
    systems = [tokens(256) for _ in range(4)]
    return [systems[i % 4] + tokens(rng.randint(16, 48)) for i in range(count)]


def run_ours(folder: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    from engine import Tokenizer

    model = Model.from_pretrained(folder, dtype="float32", device="cpu")
    tokenizer = Tokenizer.from_pretrained(folder)
    cache = PagedCache(model, max_num_tokens=65536, page_size=16)
    generator = DynamicGenerator(model, cache, tokenizer, max_chunk_size=2048)
    generator.generate("warm up", max_new_tokens=4)  # first-call allocations outside the timing
    start = time.perf_counter()
    for ids in prompts:
        generator.enqueue(
            DynamicJob(ids, new_tokens, gen_settings=SamplerSettings.greedy(), stop_conditions=[])
        )
    produced = 0
    outputs = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                produced += result["new_tokens"]
                outputs[result["serial"]] = result["job"].new_token_ids
    elapsed = time.perf_counter() - start
    stats = generator.stats()
    return {
        "seconds": elapsed,
        "tokens": produced,
        "tokens_per_s": produced / elapsed,
        "cached_prompt_tokens": stats["cached_tokens_total"],
        "prompt_tokens": stats["prompt_tokens_total"],
        "outputs": [outputs[k] for k in sorted(outputs)],
    }


def run_transformers(folder: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    config = transformers.GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    model.generate_batch([prompts[0][:8]], generation_config=config)  # warm up
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.generated_tokens) for r in results.values())
    if produced == 0:
        raise RuntimeError("transformers generate_batch produced no tokens")
    return {"seconds": elapsed, "tokens": produced, "tokens_per_s": produced / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    folder = ensure_demo_model(SPEC, cache_dir=Path(tempfile.gettempdir()) / "pagedserve-bench")
    rows = {}
    for kind in ("unique", "shared"):
        prompts = make_prompts(kind, args.prompts, SPEC.vocab_size)
        ours = run_ours(folder, prompts, args.new_tokens)
        theirs = run_transformers(folder, prompts, args.new_tokens)
        ours.pop("outputs")
        rows[kind] = {
            "ours": ours,
            "transformers": theirs,
            "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        }
        print(
            f"{kind:8s} ours {ours['tokens_per_s']:8.1f} tok/s   transformers "
            f"{theirs['tokens_per_s']:8.1f} tok/s   ratio {rows[kind]['ratio']:.2f}   "
            f"(cached prompt tokens {ours['cached_prompt_tokens']}/{ours['prompt_tokens']})",
            flush=True,
        )
    report = {
        "benchmark": "cpu_vs_transformers",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "torch_threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "model": {
            "parameters": SPEC.num_parameters(),
            "dtype": "float32",
            "spec": SPEC.__dict__ if hasattr(SPEC, "__dict__") else str(SPEC),
        },
        "workload": {"prompts": args.prompts, "new_tokens": args.new_tokens, "greedy": True},
        "results": rows,
        "goals": {"unique_ratio": 1.5, "shared_ratio": 3.0},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
