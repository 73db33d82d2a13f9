"""bench/kv_zero_point.py (an emulated 4-bit format with a zero point): its rounding, its
error bound and its use by bench/kv_quant_quality.py."""

from __future__ import annotations

import pytest
import torch

from bench import kv_zero_point as zp


def test_stored_scale_clears_the_four_low_mantissa_bits():
    s = torch.tensor([1.0, 1.0 + 15 / 1024, 0.1, 3.0e-3])
    stored = zp.stored_scale(s)
    bits = stored.to(torch.float16).view(torch.int16)
    assert torch.all(bits & 15 == 0)
    assert torch.all(stored <= s) and torch.all(stored >= s * (1 - 16 / 1024))
    assert stored[1] == 1.0


def test_full_range_candidate_error_is_bounded(monkeypatch):
    """f = 1: the step s is the range [min(lo, 0), max(hi, 0)] / 15 rounded down by at most
    2^-6, and z centres the 16 levels on it to within s / 2, so its ends stick out by at most
    7.5 (range / 15 - s) + s / 2 <= 0.62 range / 15, and values inside round by s / 2."""
    monkeypatch.setattr(zp, "FRACTIONS", (1.0,))
    gen = torch.Generator().manual_seed(0)
    groups = torch.randn(500, 32, generator=gen) * torch.rand(500, 1, generator=gen) * 10
    groups += torch.randn(500, 1, generator=gen) * 5  # offsets: the case a zero point serves
    values = zp.zero_point_groups(groups)
    exact_step = (groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / 15
    assert torch.all((values - groups).abs() <= 0.62 * exact_step[:, None] + 1e-6)


def test_search_keeps_the_least_error_and_beats_symmetric_groups_with_an_offset(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    groups = torch.rand(400, 32, generator=gen) * 2 + 1.0  # all positive: [1, 3]
    searched = (zp.zero_point_groups(groups) - groups).square().sum(-1)
    monkeypatch.setattr(zp, "FRACTIONS", (1.0,))
    full = (zp.zero_point_groups(groups) - groups).square().sum(-1)
    assert torch.all(searched <= full + 1e-9) and searched.sum() < full.sum()
    from engine.cache.quant import dequantize, quantize

    data, scales = quantize(groups.reshape(-1, 32), 4, rotate=False, search=True)
    symmetric = (dequantize(data, scales, 4) - groups).square().sum(-1)
    # symmetric: the step is ~3 / 8 (the largest value at code -8); here ~3 / 15
    assert searched.sum() < symmetric.sum() / 2


def test_constant_groups():
    groups = torch.full((2, 32), 0.0)
    groups[1] = 3.0
    values = zp.zero_point_groups(groups)
    assert torch.equal(values[0], groups[0])  # all zero: scale 0, nothing to store
    # the range [0, 3]: a step of ~0.2, 3 on (or next to) the top level
    assert torch.all((values[1] - 3.0).abs() <= 0.62 * 3.0 / 15)


def test_round_trip_rotates_back():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2, 64, generator=gen)
    back = zp.zero_point_round_trip(x)
    assert back.shape == x.shape
    assert 0 < (back - x).abs().max() < 0.5


@pytest.mark.parametrize("name", ["q4+rot+zp", "q4+rot+zpk"])
def test_modes_are_named_on_the_command_line(name):
    from bench.kv_quant_quality import MODES, emulated, parse_modes, storage

    mode = parse_modes(name)[1]
    assert mode.name == name and emulated(mode) and name not in MODES
    assert storage(mode) == ("fp16", None, None)
