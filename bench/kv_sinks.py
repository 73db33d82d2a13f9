"""EXPERIMENT (bench only, not an engine format): a sequence's first tokens kept unquantized.

The first tokens of a sequence (the "attention sinks": BOS and its neighbours) take a large
share of every later query's attention, so their quantization error reaches every position.
This asks how much of a quantized cache's loss they account for: the keys and values of the
tokens at positions below ``sinks`` are stored exactly, every other token's as the engine
stores them (rotated groups, the 4-bit scale search, keys centered).

``sink_ops`` emulates it on an unquantized cache in the run dtype, as bench/kv_zero_point.py
does: the write rotates q and k itself, subtracts the model's key centers from the keys (the
engine's ``center_keys``; attention stays exact) and stores the dequantized values. A token's
position is read off its rotary angle of the lowest frequency (exact well past 100k tokens),
so the prompts of the greedy runs, whose pages lie anywhere, are handled as the scored text is.
``bench/kv_quant_quality.py`` runs it as the modes "q4+rot+sink<N>" and "q8+rot+sink<N>".
"""

from __future__ import annotations

import dataclasses

import torch

from bench.kv_zero_point import engine_round_trip
from engine.cuda.rotary import rotary_reference
from engine.ops import OpSet

SINK_COUNTS = (0, 4, 16, 64)  # 0: the engine's storage (the emulation's check)


def positions(cos: torch.Tensor, sin: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """[T] long: each row's position, from the angle of the rotary tables' last (lowest)
    frequency (cos / sin [T, D/2])."""
    angle = torch.atan2(sin[:, -1].double(), cos[:, -1].double())
    return torch.round(angle / inv_freq[-1].double()).long()


def sink_ops(
    ops: OpSet, centers: list[torch.Tensor], inv_freq: torch.Tensor, sinks: int, bits: tuple
) -> OpSet:
    """``ops`` over an unquantized cache whose write stores the keys (less
    ``centers[layer]``) and values of positions ``>= sinks`` as the engine's rotated groups of
    ``bits`` = (K bits, V bits) dequantize them, and those below ``sinks`` exactly."""
    state = {"calls": 0}
    k_bits, v_bits = bits

    def write(q, k, v, cos, sin, k_pages, v_pages, slots):
        layer = state["calls"] % len(centers)
        state["calls"] += 1
        q, k = rotary_reference(q, k, cos, sin)
        sink = (positions(cos, sin, inv_freq) < sinks)[:, None, None]
        k = k.float() - centers[layer]
        k = torch.where(sink, k, engine_round_trip(k, k_bits).float()).to(q.dtype)
        v = torch.where(sink, v.float(), engine_round_trip(v, v_bits).float()).to(q.dtype)
        one, zero = torch.ones_like(cos), torch.zeros_like(sin)  # q, k are rotated already
        return ops.rotary_cache_write(q, k, v, one, zero, k_pages, v_pages, slots)

    return dataclasses.replace(ops, rotary_cache_write=write)
