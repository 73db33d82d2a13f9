"""The CPU kernels' vector code (engine/cpu/simd.py): a group's values equal the cache's own
unpacking (engine/cache/quant.py) times the scale, bit for bit, land where the index tuples say
and nowhere else; a block's dot products and weighted sums are numpy's (float64) within float32
rounding, for every row count and head size the kernels pass, written only where they belong;
and calls the intrinsics do not type are refused."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from numba.core.errors import TypingError

from engine.cache.quant import GROUP, _pack
from engine.cpu.simd import (
    BYTES_4BIT,
    dequantize_4bit_group,
    dequantize_8bit_group,
    rounding_error,
    score_rows,
    weigh_rows,
)


@numba.njit
def _rows_4bit(codes, scales, out):
    """out [T, G * 32] from codes [T, KV=2, G * 16] of head 1 (a 4-D index), groups by row."""
    for t in range(codes.shape[0]):
        for g in range(scales.shape[1]):
            dequantize_4bit_group(codes, (t, 1, g * BYTES_4BIT), out, (t, g * GROUP), scales[t, g])


@numba.njit
def _rows_8bit(codes, scales, out):
    for t in range(codes.shape[0]):
        for g in range(scales.shape[1]):
            dequantize_8bit_group(codes, (t, 1, g * GROUP), out, (t, g * GROUP), scales[t, g])


def _codes(bits: int, rows: int, groups: int, seed: int) -> torch.Tensor:
    """int8 codes [rows, groups * 32] over the whole range of ``bits``, extremes included."""
    limit = 1 << (bits - 1)
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-limit, limit, (rows, groups * GROUP), generator=gen, dtype=torch.int8)
    codes[0, 0], codes[0, 1] = -limit, limit - 1
    return codes


def _packed(codes: torch.Tensor, bits: int) -> np.ndarray:
    """The cache's bytes for int8 codes [rows, groups * 32]."""
    groups = codes.float().reshape(codes.shape[0], -1, GROUP)
    return _pack(groups, bits).view(torch.uint8).numpy()


def _scales(rows: int, groups: int) -> np.ndarray:
    """float16 scales (as float32): normal, tiny (subnormal float16) and zero."""
    values = np.random.default_rng(3).lognormal(-4, 3, (rows, groups)).astype(np.float16)
    values[0, 0], values[-1, -1] = np.float16(6e-8), np.float16(0.0)
    return values.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_groups_equal_the_caches_unpacking_times_the_scale(bits: int) -> None:
    rows, groups = 7, 4
    codes = _codes(bits, rows, groups, seed=bits)
    scales = _scales(rows, groups)
    packed = _packed(codes, bits)  # [rows, W]
    pages = np.zeros((rows, 2, packed.shape[1]), np.uint8)  # KV head 0 left zero
    pages[:, 1] = packed
    expected = codes.float().numpy() * np.repeat(scales, GROUP, axis=1)
    out = np.full((rows, groups * GROUP), np.nan, np.float32)
    (_rows_4bit if bits == 4 else _rows_8bit)(pages, scales, out)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_group_writes_its_32_values_and_nothing_else(bits: int) -> None:
    codes = _codes(bits, 1, 1, seed=7)
    packed = _packed(codes, bits)
    pages = np.zeros((1, 2, packed.shape[1]), np.uint8)
    pages[0, 1] = packed
    out = np.full((1, 3 * GROUP), -1.0, np.float32)

    @numba.njit
    def middle(codes, out, scale):
        if bits == 4:
            dequantize_4bit_group(codes, (0, 1, 0), out, (0, GROUP), scale)
        else:
            dequantize_8bit_group(codes, (0, 1, 0), out, (0, GROUP), scale)

    middle(pages, out, np.float32(0.5))
    assert np.array_equal(out[0, GROUP : 2 * GROUP], codes[0].float().numpy() * 0.5)
    assert (out[0, :GROUP] == -1.0).all() and (out[0, 2 * GROUP :] == -1.0).all()


def test_calls_it_does_not_type_are_refused() -> None:
    @numba.njit
    def wrong_dtype(codes, out):
        dequantize_4bit_group(codes, (0,), out, (0,), np.float32(1.0))

    @numba.njit
    def short_index(codes, out):
        dequantize_8bit_group(codes, (0,), out, (0,), np.float32(1.0))

    with pytest.raises(TypingError):
        wrong_dtype(np.zeros(16, np.int8), np.zeros(32, np.float32))
    with pytest.raises(TypingError):
        short_index(np.zeros((2, 32), np.uint8), np.zeros(32, np.float32))


def _rounding_error_by_numpy(x: np.ndarray, step: np.float32, low: float, high: float) -> float:
    """The intrinsic's arithmetic in numpy: float32 quotient, +0.5, floor, clamp, float32
    residual; squares in float64 summed per lane (element j in lane j % 8), lanes pairwise."""
    q = np.clip(np.floor((x / step).astype(np.float32) + np.float32(0.5)), low, high)
    residual = (x - (q * step).astype(np.float32)).astype(np.float32).astype(np.float64)
    lanes = np.zeros(8)
    for part in range(GROUP // 8):
        lanes = lanes + residual[part * 8 : part * 8 + 8] ** 2
    while len(lanes) > 1:
        lanes = lanes[: len(lanes) // 2] + lanes[len(lanes) // 2 :]
    return float(lanes[0])


@numba.njit
def _errors(values, steps, low, high, out):
    for i in range(steps.shape[0]):
        out[i] = rounding_error(values, (i % values.shape[0], 0), steps[i], low, high)


def test_rounding_error_is_the_scale_searchs_sum_of_squared_residuals() -> None:
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((6, GROUP)) * rng.lognormal(0, 2, (6, 1))).astype(np.float32)
    values[0, :4] = [0.0, -0.0, 1e-30, -3e4]  # zeros, a value far below and one far past range
    tops = np.abs(values).max(axis=1)
    steps = np.concatenate([tops / 7.5, tops / 9.0, tops / 2.0, [1.0] * 6]).astype(np.float32)
    out = np.zeros(len(steps))
    _errors(values, steps, np.float32(-8.0), np.float32(7.0), out)
    expected = [
        _rounding_error_by_numpy(values[i % 6], steps[i], -8.0, 7.0) for i in range(len(steps))
    ]
    assert out.tolist() == expected
    assert (out[12:] > 0).all()  # steps of 1: values past the codes clamp, with a residual


def test_rounding_error_refuses_other_types() -> None:
    @numba.njit
    def float64_values(values):
        return rounding_error(values, (0,), np.float32(1.0), np.float32(-8.0), np.float32(7.0))

    with pytest.raises(TypingError):
        float64_values(np.zeros(GROUP))


@numba.njit
def _score_and_weigh(scores, query, weights, out, block, count):
    """Row 1 of each target from row 1 of query and weights (row 0 and 2 must stay as they
    were), after slot 2 of the scores (slots 0, 1 and past 2 + count likewise)."""
    score_rows(scores, (1, 2), query, (1, 0), block, count)
    weigh_rows(out, (1, 0), weights, (1, 2), block, count)


# head sizes: one vector, two, five (no whole pass of 32 floats in the weighted sum: its tail
# alone), SmolLM2's, 8B's, 256; row counts: none, one, below, at and past a group of 8, pages
@pytest.mark.parametrize("dim", [8, 16, 40, 64, 128, 256])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 16, 17])
def test_block_dot_products_and_weighted_sums_are_numpys(dim: int, count: int) -> None:
    rng = np.random.default_rng(dim * 100 + count)
    rows = max(count, 1)
    block = rng.standard_normal((rows, dim)).astype(np.float32)
    query = rng.standard_normal((3, dim)).astype(np.float32)
    weights = rng.random((3, count + 4)).astype(np.float32)
    scores = np.full((3, count + 4), np.nan, np.float32)
    out = rng.standard_normal((3, dim)).astype(np.float32)
    before = out.copy()
    _score_and_weigh(scores, query, weights, out, block, count)

    used = block[:count].astype(np.float64)
    expected_scores = used @ query[1].astype(np.float64)
    expected_out = before[1] + weights[1, 2 : 2 + count].astype(np.float64) @ used
    tol = 1e-5 * (np.sqrt(dim) + np.sqrt(count) + 1)
    np.testing.assert_allclose(scores[1, 2 : 2 + count], expected_scores, rtol=0, atol=tol)
    np.testing.assert_allclose(out[1], expected_out, rtol=0, atol=tol)
    assert np.isnan(scores[[0, 2]]).all() and np.isnan(scores[1, :2]).all()
    assert np.isnan(scores[1, 2 + count :]).all()
    assert np.array_equal(out[[0, 2]], before[[0, 2]])


def test_block_calls_it_does_not_type_are_refused() -> None:
    @numba.njit
    def float64_block(out, rows, block):
        score_rows(out, (0,), rows, (0,), block, 1)

    @numba.njit
    def strided_block(out, rows, block):
        weigh_rows(out, (0,), rows, (0,), block[:, ::2], 1)

    out, rows = np.zeros(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(TypingError):
        float64_block(out, rows, np.zeros((2, 8)))
    with pytest.raises(TypingError):
        strided_block(out, rows, np.zeros((2, 16), np.float32))
