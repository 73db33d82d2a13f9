"""What log-probabilities cost: one batched ``sample()`` call at batch 32 over a 32768-wide
vocabulary (random float32 logits), with no row asking, every row asking ``logprobs=k``, and
only a quarter of the rows asking; greedy and sampled (temperature 0.8) settings.
Also the ingress side: formatting one token's entry into OpenAI's chat and completion shapes
(``deployments.logprobs.LogprobsFormatter``, token spelling cached) on the demo tokenizer.

Medians of ``--repeats`` timed calls after warm-up; the device is the CPU unless ``--device``.

    PYTHONPATH=. python bench/logprobs_overhead.py [--device cuda] [--output PATH.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from deployments.logprobs import LogprobsFormatter
from engine import Tokenizer
from engine.demo import ensure_demo_model
from engine.sampling import SampleRequest, SamplerSettings, sample
from engine.token_bytes import TokenBytes

RESULTS = Path(__file__).parent / "results" / "logprobs_overhead.json"
VOCAB = 32768
BATCH = 32


def _time(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sampler_cases(device: str, repeats: int) -> list[dict]:
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name, settings in [
        ("greedy", SamplerSettings.greedy()),
        ("sampled", SamplerSettings(temperature=0.8)),
    ]:
        base = None
        for asking, k in [(0, None), (BATCH, 0), (BATCH, 5), (BATCH, 20), (BATCH // 4, 5)]:

            def run(asking=asking, k=k, settings=settings):
                requests = [
                    SampleRequest(settings, random.Random(i), logprobs=k if i < asking else None)
                    for i in range(BATCH)
                ]
                sample(logits, requests, VOCAB)

            seconds = _time(run, repeats)
            base = seconds if base is None else base
            rows.append(
                {
                    "settings": name,
                    "rows_asking": asking,
                    "k": k,
                    "ms_per_step": seconds * 1e3,
                    "vs_none": seconds / base,
                }
            )
    return rows


def formatter_cases(repeats: int) -> list[dict]:
    tokenizer = Tokenizer.from_pretrained(ensure_demo_model())
    spell = TokenBytes(tokenizer)
    rng = random.Random(0)
    entries = [
        (rng.randrange(tokenizer.vocab_size), -1.0, rng.sample(range(tokenizer.vocab_size), 5),
         [-1.0] * 5)
        for _ in range(256)
    ]  # fmt: skip
    rows = []
    for chat in (True, False):
        seconds = _time(lambda chat=chat: LogprobsFormatter(spell, chat).format(entries), repeats)
        route = "chat" if chat else "completions"
        rows.append({"route": route, "k": 5, "us_per_token": seconds / len(entries) * 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampler = sampler_cases(args.device, args.repeats)
    formatter = formatter_cases(args.repeats)
    print(f"sample() at batch {BATCH}, vocab {VOCAB}, {args.device}, 1 torch thread")
    print(f"{'settings':8} {'rows':>4} {'k':>4} {'ms/step':>8} {'vs none':>8}")
    for r in sampler:
        k = "-" if r["k"] is None else r["k"]
        print(
            f"{r['settings']:8} {r['rows_asking']:>4} {k:>4} "
            f"{r['ms_per_step']:>8.3f} {r['vs_none']:>8.2f}"
        )
    for r in formatter:
        print(f"ingress formatting ({r['route']}, k={r['k']}): {r['us_per_token']:.1f} us/token")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "device": args.device,
        "torch_threads": 1,
        "sampler": sampler,
        "formatter": formatter,
    }
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    print(f"-> {args.output}")


if __name__ == "__main__":
    main()
