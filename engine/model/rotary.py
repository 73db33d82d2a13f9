"""Rotary embedding frequencies: default, linear and llama3 scaling, as HF computes them."""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies (CPU; move them once to the device)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short kept, a smooth blend between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of position * frequency: [T, head_dim / 2] each, in ``dtype``.

    Computed in float32 first (as HF does) so low-precision runs round only once.
    """
    freqs = positions[:, None].float() * inv_freq[None, :]
    return freqs.cos().to(dtype), freqs.sin().to(dtype)
