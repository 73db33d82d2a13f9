"""Host cost of launching the engine's Numba CUDA kernels, per launch mode, against the torch
references of the same ops; and the sampling paths at batch 64 x the Llama-3 vocabulary.

Why: an eager decode step spent most of its time on the host launching kernels, and a sampled
(top-k/top-p) decode step at batch 64 spent ~20 ms somewhere. This script times each launch
function alone, at Llama-3.2-1B shapes (hidden 2048, 32 heads, 8 KV heads, head_dim 64,
intermediate 8192, fp16, pages of 16 tokens, vocab 128256).

Per launch function and shape (decode batch 1 and 64 with 1024-token contexts, prefill of one
2048-token prompt; the quantized-page ops at the decode shapes only):

    first ms  the first call (compiles on a fresh process; the torch ops: their first call);
    host us   N back-to-back calls timed with perf_counter, before the synchronize, / N: what
              the host spends per launch (argument checks, packing, the launch itself);
    wall us   the same N calls including the final torch.cuda.synchronize(), / N: the host
              cost or the device time, whichever is longer (the queue overlaps them).

N is ``--iters`` (200), cut for slow calls so that a row takes about ``--row-budget``
seconds. Inputs are built as the model builds them (q/k/v: split views of one fused qkv
tensor; the batch and its pages from ``engine.batch.build_forward_batch``) and reused by every
call, so each call pays what a layer pays in a forward whose attention plan is made (the
plan, like the torch reference's attention groups, is built once per forward).

The torch reference rows (``*_reference``, mode ``torch``) time the op set's reference
functions (engine/ops.py ``TORCH_OPS``) the same way. Sampling rows, at batch 1 and 64 of
float32 logits (randn * 3), top_k 50, top_p 0.9, temperature 0.8 in every row (greedy rows:
temperature 0): ``greedy_cuda`` and ``sample_cuda`` (the launches; uniforms float64 on the
device), ``SamplerState.sample_on_device`` with the kernels (what the generator calls each
decode step: its logit edits, one host draw per row and their upload, ``sample_cuda``), and
the torch fast path ``sampling_fast._choose(..., kernels=False)`` (mode ``torch``; it reads
device values on the host). Their ``synced ms`` is the median of calls each followed by a
synchronize.

Launch modes: the engine reads ``ENGINE_NUMBA_LAUNCH`` (engine/cuda/fast_launch.py; ``fast``:
the engine's own argument packing, the default on a GPU; ``numba``: Numba's dispatcher). Each
mode of ``--launch`` runs in its own child process (``--child MODE``) with the variable set
(whenever the engine reads it); the parent prints one table and writes the JSON (default
bench/results/kernel_launch.json), with what each child's engine reported about its launch
path (``modes.*.launch_settings``). The torch rows are measured in the first child only.
``--time-limit`` (55 s) bounds the whole run: each child gets a share of what is left, skips
the rows it has no time for, and writes its rows as it goes, so a child stopped at its limit
still reports what it measured.

Without CUDA it exits with status 2 unless ``--dry-run``: the CUDA simulator
(NUMBA_ENABLE_CUDASIM=1) on CPU tensors, tiny fp32 shapes (hidden 64, heads 2/1, head_dim 32,
decode batch 4 with 16-token contexts, no prefill, sampling batch 2 of a 512-token vocabulary:
the simulated sampling kernel takes ~0.5 s per row), N = 3 (1 for the slowest simulated
kernels), one mode (the variable means nothing there); ~15 s: a code check whose numbers say
nothing about a GPU.

    python bench/kernel_launch.py                         # both modes, ~40-55 s on an H200
    python bench/kernel_launch.py --launch fast --ops sample,greedy
    python bench/kernel_launch.py --dry-run --output /tmp/kernel_launch.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import inspect
import json
import logging
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

STARTED = time.time()  # the time limit counts from here (before torch's import)

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the engine, when run as ``python bench/kernel_launch.py``
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_decode  # noqa: E402  (the bench folder: device_info shared with gpu_decode.py)

logger = logging.getLogger("kernel_launch")

RESULTS = Path(__file__).parent / "results" / "kernel_launch.json"
DRY_RUN_RESULTS = Path(tempfile.gettempdir()) / "kernel_launch_dry_run.json"
LAUNCH_ENV = "ENGINE_NUMBA_LAUNCH"
LAUNCH_MODES = ("fast", "numba")
SIMULATOR_ENV = "NUMBA_ENABLE_CUDASIM"
# Modules whose public ``*_cuda`` functions are the kernel launch functions.
KERNEL_MODULES = ("norm", "activation", "rotary", "attention", "quant_kernels", "sampling")
OPS = (
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "rotary_cache_write",
    "paged_attention",
    "quant_rotary_cache_write",
    "paged_attention_quant",
    "greedy",
    "sample",
)
SAMPLING_OPS = ("greedy", "sample")
EPS = 1e-5
TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.8
KILL_GRACE_S = 4.0  # past its deadline a child still finishes the row it is in, up to this
REFS_WEIGHT = 1.25  # the first child's share of the time limit (it times the torch rows too)


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    page_size: int
    dtype: str


@dataclass(frozen=True)
class Shape:
    name: str
    seqs: tuple[tuple[int, int], ...]  # (cached tokens, new tokens) per sequence
    quant: bool = True  # also the quantized-page ops (decode shapes: one specialisation)


@dataclass(frozen=True)
class Workload:
    dims: Dims
    shapes: tuple[Shape, ...]
    sampling_batches: tuple[int, ...]
    iters: int
    min_iters: int
    synced_calls: int
    sizing_call: bool  # False: N is sized from the first call (the simulator compiles little)


def _decode(batch: int, context: int) -> Shape:
    return Shape(f"decode b{batch} ctx{context}", ((context - 1, 1),) * batch)


def _prefill(tokens: int) -> Shape:
    return Shape(f"prefill 1x{tokens}", ((0, tokens),), quant=False)


GPU_WORKLOAD = Workload(
    dims=Dims(2048, 8192, 32, 8, 64, 128256, 16, "float16"),
    shapes=(_decode(64, 1024), _decode(1, 1024), _prefill(2048)),
    sampling_batches=(64, 1),
    iters=200,
    min_iters=10,
    synced_calls=10,
    sizing_call=True,
)
DRY_WORKLOAD = Workload(
    dims=Dims(64, 128, 2, 1, 32, 512, 16, "float32"),
    shapes=(_decode(4, 16),),
    sampling_batches=(2,),  # the simulated sampling kernel: ~0.5 s per row per call
    iters=3,
    min_iters=1,
    synced_calls=1,
    sizing_call=False,
)


@dataclass
class Row:
    function: str  # the function called: rms_norm_cuda, rms_norm_reference, ...
    op: str  # one of OPS: what kernel rows and torch rows share
    group: str  # kernel | torch | sampling
    case: str  # decode b64 ctx1024, sampling b64 top-k/top-p, ...
    shapes: str
    mode: str  # the launch mode, or "torch" for the references
    iters: int
    first_call_ms: float
    host_us: float
    wall_us: float
    synced_ms: float | None = None  # sampling rows: median of (call + synchronize)


@dataclass
class Entry:
    """One row to measure: ``call`` runs the function once on prebuilt inputs."""

    function: str
    op: str
    group: str
    case: str
    shapes: str
    call: Callable[[], Any]
    reference: bool = False  # a torch row: measured in the first child only
    synced: bool = False


# ---------------------------------------------------------------------------------------------
# Timing


def synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection pass inside a timed loop (a full one costs ~0.1 s)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure(entry: Entry, wl: Workload, budget_s: float, cuda: bool, mode: str) -> Row:
    """One warm-up call, one call to size N, then N back-to-back calls (see the docstring),
    and for the sampling rows a few calls each followed by a synchronize."""
    synchronize(cuda)
    began = time.perf_counter()
    entry.call()
    synchronize(cuda)
    first = single = time.perf_counter() - began
    if wl.sizing_call:  # the first call compiled: time another one
        began = time.perf_counter()
        entry.call()
        synchronize(cuda)
        single = time.perf_counter() - began
    iters = wl.iters
    if single * iters > budget_s:
        iters = max(wl.min_iters, min(iters, int(budget_s / max(single, 1e-9))))
    with no_gc():
        synchronize(cuda)
        began = time.perf_counter()
        for _ in range(iters):
            entry.call()
        host = time.perf_counter() - began
        synchronize(cuda)
        wall = time.perf_counter() - began
    synced = None
    if entry.synced:
        times = []
        with no_gc():
            for _ in range(min(iters, wl.synced_calls)):
                began = time.perf_counter()
                entry.call()
                synchronize(cuda)
                times.append(time.perf_counter() - began)
        synced = 1e3 * statistics.median(times)
    return Row(
        function=entry.function,
        op=entry.op,
        group=entry.group,
        case=entry.case,
        shapes=entry.shapes,
        mode="torch" if entry.reference else mode,
        iters=iters,
        first_call_ms=1e3 * first,
        host_us=1e6 * host / iters,
        wall_us=1e6 * wall / iters,
        synced_ms=synced,
    )


# ---------------------------------------------------------------------------------------------
# Inputs and the rows to measure


def _short(dtype: torch.dtype) -> str:
    return {torch.float16: "f16", torch.float32: "f32"}[dtype]


def _dims_text(t: torch.Tensor) -> str:
    return "[" + ",".join(str(s) for s in t.shape) + "]"


def forward_batch(shape: Shape, dims: Dims, device: torch.device) -> tuple[Any, int]:
    """(ForwardBatch of ``shape``, number of pages): each sequence on pages of its own."""
    from engine.batch import SequenceInput, build_forward_batch

    seqs, first_page = [], 0
    for cached, new in shape.seqs:
        pages = -(-(cached + new) // dims.page_size)
        ids = list(range(first_page, first_page + pages))
        seqs.append(SequenceInput(token_ids=[1] * new, num_cached=cached, pages=ids))
        first_page += pages
    return build_forward_batch(seqs, dims.page_size, device), first_page


def layer_entries(shape: Shape, dims: Dims, device: torch.device, quant: str) -> list[Entry]:
    """The per-layer ops of one forward of ``shape``: kernel and reference entries."""
    from engine.cuda import activation, attention, norm, rotary

    dtype = getattr(torch, dims.dtype)
    gen = torch.Generator().manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(device, dtype)

    batch, num_pages = forward_batch(shape, dims, device)
    tokens, h, kv, d = batch.num_tokens, dims.heads, dims.kv_heads, dims.head_dim
    x, residual = randn(tokens, dims.hidden, scale=0.1), randn(tokens, dims.hidden)
    residual_ref = residual.clone()
    weight = randn(dims.hidden, scale=0.1) + 1
    gate_up = randn(tokens, 2 * dims.intermediate)
    qkv = randn(tokens, (h + 2 * kv) * d)  # the fused qkv matmul's output, split as the model
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = q.reshape(tokens, h, d), k.reshape(tokens, kv, d), v.reshape(tokens, kv, d)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    freqs = batch.positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    k_pages = randn(num_pages, dims.page_size, kv, d)
    v_pages = randn(num_pages, dims.page_size, kv, d)
    slots, scale, attn_q = batch.slot_mapping, d**-0.5, randn(tokens, h, d)

    t = _short(dtype)
    rows_text = f"x{_dims_text(x)} {t}"
    rope_text = f"q{_dims_text(q)} kv{_dims_text(k)} pages{_dims_text(k_pages)} {t}"
    entries: list[Entry] = []
    pair = functools.partial(_pair, entries, shape.name)
    pair(
        "rms_norm", f"{rows_text} w[{dims.hidden}]",
        norm.rms_norm_cuda, norm.rms_norm_reference,
        lambda: norm.rms_norm_cuda(x, weight, EPS),
        lambda: norm.rms_norm_reference(x, weight, EPS),
    )  # fmt: skip
    pair(
        "add_rms_norm", f"{rows_text} residual w[{dims.hidden}]",
        norm.add_rms_norm_cuda, norm.add_rms_norm_reference,
        lambda: norm.add_rms_norm_cuda(x, residual, weight, EPS),  # residual updated in place
        lambda: norm.add_rms_norm_reference(x, residual_ref, weight, EPS),
    )  # fmt: skip
    pair(
        "silu_mul", f"gate_up{_dims_text(gate_up)} {t}",
        activation.silu_mul_cuda, activation.silu_mul_reference,
        lambda: activation.silu_mul_cuda(gate_up),
        lambda: activation.silu_mul_reference(gate_up),
    )  # fmt: skip
    pair(
        "rotary_cache_write", rope_text,
        rotary.rotary_cache_write_cuda, rotary.rotary_cache_write_reference,
        lambda: rotary.rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots),
        lambda: rotary.rotary_cache_write_reference(q, k, v, cos, sin, k_pages, v_pages, slots),
    )  # fmt: skip
    pair(
        "paged_attention", f"q{_dims_text(attn_q)} pages{_dims_text(k_pages)} {t}",
        attention.paged_attention_cuda, attention.paged_attention_reference,
        lambda: attention.paged_attention_cuda(attn_q, k_pages, v_pages, batch, scale),
        lambda: attention.paged_attention_reference(attn_q, k_pages, v_pages, batch, scale),
    )  # fmt: skip
    if shape.quant and quant != "none":
        rope = (q, k, v, cos, sin)
        quant_entries(pair, quant, rope, attn_q, batch, k_pages.shape, rope_text)
    return entries


def _pair(entries, case, op, shapes, kernel, ref, kernel_call, ref_call) -> None:
    """A kernel entry and its torch reference's."""
    entries.append(Entry(kernel.__name__, op, "kernel", case, shapes, kernel_call))
    entries.append(Entry(ref.__name__, op, "torch", case, shapes, ref_call, reference=True))


def quant_entries(pair, quant: str, rope, attn_q, batch, page_shape, rope_text: str) -> None:
    """The ops over quantized pages (rotated groups), ``quant``'s bit widths for K and V."""
    from engine.cache.quant import QUANT_BITS, allocate_quant_pages
    from engine.cuda import quant_kernels, quant_reference

    num_pages, page_size, kv, d = page_shape
    k_bits, v_bits = QUANT_BITS[quant]
    qk = allocate_quant_pages(num_pages, page_size, kv, d, k_bits, True, attn_q.device)
    qv = allocate_quant_pages(num_pages, page_size, kv, d, v_bits, True, attn_q.device)
    slots, scale = batch.slot_mapping, d**-0.5
    quant_text = f"{quant}+rot pages[{num_pages},{page_size},{kv},{d}]"
    pair(
        "quant_rotary_cache_write", f"{rope_text} -> {quant_text}",
        quant_kernels.quant_rotary_cache_write_cuda,
        quant_reference.quant_rotary_cache_write_reference,
        lambda: quant_kernels.quant_rotary_cache_write_cuda(*rope, qk, qv, slots),
        lambda: quant_reference.quant_rotary_cache_write_reference(*rope, qk, qv, slots),
    )  # fmt: skip
    pair(
        "paged_attention_quant", f"q{_dims_text(attn_q)} {quant_text}",
        quant_kernels.paged_attention_quant_cuda,
        quant_reference.quant_paged_attention_reference,
        lambda: quant_kernels.paged_attention_quant_cuda(attn_q, qk, qv, batch, scale),
        lambda: quant_reference.quant_paged_attention_reference(attn_q, qk, qv, batch, scale),
    )  # fmt: skip


def sampling_entries(batch: int, dims: Dims, device: torch.device) -> list[Entry]:
    """Greedy and top-k/top-p token choice over [batch, vocab] float32 logits."""
    from engine.cuda.sampling import SampleRows, greedy_cuda, sample_cuda
    from engine.sampling import SampleRequest, SamplerSettings
    from engine.sampling_fast import SamplerState, _choose

    gen = torch.Generator().manual_seed(batch)
    x = (torch.randn(batch, dims.vocab, generator=gen) * 3.0).to(device)
    vocab = dims.vocab
    rows = SampleRows(
        temps=torch.full((batch,), TEMPERATURE, device=device),
        top_k=torch.full((batch,), TOP_K, dtype=torch.int64, device=device),
        top_p=torch.full((batch,), TOP_P, device=device),
        min_p=torch.zeros(batch, device=device),
        greedy=torch.zeros(batch, dtype=torch.bool, device=device),
    )
    uniforms = torch.rand(batch, generator=gen, dtype=torch.float64).to(device)
    sampled = SamplerSettings(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    greedy = SamplerSettings(temperature=0.0)

    def requests(settings: SamplerSettings) -> list[SampleRequest]:
        return [SampleRequest(settings, random.Random(i)) for i in range(batch)]

    sampled_requests, greedy_requests = requests(sampled), requests(greedy)
    torch_state = SamplerState(kernels=False)
    sampled_params = torch_state.params(sampled_requests, device)
    greedy_params = SamplerState(kernels=False).params(greedy_requests, device)
    device_state = SamplerState(kernels=True)  # the generator's sampler on a GPU

    logits = f"logits[{batch},{vocab}] f32"
    settings = f"top_k {TOP_K} top_p {TOP_P} T {TEMPERATURE}"
    greedy_case, sampled_case = f"greedy b{batch}", f"top-k/top-p b{batch}"

    def entry(function, op, group, case, shapes, call, reference=False) -> Entry:
        return Entry(function, op, group, case, shapes, call, reference, synced=True)

    return [
        entry("greedy_cuda", "greedy", "kernel", greedy_case, logits,
              lambda: greedy_cuda(x, vocab)),
        entry("sampling_fast._choose", "greedy", "sampling", greedy_case,
              f"{logits}, kernels=False",
              lambda: _choose(x, vocab, greedy_params, greedy_requests, kernels=False),
              reference=True),
        entry("sample_cuda", "sample", "kernel", sampled_case, f"{logits} {settings}",
              lambda: sample_cuda(x, vocab, uniforms, rows)),
        entry("SamplerState.sample_on_device", "sample", "sampling", sampled_case,
              f"{logits} {settings}, kernels=True",
              lambda: device_state.sample_on_device(x, sampled_requests, vocab)),
        entry("sampling_fast._choose", "sample", "sampling", sampled_case,
              f"{logits} {settings}, kernels=False",
              lambda: _choose(x, vocab, sampled_params, sampled_requests, kernels=False),
              reference=True),
    ]  # fmt: skip


def entry_groups(
    wl: Workload, device: torch.device, quant: str, ops: set[str]
) -> Iterator[tuple[str, Callable[[], list[Entry]]]]:
    """(name, builder of its entries) in priority order: decode b64 and its sampling first.
    Built one group at a time, so one group's tensors are freed before the next one's."""
    layers = bool(ops - set(SAMPLING_OPS))
    sampling = bool(ops & set(SAMPLING_OPS))
    batches = list(wl.sampling_batches)
    for shape in wl.shapes:
        if layers:
            yield shape.name, functools.partial(layer_entries, shape, wl.dims, device, quant)
        if batches and sampling:
            batch = batches.pop(0)
            yield f"sampling b{batch}", functools.partial(sampling_entries, batch, wl.dims, device)
    for batch in batches if sampling else []:
        yield f"sampling b{batch}", functools.partial(sampling_entries, batch, wl.dims, device)


def kernel_functions() -> list[str]:
    """The engine's kernel launch functions: public ``*_cuda`` functions of KERNEL_MODULES."""
    names = []
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(f"engine.cuda.{module_name}")
        for name, value in vars(module).items():
            if (
                name.endswith("_cuda")
                and not name.startswith("_")
                and inspect.isfunction(value)
                and value.__module__ == module.__name__
            ):
                names.append(name)
    return sorted(names)


# ---------------------------------------------------------------------------------------------
# Child: one launch mode


def launch_settings() -> dict[str, Any]:
    """What the engine itself says about the launch path (best effort: absent before the
    engine reads ``ENGINE_NUMBA_LAUNCH``)."""
    from engine.cuda import _launch

    settings: dict[str, Any] = {"simulator": _launch.SIMULATOR}
    with contextlib.suppress(Exception):
        from engine.cuda import fast_launch

        settings["launch_mode"] = fast_launch.launch_mode()
    launchers = getattr(_launch, "_LAUNCHERS", None)
    if isinstance(launchers, dict):
        settings["fast_launchers"] = len(launchers)
    return settings


def measure_entry(entry: Entry, wl: Workload, args: argparse.Namespace, result: dict) -> None:
    """One row into ``result``: measured, skipped (past the deadline) or an error."""
    label = f"{entry.function} [{entry.case}]"
    left = args.deadline - time.time() if args.deadline else math.inf
    if left <= 0:
        result["skipped"].append(label)
        return
    try:
        row = measure(entry, wl, min(args.row_budget, left), not args.dry_run, args.child)
    except Exception as exc:  # one broken op must not cost the others' device time
        logger.exception("%s failed", label)
        result["errors"].append(f"{label}: {type(exc).__name__}: {exc}")
        return
    result["rows"].append(asdict(row))
    logger.info(
        "%s %s: first %.1f ms, host %.1f us, wall %.1f us (N=%d)",
        *(args.child, label, row.first_call_ms, row.host_us, row.wall_us, row.iters),
    )


def run_child(args: argparse.Namespace) -> int:
    wl = workload_from(args)
    cuda = not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    result: dict[str, Any] = {
        "mode": args.child,
        "env": os.environ.get(LAUNCH_ENV),
        "device": gpu_decode.device_info(device) if cuda else {"name": "cpu (simulator)"},
        "rows": [],
        "errors": [],
        "skipped": [],
    }

    def save() -> None:  # after every row: a child stopped at its deadline keeps its rows
        result["launch_settings"] = launch_settings()
        args.child_output.write_text(json.dumps(result, indent=1) + "\n")

    result["kernel_functions"] = kernel_functions()
    save()
    with torch.inference_mode():
        for name, build in entry_groups(wl, device, args.kv_quant, set(args.ops)):
            try:
                entries = build()
            except Exception as exc:  # one broken op must not cost the others' device time
                logger.exception("%s: building the inputs failed", name)
                result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            for entry in entries:
                if entry.op in args.ops and (args.refs or not entry.reference):
                    measure_entry(entry, wl, args, result)
                    save()
            del entries
    save()
    if result["skipped"]:
        logger.warning("%s: no time left for %d rows", args.child, len(result["skipped"]))
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: one child per mode, the table, the report


def child_command(args: argparse.Namespace, mode: str, output: Path, refs: bool, deadline: float):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode]
    cmd += ["--child-output", str(output), "--ops", ",".join(args.ops)]
    cmd += ["--row-budget", str(args.row_budget)]
    if args.iters is not None:
        cmd += ["--iters", str(args.iters)]
    cmd += ["--kv-quant", args.kv_quant, "--log-level", args.log_level]
    cmd += ["--deadline", repr(deadline)]
    if args.dry_run:
        cmd.append("--dry-run")
    if refs:
        cmd.append("--refs")
    return cmd


def run_children(args: argparse.Namespace) -> dict[str, dict]:
    modes = args.launch[:1] if args.dry_run else args.launch
    if args.dry_run and len(args.launch) > 1:
        logger.info("dry run: one mode (%s); the simulator has no launch modes", modes[0])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kernel_launch_") as tmp:
        for i, mode in enumerate(modes):
            env = dict(os.environ, **{LAUNCH_ENV: mode})
            if args.dry_run:
                env[SIMULATOR_ENV] = "1"
            elif env.pop(SIMULATOR_ENV, "0") == "1":
                logger.warning("%s=1 ignored: this run times the GPU", SIMULATOR_ENV)
            deadline, timeout = 0.0, None
            if args.time_limit > 0:  # a share of what is left; the first also times torch
                left = args.time_limit - (time.time() - STARTED)
                weights = [REFS_WEIGHT if j == 0 else 1.0 for j in range(i, len(modes))]
                share = left * weights[0] / sum(weights)
                deadline = time.time() + share - KILL_GRACE_S
                timeout = max(share, 1.0)
            output = Path(tmp) / f"{mode}.json"
            cmd = child_command(args, mode, output, refs=i == 0, deadline=deadline)
            limit = "no limit" if timeout is None else f"{timeout:.0f} s"
            logger.info("mode %s: %s=%s (child time: %s)", mode, LAUNCH_ENV, mode, limit)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, env=env, stdout=sys.stderr, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
                logger.error("mode %s: stopped at its time limit (%.0f s)", mode, timeout)
            result = json.loads(output.read_text()) if output.is_file() else {"rows": []}
            result |= {"returncode": rc, "seconds": time.perf_counter() - t0}
            if rc != 0:
                logger.error("mode %s: child exited with %s", mode, rc)
            results[mode] = result
    return results


def _fmt(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"


def print_table(rows: list[dict]) -> None:
    """Rows grouped per (op, case): each mode's kernel row, then the torch row."""
    order: dict[tuple[str, str], int] = {}
    for row in rows:
        order.setdefault((row["op"], row["case"]), len(order))
    modes = {m: i for i, m in enumerate(dict.fromkeys(r["mode"] for r in rows))}
    rows = sorted(
        rows, key=lambda r: (order[(r["op"], r["case"])], r["mode"] == "torch", modes[r["mode"]])
    )
    fw = max([len("function")] + [len(r["function"]) for r in rows])
    cw = max([len("case")] + [len(r["case"]) for r in rows])
    print(
        f"{'function':{fw}s} {'case':{cw}s} {'mode':6s} {'N':>4s} {'first ms':>9s} "
        f"{'host us':>9s} {'wall us':>10s} {'synced ms':>9s}  shapes"
    )
    for r in rows:
        print(
            f"{r['function']:{fw}s} {r['case']:{cw}s} {r['mode']:6s} {r['iters']:4d} "
            f"{_fmt(r['first_call_ms'], 9)} {_fmt(r['host_us'], 9)} {_fmt(r['wall_us'], 10)} "
            f"{_fmt(r['synced_ms'], 9, 3)}  {r['shapes']}"
        )
    sampling = [r for r in rows if r["op"] in SAMPLING_OPS]
    if sampling:
        names = [f"{r['function']} ({r['mode']}) {r['case']}" for r in sampling]
        nw = max(len(n) for n in names)
        print(f"\n{'sampling: wall ms per call':{nw}s} {'back to back':>12s} {'each synced':>12s}")
        for name, r in zip(names, sampling, strict=True):
            print(f"{name:{nw}s} {r['wall_us'] / 1e3:12.3f} {_fmt(r['synced_ms'], 12, 3)}")


METHODS = {
    "first_call_ms": "the first call in a fresh process (kernels: compile + launch + sync)",
    "host_us": "N back-to-back calls on prebuilt inputs, perf_counter before the synchronize, / N",
    "wall_us": "the same N calls up to after torch.cuda.synchronize(), / N",
    "synced_ms": "sampling rows: median over a few calls each followed by a synchronize",
    "iters": "N: --iters, cut so that a row takes about --row-budget seconds",
    "mode": "ENGINE_NUMBA_LAUNCH of the child process that measured the row; torch: the "
    "torch reference (engine/ops.py TORCH_OPS, sampling_fast._choose kernels=False), measured "
    "in the first child only",
}


def run_parent(args: argparse.Namespace) -> int:
    wl = workload_from(args)
    children = run_children(args)
    rows = [row for child in children.values() for row in child["rows"]]
    device = next((c["device"] for c in children.values() if "device" in c), {"name": None})
    functions = next(
        (c["kernel_functions"] for c in children.values() if "kernel_functions" in c), []
    )
    measured = {r["function"] for r in rows}
    unbenchmarked = [f for f in functions if f not in measured]
    errors = [f"{mode}: {e}" for mode, c in children.items() for e in c.get("errors", [])]
    report = {
        "benchmark": "kernel_launch",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "device": device | {"host": platform.node()},
        "versions": gpu_decode.versions(transformers=False),
        "dims": asdict(wl.dims),
        "shapes": {s.name: [list(seq) for seq in s.seqs] for s in wl.shapes},
        "sampling": {
            "batches": list(wl.sampling_batches),
            "top_k": TOP_K,
            "top_p": TOP_P,
            "temperature": TEMPERATURE,
        },
        "kv_quant": args.kv_quant,
        "iters": wl.iters,
        "row_budget_s": args.row_budget,
        "methods": METHODS,
        "modes": {
            mode: {k: c.get(k) for k in ("env", "launch_settings", "returncode", "seconds")}
            | {"skipped": c.get("skipped", [])}
            for mode, c in children.items()
        },
        "unbenchmarked": unbenchmarked,
        "errors": errors,
        "rows": rows,
    }
    print_table(rows)
    for line in errors:
        print(f"error: {line}")
    for mode, child in children.items():
        if child.get("skipped"):
            print(f"{mode}: {len(child['skipped'])} rows skipped at the time limit")
    if unbenchmarked:
        print(f"not measured: {', '.join(unbenchmarked)}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.output}", flush=True)
    failed = errors or any(c.get("returncode") != 0 for c in children.values())
    return 1 if failed or not rows else 0


# ---------------------------------------------------------------------------------------------
# Main


def _names(text: str, choices: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = sorted(set(names) - set(choices))
    if bad or not names:
        raise SystemExit(f"{flag}: unknown {bad or names}; choose from {', '.join(choices)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--dry-run", action="store_true", help="CUDA simulator, tiny shapes, CPU")
    p.add_argument("--launch", default=",".join(LAUNCH_MODES), help="comma list: fast,numba")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--iters", type=int, default=None, help="calls per row (200; dry run 3)")
    p.add_argument("--row-budget", type=float, default=0.25, help="seconds per row, about")
    p.add_argument(
        "--kv-quant",
        default="q4",
        choices=("q8", "q6", "q4", "none"),
        help="page format of the quantized-page rows (rotated groups)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="seconds for the whole run, shared by the children (55; dry run: none; 0: none)",
    )
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--log-level", default="INFO")
    # the parent's call of a child (one launch mode)
    p.add_argument("--child", choices=LAUNCH_MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-output", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--refs", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.launch = _names(args.launch, LAUNCH_MODES, "--launch")
    args.ops = _names(args.ops, OPS, "--ops")
    if args.time_limit is None:
        args.time_limit = 0.0 if args.dry_run else 55.0
    if args.output is None:  # a dry run never overwrites the real results
        args.output = DRY_RUN_RESULTS if args.dry_run else RESULTS
    return args


def workload_from(args: argparse.Namespace) -> Workload:
    base = DRY_WORKLOAD if args.dry_run else GPU_WORKLOAD
    if args.iters is None:
        return base
    return replace(base, iters=args.iters)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "kernel_launch.py: no CUDA GPU is available; this benchmark needs one. "
            "Run with --dry-run to exercise it on CPU in the CUDA simulator.",
            file=sys.stderr,
        )
        return 2
    if args.child:
        return run_child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
