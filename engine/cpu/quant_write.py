"""The quantized cache write on the CPU: each row's codes and scales (engine/cache/quant.py's
``quantize``, the 4-bit scale search included) made by a Numba kernel and stored in their
slots, instead of the torch reference's ~50 small tensor ops per call, which made a q4 cache's
decode write cost 5x fp16's (SmolLM2, a decode step of 8 rows: 0.85 against 0.16 ms per
layer; 0.37 ms with this kernel, the rest being rotary, centering, the rotation's matmul).

Same codes and scales as the reference, bit for bit: the rows are centered and rotated by the
reference's own torch code (``quant.rotated_groups``), then per group the kernel takes the
same float32 steps (the scale's division, its rounding to float16 to nearest even, the codes'
``floor(x / scale + 0.5)``) and sums each candidate's squared error in float64 from float32
residuals, keeping the first least. Numba has no float16 on the CPU: a scale is rounded to
float16 in float64 arithmetic (exact: a float32 has 24 significant bits) and stored as its
bits. Rows of sink and recent pages are kept unquantized by the reference's own code too.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from engine.cache.quant import (
    FP16_MAX,
    SEARCH_DIVISORS,
    QuantPages,
    centered,
    rotated_groups,
    searches,
    write_sink_rows,
)

_DIVISORS = np.array(SEARCH_DIVISORS, np.float32)


@numba.njit(cache=True)
def _half(x):
    """float32 ``x`` (within float16's range) rounded to float16, to nearest even: (its value
    as a float64, its bits)."""
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(np.float64(x))
    if a < 2.0**-14:  # subnormal: a multiple of 2^-24 (1024 of them is the least normal)
        units = round(a * 2.0**24)
        return math.copysign(units * 2.0**-24, x), sign | units
    frac, exp = math.frexp(a)  # a = frac * 2^exp, 0.5 <= frac < 1
    units = round(frac * 2048.0)  # 11 significant bits
    if units == 2048:
        units, exp = 1024, exp + 1
    value = math.ldexp(np.float64(units), exp - 11)
    return math.copysign(value, x), sign | ((exp + 14) << 10) | (units - 1024)


@numba.njit(cache=True)
def _code(x, step, low, high):
    """``floor(x / step + 0.5)`` in float32 steps, clamped to [low, high]."""
    q = math.floor(np.float32(np.float32(x / step) + np.float32(0.5)))
    return min(max(q, low), high)


@numba.njit(cache=True, fastmath={"reassoc"})
def _candidate_error(group, step, low, high):
    """The sum of the group's squared residuals under ``step``: float32 residuals (exact
    products less x, rounded once), squared exactly in float64 and summed in any order
    (reassociation lets LLVM vectorize it; the squares of float32 values are exact in
    float64, so the sum rarely rounds at all: quant.search_scales' argument)."""
    total = 0.0
    for j in range(group.shape[0]):
        x = group[j]
        q = min(max(np.floor(np.float32(x / step) + np.float32(0.5)), low), high)
        r = np.float64(np.float32(x - np.float32(q * step)))
        total += r * r
    return total


@numba.njit(cache=True)
def _searched_scale(group, low, high, divisors):
    """quant.search_scales for one group: (scale value, float16 bits)."""
    first = 0
    for j in range(1, group.shape[0]):
        if abs(group[j]) > abs(group[first]):
            first = j
    m = group[first]
    best, best_bits, best_error = 0.0, 0, np.inf
    for i in range(divisors.shape[0]):
        c = np.float32(m / np.float32(-divisors[i]))
        c = min(max(c, np.float32(-FP16_MAX)), np.float32(FP16_MAX))
        value, bits = _half(c)
        step = np.float32(value) if value != 0 else np.float32(1.0)
        error = _candidate_error(group, step, np.float32(low), np.float32(high))
        if error < best_error:  # (the first least on a tie)
            best, best_bits, best_error = value, bits, error
    return best, best_bits


@numba.njit(cache=True)
def _absmax_scale(group, high):
    top = np.float32(0.0)
    for j in range(group.shape[0]):
        top = max(top, abs(group[j]))
    return _half(min(np.float32(top / np.float32(high)), np.float32(FP16_MAX)))


@numba.njit(nogil=True, cache=True)
def _write_rows(groups, bits, search, slots, data, scales, divisors):
    """groups float32 [T, KV, G, 32] (centered, rotated) -> codes into data [N, KV, W] (uint8
    view) and float16 bits into scales [N, KV, G] (uint16 view) at rows ``slots`` [T]."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.empty(groups.shape[3], np.int64)
    for t in range(groups.shape[0]):
        slot = slots[t]
        for kvh in range(groups.shape[1]):
            for g in range(groups.shape[2]):
                group = groups[t, kvh, g]
                if search:
                    value, bits16 = _searched_scale(group, low, high, divisors)
                else:
                    value, bits16 = _absmax_scale(group, high)
                scales[slot, kvh, g] = bits16
                step = np.float32(value) if value != 0 else np.float32(1.0)
                for j in range(group.shape[0]):
                    codes[j] = _code(group[j], step, low, high)
                if bits == 8:
                    base = g * group.shape[0]
                    for j in range(group.shape[0]):
                        data[slot, kvh, base + j] = codes[j] & 0xFF
                else:
                    half = group.shape[0] // 2
                    base = g * half
                    for j in range(half):
                        data[slot, kvh, base + j] = (codes[j] + 8) | ((codes[j + half] + 8) << 4)


def write_slots_cpu(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """``quant.write_slots`` on the CPU (same codes, scales and unquantized rows), the codes
    and scales by ``_write_rows``."""
    x = centered(pages, x)
    groups = rotated_groups(x, pages.rotate)
    flat_data = pages.data.view(-1, *pages.data.shape[2:]).view(torch.uint8)
    flat_scales = pages.scales.view(-1, *pages.scales.shape[2:]).view(torch.int16)
    _write_rows(
        groups.contiguous().numpy(),
        pages.bits,
        searches(pages.bits, pages.rotate),
        slots.long().numpy(),
        flat_data.numpy(),
        flat_scales.numpy().view(np.uint16),
        _DIVISORS,
    )
    if pages.sinks is not None:
        write_sink_rows(pages, x, slots)
