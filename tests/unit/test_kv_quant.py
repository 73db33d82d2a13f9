"""The quantized K/V layout (engine/cache/quant.py): packing, and error bounds the scheme implies.

Bounds, derived rather than tuned: with s = the stored fp16 scale of a group (absmax / qmax,
rounded to fp16) every element rounds to the nearest multiple of s inside [-qmax s, qmax s],
so |x - deq(q(x))| <= s / 2 (plus float32 rounding of x / s: a relative 2^-22 of |x| / s
steps at most). With the rotation the bound holds per element in the rotated space; back in
the original space H is orthonormal, so the group's error keeps its L2 norm: <= sqrt(32) s / 2.
Rotated 4-bit groups search their scale among candidates that include absmax / 7's (up to the
sign), keeping the least squared error: their error is at most that scheme's, so the same L2
bound holds with s7 = fp16(absmax / 7); per element it does not (the search may clip).
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.cache.quant import (
    GROUP,
    SEARCH_DIVISORS,
    QuantPages,
    allocate_quant_pages,
    check_quant,
    dequantize,
    hadamard,
    put_rows,
    qmax,
    quantize,
    rotate_groups,
    search_scales,
    write_slots,
)

SLACK = 1e-5  # float32 rounding of x / s and of s * q, in units of s


def _data(seed: int = 0, outliers: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 3, 128, generator=gen)
    if outliers:  # a few large channels, as real keys have
        x[..., 5] *= 20
        x[..., 70] *= 8
    x[0, 0, :GROUP] = 0  # an all-zero group
    return x


def _groups(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], -1, GROUP)


@pytest.mark.parametrize("bits", [8, 4])
def test_error_within_half_a_step(bits):
    x = _data()
    data, scales = quantize(x, bits, rotate=False)
    err = _groups(x - dequantize(data, scales, bits)).abs().amax(dim=-1)
    step = scales.float()
    assert torch.all(err <= step / 2 * (1 + SLACK) + 1e-30)
    # the scale is absmax / qmax up to fp16 rounding (relative 2^-11)
    want = _groups(x).abs().amax(dim=-1) / qmax(bits)
    assert torch.allclose(step, want, rtol=2**-11, atol=0)
    assert torch.all(err[0, 0, 0] == 0)  # the zero group comes back exactly


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_error_bounds(bits):
    x = _data()
    data, scales = quantize(x, bits, rotate=True)
    deq = dequantize(data, scales, bits)  # still in the rotated space
    step = scales.float().abs()
    if bits == 8:  # absmax / 127: half a step per element
        err_rot = _groups(rotate_groups(x) - deq).abs().amax(dim=-1)
        assert torch.all(err_rot <= step / 2 * (1 + SLACK) + 1e-6)
    else:  # searched: the absmax / 7 scheme's step bounds the group's L2 error
        step = quantize(x, bits, rotate=True, search=False)[1].float()
    back = rotate_groups(deq)
    l2 = _groups(x - back).norm(dim=-1)
    assert torch.all(l2 <= math.sqrt(GROUP) * step / 2 * (1 + SLACK) + 1e-6)


def test_searched_scales_never_lose_to_absmax():
    """Rotated 4-bit: per group the searched scale's squared error is at most absmax / 7's
    (its first candidate), lower in total, and it uses the code -8 absmax never does."""
    x = rotate_groups(_data(seed=3))
    plain = dequantize(*quantize(x, 4, rotate=False, search=False), 4)
    data, scales = quantize(x, 4, rotate=False, search=True)
    searched = dequantize(data, scales, 4)
    err_plain = _groups(x - plain).double().square().sum(dim=-1)
    err_searched = _groups(x - searched).double().square().sum(dim=-1)
    assert torch.all(err_searched <= err_plain * (1 + 1e-12))
    assert err_searched.sum() < 0.85 * err_plain.sum()
    assert int((data & 15).min()) == 0 or int((data >> 4).min()) == 0
    # the chosen scale is -m / d for one of the divisors (m: the group's extreme element)
    groups = _groups(x)
    m = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))[..., 0]
    ratios = (m / -scales.float())[m != 0]
    nearest = torch.tensor(SEARCH_DIVISORS)[
        (ratios[:, None] - torch.tensor(SEARCH_DIVISORS)).abs().argmin(-1)
    ]
    assert torch.allclose(ratios, nearest, rtol=2**-10)
    assert len(set(nearest.tolist())) >= 4


def _search_one_divisor_at_a_time(groups: torch.Tensor) -> torch.Tensor:
    """search_scales by its definition: each divisor's scale in turn, kept where its float64
    squared error is strictly lower than the best so far (the first on a tie)."""
    m = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))[..., 0]
    best = best_error = None
    for d in SEARCH_DIVISORS:
        scales = (m / -d).clamp(-65504.0, 65504.0).half()
        step = torch.where(scales != 0, scales.float(), torch.ones_like(scales.float()))
        codes = torch.floor(groups / step[..., None] + 0.5).clamp(-8, 7)
        error = (groups - codes * scales.float()[..., None]).double().square().sum(dim=-1)
        if best is None:
            best, best_error = scales, error
            continue
        better = error < best_error
        best, best_error = torch.where(better, scales, best), torch.where(better, error, best_error)
    return best


@pytest.mark.parametrize("rows", [5, 300])  # 300 x 4 groups: more than one slice of the search
def test_searched_scales_are_the_definitions_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    x = rotate_groups(torch.randn(rows, 128, generator=gen) * 3)
    x[0, :GROUP] = 0  # an all-zero group (scale -0.0 from d = 7)
    x[1] = torch.round(x[1] * 2) / 2  # coarse values
    x[2, :GROUP] = 0
    x[2, 3] = 56.0  # exact under d = 7 and d = 8 alike: the first (scale -8) wins the tie
    groups = _groups(x)
    got, want = search_scales(groups, 4), _search_one_divisor_at_a_time(groups)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # signs of zero too
    assert float(got[2, 0]) == -8.0


def test_search_is_the_default_for_rotated_4_bit_only():
    x = _data()
    for bits, rotate in ((4, True), (4, False), (8, True)):
        want = quantize(x, bits, rotate, search=bits == 4 and rotate)
        got = quantize(x, bits, rotate)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(quantize(x, 4, True)[1], quantize(x, 4, True, search=False)[1])


def test_rotation_shrinks_outlier_groups():
    x = _data()
    _, plain = quantize(x, 4, rotate=False)
    _, rotated = quantize(x, 4, rotate=True)
    # channel 5 (x20) dominates group 0: the rotation spreads it over the group
    assert rotated[..., 0].float().mean() < 0.5 * plain[..., 0].float().mean()


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard("cpu")
    assert torch.allclose(h @ h, torch.eye(GROUP), atol=1e-6)
    assert torch.equal(h, h.T)


def test_q4_packing_layout():
    # element j in the low nibble of byte j, element j + 16 in the high nibble, as q + 8
    x = torch.zeros(1, GROUP)
    x[0, 0], x[0, 16], x[0, 3], x[0, 31] = 7.0, -7.0, 1.0, -3.0
    data, scales = quantize(x, 4, rotate=False)
    assert data.shape == (1, 16) and data.dtype == torch.uint8
    assert scales.item() == 1.0
    assert data[0, 0].item() == (7 + 8) | ((-7 + 8) << 4)
    assert data[0, 3].item() == (1 + 8) | (8 << 4)
    assert data[0, 15].item() == 8 | ((-3 + 8) << 4)
    assert torch.equal(dequantize(data, scales, 4), x)


def test_q8_codes_are_int8_within_qmax():
    data, _ = quantize(_data() * 100, 8, rotate=False)
    assert data.dtype == torch.int8 and int(data.abs().max()) == 127


def test_write_slots_and_page_shapes():
    pages = allocate_quant_pages(3, 4, 2, 64, bits=4, rotate=False, device="cpu")
    assert pages.shape == (3, 4, 2, 64)
    assert pages.data.shape == (3, 4, 2, 32) and pages.scales.shape == (3, 4, 2, 2)
    assert pages.bytes_per_slot() == 2 * (32 + 2 * 2)
    x = torch.randn(2, 2, 64)
    write_slots(pages, x, torch.tensor([5, 11]))
    got = dequantize(pages.data[1, 1], pages.scales[1, 1], 4)
    want_data, want_scales = quantize(x[0], 4, rotate=False)
    assert torch.equal(pages.data[1, 1], want_data) and torch.equal(pages.scales[1, 1], want_scales)
    assert torch.all((got - x[0]).abs() <= 0.5 * want_scales.float().repeat_interleave(GROUP, -1))
    assert torch.all(pages.data[0] == 0)


def test_modes_are_validated():
    assert check_quant("q4", None) is True and check_quant("q8", False) is False
    assert check_quant("fp16", None) is False
    with pytest.raises(ValueError, match="'q3'"):
        check_quant("q3", None)
    with pytest.raises(ValueError, match="rotate=True"):
        check_quant("fp16", True)
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        allocate_quant_pages(1, 4, 1, 48, bits=8, rotate=False, device="cpu")
    assert isinstance(allocate_quant_pages(1, 4, 1, 32, 8, False, "cpu"), QuantPages)


@pytest.mark.parametrize("lead", [(2, 5), (9,)])
def test_put_rows_in_place_and_by_where_agree(lead):
    """The CPU's in-place put (only the hits' rows read) and the device's torch.where give the
    same tensor; neither touches the source, and the rows cast to out's dtype."""
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(*lead, 4, 3, 8, generator=gen).half()
    source = torch.randn(6, 4, 3, 8, generator=gen)
    hit = torch.rand(lead, generator=gen) < 0.4
    hit.view(-1)[0] = True
    at = torch.randint(0, 6, lead, generator=gen)
    by_where = put_rows(out.clone(), hit, source, at, in_place=False)
    in_place = put_rows(out.clone(), hit, source, at, in_place=True)
    assert torch.equal(by_where, in_place) and by_where.dtype == torch.float16
    assert torch.equal(in_place[hit], source[at[hit]].half())
    assert torch.equal(in_place[~hit], out[~hit])
