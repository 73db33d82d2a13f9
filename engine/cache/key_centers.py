"""The per-layer key centers of a quantized cache (``QuantPages.center``, engine/cache/quant.py).

A layer's center is the mean post-RoPE key [KV, D] of one forward over ``CENTER_TOKENS``
uniformly random token ids drawn from a fixed seed, through a small unquantized cache: the
model alone decides it (no text, no tokenizer), the same on every machine and replica, so pages
written anywhere by one model agree. Subtracting any fixed vector from every key leaves
attention exact; the mean is the choice that shrinks the stored keys most. Measured on SmolLM2
over the 4096-token bench text (bench/kv_quant_quality.py): q4 with rotation went from +4.7% to
+4.0% perplexity over fp32.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.ops import TORCH_OPS

CENTER_TOKENS = 512
CENTER_SEED = 0
_PAGE_SIZE = 16


def calibration_ids(
    vocab_size: int, tokens: int = CENTER_TOKENS, seed: int = CENTER_SEED
) -> list[int]:
    """``tokens`` token ids drawn uniformly below ``vocab_size`` from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (tokens,), generator=generator).tolist()


def key_centers(model, ids: list[int] | None = None) -> list[torch.Tensor]:
    """Per layer, the mean post-RoPE key float32 [KV, D] of one forward of ``ids`` (default:
    ``calibration_ids``) through an unquantized cache, on the model's device, with the torch
    reference ops whatever ``model.ops`` is: any fixed vector keeps attention exact, and the
    references are as fast as the kernels for one prefill on a GPU and far faster in the CUDA
    simulator."""
    if ids is None:
        ids = calibration_ids(model.config.vocab_size)
    if not ids:
        raise ValueError("key_centers needs at least one token id, got none")
    pages = -(-len(ids) // _PAGE_SIZE)
    kv = model.allocate_kv(pages, _PAGE_SIZE)
    batch = build_forward_batch([SequenceInput(ids, 0, range(pages))], _PAGE_SIZE, model.device)
    means: list[torch.Tensor] = []

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        out = TORCH_OPS.rotary_cache_write(q, k, v, cos, sin, k_pages, v_pages, slots)
        # the rows just written are the post-RoPE keys in the run dtype
        written = k_pages.view(-1, *k_pages.shape[2:]).index_select(0, slots.long())
        means.append(written.float().mean(dim=0).contiguous())
        return out

    with torch.inference_mode():
        model.network(batch, kv, dataclasses.replace(TORCH_OPS, rotary_cache_write=write))
    layers = model.config.num_layers
    if len(means) != layers:
        raise RuntimeError(f"{len(means)} cache writes in one forward of {layers} layers")
    return means
