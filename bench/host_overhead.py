"""Host overhead of ``DynamicGenerator.iterate()`` with a null forward.

The model runner is replaced by ``NullRunner``: its ``forward_plan(plan)`` builds the step's
ragged batch on the host as the eager runner does and returns fixed float32 logits (one row per
sampling entry, in plan order) without any model compute. ``--batch-paths`` picks the builder:
``persistent`` (``engine.persistent_batch.PersistentBatch``, the runner's default) and/or
``reference`` (``plan_rows`` + ``build_forward_batch``, ``ENGINE_PERSISTENT_BATCH=0``). With
both, every step builds its batch with each (alternating which goes first, and checking that
the two batches are equal), so both builders are timed on the same plans under the same load;
the report's ``batch_paths`` compares schedule + batch build per step (such rows' ``batch``
part and ``us/step`` include both builds). Everything else is the real engine: scheduler,
page table, per-job sample requests, batched sampling (torch on the CPU here), detokenizer,
stop strings and result dicts. What is left per step is what the host adds to every forward.

Model and tokenizer: the demo model (``engine.demo``) with one 64-wide layer and a 32768-wide
vocabulary (Llama-2-like width), only for its config and cache shapes; the tokenizer is a
byte-level BPE of 32000 ids trained here on a synthetic corpus of pseudo-words (the demo corpus
only supports ~1.9k), with the demo's special tokens and configs, so sampled ids decode like a
real 32k vocabulary's. The 768 padded ids are masked by the sampler's ``vocab_limit``. The EOS
ids get -inf logits so no job ends while it is timed.

Each case enqueues ``batch`` jobs with distinct random prompts, runs past prefill and a few
decode steps, then times decode steps, alternating plain steps (the headline numbers) with
instrumented ones (the breakdown: the generator's own sub-steps wrapped with perf_counter
timers). Medians are reported.

``--text-stages inline deferred`` runs every case both ways: ``deferred`` is the generator's
``defer_text=True`` (its default on a GPU), where a step renders the previous step's text, held
text and stop strings (``_render_pending``) after handing the next forward to the device. The
``text`` column is that stage; with a real forward it overlaps the device's work, so
``critical us/step`` (step minus ``text``) is what the device waits for between forwards.
``async`` is ``async_scheduling=True`` (its default on a GPU, engine/inflight.py): the step's
tokens stay on the device and the host reads them, with their text, in the next step after
launching its forward (``_read_in_flight``, the ``text`` column then). On this CPU nothing
overlaps, so the async stage only shows what the path costs the host; on a GPU everything in
a step but the sampling launch overlaps the forward.

``--baseline REF`` runs the same cases with the engine at git ref REF too: a temporary
``git worktree`` at REF, and this script (the same harness) in a subprocess whose PYTHONPATH
puts that tree's ``engine`` first, mode by mode before this engine's cases, so both see the
same load. The JSON then holds both (``results``, ``baseline``) and a per-case
``comparison``. The harness is this script: REF's engine must have what it uses (an engine
from before ``PersistentBatch`` runs with ``--batch-paths reference``).

    PYTHONPATH=. python bench/host_overhead.py [--quick] [--output bench/results/host_overhead.json]
        [--batch-paths reference persistent]
    PYTHONPATH=. python bench/host_overhead.py --baseline main --batches 1 64 256
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

import engine
import engine.generator as generator_module
from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from engine.batch import build_forward_batch
from engine.demo import SPECIAL_TOKENS, DemoModelSpec, ensure_demo_model
from engine.job import MODEL_EOS
from engine.model.runner import plan_rows
from engine.scheduler import StepPlan

RESULTS = Path(__file__).parent / "results" / "host_overhead.json"
SPEC = DemoModelSpec(
    vocab_size=32768,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
TOKENIZER_VOCAB = 32000
MAX_CHUNK = 8192  # prefill budget per step (the warm-up only)
BATCHES = (1, 8, 64, 256, 512)
QUICK_BATCHES = (1, 4)
STOP_STRINGS = ("\n\nUser:", "</answer>")
TOP = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
MODES: dict[str, tuple[SamplerSettings, tuple[str, ...]]] = {
    "greedy": (SamplerSettings.greedy(), ()),
    "topk_topp": (SamplerSettings(**TOP), ()),
    "topp": (SamplerSettings(temperature=0.8, top_p=0.9), ()),  # no top_k: the OpenAI style
    # temperature alone (top_p 1, no top_k): what an OpenAI client sends by default
    "temperature": (SamplerSettings(temperature=1.0), ()),
    "penalties": (SamplerSettings(**TOP, repetition_penalty=1.1, presence_penalty=0.5), ()),
    "greedy_stop": (SamplerSettings.greedy(), STOP_STRINGS),
}
PARTS = ("schedule", "batch", "sample", "receive", "text", "other")
# the generator options of each text stage ("async": tokens read one step later, with text)
TEXT_STAGES = {"inline": {}, "deferred": {"defer_text": True}, "async": {"async_scheduling": True}}
BATCH_PATHS = ("reference", "persistent")
# (mode, batch, target us per step) from the issue "Host overhead per step"
GOALS = (("greedy_stop", 256, 3000.0), ("penalties", 256, 5000.0), ("greedy", 1, 300.0))


class NullRunner:
    """A runner stand-in: host batch building with each of ``batch_paths``, fixed logits, no
    model compute. ``build_times``: seconds per builder and step."""

    decode_graph_steps = 0

    def __init__(
        self, logits: torch.Tensor, page_size: int, batch_paths: tuple[str, ...] = ("persistent",)
    ):
        if not batch_paths or not set(batch_paths) <= set(BATCH_PATHS):
            raise ValueError(f"batch_paths must be some of {BATCH_PATHS}, got {batch_paths!r}")
        self.logits = logits
        self.page_size = page_size
        builders = {  # made only for the paths asked for
            "reference": lambda: (
                lambda plan: build_forward_batch(plan_rows(plan), page_size, "cpu")
            ),
            "persistent": lambda: _persistent_batch(page_size).build,
        }
        self.builders = [(name, builders[name]()) for name in dict.fromkeys(batch_paths)]
        self.build_times: dict[str, list[float]] = {name: [] for name, _ in self.builders}
        self._steps = 0

    def forward_plan(self, plan: StepPlan, token_patch=None) -> torch.Tensor:
        self._steps += 1
        order = self.builders if self._steps % 2 else self.builders[::-1]
        batches = []
        for name, build in order:
            start = time.perf_counter()
            batch = build(plan)
            if token_patch is not None:  # async scheduling: input ids from the device
                token_patch.apply(batch.input_ids)
            batches.append(batch)
            self.build_times[name].append(time.perf_counter() - start)
        for other in batches[1:]:
            check_same_batch(other, batches[0])
        return self.logits[: batches[0].logits_indices.shape[0]]


def _persistent_batch(page_size: int):
    # imported when used: a --baseline engine from before it can run --batch-paths reference
    from engine.persistent_batch import PersistentBatch

    return PersistentBatch(page_size, "cpu")


def check_same_batch(a, b) -> None:
    """RuntimeError unless two forward batches hold the same tensors and host values."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "attention":
            continue
        same = (
            x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            if isinstance(x, torch.Tensor)
            else x == y
        )
        if not same:
            raise RuntimeError(f"the batch builders disagree on {f.name}: {x} vs {y}")


def fixed_logits(rows: int, vocab: int, banned: set[int], seed: int = 0) -> torch.Tensor:
    """Random logits with a spread like a model's (a few hundred tokens hold most mass)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3.0
    logits[:, sorted(banned)] = -torch.inf
    return logits


@dataclass
class CaseResult:
    mode: str
    batch: int
    text_stage: str  # "inline", "deferred" or "async" (see TEXT_STAGES)
    batch_path: str  # the builders of each step, "+"-joined (see BATCH_PATHS)
    steps: int
    tokens_per_step: float
    us_per_step: float  # median of plain (uninstrumented) steps
    us_per_token: float
    us_per_step_instrumented: float
    breakdown_us: dict[str, float]  # medians per part (instrumented steps)
    sample_tensor_us: float  # the part of "sample" in the sampler (SamplerState.sample or sample)
    critical_us_per_step: float  # instrumented steps minus the deferred text stage (median)
    text_results_per_step: float  # results rendered one step late (median; 0 when inline)
    build_us: dict[str, float]  # per builder: batch build per step (median of timed steps)


class StepTimers:
    """perf_counter wrappers around the generator's sub-steps, switched on per step."""

    def __init__(self, generator: DynamicGenerator):
        self.generator = generator
        self.totals: dict[str, float] = defaultdict(float)
        self.text_results = 0  # results the deferred text stage returned (0 when inline)
        self._originals: list[tuple[Any, str, Any]] = []
        self._active: set[str] = set()  # keys being timed now

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)
        totals = self.totals

        active = self._active

        def timed(*args, **kwargs):
            if key in active:  # nested (sample_on_device calls sample): counted once
                return original(*args, **kwargs)
            active.add(key)
            start = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start
                active.discard(key)
            if key == "text":
                self.text_results += len(result)
            return result

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)

    def __enter__(self) -> StepTimers:
        g = self.generator
        self.totals.clear()
        self.text_results = 0
        self._wrap(g.scheduler, "schedule", "schedule")
        self._wrap(g.scheduler, "commit", "schedule")
        self._wrap(g.runner, "forward_plan", "batch")
        self._wrap(g, "_sample", "sample_all")
        self._wrap(g, "_receive", "receive")
        sampler = getattr(g, "_sampler", None)  # engines with a SamplerState call it instead
        if sampler is not None:
            self._wrap(sampler, "sample", "sample_tensor")
            if hasattr(sampler, "sample_on_device"):
                self._wrap(sampler, "sample_on_device", "sample_tensor")
        else:
            self._wrap(generator_module, "sample", "sample_tensor")
        if hasattr(g, "_render_pending"):  # a --baseline engine may predate the text stage
            self._wrap(g, "_render_pending", "text")
        if hasattr(g, "_read_in_flight"):  # async scheduling: tokens and text a step later
            self._wrap(g, "_read_in_flight", "text")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._originals):
            if owner is generator_module:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance attribute hid the class's method
        self._originals.clear()

    def parts(self, total: float) -> dict[str, float]:
        t = self.totals
        parts = {
            "schedule": t["schedule"],
            "batch": t["batch"],
            "sample": t["sample_all"] - t["receive"],
            "receive": t["receive"],
            # _render_pending runs inside _receive only when a job is cancelled, never here
            "text": t["text"],
        }
        parts["other"] = total - sum(parts.values())
        parts["sample_tensor"] = t["sample_tensor"]
        parts["critical"] = total - t["text"]
        parts["text_results"] = self.text_results
        return parts


def load(cache_dir: Path, tokenizer_vocab: int) -> tuple[Model, Tokenizer]:
    folder = ensure_demo_model(SPEC, cache_dir=cache_dir)
    model = Model.from_pretrained(folder, dtype="float32", device="cpu")
    return model, synthetic_tokenizer(folder, tokenizer_vocab)


def synthetic_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids (the demo's special tokens first) trained on
    seeded pseudo-words, with the demo model's tokenizer and generation configs. The trained
    tokenizer is kept beside the model (a ``--baseline`` run loads it twice)."""
    configs = {
        name: json.loads((folder / f"{name}.json").read_text())
        for name in ("tokenizer_config", "config", "generation_config")
    }
    saved = folder / f"bench_tokenizer_{vocab_size}.json"
    if not saved.exists():
        tmp = saved.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_train_tokenizer(vocab_size))
        tmp.replace(saved)
    return Tokenizer(
        saved.read_text(),
        tokenizer_config=configs["tokenizer_config"],
        model_config=configs["config"],
        generation_config=configs["generation_config"],
    )


def _train_tokenizer(vocab_size: int) -> str:
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiouy"] + list("aeiou")
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(60000)]
    lines = [" ".join(rng.choices(words, k=12)) for _ in range(40000)]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(lines, trainer=trainer)
    return hf.to_str()


def make_generator(
    model,
    tokenizer,
    batch: int,
    seq_len: int,
    options: dict[str, bool] | None = None,
    batch_paths: tuple[str, ...] = ("persistent",),
) -> DynamicGenerator:
    """``options``: the text stage's generator options (only when asked: a --baseline engine
    from before them has no such arguments)."""
    cache = PagedCache(model, max_num_tokens=batch * (seq_len + 16) + 64)
    options = options or {}
    generator = DynamicGenerator(
        model,
        cache,
        tokenizer,
        max_batch_size=batch,
        max_seq_len=seq_len,
        max_chunk_size=MAX_CHUNK,
        **options,
    )
    eos = set(generator.default_stop_tokens)
    generator.runner = NullRunner(
        fixed_logits(batch, model.config.vocab_size, eos), cache.page_size, batch_paths
    )
    return generator


def enqueue_jobs(generator, mode: str, batch: int, prompt_len: int, new_tokens: int) -> None:
    settings, stops = MODES[mode]
    rng = random.Random(batch)
    top = generator.tokenizer.vocab_size
    eos = generator.default_stop_tokens
    for i in range(batch):
        prompt = [t for t in (rng.randrange(top) for _ in range(prompt_len * 2)) if t not in eos]
        generator.enqueue(
            DynamicJob(
                prompt[:prompt_len],
                new_tokens,
                stop_conditions=[MODEL_EOS, *stops],
                gen_settings=settings,
                seed=i,
                identifier=i,
            )
        )


def warm_up(generator: DynamicGenerator, decode_steps: int) -> None:
    """Past every prefill, then a few decode steps."""
    while any(not job.new_token_ids for job in generator._jobs.values()):
        generator.iterate()
    for _ in range(decode_steps):
        generator.iterate()


def timed_steps(generator, steps: int) -> tuple[list[float], list[float], list[dict], int]:
    """Alternate plain and instrumented steps; returns their times, parts and token count."""
    plain, instrumented, parts, tokens = [], [], [], 0
    timers = StepTimers(generator)
    for _ in range(steps):
        start = time.perf_counter()
        results = generator.iterate()
        plain.append(time.perf_counter() - start)
        tokens += sum(1 for r in results if r["stage"] == "streaming")
        with timers:
            start = time.perf_counter()
            results = generator.iterate()
            total = time.perf_counter() - start
        instrumented.append(total)
        parts.append(timers.parts(total))
        tokens += sum(1 for r in results if r["stage"] == "streaming")
    return plain, instrumented, parts, tokens


def supported_stages(stages: list[str]) -> list[str]:
    """The text stages this engine's generator has the options of (a --baseline engine from
    before async scheduling has no ``async`` stage; its rows are then left out)."""
    accepted = inspect.signature(DynamicGenerator.__init__).parameters
    return [s for s in stages if set(TEXT_STAGES[s]) <= set(accepted)]


def run_case(model, tokenizer, mode: str, batch: int, args, text_stage: str) -> CaseResult:
    steps = max(args.min_steps, min(args.max_steps, args.step_budget // batch))
    warm = 3
    # jobs that finish prefill first decode while the others prefill
    prefill_steps = batch * args.prompt_len // MAX_CHUNK + 1
    new_tokens = warm + 2 * steps + prefill_steps + 8
    generator = make_generator(
        model,
        tokenizer,
        batch,
        args.prompt_len + new_tokens,
        TEXT_STAGES[text_stage],
        tuple(args.batch_paths),
    )
    enqueue_jobs(generator, mode, batch, args.prompt_len, new_tokens)
    warm_up(generator, warm)
    build_times = generator.runner.build_times
    for times in build_times.values():
        times.clear()
    plain, instrumented, parts, tokens = timed_steps(generator, steps)
    if len(generator._jobs) != batch:
        raise RuntimeError(f"{mode} batch {batch}: a job ended while timed")
    us = 1e6 * statistics.median(plain)
    return CaseResult(
        mode=mode,
        batch=batch,
        text_stage=text_stage,
        batch_path="+".join(build_times),
        steps=steps,
        tokens_per_step=tokens / (2 * steps),
        us_per_step=us,
        us_per_token=us / batch,
        us_per_step_instrumented=1e6 * statistics.median(instrumented),
        breakdown_us={k: 1e6 * statistics.median(p[k] for p in parts) for k in PARTS},
        sample_tensor_us=1e6 * statistics.median(p["sample_tensor"] for p in parts),
        critical_us_per_step=1e6 * statistics.median(p["critical"] for p in parts),
        text_results_per_step=statistics.median(p["text_results"] for p in parts),
        build_us={name: 1e6 * statistics.median(t) for name, t in build_times.items()},
    )


def goals(results: list[CaseResult] | list[dict]) -> list[dict[str, Any]]:
    # the goals are for the inline stage (a CPU generator's default); deferred rows add the
    # critical path, which is what the device would wait for. (With both batch paths, a
    # step builds its batch twice: the numbers are slightly pessimistic.)
    rows = [r if isinstance(r, dict) else asdict(r) for r in results]
    by_case = {(r["mode"], r["batch"]): r for r in rows if r["text_stage"] == "inline"}
    out = []
    for mode, batch, target in GOALS:
        r = by_case.get((mode, batch))
        if r is not None:
            out.append(
                {
                    "mode": mode,
                    "batch": batch,
                    "batch_path": r["batch_path"],
                    "target_us_per_step": target,
                    "measured_us_per_step": r["us_per_step"],
                    "met": r["us_per_step"] <= target,
                }
            )
    return out


@contextmanager
def baseline_tree(ref: str) -> Iterator[tuple[Path, str]]:
    """A temporary git worktree of the repository at ``ref`` (and its commit), removed on
    exit."""
    repo = Path(__file__).resolve().parents[1]
    found = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode:
        raise SystemExit(f"--baseline {ref!r} is not a commit of {repo}: {found.stderr.strip()}")
    commit = found.stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="host-overhead-baseline-"))
    tree = folder / "tree"
    add = ["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree), commit]
    subprocess.run(add, check=True)
    try:
        yield tree, commit
    finally:
        remove = ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)]
        subprocess.run(remove, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def run_in_tree(script: str, flags: list[str], tree: Path) -> dict[str, Any]:
    """``script flags --output FILE`` in a subprocess whose PYTHONPATH puts ``tree`` (a
    ``baseline_tree``) first, so the code it imports is that tree's while the harness stays
    ``script``; returns the JSON it wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "baseline.json"
        command = [sys.executable, script, *flags, "--output", str(output)]
        env = dict(os.environ, PYTHONPATH=str(tree))
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"the baseline run failed:\n{done.stdout}\n{done.stderr}")
        return json.loads(output.read_text())


def run_baseline(args, mode: str, tree: Path) -> dict[str, Any]:
    """This script's cases of one mode with the engine of ``tree``: a subprocess whose
    PYTHONPATH puts that tree's ``engine`` package first (the harness stays this one)."""
    flags = [
        *(["--quick"] if args.quick else []),
        *("--modes", mode, "--batches", *map(str, args.batches)),
        *("--text-stages", *args.text_stages, "--prompt-len", str(args.prompt_len)),
        *("--batch-paths", *(args.baseline_batch_paths or args.batch_paths)),
        *("--step-budget", str(args.step_budget), "--min-steps", str(args.min_steps)),
        *("--max-steps", str(args.max_steps), "--threads", str(args.threads)),
        *("--tokenizer-vocab", str(args.tokenizer_vocab), "--cache-dir", str(args.cache_dir)),
        *("--label", f"baseline {args.baseline}"),
    ]
    return run_in_tree(str(Path(__file__).resolve()), flags, tree)


def comparison(before: list[dict], after: list[CaseResult]) -> list[dict[str, Any]]:
    """Per case: us per step with the baseline engine and with this one."""
    key = ("mode", "batch", "text_stage", "batch_path")
    old = {tuple(r[k] for k in key): r for r in before}
    out = []
    for r in after:
        b = old.get((r.mode, r.batch, r.text_stage, r.batch_path))
        if b is not None:
            out.append(
                {
                    "mode": r.mode,
                    "batch": r.batch,
                    "text_stage": r.text_stage,
                    "batch_path": r.batch_path,
                    "baseline_us_per_step": b["us_per_step"],
                    "us_per_step": r.us_per_step,
                    "baseline_sample_tensor_us": b["sample_tensor_us"],
                    "sample_tensor_us": r.sample_tensor_us,
                    "speedup": b["us_per_step"] / r.us_per_step,
                }
            )
    return out


def batch_path_comparison(results: list[CaseResult]) -> list[dict[str, Any]]:
    """Schedule + batch build per step (medians of the timed steps) for cases run with both
    batch paths: the same plans built by each builder."""
    out = []
    for r in results:
        if set(r.build_us) != set(BATCH_PATHS):
            continue
        schedule = r.breakdown_us["schedule"]
        row: dict[str, Any] = {"mode": r.mode, "batch": r.batch, "text_stage": r.text_stage}
        row["schedule_us"] = schedule
        for name, build in r.build_us.items():
            row[name] = {"batch_build_us": build, "schedule_plus_batch_build_us": schedule + build}
        row["batch_build_speedup"] = r.build_us["reference"] / r.build_us["persistent"]
        out.append(row)
    return out


def print_row(r: CaseResult | dict, engine: str = "this") -> None:
    r = argparse.Namespace(**(r if isinstance(r, dict) else asdict(r)))
    b = r.breakdown_us
    parts = " ".join(f"{b[k]:9.0f}" for k in PARTS)
    print(
        f"{engine:10s} {r.mode:12s} {r.text_stage:8s} {r.batch_path:20s} {r.batch:5d} "
        f"{r.us_per_step:10.0f} "
        f"{r.us_per_token:8.1f} {parts} {r.sample_tensor_us:9.0f} {r.critical_us_per_step:9.0f}",
        flush=True,
    )


def print_header() -> None:
    parts = " ".join(f"{k:>9s}" for k in PARTS)
    print(
        f"{'engine':10s} {'mode':12s} {'text':8s} {'batch path':20s} {'batch':>5s} "
        f"{'us/step':>10s} "
        f"{'us/tok':>8s} {parts} "
        f"{'(tensor)':>9s} {'critical':>9s}"
    )


def report(args, results: list[CaseResult], tokenizer) -> dict[str, Any]:
    return {
        "benchmark": "host_overhead",
        "label": args.label,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "model": {
            "spec": asdict(SPEC),
            "logits_width": SPEC.vocab_size,
            "tokenizer_vocab": tokenizer.vocab_size,
            "tokenizer": "byte-level BPE trained on seeded pseudo-words (synthetic_tokenizer)",
        },
        "workload": {
            "prompt_len": args.prompt_len,
            "batches": list(args.batches),
            "text_stages": list(args.text_stages),
            "batch_paths": list(args.batch_paths),
            "modes": {
                name: {"settings": repr(s), "stop_strings": list(stops)}
                for name, (s, stops) in MODES.items()
            },
            "forward": "null: the batch built on the CPU (batch_paths), fixed logits",
        },
        "engine": str(Path(engine.__file__).parent),
        "units": "microseconds; medians over timed decode steps",
        "results": [asdict(r) for r in results],
        "goals": goals(results),
        "batch_paths": batch_path_comparison(results),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (a few seconds)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--batches", nargs="+", type=int, default=None)
    p.add_argument(
        "--text-stages",
        nargs="+",
        choices=list(TEXT_STAGES),
        default=["inline"],
        help="inline: text rendered in the step that sampled it; deferred: one step later; "
        "async: async_scheduling (tokens read, and their text made, one step later)",
    )
    p.add_argument(
        "--batch-paths",
        nargs="+",
        choices=BATCH_PATHS,
        default=["persistent"],
        help="persistent: PersistentBatch (the runner's default); reference: plan_rows + "
        "build_forward_batch (ENGINE_PERSISTENT_BATCH=0)",
    )
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--step-budget", type=int, default=4096, help="steps ~ budget / batch")
    p.add_argument("--min-steps", type=int, default=15)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--tokenizer-vocab", type=int, default=TOKENIZER_VOCAB)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--label", default="")
    p.add_argument(
        "--baseline",
        metavar="REF",
        default=None,
        help="also run every case with the engine at git ref REF (a temporary worktree), "
        "side by side; both go into the JSON with a per-case comparison",
    )
    p.add_argument(
        "--baseline-batch-paths",
        nargs="+",
        choices=BATCH_PATHS,
        default=None,
        help="the baseline's --batch-paths (default: the same); reference for an engine from "
        "before PersistentBatch",
    )
    p.add_argument("--output", type=Path, default=RESULTS)
    p.add_argument(
        "--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "pagedserve-bench"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.batches = args.batches or list(QUICK_BATCHES)
        args.prompt_len, args.min_steps, args.max_steps = 16, 3, 3
        args.tokenizer_vocab = min(args.tokenizer_vocab, 4000)  # trains in a fraction of a second
    args.batches = args.batches or list(BATCHES)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline is None:
        run(args, None)
    else:
        with baseline_tree(args.baseline) as (tree, commit):
            run(args, (tree, commit))


def run(args, baseline: tuple[Path, str] | None) -> None:
    """Every case with this engine; with a baseline tree, each mode's cases with that
    engine first (a subprocess), so the two run side by side under the same load."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.cache_dir, args.tokenizer_vocab)
    results: list[CaseResult] = []
    before: list[dict] = []
    for mode in args.modes:
        if baseline is not None:
            other = run_baseline(args, mode, baseline[0])
            before += [r | {"engine": other["engine"]} for r in other["results"]]
        print_header()
        for row in (r for r in before if r["mode"] == mode):
            print_row(row, engine=args.baseline)
        for batch in args.batches:
            for stage in supported_stages(args.text_stages):
                results.append(run_case(model, tokenizer, mode, batch, args, stage))
                print_row(results[-1])
    for name, rows in (("this", results), (args.baseline, before)):
        for g in goals(rows):
            print(
                f"goal {g['mode']} batch {g['batch']} [{name}]: "
                f"{g['measured_us_per_step']:.0f} us/step (target "
                f"{g['target_us_per_step']:.0f}) {'met' if g['met'] else 'NOT met'}"
            )
    for c in batch_path_comparison(results):
        ref, per = c["reference"], c["persistent"]
        print(
            f"batch paths {c['mode']} {c['text_stage']} batch {c['batch']}: schedule+batch "
            f"{ref['schedule_plus_batch_build_us']:.0f} us (reference) -> "
            f"{per['schedule_plus_batch_build_us']:.0f} us (persistent); batch build "
            f"{c['batch_build_speedup']:.1f}x faster"
        )
    out = report(args, results, tokenizer)
    if baseline is not None:
        out["baseline"] = {
            "ref": args.baseline,
            "commit": baseline[1],
            "engine": before[0]["engine"] if before else None,
            "results": before,
            "goals": goals(before),
        }
        out["comparison"] = comparison(before, results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
