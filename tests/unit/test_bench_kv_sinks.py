"""bench/kv_sinks.py (an emulated cache whose first tokens stay unquantized): positions read
off the rotary tables, and the write storing sinks exactly and the rest as the engine does."""

from __future__ import annotations

import torch

from bench import kv_sinks
from bench.kv_zero_point import engine_round_trip
from engine.config import RopeConfig
from engine.cuda.rotary import rotary_reference
from engine.model.rotary import cos_sin, inverse_frequencies
from engine.ops import TORCH_OPS


def test_positions_come_back_from_the_rotary_tables():
    inv_freq = inverse_frequencies(RopeConfig(theta=100000.0), 64)
    wanted = torch.tensor([0, 1, 3, 15, 16, 17, 1000, 4095, 131071])
    cos, sin = cos_sin(inv_freq, wanted, torch.float32)
    assert torch.equal(kv_sinks.positions(cos, sin, inv_freq), wanted)


def test_sink_rows_are_stored_exactly_and_the_rest_as_the_engine_stores_them():
    gen = torch.Generator().manual_seed(0)
    inv_freq = inverse_frequencies(RopeConfig(theta=10000.0), 64)
    positions = torch.tensor([5, 0, 7, 2, 30, 3])  # (rows in any order, as a batch has them)
    cos, sin = cos_sin(inv_freq, positions, torch.float32)
    q, k, v = (torch.randn(6, h, 64, generator=gen) for h in (2, 1, 1))
    center = torch.randn(1, 64, generator=gen)
    pages = [torch.zeros(2, 8, 1, 64) for _ in range(2)]
    ops = kv_sinks.sink_ops(TORCH_OPS, [center], inv_freq, 4, (4, 4))
    slots = torch.arange(6) + 3
    out = ops.rotary_cache_write(q, k, v, cos, sin, *pages, slots)
    rotated_q, rotated_k = rotary_reference(q, k, cos, sin)
    assert torch.allclose(out, rotated_q)
    stored_k, stored_v = (p.view(-1, 1, 64)[slots] for p in pages)
    sink = positions < 4
    assert torch.allclose(stored_k[sink], (rotated_k - center)[sink])
    assert torch.equal(stored_v[sink], v[sink])
    assert torch.allclose(stored_k[~sink], engine_round_trip(rotated_k - center)[~sink])
    assert torch.allclose(stored_v[~sink], engine_round_trip(v)[~sink])
    assert not torch.allclose(stored_v[~sink], v[~sink], atol=1e-3)  # (4 bits: visibly off)
