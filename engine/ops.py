"""One table of the model's non-matmul ops, so every implementation can be swapped as a set.

``select_ops(device)`` returns the op set for a device: the Numba CUDA kernels on a GPU, and
on the CPU the torch references with Numba CPU kernels for decode rows' attention (float and
quantized pages) and a quantized cache's write (engine/cpu/). The environment variable
``ENGINE_OPS`` forces a choice: ``torch`` (the references alone) or ``cuda`` (Numba CUDA
kernels).
Matmuls are not in the table: they always go to torch (cuBLAS on GPU, MKL/oneDNN on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine.cuda.activation import silu_mul_reference
from engine.cuda.attention import chunk_split_devices, decode_split, paged_attention_reference
from engine.cuda.norm import add_rms_norm_reference, rms_norm_reference
from engine.cuda.quant_reference import (
    by_storage,
    quant_paged_attention_reference,
    quant_rotary_cache_write_reference,
)
from engine.cuda.rotary import rotary_cache_write_reference

OPS_ENV = "ENGINE_OPS"
OPS_CHOICES = ("auto", "torch", "cuda")
PREFILL_ATTENTION_ENV = "ENGINE_PREFILL_ATTENTION"
PREFILL_ATTENTION_CHOICES = ("torch", "kernel")


@dataclass(frozen=True, slots=True)
class OpSet:
    """The ops a forward pass calls; see each reference for shapes and semantics.

    Callers ask the capabilities below, never the name (which is for logs and reports).
    """

    name: str
    rms_norm: Any
    add_rms_norm: Any
    rotary_cache_write: Any
    paged_attention: Any
    silu_mul: Any
    # The ops compile per specialisation on first launch: warm them up before serving.
    compiles: bool = False
    # A forward's launches depend only on device buffers and on values fixed when its
    # attention plan is made, so a padded static batch can be captured and replayed as a
    # CUDA graph. The torch reference sizes its masks from each step's host values: False.
    supports_graphs: bool = False
    # Run dtypes the ops take (None: any).
    dtypes: tuple[torch.dtype, ...] | None = None
    # Compiles what a warm-up forward cannot reach: (config, dtype, device, page_size).
    warm_up_extra: Callable[[Any, torch.dtype, torch.device, int], None] | None = None
    # It compiles CPU kernels (not the CUDA simulator's, which are not worth a warm-up): a
    # runner on a CPU device warms them up too.
    compiles_on_cpu: bool = False

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return self.dtypes is None or dtype in self.dtypes


TORCH_OPS = OpSet(
    name="torch",
    rms_norm=rms_norm_reference,
    add_rms_norm=add_rms_norm_reference,
    # Each op taking pages routes quantized storage (QuantPages) to its quantized variant.
    rotary_cache_write=by_storage(
        rotary_cache_write_reference, quant_rotary_cache_write_reference, pages_arg=5
    ),
    paged_attention=by_storage(
        paged_attention_reference, quant_paged_attention_reference, pages_arg=1
    ),
    silu_mul=silu_mul_reference,
)


@functools.cache
def cpu_ops(decode: ModuleType | None = None) -> OpSet:
    """The CPU's op set: the torch references, with Numba kernels (imported on first use:
    they load numba) for decode rows' attention, which reads a quantized cache's codes in
    place, and float pages too (engine/cpu/decode_attention.py ``float_kernel_pays``), and
    for a quantized cache's write, which makes its rows' codes and scales in one pass
    (engine/cpu/quant_write.py). Their first call compiles them (or loads them from Numba's
    cache), so runners warm them up. ``decode``: the decode kernel's module (by default
    engine.cpu.decode_attention; bench/cpu_decode_kernel.py passes an older version's, which
    the op set's warm-up, this tree's, does not compile)."""
    if decode is None:
        from engine.cpu import decode_attention as decode
    from engine.cpu.kv_gather import quant_chunk_attention_cpu
    from engine.cpu.quant_write import write_slots_cpu

    def float_takes(q, k_pages, batch) -> bool:
        return decode.supports(q, k_pages, batch) and decode.float_kernel_pays(batch)

    return dataclasses.replace(
        TORCH_OPS,
        name="cpu",
        rotary_cache_write=by_storage(
            rotary_cache_write_reference,
            functools.partial(quant_rotary_cache_write_reference, write=write_slots_cpu),
            pages_arg=5,
        ),
        paged_attention=by_storage(
            decode_rows_on(decode.decode_attention_cpu, paged_attention_reference, float_takes),
            decode_rows_on(
                decode.quant_decode_attention_cpu,
                quant_chunk_attention_cpu,
                decode.supports,
                decode.VERIFY_ROWS,
            ),
            pages_arg=1,
        ),
        compiles=True,
        compiles_on_cpu=True,
        warm_up_extra=_warm_up_cpu_decode,
    )


def cuda_ops() -> OpSet:
    """The Numba CUDA kernels as an op set (imported on first use: it loads numba)."""
    from engine.cuda._launch import KERNEL_DTYPES
    from engine.cuda.activation import silu_mul_cuda
    from engine.cuda.attention import paged_attention_cuda
    from engine.cuda.kv_gather import quant_chunk_attention_cuda
    from engine.cuda.norm import add_rms_norm_cuda, rms_norm_cuda
    from engine.cuda.quant_kernels import (
        paged_attention_quant_cuda,
        quant_rotary_cache_write_cuda,
    )
    from engine.cuda.rotary import rotary_cache_write_cuda

    return OpSet(
        name="cuda",
        rms_norm=rms_norm_cuda,
        add_rms_norm=add_rms_norm_cuda,
        rotary_cache_write=by_storage(
            rotary_cache_write_cuda, quant_rotary_cache_write_cuda, pages_arg=5
        ),
        paged_attention=by_storage(
            by_query_length(paged_attention_cuda, paged_attention_reference, CUDA_VERIFY_ROWS),
            by_query_length(
                paged_attention_quant_cuda, quant_chunk_attention_cuda, CUDA_VERIFY_ROWS
            ),
            pages_arg=1,
        ),
        silu_mul=silu_mul_cuda,
        compiles=True,
        supports_graphs=True,
        dtypes=KERNEL_DTYPES,
        warm_up_extra=_warm_up_split_merge,
    )


# The CUDA op set's draft verification: a sequence of at most this many query tokens that is
# not a prompt chunk (a token and its drafts) goes to the decode kernel, each query token a
# row with its own causal limit, rather than through the prompt-chunk route (its pages
# gathered, quantized ones dequantized, then SDPA). H200, 8B shape, 32 sequences x 4k context,
# 1 + 4 drafts each, one step's attention in 32 layers, eager as the generator runs a
# verify step, so on the CUDA-core kernel (bench/kv_quant_decode.py's verify_step_ms;
# bench/results/gpu_decode_h200_2026-11-30_8b_kv_verify.json): q4 pages 53.5 -> 20.9 ms,
# fp16 31.9 -> 27.3 ms. The kernel reads a sequence's context once per row, the gather once
# per sequence, so longer verifies are left to the gather: by that run's rates fp16 would
# break even near 6 rows and q4 near 12 (not measured).
CUDA_VERIFY_ROWS = 5


def by_query_length(kernel: Callable, reference: Callable, short: int = 1) -> Callable:
    """Attention: decode batches (one query token per sequence) on the Numba kernel, which
    CUDA graphs capture; sequences with a longer query (prefill, chunked prefill, and draft
    verification of more than ``short`` tokens) on the torch reference, whose SDPA uses the
    tensor cores. In a batch with both, the one-token sequences (and each query token of the
    sequences of at most ``short`` tokens that are not prompt chunks: ``decode_rows_on``)
    still go to the kernel (``decode_split``), so a decode row reads its context the same way
    in every step and a quantized cache is not dequantized for it. Measured on an
    H200 for fp16/fp32 pages (bench/kernel_launch.py, 1B shape): prefill of 2048 tokens
    2.66 ms in the kernel (CUDA cores, one key per lane group per step) vs 0.18 ms; decode at
    batch 64 x 1k about equal (138 vs 135 us). Quantized pages go the same way: the pages the
    batch names are dequantized into one buffer for SDPA, as ExLlamaV2 does for every step
    (one kernel launch per K and V: engine/cuda/kv_gather.py), and a prompt chunk reads its
    own K/V exactly (engine/cuda/quant_reference.py), which the kernel does not.
    ``ENGINE_PREFILL_ATTENTION=kernel`` keeps the kernel for every batch (a quantized prompt
    chunk then reads its own K/V through their codes)."""
    if prefill_attention_choice() == "kernel":
        return kernel
    return decode_rows_on(kernel, reference, short=short)


def decode_rows_on(
    kernel: Callable, reference: Callable, takes: Callable | None = None, short: int = 1
) -> Callable:
    """Attention whose decode rows go to ``kernel`` (a decode batch, or a batch's one-token
    sequences and, with ``short`` > 1, each query token of its sequences of at most ``short``
    tokens that are not prompt chunks, drafts to verify: ``decode_split``) and every other
    sequence to ``reference``. ``takes(q, k_pages, decode_batch)``: whether the kernel takes
    these decode rows (None: always); where it does not, the whole batch goes to
    ``reference`` in one call."""

    def attention(q, k_pages, v_pages, batch, scale, sliding_window=None):
        if batch.max_query_len == 1:
            on_kernel = takes is None or takes(q, k_pages, batch)
            chosen = kernel if on_kernel else reference
            return chosen(q, k_pages, v_pages, batch, scale, sliding_window)
        split = decode_split(batch, short)
        if split is None or (takes is not None and not takes(q[split.rows], k_pages, split.decode)):
            return reference(q, k_pages, v_pages, batch, scale, sliding_window)
        rows = split.rows
        if split.rest is None:  # (every row, in order)
            return kernel(q[rows], k_pages, v_pages, split.decode, scale, sliding_window)
        out = reference(q, k_pages, v_pages, split.rest, scale, sliding_window)
        out[rows] = kernel(q[rows], k_pages, v_pages, split.decode, scale, sliding_window)
        return out

    attention.__name__ = getattr(kernel, "__name__", "attention")
    attention.__doc__ = kernel.__doc__
    return attention


def prefill_attention_choice() -> str:
    choice = os.environ.get(PREFILL_ATTENTION_ENV, "torch").strip().lower() or "torch"
    if choice not in PREFILL_ATTENTION_CHOICES:
        raise ValueError(
            f"{PREFILL_ATTENTION_ENV}={choice!r} is not one of "
            f"{', '.join(PREFILL_ATTENTION_CHOICES)}"
        )
    return choice


def _warm_up_split_merge(config, dtype: torch.dtype, device: torch.device, page_size: int):
    """Short warm-up contexts never split the attention's key range: compile the merge kernel
    here, or the first long-context decode would compile it mid-request."""
    from engine.cuda.attention import warm_up_split_merge

    warm_up_split_merge(
        dtype, device, config.num_heads, config.num_kv_heads, config.head_dim, page_size
    )


def _warm_up_cpu_decode(config, dtype: torch.dtype, device: torch.device, page_size: int):
    """A warm-up forward's one decode row is not ragged, so it leaves float pages on the
    reference: compile the CPU decode kernel here, or the first ragged batch would compile it
    mid-request."""
    from engine.cpu.decode_attention import warm_up_decode_attention_cpu

    warm_up_decode_attention_cpu(dtype, config.num_heads, config.num_kv_heads, config.head_dim)


def ops_choice() -> str:
    choice = os.environ.get(OPS_ENV, "auto").strip().lower() or "auto"
    if choice not in OPS_CHOICES:
        raise ValueError(f"{OPS_ENV}={choice!r} is not one of {', '.join(OPS_CHOICES)}")
    return choice


def select_ops(device: torch.device | str) -> OpSet:
    """The op set for ``device``: the Numba kernels on CUDA devices, ``cpu_ops`` elsewhere.
    ``ENGINE_OPS=torch`` forces the references (to bisect a drift);
    ``ENGINE_OPS=cuda`` forces the kernels, on CPU too when ``NUMBA_ENABLE_CUDASIM=1``.
    (``ENGINE_CHUNK_SPLIT``, read by the attention reference, is checked here too, so a bad
    value stops the model's load rather than its first prompt chunk.)"""
    chunk_split_devices()
    choice = ops_choice()
    device = torch.device(device)
    if choice == "torch":
        return TORCH_OPS
    if choice == "auto" and device.type != "cuda":
        return cpu_ops()
    from engine.cuda._launch import SIMULATOR

    if device.type != "cuda" and not SIMULATOR:
        raise ValueError(
            f"{OPS_ENV}=cuda on a {device.type} device needs the CUDA simulator "
            "(set NUMBA_ENABLE_CUDASIM=1 before starting Python)"
        )
    return cuda_ops()
