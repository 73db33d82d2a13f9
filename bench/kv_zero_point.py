"""EXPERIMENT (bench only, not an engine format): 4-bit groups with an integer zero point, emulated.

The engine's 4-bit groups are symmetric: value = q * s with q in -8..7 (the scale's sign picks
which end the extra level -8 serves). A zero point shifts the 16 levels to where the group's
values are: value = (c - z) * s with c and z in 0..15. The proposal keeps the bytes of today's
layout: z lives in the four low mantissa bits of the group's fp16 scale word, which leaves the
scale 6 mantissa bits (a relative step of 2^-7, far below a 4-bit step's).

Per group of 32 (rotated by the 32-point Hadamard matrix first, as the engine's rotated groups):
for each fraction f in ``FRACTIONS`` of the group's range [min(lo, 0), max(hi, 0)] (the levels
always hold 0, as an integer z in 0..15 implies), s = (max - min) * f / 15 rounded to
the stored 6-bit-mantissa fp16 (at least 2^-14, fp16's smallest normal; 0 for a constant
group), z = clamp(floor(7.5 - mid / s + 0.5), 0, 15) with mid the range's midpoint, codes
c = clamp(floor(x / s + 0.5) + z, 0, 15); the candidate with the least squared error is kept
(f < 1 clips the extremes for a finer step, as the engine's scale search does).

``zero_point_ops`` emulates it on an unquantized cache in the run dtype: the write rotates q and
k itself, subtracts the model's key centers (the engine's ``center_keys``), and stores the
dequantized values; attention reads them as they are (what the kernel would compute, up to the
order of float operations). ``bench/kv_quant_quality.py`` runs it as the modes "q4+rot+zp"
(keys and values) and "q4+rot+zpk" (keys only, values as the engine quantizes them).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.cache.quant import GROUP, dequantize, hadamard, quantize, rotate_groups
from engine.cuda.rotary import rotary_reference
from engine.ops import OpSet

LEVELS = 15  # codes 0..15
FRACTIONS = (1.0, 0.95, 0.9, 0.85, 0.8)
MIN_NORMAL = 2.0**-14  # fp16's smallest normal: a stored scale's exponent field is never 0


def stored_scale(s: torch.Tensor) -> torch.Tensor:
    """float32 scales as the proposed word stores them: fp16 with the low 4 mantissa bits
    cleared (they hold z), as float32."""
    bits = s.to(torch.float16).view(torch.int16).to(torch.int32) & ~15
    return bits.to(torch.int16).view(torch.float16).float()


def zero_point_groups(groups: torch.Tensor) -> torch.Tensor:
    """groups [..., 32] (float32) -> their dequantized values under the best candidate."""
    # the levels (0 - z) s .. (15 - z) s hold 0 for any z in 0..15: the range must too
    lo, hi = groups.amin(-1).clamp(max=0.0), groups.amax(-1).clamp(min=0.0)
    mid = (lo + hi) * 0.5
    best_error = best = None
    for f in FRACTIONS:
        s = stored_scale((hi - lo) * f / LEVELS)
        s = torch.where(hi > lo, s.clamp_min(MIN_NORMAL), torch.zeros_like(s))
        step = torch.where(s > 0, s, torch.ones_like(s))
        z = torch.floor(7.5 - mid / step + 0.5).clamp(0, LEVELS)
        c = (torch.floor(groups / step[..., None] + 0.5) + z[..., None]).clamp(0, LEVELS)
        values = (c - z[..., None]) * s[..., None]
        error = (values - groups).double().square().sum(-1)
        if best is None:
            best, best_error = values, error
            continue
        better = error < best_error
        best = torch.where(better[..., None], values, best)
        best_error = torch.where(better, error, best_error)
    return best


def zero_point_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> its rotated zero-point 4-bit groups, dequantized and rotated back."""
    shape = x.shape
    groups = x.float().reshape(*shape[:-1], -1, GROUP) @ hadamard(x.device)
    values = zero_point_groups(groups) @ hadamard(x.device)
    return values.reshape(shape).to(x.dtype)


def engine_round_trip(x: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """x [..., D] through the engine's rotated symmetric groups (``quantize``), back."""
    data, scales = quantize(x, bits, rotate=True)
    return rotate_groups(dequantize(data, scales, bits)).to(x.dtype)


def zero_point_ops(ops: OpSet, centers: list[torch.Tensor], values: bool = True) -> OpSet:
    """``ops`` over an unquantized cache whose write stores keys (less ``centers[layer]``) and,
    with ``values``, values as zero-point 4-bit groups dequantized (values otherwise as the
    engine's q4 stores them)."""
    state = {"calls": 0}

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        layer = state["calls"] % len(centers)
        state["calls"] += 1
        q, k = rotary_reference(q, k, cos, sin)
        k = zero_point_round_trip(k.float() - centers[layer]).to(k.dtype)
        v = zero_point_round_trip(v) if values else engine_round_trip(v)
        one, zero = torch.ones_like(cos), torch.zeros_like(sin)  # q, k are rotated already
        return ops.rotary_cache_write(q, k, v, one, zero, k_pages, v_pages, slots)

    return dataclasses.replace(ops, rotary_cache_write=write)
