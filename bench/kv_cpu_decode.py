"""Decode speed of each KV-cache mode on the CPU.

On a CPU a decode row's attention reads the pages in place, float rows or codes
(engine/cpu/decode_attention.py), a prompt chunk's copies (dequantizes) the pages it names
(the torch reference), and every quantized cache write quantizes the step's rows
(engine/cpu/quant_write.py, the 4-bit scale search included), so a quantized cache may trade
tokens per byte for time per step. This runs the real generator on the installed
SmolLM2-135M (float32, ``--threads`` torch threads): ``--batch`` jobs with prompts of
``--context`` tokens of the fixed text (different windows of it, so no prefix is shared),
prefilled in one step (or in forwards of ``--chunk`` tokens), then ``--steps`` greedy decode
steps of the whole batch, each timed (prefill, scheduling, forward, sampling, text). The fp16
cache (the model's dtype here, float32) is the baseline of the same run. Each mode also
reports the part of a step spent in the model's paged attention (``attn ms``: every layer's
call, timed by the host's clock around the op), where the page format counts and the
matmuls do not.

Modes: fp16, q8, q6, q4, and any of them with ``+sinks+recent`` (a sink page per sequence
and recent pages for its last blocks, read unquantized; README, "KV cache").

``--ngram``: the jobs decode with n-gram drafts (``use_ngram_draft``), on prompts that repeat
a window of the fixed text of ``NGRAM_WINDOW`` tokens (each job its own window; a quarter of
the shortest prompt if less), which the
model goes on repeating, so nearly every draft is accepted; every step after the first
tokens is timed, and tokens/s is the tokens those steps made over their time (ms/step: their
mean). Each step verifies drafts of every job: over quantized pages, rows of a few tokens
(engine/cpu/decode_attention.py ``VERIFY_ROWS``).

``--baseline REF`` also runs every mode with the engine at git ref REF (a temporary git
worktree; this script, in a subprocess whose PYTHONPATH puts that tree first), mode by mode
before this engine's, so both see the same load; the JSON then holds both (the printed table
adds each mode's speedup).

    python bench/kv_cpu_decode.py [--baseline REF] [--quick]
        # writes bench/results/kv_cpu_decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # (last: a baseline run's PYTHONPATH puts its tree's engine first)

import engine  # noqa: E402
from bench import kv_quant_quality as quality  # noqa: E402
from bench.host_overhead import baseline_tree  # noqa: E402
from bench.record import write_record  # noqa: E402
from engine import DynamicGenerator, DynamicJob, SamplerSettings  # noqa: E402
from engine.cache.kv_cache import PagedCache, recent_pages_for  # noqa: E402
from engine.cache.quant import CACHE_QUANTS  # noqa: E402

RESULTS = REPO / "bench" / "results" / "kv_cpu_decode.json"
EXACT_PAGES = "+sinks+recent"
DEFAULT_MODES = ("fp16", "q8", "q6", "q4", "q4" + EXACT_PAGES)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    mode: str
    bytes_per_token: int  # K/V storage per token, all layers (sink and recent pages apart)
    prefill_s: float  # the steps until every job had its first token
    decode_steps: int
    ms_per_step: float  # median over the decode steps (--ngram: their mean)
    tokens_per_s: float  # batch / median step (--ngram: the steps' tokens / their time)
    # --repeats: each run's prefill_s and ms_per_step (the fields above: their medians)
    prefill_runs: tuple[float, ...] = ()
    step_runs: tuple[float, ...] = ()
    # of ms_per_step, the time in the model's paged attention (every layer's call; taken as
    # ms_per_step is), and each run's
    attention_ms_per_step: float = 0.0
    attention_runs: tuple[float, ...] = ()


def parse_mode(mode: str) -> tuple[str, bool]:
    """``mode`` -> (cache quant, sink and recent pages); a ValueError names a bad one."""
    exact = mode.endswith(EXACT_PAGES)
    quant = mode[: -len(EXACT_PAGES)] if exact else mode
    if quant not in CACHE_QUANTS or (exact and quant == "fp16"):
        names = ", ".join(CACHE_QUANTS)
        raise ValueError(f"unknown mode {mode!r}: one of {names} (the quantized +sinks+recent)")
    return quant, exact


def context_lengths(batch: int, context: int, ragged: bool) -> list[int]:
    """Each job's prompt length: ``context`` tokens, or with ``ragged`` halving from job to
    job (at least 16), as a serving batch mixes long and short conversations."""
    return [max(context >> i, 16) if ragged else context for i in range(batch)]


def prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Windows of the fixed text, one per length, none sharing a page."""
    ids = quality.text_ids(tokenizer)
    longest = max(lengths)
    if len(ids) < longest + len(lengths):
        raise ValueError(f"--context {longest}: the fixed text has {len(ids)} tokens")
    stride = (len(ids) - longest) // len(lengths)
    return [ids[i * stride : i * stride + n] for i, n in enumerate(lengths)]


class AttentionClock:
    """The model's paged attention, timed: ``seconds`` sums its calls (on a CPU each op
    returns when done, so the host's clock times it)."""

    def __init__(self, attention):
        self.attention = attention
        self.seconds = 0.0

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        out = self.attention(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        return out


@contextlib.contextmanager
def ops_of(model, ops):
    """``model`` runs ``ops`` within: a generator made here keeps them (its runner takes the
    model's op set when it is made). (Here, not in a shared bench module: a --baseline run
    imports an older tree's ``bench`` package first, which may not have it.)"""
    kept, model.ops = model.ops, ops
    try:
        yield model
    finally:
        model.ops = kept


NGRAM_WINDOW = 256  # --ngram: tokens of the fixed text each prompt repeats (at most)


def repeated_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """--ngram's prompts: job i's window of the fixed text (NGRAM_WINDOW tokens, or a quarter
    of its length if less), repeated to its length: the model continues the repetition, and
    its n-grams draft it."""
    window = min(NGRAM_WINDOW, max(min(lengths) // 4, 1))
    windows = prompts(tokenizer, [window] * len(lengths))
    return [(w * (n // window + 1))[:n] for w, n in zip(windows, lengths, strict=True)]


def measure(
    model,
    tokenizer,
    mode: str,
    batch: int,
    context: int,
    steps: int,
    ragged: bool = False,
    chunk: int = 0,
    ngram: bool = False,
) -> DecodeResult:
    """One mode: the batch's prompts prefilled (in forwards of ``chunk`` tokens; 0: all in
    one), then ``steps`` timed decode steps (``ngram``: steps with drafts until every job made
    steps + 1 tokens)."""
    quant, exact = parse_mode(mode)
    extra = {"sink_pages": batch, "recent_pages": recent_pages_for(batch)} if exact else {}
    cache = PagedCache(model, max_num_tokens=batch * (context + steps + 64), quant=quant, **extra)
    chunk = chunk or batch * context  # (0: the whole prefill in one step)
    clock = AttentionClock(model.ops.paged_attention)
    with ops_of(model, dataclasses.replace(model.ops, paged_attention=clock)):
        gen = DynamicGenerator(
            model, cache, tokenizer, max_batch_size=batch, max_chunk_size=chunk,
            use_ngram_draft=ngram,
        )  # fmt: skip
    greedy = SamplerSettings.greedy()
    lengths = context_lengths(batch, context, ragged)
    made_by = repeated_prompts if ngram else prompts
    for ids in made_by(tokenizer, lengths):  # (no stop: every job makes steps + 1 tokens)
        job = DynamicJob(ids, max_new_tokens=steps + 1, stop_conditions=[], gen_settings=greedy)
        gen.enqueue(job)
    started, decode, attention, tokens = time.perf_counter(), [], [], 0
    answered = set()  # jobs with a first token (in chunks, the first decode while others prefill)
    prefill_s = 0.0
    while gen.num_remaining_jobs():
        t, attended = time.perf_counter(), clock.seconds
        results = gen.iterate()
        took = time.perf_counter() - t
        made = [r for r in results if "token_ids" in r and r["token_ids"].numel()]
        made_tokens = sum(r["token_ids"].numel() for r in made)
        if len(answered) < batch:
            answered.update(r["serial"] for r in made)
            prefill_s = time.perf_counter() - started
        elif ngram or made_tokens == batch:  # (without drafts: a step of the whole batch)
            decode.append(took)
            attention.append(clock.seconds - attended)
            tokens += made_tokens
    if not decode:
        raise RuntimeError(f"{mode}: no decode step of the whole batch was timed")
    size = cache.bytes_per_token()
    if ngram:
        mean_ms, attention_ms = (sum(times) / len(times) * 1e3 for times in (decode, attention))
        speed = tokens / sum(decode)
        return DecodeResult(
            mode, size, prefill_s, len(decode), mean_ms, speed, attention_ms_per_step=attention_ms
        )
    median = statistics.median(decode)
    return DecodeResult(
        mode, size, prefill_s, len(decode), median * 1e3, batch / median,
        attention_ms_per_step=statistics.median(attention) * 1e3,
    )  # fmt: skip


def median_of(runs: list[DecodeResult], batch: int, ngram: bool = False) -> DecodeResult:
    """One mode's repeated runs as one result: the median prefill and step times, each run's
    kept beside them (this box's single runs vary by 10-20%); with ``ngram`` the median
    tokens/s (steps make different numbers of tokens)."""
    prefill = tuple(r.prefill_s for r in runs)
    steps = tuple(r.ms_per_step for r in runs)
    attention = tuple(r.attention_ms_per_step for r in runs)
    ms = statistics.median(steps)
    speed = statistics.median(r.tokens_per_s for r in runs) if ngram else batch / ms * 1e3
    return dataclasses.replace(
        runs[0],
        prefill_s=statistics.median(prefill),
        ms_per_step=ms,
        tokens_per_s=speed,
        prefill_runs=prefill,
        step_runs=steps,
        attention_ms_per_step=statistics.median(attention),
        attention_runs=attention,
    )


def run_baseline(args: argparse.Namespace, mode: str, tree: Path) -> tuple[DecodeResult, str]:
    """One run of one mode with the engine of ``tree`` (this script in a subprocess), and
    the folder its ``engine`` was imported from."""
    flags = [
        "--modes", mode, "--batch", str(args.batch), "--context", str(args.context),
        *("--steps", str(args.steps), "--threads", str(args.threads), "--repeats", "1"),
        *(["--ragged"] if args.ragged else []), "--chunk", str(args.chunk),
        *(["--ngram"] if args.ngram else []),
    ]  # fmt: skip
    # (imported here: the baseline's own process runs this script with the tree's ``bench``
    # first on its path, and an older tree has no ``run_in_tree``)
    from bench.host_overhead import run_in_tree

    record = run_in_tree(str(Path(__file__).resolve()), flags, tree)
    return DecodeResult(**record["results"][0]), record["engine"]


def table(results: list[DecodeResult], baseline: dict[str, dict[str, Any]]) -> str:
    fp16 = next((r for r in results if r.mode == "fp16"), None)
    head = f"{'mode':18} {'bytes/token':>11} {'prefill s':>9} {'ms/step':>8} {'attn ms':>7}"
    head += f" {'tok/s':>7} {'vs fp16':>7}"
    extra = f" {'baseline tok/s':>14} {'speedup':>7} {'baseline prefill s':>18}"
    extra += f" {'baseline attn ms':>16}"
    lines = [head + (extra if baseline else "")]
    for r in results:
        vs = f"{r.tokens_per_s / fp16.tokens_per_s:7.2f}" if fp16 else f"{'':7}"
        line = f"{r.mode:18} {r.bytes_per_token:11d} {r.prefill_s:9.2f} {r.ms_per_step:8.1f} "
        line += f"{r.attention_ms_per_step:7.1f} {r.tokens_per_s:7.1f} {vs}"
        if r.mode in baseline:
            old = baseline[r.mode]
            line += f" {old['tokens_per_s']:14.1f} {r.tokens_per_s / old['tokens_per_s']:7.2f}"
            line += f" {old['prefill_s']:18.2f} {old['attention_ms_per_step']:16.1f}"
        lines.append(line)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--ragged", action="store_true", help="prompt lengths halving from --context on"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--chunk", type=int, default=0,
        help="token budget of a forward (the serving preset's: 512); 0: each prefill in one",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="runs per mode (each beside the baseline's), reported as medians",
    )  # fmt: skip
    parser.add_argument("--ngram", action="store_true", help="n-gram drafts on repeated text")
    parser.add_argument("--baseline", metavar="REF", help="also run the engine at git ref REF")
    parser.add_argument("--quick", action="store_true", help="batch 2, 64 tokens, 4 steps")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.steps = 2, 64, 4
    for mode in args.modes:
        parse_mode(mode)
    if args.chunk < 0:
        parser.error(f"--chunk {args.chunk}: 0 (one forward) or more")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = quality.load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, tokenizer, gguf = loaded
    # An untimed run first: a process's first prefill is slower (each new matmul shape's
    # kernels are made on first use), and the baseline runs in a fresh process each time
    # (this box: 10-20% on the first prefill of 8 x 1024 tokens).
    # (In chunks the first jobs decode while later ones prefill, and end after 1 + steps tokens:
    # a run of 1 step would have no step of the whole batch to time.)
    warm_steps = args.steps if args.chunk else 1
    shape = (args.batch, args.context, warm_steps, args.ragged, args.chunk, args.ngram)
    measure(model, tokenizer, args.modes[0], *shape)
    results, baseline = [], {}
    no_tree = contextlib.nullcontext((None, None))
    with baseline_tree(args.baseline) if args.baseline else no_tree as (tree, commit):
        for mode in args.modes:
            runs, baseline_runs = [], []
            for _ in range(args.repeats):  # (interleaved: both see the same load)
                if tree is not None:
                    baseline_runs.append(run_baseline(args, mode, tree))
                shape = (args.batch, args.context, args.steps, args.ragged, args.chunk, args.ngram)
                runs.append(measure(model, tokenizer, mode, *shape))
            results.append(median_of(runs, args.batch, args.ngram))
            if baseline_runs:
                merged = median_of([run for run, _ in baseline_runs], args.batch, args.ngram)
                baseline[mode] = {**dataclasses.asdict(merged), "engine": baseline_runs[0][1]}
            print(table(results[-1:], baseline), flush=True)
    print(table(results, baseline))
    write_record(
        args.output, "kv_cpu_decode",
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads",
        engine=str(Path(engine.__file__).parent), model=gguf.name,
        batch=args.batch, context=args.context, steps=args.steps, repeats=args.repeats,
        chunk=args.chunk or None, ngram=args.ngram,
        contexts=context_lengths(args.batch, args.context, args.ragged),
        results=[dataclasses.asdict(r) for r in results],
        baseline={"ref": args.baseline, "commit": commit, "results": baseline} if tree else None,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
