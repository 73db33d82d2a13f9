"""GPU decode/prefill throughput of the engine vs the roofline and transformers' generate_batch.

Models: random fp16 Llama-3-8B and Llama-3.2-1B shapes, built directly in GPU memory with seeded
N(0, 0.02) weights (norms = 1, the demo-model recipe). ``ensure_demo_model`` is used only for
the tokenizer (a carrier folder with the same vocabulary and a 1-layer width-64 body): writing
the 8B model through the demo builder would put 32 GB of float32 safetensors on disk (half the
lent machine's disk) and spend minutes of GPU time generating, writing and reloading them.

Measurements per model, for each op set (``default`` = what ``Model`` and ``DynamicGenerator``
pick: the Numba CUDA kernels on CUDA, decode steps replayed as CUDA graphs; ``eager`` = the
kernels with ENGINE_CUDA_GRAPHS=0, decode-gen rows only; ``torch`` = ENGINE_OPS=torch, the torch
references):

    decode-gen   DynamicGenerator: B jobs with 1k-token prompts are prefilled, then
                 ``--warmup-steps`` iterate() calls, then ``--decode-steps`` timed iterate()
                 calls, each one decode step of B tokens (scheduling, batch building, forward,
                 sampling, detokenising: everything a user waits for).
    decode-fwd   Model.forward alone on one prebuilt decode batch (B sequences, 1k cached
                 tokens each, zeroed K/V: same bytes read), timed with CUDA events.
    prefill      DynamicGenerator: B unique 2k-token prompts, max_new_tokens=1, wall time.
    roofline     weights (+ K/V of the batch) read once per step / measured copy bandwidth
                 (1 GiB device-to-device copy, read + write counted).
    same-load    (default op set) our generator vs transformers' generate_batch on the SAME
                 weights and prompts: B=32 prompts of 1k tokens, greedy, --hf-new-tokens new
                 tokens; decode-phase tok/s from per-token timestamps (window in which every
                 request has finished prefill and none has finished), plus end-to-end tok/s.

Prints a table and writes JSON (default bench/results/gpu_decode.json). Without a CUDA GPU it
exits with status 2 unless ``--dry-run`` (CPU, a tiny float32 model, ENGINE_OPS=torch, contexts
of 32 tokens, batches 1 and 4, 4 decode steps, a 64 MiB CPU copy for the "bandwidth").

    python bench/gpu_decode.py                              # both models, everything
    python bench/gpu_decode.py --models llama3-8b           # one model per call ...
    python bench/gpu_decode.py --models llama3.2-1b --merge # ... --merge keeps the rest
    python bench/gpu_decode.py --dry-run --output /tmp/gpu_decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("gpu_decode")

RESULTS = Path(__file__).parent / "results" / "gpu_decode.json"
DRY_RUN_RESULTS = Path(tempfile.gettempdir()) / "gpu_decode_dry_run.json"
DEFAULT_CACHE_DIR = Path(tempfile.gettempdir()) / "pagedserve-gpu-bench"
INIT_STD = 0.02
OPS_SETS = ("default", "eager", "torch")
# default: what Model and DynamicGenerator pick (on CUDA: the Numba kernels, decode steps in
# CUDA graphs); eager: the kernels without graphs (decode-gen only: the other rows would repeat
# default's); torch: ENGINE_OPS=torch, the torch references (no graphs).
OPS_ENVIRONMENT = {
    "default": {},
    "eager": {"ENGINE_CUDA_GRAPHS": "0"},
    "torch": {"ENGINE_OPS": "torch"},
}
GOAL_ROOFLINE_FRACTION = 0.80  # batch-1 decode of the 8B shape
GOAL_VS_TRANSFORMERS = 3.0  # batch-32 decode vs generate_batch
PRIMARY_MODEL = "llama3-8b"


@dataclass(frozen=True)
class Workload:
    decode_batches: tuple[int, ...] = (1, 8, 32, 128)
    decode_context: int = 1024
    decode_steps: int = 64
    warmup_steps: int = 8
    prefill_batches: tuple[int, ...] = (1, 8)
    prefill_len: int = 2048
    hf_batch: int = 32
    hf_new_tokens: int = 128
    page_size: int = 16
    chunk_size: int = 2048
    copy_bytes: int = 1 << 30
    seed: int = 0
    quant_batch: int = 32  # KV-cache modes (bench/kv_quant_decode.py): batch x context
    quant_context: int = 4096
    # (fp16 first: the others' ratios are to it; kv_quant_decode.MODES)
    quant_modes: tuple[str, ...] = ("fp16", "q8", "q6", "q4", "q4+sinks", "q4+sinks+recent")


DRY_WORKLOAD = Workload(
    decode_batches=(1, 4),
    decode_context=32,
    decode_steps=4,
    warmup_steps=1,
    prefill_batches=(1, 4),
    prefill_len=64,
    hf_batch=4,
    hf_new_tokens=8,
    copy_bytes=64 << 20,
    quant_batch=4,
    quant_context=32,
)


def gpu_specs() -> dict[str, Any]:
    from engine.demo import DemoModelSpec

    return {
        # Llama-3-8B: untied 128,256-token embeddings.
        "llama3-8b": DemoModelSpec(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
        ),
        # Llama-3.2-1B: tied embeddings (default rope, not llama3 scaling: shapes are what count).
        "llama3.2-1b": DemoModelSpec(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    }


def dry_specs() -> dict[str, Any]:
    from engine.demo import DemoModelSpec

    return {
        "tiny": DemoModelSpec(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,  # head_dim 32: one group of the quantized KV cache modes
            num_key_value_heads=1,
            max_position_embeddings=1024,
        )
    }


# ---------------------------------------------------------------------------------------------
# Timing


@dataclass
class Elapsed:
    seconds: float = math.nan


class Timer:
    """CUDA events around the timed region on CUDA (after a synchronize), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def measure(self) -> Iterator[Elapsed]:
        elapsed = Elapsed()
        self.synchronize()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield elapsed
            torch.cuda.synchronize()  # kernels on any stream (Numba's too) are done
            end.record()
            end.synchronize()
            elapsed.seconds = start.elapsed_time(end) / 1000.0
        else:
            began = time.perf_counter()
            yield elapsed
            elapsed.seconds = time.perf_counter() - began


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# Table


HEADER = (
    f"{'model':12s} {'ops':7s} {'measure':12s} {'batch':>5s} {'ctx':>5s} "
    f"{'tok/s':>10s} {'ms/step':>9s} {'roofline':>8s}"
)


def print_row(model: str, ops: str, measure: str, row: dict[str, Any]) -> None:
    fraction = row.get("roofline_fraction")
    roof = f"{100 * fraction:7.1f}%" if fraction is not None else f"{'-':>8s}"
    ms = row.get("ms_per_step")
    ms_text = f"{ms:9.2f}" if ms is not None else f"{'-':>9s}"
    tps = row.get("tokens_per_s")
    tps_text = f"{tps:10.1f}" if tps is not None else f"{'-':>10s}"
    print(
        f"{model:12s} {ops:7s} {measure:12s} {row.get('batch', '-')!s:>5s} "
        f"{row.get('context', '-')!s:>5s} {tps_text} {ms_text} {roof}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# Models


def build_network(spec: Any, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """(ModelConfig, LlamaForCausalLM) with seeded random weights, built on ``device``."""
    from engine.config import ModelConfig
    from engine.demo import hf_config
    from engine.model.llama import LlamaForCausalLM

    config = ModelConfig.from_dict(hf_config(spec))
    network = LlamaForCausalLM(config, dtype, device)
    generator = torch.Generator(device=device).manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in network.named_parameters():  # tied lm_head is listed once
            if name.endswith("norm"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    return config, network.eval()


def load_tokenizer(vocab_size: int, cache_dir: Path) -> Any:
    """The demo tokenizer for this vocabulary, from a tiny carrier demo-model folder."""
    from engine import Tokenizer
    from engine.demo import DemoModelSpec, ensure_demo_model

    carrier = DemoModelSpec(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return Tokenizer.from_pretrained(ensure_demo_model(carrier, cache_dir=cache_dir))


@contextlib.contextmanager
def ops_env(ops: str) -> Iterator[None]:
    """The environment of an op set, while its Model and generators are built."""
    saved = {name: os.environ.get(name) for name in OPS_ENVIRONMENT[ops]}
    os.environ.update(OPS_ENVIRONMENT[ops])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_model(config: Any, network: Any, page_size: int) -> Any:
    from engine import Model
    from engine.model.runner import warm_up

    model = Model(config, network)
    if model.ops.compiles and model.device.type == "cuda":
        warm_up(model, model.ops, page_size)  # compile every kernel specialisation untimed
    return model


# ---------------------------------------------------------------------------------------------
# Roofline


def weight_bytes_per_step(spec: Any, element_size: int) -> int:
    """Weights read by one decode step: everything but the embedding gather (a tied embedding
    is still read whole as the LM head)."""
    gathered = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    return (spec.num_parameters() - gathered) * element_size


def copy_bandwidth(device: torch.device, nbytes: int, timer: Timer, repeats: int = 10) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up
    with timer.measure() as elapsed:
        for _ in range(repeats):
            dst.copy_(src)
    moved = 2 * nbytes * repeats  # read + write
    del src, dst
    free_memory(device)
    return {
        "bytes_copied": nbytes,
        "repeats": repeats,
        "seconds": elapsed.seconds,
        "bytes_per_s": moved / elapsed.seconds,
        "note": "device-to-device copy, read + write bytes counted",
    }


def add_roofline(row: dict, weight_bytes: int, kv_per_token: int, bandwidth: float) -> dict:
    context = row.get("mean_context", row["context"])
    step_bytes = weight_bytes + round(row["batch"] * context * kv_per_token)
    roofline_tps = row["batch"] * bandwidth / step_bytes
    row["bytes_per_step"] = step_bytes
    row["roofline_tokens_per_s"] = roofline_tps
    row["roofline_fraction"] = row["tokens_per_s"] / roofline_tps
    return row


# ---------------------------------------------------------------------------------------------
# Engine measurements


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(count)]


def new_generator(model: Any, tokenizer: Any, batch: int, tokens_per_seq: int, wl: Workload):
    from engine import DynamicGenerator, PagedCache

    pages = batch * -(-tokens_per_seq // wl.page_size) + 1
    cache = PagedCache(model, max_num_tokens=pages * wl.page_size, page_size=wl.page_size)
    return DynamicGenerator(
        model, cache, tokenizer, max_batch_size=batch, max_chunk_size=wl.chunk_size
    )


def enqueue(generator: Any, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    from engine import DynamicJob, SamplerSettings

    jobs = [
        DynamicJob(ids, new_tokens, gen_settings=SamplerSettings.greedy(), stop_conditions=[])
        for ids in prompts
    ]
    for job in jobs:
        generator.enqueue(job)
    return jobs


def generator_decode(model: Any, tokenizer: Any, batch: int, wl: Workload, timer: Timer) -> dict:
    """Prefill B contexts through the generator, then time decode iterate() calls."""
    ctx = wl.decode_context
    # Early jobs decode while later ones still prefill: leave room so none finishes in the window.
    prefill_steps = -(-batch * ctx // wl.chunk_size)
    new_tokens = prefill_steps + wl.warmup_steps + wl.decode_steps + 2
    generator = new_generator(model, tokenizer, batch, ctx + new_tokens, wl)
    prompts = random_prompts(batch, ctx, tokenizer.vocab_size, wl.seed + batch)
    jobs = enqueue(generator, prompts, new_tokens)
    while any(not job.new_token_ids for job in jobs):
        generator.iterate()
    for _ in range(wl.warmup_steps):
        generator.iterate()
    before = sum(len(job.new_token_ids) for job in jobs)
    # Contexts grow by one token a step; the roofline uses the mean over the window.
    mean_context = ctx + before / batch + (wl.decode_steps - 1) / 2
    with timer.measure() as elapsed:
        for _ in range(wl.decode_steps):
            generator.iterate()
    produced = sum(len(job.new_token_ids) for job in jobs) - before
    graphs = generator.runner.decode_graphs
    for job in jobs:
        generator.cancel(job, emit_result=False)
    return {
        "cuda_graphs": "captured" if graphs and graphs.capture else "eager" if graphs else "off",
        "batch": batch,
        "context": ctx,
        "mean_context": mean_context,
        "steps": wl.decode_steps,
        "tokens": produced,
        "seconds": elapsed.seconds,
        "tokens_per_s": produced / elapsed.seconds,
        "ms_per_step": 1000 * elapsed.seconds / wl.decode_steps,
    }


def forward_decode(model: Any, batch: int, wl: Workload, timer: Timer) -> dict:
    """Time Model.forward on one decode batch: B sequences with ``ctx`` cached tokens each."""
    from engine.batch import AttentionPlan, SequenceInput, build_forward_batch

    ctx, size = wl.decode_context, wl.page_size
    per_seq = -(-(ctx + 1) // size)
    kv = model.allocate_kv(batch * per_seq, size)
    seqs = [
        SequenceInput([4 + b % 100], num_cached=ctx, pages=range(b * per_seq, (b + 1) * per_seq))
        for b in range(batch)
    ]
    forward_batch = build_forward_batch(seqs, size, model.device)

    def step() -> None:
        forward_batch.attention = AttentionPlan()  # planned per forward, as a fresh batch is
        model.forward(forward_batch, kv)

    for _ in range(wl.warmup_steps):
        step()
    with timer.measure() as elapsed:
        for _ in range(wl.decode_steps):
            step()
    return {
        "batch": batch,
        "context": ctx,
        "steps": wl.decode_steps,
        "tokens": batch * wl.decode_steps,
        "seconds": elapsed.seconds,
        "tokens_per_s": batch * wl.decode_steps / elapsed.seconds,
        "ms_per_step": 1000 * elapsed.seconds / wl.decode_steps,
    }


def generator_prefill(model: Any, tokenizer: Any, batch: int, wl: Workload, timer: Timer) -> dict:
    """B unique prompts of ``prefill_len`` tokens, one new token each; after a warm-up prompt."""
    length = wl.prefill_len
    generator = new_generator(model, tokenizer, batch + 1, length + 1, wl)
    vocab = tokenizer.vocab_size
    enqueue(generator, random_prompts(1, length, vocab, wl.seed + 7919), 1)  # warm-up
    while generator.num_remaining_jobs():
        generator.iterate()
    cached_before = generator.stats()["cached_tokens_total"]
    prompts = random_prompts(batch, length, vocab, wl.seed + 1000 + batch)
    with timer.measure() as elapsed:
        enqueue(generator, prompts, 1)
        while generator.num_remaining_jobs():
            generator.iterate()
    tokens = batch * length
    return {
        "batch": batch,
        "context": length,
        "tokens": tokens,
        "seconds": elapsed.seconds,
        "tokens_per_s": tokens / elapsed.seconds,
        "ms_per_step": None,
        "cached_prompt_tokens": generator.stats()["cached_tokens_total"] - cached_before,
    }


# ---------------------------------------------------------------------------------------------
# Same workload: our generator vs transformers' generate_batch


def decode_phase(stamps: list[list[float]]) -> dict:
    """Decode rate from per-request token timestamps, in the window where every request has its
    first token (prefill done) and, if possible, none has finished."""
    stamps = [s for s in stamps if s]
    if not stamps:
        return {"tokens": 0, "seconds": None, "tokens_per_s": None, "all_active": False}
    start = max(s[0] for s in stamps)
    end, all_active = min(s[-1] for s in stamps), True
    if end <= start:
        end, all_active = max(s[-1] for s in stamps), False
    tokens = sum(1 for s in stamps for t in s if start < t <= end)
    seconds = end - start
    rate = tokens / seconds if seconds > 0 and tokens else None
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": rate, "all_active": all_active}


def ours_same_workload(
    model: Any, tokenizer: Any, prompts: list[list[int]], wl: Workload, timer: Timer
) -> dict:
    generator = new_generator(model, tokenizer, len(prompts), len(prompts[0]) + 64, wl)
    warm = random_prompts(len(prompts), len(prompts[0]), tokenizer.vocab_size, wl.seed + 31)
    enqueue(generator, warm, 4)  # warm-up: same shapes, other tokens (no prefix-cache hits)
    while generator.num_remaining_jobs():
        generator.iterate()
    generator = new_generator(
        model, tokenizer, len(prompts), len(prompts[0]) + wl.hf_new_tokens, wl
    )
    stamps: dict[int, list[float]] = {}
    timer.synchronize()
    began = time.perf_counter()
    jobs = enqueue(generator, prompts, wl.hf_new_tokens)
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if "token_ids" in result:
                stamps.setdefault(result["serial"], []).append(time.perf_counter())
    seconds = time.perf_counter() - began
    produced = sum(len(job.new_token_ids) for job in jobs)
    return {
        "batch": len(prompts),
        "context": len(prompts[0]),
        "new_tokens": wl.hf_new_tokens,
        "tokens": produced,
        "e2e_seconds": seconds,
        "e2e_tokens_per_s": produced / seconds,
        "all_prefilled_s": _all_prefilled(list(stamps.values()), began),
        "decode_phase": decode_phase(list(stamps.values())),
        "outputs": [job.new_token_ids for job in jobs],
    }


def build_hf_model(spec: Any, network: Any, dtype: torch.dtype, device: torch.device) -> Any:
    """transformers' LlamaForCausalLM with our weights copied in (fused qkv/gate_up split)."""
    import transformers

    from engine.demo import hf_config

    config = transformers.LlamaConfig(**hf_config(spec))
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(
            config, dtype=dtype, attn_implementation="sdpa"
        )
    copy_weights(network, hf)
    return hf.eval()


def copy_weights(network: Any, hf: Any) -> None:
    state = hf.state_dict()
    targets = network.weight_targets()
    with torch.no_grad():
        for name, target in targets.items():
            dest = state[name]
            src = target.param
            if target.offset is not None:
                src = src.narrow(0, target.offset, dest.shape[0])
            dest.copy_(src)
        if network.cfg.tie_word_embeddings and "lm_head.weight" in state:
            state["lm_head.weight"].copy_(network.embed)  # a no-op when transformers tied them
    untouched = set(state) - set(targets) - {"lm_head.weight"}
    if untouched:
        raise RuntimeError(f"transformers tensors not filled from our weights: {sorted(untouched)}")


def compare_logits(model: Any, hf: Any, length: int, seed: int) -> dict:
    """Our Model.logits vs transformers' forward on one random prompt."""
    ids = random_prompts(1, length, model.config.vocab_size, seed)[0]
    ours = model.logits(ids)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids], device=model.device)).logits[0].float()
    return {
        "prompt_tokens": length,
        "max_abs_diff": float((ours - theirs).abs().max()),
        "logit_std": float(theirs.std()),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()),
    }


def transformers_same_workload(hf: Any, prompts: list[list[int]], wl: Workload, vocab: int) -> dict:
    """generate_batch twice (warm-up on other tokens, then timed) with one persistent manager."""
    import transformers

    def config() -> Any:
        return transformers.GenerationConfig(
            max_new_tokens=wl.hf_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )

    warm = random_prompts(len(prompts), len(prompts[0]), vocab, wl.seed + 31)
    on_gpu = hf.device.type == "cuda"
    # On GPU: transformers' own sizing (KV cache from free memory) and warm-up (CUDA graphs).
    # On CPU (dry run) both would take ~40 s: a small cache and no warm-up instead.
    cb_config = None if on_gpu else cpu_cb_config(len(prompts), len(prompts[0]), wl)
    options = {
        "persistent_manager": True,
        "warmup": on_gpu,
        "continuous_batching_config": cb_config,
    }
    hf.generate_batch(warm, generation_config=config(), **options)
    if hf.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    results = hf.generate_batch(
        prompts, generation_config=config(), record_timestamps=True, **options
    )
    seconds = time.perf_counter() - began
    attn_implementation = hf.config._attn_implementation  # what the manager switched to
    hf.destroy_cached_continuous_batching_manager()
    ordered = [results[key] for key in sorted(results, key=_request_index)]
    stamps = [r.timestamps or [] for r in ordered]
    produced = sum(len(r.generated_tokens) for r in ordered)
    if produced == 0:
        raise RuntimeError("transformers generate_batch produced no tokens")
    return {
        "batch": len(prompts),
        "context": len(prompts[0]),
        "new_tokens": wl.hf_new_tokens,
        "tokens": produced,
        "e2e_seconds": seconds,
        "e2e_tokens_per_s": produced / seconds,
        "all_prefilled_s": _all_prefilled(stamps, began),
        "decode_phase": decode_phase(stamps),
        "attn_implementation": attn_implementation,
        "outputs": [list(r.generated_tokens) for r in ordered],
    }


def cpu_cb_config(batch: int, prompt_len: int, wl: Workload) -> Any:
    import transformers

    page = 256  # transformers' default page size
    blocks = batch * -(-(prompt_len + wl.hf_new_tokens) // page) + 4
    return transformers.ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=512)


def _all_prefilled(stamps: list[list[float]], began: float) -> float | None:
    """Seconds from the start until every request had its first token."""
    firsts = [s[0] for s in stamps if s]
    return max(firsts) - began if firsts else None


def _request_index(request_id: str) -> tuple[int, str]:
    digits = "".join(ch for ch in str(request_id) if ch.isdigit())
    return (int(digits) if digits else -1, str(request_id))


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far the greedy outputs agree (random fp16 models make near-ties; this is a sanity
    check, not a gate). Our sampler never picks ids >= the tokenizer's vocabulary."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=False):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        prefixes.append(n)
    return {
        "requests": len(prefixes),
        "identical": sum(1 for a, b in zip(ours, theirs, strict=False) if a == b),
        "mean_common_prefix": sum(prefixes) / max(1, len(prefixes)),
    }


# ---------------------------------------------------------------------------------------------
# Per-model driver


@dataclass
class Context:
    device: torch.device
    dtype: torch.dtype
    workload: Workload
    timer: Timer
    bandwidth: float
    cache_dir: Path
    ops_sets: tuple[str, ...]
    transformers: bool


MEASURE_LABELS = {"decode_generator": "decode-gen", "decode_forward": "decode-fwd"}


def measure_ops(name: str, ops: str, model: Any, tokenizer: Any, ctx: Context, roof: dict) -> dict:
    """Decode (generator and forward) and prefill rows for one model and op set."""
    wl, timer = ctx.workload, ctx.timer
    runs = {"decode_generator": lambda b: generator_decode(model, tokenizer, b, wl, timer)}
    if ops != "eager":  # graphs change only the generator's decode steps
        runs["decode_forward"] = lambda b: forward_decode(model, b, wl, timer)
    out: dict[str, Any] = {"ops_name": model.ops.name}
    for key, run in runs.items():
        out[key] = []
        for batch in wl.decode_batches:
            row = add_roofline(run(batch), roof["weights"], roof["kv_per_token"], ctx.bandwidth)
            out[key].append(row)
            print_row(name, ops, MEASURE_LABELS[key], row)
            free_memory(ctx.device)
    if ops == "eager":
        return out
    out["prefill"] = []
    for batch in wl.prefill_batches:
        row = generator_prefill(model, tokenizer, batch, wl, timer)
        out["prefill"].append(row)
        print_row(name, ops, "prefill", row)
        free_memory(ctx.device)
    return out


def print_same_workload(name: str, who: str, result: dict) -> None:
    base = {"batch": result["batch"], "context": result["context"]}
    print_row(name, who, "e2e", {**base, "tokens_per_s": result["e2e_tokens_per_s"]})
    print_row(name, who, "decode-phase", {**base, **result["decode_phase"]})


def ours_vs_hf_setup(
    name: str, spec: Any, config: Any, network: Any, tokenizer: Any, ctx: Context
) -> tuple[dict, Any, dict]:
    """Our side of the same workload, then the transformers copy of the weights and a logits
    check; returns (ours, hf_model, logits_check). Our Model objects are gone on return."""
    wl = ctx.workload
    model = make_model(config, network, wl.page_size)
    prompts = same_workload_prompts(wl, tokenizer.vocab_size)
    ours = ours_same_workload(model, tokenizer, prompts, wl, ctx.timer)
    print_same_workload(name, model.ops.name, ours)
    free_memory(ctx.device)
    hf = build_hf_model(spec, network, ctx.dtype, ctx.device)
    check = compare_logits(model, hf, min(64, wl.decode_context), wl.seed + 77)
    logger.info("%s: logits check vs transformers %s", name, check)
    return ours, hf, check


def same_workload_prompts(wl: Workload, vocab: int) -> list[list[int]]:
    return random_prompts(wl.hf_batch, wl.decode_context, vocab, wl.seed + 4242)


def compare_with_transformers(ours: dict, theirs: dict, check: dict, default_ops: dict) -> dict:
    ours_out, theirs_out = ours.pop("outputs"), theirs.pop("outputs")
    ours_rate = ours["decode_phase"]["tokens_per_s"]
    theirs_rate = theirs["decode_phase"]["tokens_per_s"]
    sweep = next(
        (r for r in default_ops.get("decode_generator", []) if r["batch"] == theirs["batch"]), None
    )
    return {
        "logits_check": check,
        "ours": ours,
        "transformers": theirs,
        "greedy_agreement": token_agreement(ours_out, theirs_out),
        "decode_phase_ratio": _ratio(ours_rate, theirs_rate),
        "e2e_ratio": _ratio(ours["e2e_tokens_per_s"], theirs["e2e_tokens_per_s"]),
        "decode_sweep_ratio": _ratio(sweep["tokens_per_s"] if sweep else None, theirs_rate),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_model(name: str, spec: Any, ctx: Context) -> dict:
    from engine.cache.kv_cache import kv_bytes_per_token

    logger.info(
        "%s: building %.2fB parameters on %s", name, spec.num_parameters() / 1e9, ctx.device
    )
    config, network = build_network(spec, ctx.dtype, ctx.device)
    tokenizer = load_tokenizer(spec.vocab_size, ctx.cache_dir)
    element = torch.empty((), dtype=ctx.dtype).element_size()
    roof = {
        "weights": weight_bytes_per_step(spec, element),
        "kv_per_token": kv_bytes_per_token(config, ctx.dtype),
    }
    result: dict[str, Any] = {
        "spec": dataclasses.asdict(spec),
        "parameters": spec.num_parameters(),
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "construction": "in memory: engine LlamaForCausalLM, seeded N(0, 0.02), norms 1",
        "weight_bytes_per_step": roof["weights"],
        "kv_bytes_per_token": roof["kv_per_token"],
        "tokenizer_vocab": tokenizer.vocab_size,
        "ops": {},
    }
    for ops in ctx.ops_sets:
        with ops_env(ops):
            model = make_model(config, network, ctx.workload.page_size)
            result["ops"][ops] = measure_ops(name, ops, model, tokenizer, ctx, roof)
            if ops == "default":
                result["kv_quant"] = kv_quant_section(model, ctx)
        del model
        free_memory(ctx.device)
    if ctx.transformers:
        ours, hf, check = ours_vs_hf_setup(name, spec, config, network, tokenizer, ctx)
        del network  # free our copy before transformers sizes its KV cache from free memory
        free_memory(ctx.device)
        theirs = transformers_same_workload(
            hf,
            same_workload_prompts(ctx.workload, tokenizer.vocab_size),
            ctx.workload,
            spec.vocab_size,
        )
        print_same_workload(name, "hf", theirs)
        result["transformers"] = compare_with_transformers(
            ours, theirs, check, result["ops"].get("default", {})
        )
        del hf
    free_memory(ctx.device)
    return result


def kv_quant_section(model: Any, ctx: Context) -> dict:
    """Bytes per token and decode tok/s per KV-cache mode (bench/kv_quant_decode.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kv_quant_decode import measure_kv_quant

    return measure_kv_quant(model, ctx.workload, ctx.timer, lambda: free_memory(ctx.device))


# ---------------------------------------------------------------------------------------------
# Report


def goals(models: dict[str, dict]) -> dict:
    """The issue's goals, judged on the 8B model (or the first model present)."""
    primary = PRIMARY_MODEL if PRIMARY_MODEL in models else next(iter(models), None)
    entry = models.get(primary, {}) if primary else {}
    sweep = entry.get("ops", {}).get("default", {}).get("decode_generator", [])
    batch1 = next((r for r in sweep if r["batch"] == 1), None)
    fraction = batch1["roofline_fraction"] if batch1 else None
    ratio = entry.get("transformers", {}).get("decode_phase_ratio")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kv_quant_decode import kv_quant_goals

    kv_goals = {
        key: _goal(target, measured, "kv_quant rows, default op set")
        for key, (target, measured) in kv_quant_goals(entry.get("kv_quant")).items()
    }
    return {
        **kv_goals,
        "model": primary,
        "batch1_decode_roofline_fraction": _goal(
            GOAL_ROOFLINE_FRACTION, fraction, "decode_generator, default op set, batch 1"
        ),
        "batch32_decode_vs_transformers": _goal(
            GOAL_VS_TRANSFORMERS,
            ratio,
            "decode-phase tok/s, our generator / transformers generate_batch, same prompts",
        ),
    }


def _goal(target: float, measured: float | None, source: str) -> dict:
    met = None if measured is None else measured >= target
    return {"target": target, "measured": measured, "met": met, "source": source}


def device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": f"cpu ({platform.processor() or platform.machine()}), dry run"}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "total_memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
    }


def versions(transformers: bool = True) -> dict:
    """Python, torch, CUDA, numba and numba-cuda versions (+ transformers': imports it)."""

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numba": dist("numba"),
        "numba_cuda": dist("numba-cuda"),
    }
    if transformers:
        import transformers as hf

        found["transformers"] = hf.__version__
    return found


def print_goals(report_goals: dict) -> None:
    for key in [k for k in report_goals if k != "model"]:
        goal = report_goals[key]
        measured = "-" if goal["measured"] is None else f"{goal['measured']:.3f}"
        verdict = {True: "MET", False: "NOT MET", None: "not measured"}[goal["met"]]
        print(f"goal {key} ({report_goals['model']}): {measured} vs >= {goal['target']}: {verdict}")


def merge_models(previous: dict[str, dict], current: dict[str, dict]) -> dict[str, dict]:
    """Models (and, within a model, op sets and the transformers section) measured now replace
    the previous ones; everything else is kept."""
    merged = dict(previous)
    for name, entry in current.items():
        old = previous.get(name, {})
        merged[name] = {**old, **entry, "ops": {**old.get("ops", {}), **entry["ops"]}}
    return merged


def write_report(report: dict, output: Path, merge: bool) -> None:
    if merge and output.is_file():
        previous = json.loads(output.read_text())
        if previous.get("dry_run") == report["dry_run"]:
            report["models"] = merge_models(previous.get("models", {}), report["models"])
        else:
            logger.warning(
                "--merge: %s is from a %s run; not merged",
                output,
                "dry" if previous.get("dry_run") else "GPU",
            )
    report["goals"] = goals(report["models"])
    print_goals(report["goals"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {output}", flush=True)


# ---------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny model, ENGINE_OPS=torch: exercise every code path",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"JSON path (default {RESULTS}; with --dry-run {DRY_RUN_RESULTS})",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="where ensure_demo_model keeps the tokenizer carrier folders",
    )
    parser.add_argument(
        "--models", default=None, help="comma list of llama3-8b,llama3.2-1b (default: both)"
    )
    parser.add_argument(
        "--ops",
        default=",".join(OPS_SETS),
        help="comma list of op sets: default (kernels + CUDA graphs), eager, torch",
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep models already in --output that this run does not measure",
    )
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--hf-new-tokens", type=int, default=None)
    parser.add_argument("--decode-batches", default=None, help="comma list, e.g. 1,8,32,128")
    parser.add_argument("--prefill-batches", default=None, help="comma list, e.g. 1,8")
    parser.add_argument(
        "--kv-modes", default=None, help="KV-cache modes, fp16 first, e.g. fp16,q4 (default: all)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.output is None:  # a dry run never overwrites the real results
        args.output = DRY_RUN_RESULTS if args.dry_run else RESULTS
    return args


def workload_from(args: argparse.Namespace) -> Workload:
    base = DRY_WORKLOAD if args.dry_run else Workload()
    changes: dict[str, Any] = {}
    for field in ("decode_steps", "warmup_steps", "hf_new_tokens"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    for field in ("decode_batches", "prefill_batches"):
        if getattr(args, field):
            changes[field] = tuple(int(x) for x in getattr(args, field).split(","))
    if args.kv_modes:
        modes = tuple(m.strip() for m in args.kv_modes.split(",") if m.strip())
        if modes[:1] != ("fp16",):
            raise SystemExit(f"--kv-modes {args.kv_modes!r}: fp16 first (the ratios' base)")
        changes["quant_modes"] = modes
    return dataclasses.replace(base, **changes)


def select_models(args: argparse.Namespace) -> dict[str, Any]:
    specs = dry_specs() if args.dry_run else gpu_specs()
    if not args.models:
        return specs
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = sorted(set(names) - set(specs))
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; choose from {sorted(specs)}")
    return {name: specs[name] for name in names}


def make_context(args: argparse.Namespace) -> tuple[Context, dict]:
    """The run context and the copy-bandwidth measurement its roofline uses."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    wl = workload_from(args)
    timer = Timer(device)
    ops_sets = tuple(o.strip() for o in args.ops.split(",") if o.strip())
    bad = sorted(set(ops_sets) - set(OPS_SETS))
    if bad:
        raise SystemExit(f"unknown --ops {bad}; choose from {list(OPS_SETS)}")
    bandwidth = copy_bandwidth(device, wl.copy_bytes, timer)
    logger.info("copy bandwidth %.1f GB/s", bandwidth["bytes_per_s"] / 1e9)
    return Context(
        device=device,
        dtype=torch.float32 if args.dry_run else torch.float16,
        workload=wl,
        timer=timer,
        bandwidth=bandwidth["bytes_per_s"],
        cache_dir=args.cache_dir,
        ops_sets=ops_sets,
        transformers=not args.skip_transformers,
    ), bandwidth


METHODS = {
    "decode_generator": "DynamicGenerator.iterate() decode steps after the B prompts are "
    "prefilled and --warmup-steps more steps; wall time (CUDA events after a synchronize)",
    "decode_forward": "Model.forward on one prebuilt decode batch (B sequences, `context` "
    "cached tokens, zeroed K/V), CUDA events; no scheduling, batch building or sampling",
    "prefill": "DynamicGenerator, B unique prompts, max_new_tokens=1, after one warm-up prompt",
    "roofline": "(weights read per step + B * context * K/V bytes per token) / copy bandwidth; "
    "embedding gather excluded, a tied embedding counted once as the LM head",
    "transformers": "same weights and prompts; generate_batch (greedy, EOS off) after a warm-up "
    "call on other prompts with the same persistent manager; decode_phase from per-token "
    "timestamps in the window where all requests are past prefill and none has finished; "
    "e2e = wall time of the timed call, prefill included (for transformers also its manager "
    "thread start/stop); our side runs the same prompts through DynamicGenerator",
    "kv_quant": "per KV-cache mode (fp16/q8/q6/q4, q4 with sink pages, and with recent pages "
    "too), default op set: "
    "bytes per token, tokens in fp16's bytes, Model.forward and paged_attention alone (every "
    "layer) on one decode batch of quant_batch x quant_context over random K/V; see "
    "bench/kv_quant_decode.py",
    "ops": "default = the op set Model picks (Numba CUDA kernels on CUDA) with decode steps in "
    "CUDA graphs; eager = the same kernels with ENGINE_CUDA_GRAPHS=0 (decode-gen rows only); "
    "torch = ENGINE_OPS=torch (torch references); matmuls are torch/cuBLAS in all",
}

NO_GPU_MESSAGE = (
    "gpu_decode.py: no CUDA GPU is available; this benchmark needs one (an H100/H200). "
    "Run with --dry-run to exercise it on CPU with a tiny model."
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["ENGINE_OPS"] = "torch"  # the torch references, as on a machine without CUDA
    models = select_models(args)
    ctx, bandwidth = make_context(args)
    report: dict[str, Any] = {
        "benchmark": "gpu_decode",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "device": device_info(ctx.device),
        "versions": versions(),
        # the engine switches this run was started with (baselines set them)
        "environment": {
            k: os.environ.get(k)
            for k in ("ENGINE_NUMBA_LAUNCH", "ENGINE_PREFILL_ATTENTION", "ENGINE_CUDA_GRAPHS")
        },
        "workload": dataclasses.asdict(ctx.workload),
        "copy_bandwidth": bandwidth,
        "methods": METHODS,
        "models": {},
    }
    print(HEADER, flush=True)
    for name, spec in models.items():
        report["models"][name] = run_model(name, spec, ctx)
    write_report(report, args.output, args.merge)
    return 0


if __name__ == "__main__":
    sys.exit(main())
