"""The quantized cache write on the CPU: each row's codes and scales (engine/cache/quant.py's
``quantize``, the 4-bit scale search included) made by a Numba kernel and stored in their
slots, instead of the torch reference's ~50 small tensor ops per call, which made a q4 cache's
decode write cost 5x fp16's (SmolLM2, a decode step of 8 rows: 0.85 against 0.16 ms per
layer; 0.26 ms with this kernel, the rest being rotary, centering, the rotation's matmul).

Same codes and scales as the reference, bit for bit: per row and KV head the kernel takes the
reference's float32 steps, the center taken off (``quant.centered``), the Hadamard rotation by
the same five butterfly stages (``quant.hadamard_butterflies``), then per group the scale's
division, its rounding to float16 to nearest even and the codes' ``floor(x / scale + 0.5)``,
summing each candidate's squared error in float64 from float32 residuals and keeping the first
least. (Until stop 50 the centering and a matmul rotation ran as torch ops before the kernel:
four ops and a copy per call, ~0.1 ms of a decode step's 0.16 ms write per layer, K or V.)
Numba has no float16 on the CPU: a scale is rounded to
float16 on its float32 bits (engine/cpu/bits.py; libm's frexp took a fifth of the search)
and stored as its bits. Rows of sink and recent pages are kept unquantized by the
reference's own code too.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from engine.cache.quant import (
    FP16_MAX,
    GROUP,
    SEARCH_DIVISORS,
    QuantPages,
    centered,
    check_head_dim,
    searches,
    write_sink_rows,
)
from engine.cpu.bits import bits_from_float, float16_bits, float_from_bits
from engine.cpu.hadamard import rotate_row
from engine.cpu.turns import in_turns

_DIVISORS = np.array(SEARCH_DIVISORS, np.float32)


@numba.njit(cache=True)
def _half(x):
    """float32 ``x`` (within float16's range) rounded to float16, to nearest even: (its value
    as a float64, its bits). On the float32's bits: the 13 (or, below float16's normal range,
    more) low significand bits dropped, rounding up past half and on half to an even result;
    a carry into the exponent is the next binade's first value, as in the bits themselves."""
    b = bits_from_float(np.float32(x))
    sign = (b >> 16) & 0x8000
    exponent = (b >> 23) & 0xFF  # biased by 127; float16's by 15
    significand = (b & 0x7FFFFF) | (0x800000 if exponent else 0)
    # units of float16's last place: 2^-24 below its normal range (exponent < 113), else
    # 2^(exponent - 137), of which the first 1024 are implicit
    shift = 126 - exponent if exponent < 113 else 13
    units = 0 if shift > 24 else _round_shift(significand, shift)  # (below 2^-25: zero)
    if exponent < 113:
        value = units * 2.0**-24
        bits = sign | units  # (1024 units: the least normal's bits, as float16 has them)
    else:
        bits = sign | (((exponent - 112) << 10) + units - 1024)
        value = np.float64(float_from_bits(np.int32((exponent - 10) << 23))) * units  # 2^(e-137)
    return (-value if sign else value), bits


@numba.njit(cache=True)
def _round_shift(n, shift):
    """round(n / 2^shift) to nearest even, for a non-negative integer n."""
    kept = n >> shift
    rest = n & ((1 << shift) - 1)
    halfway = 1 << (shift - 1)
    if rest > halfway or (rest == halfway and kept & 1):
        kept += 1
    return kept


@numba.njit(cache=True)
def _step(scale):
    """The divisor a scale quantizes by: the scale, or 1 for a zero scale (an all-zero group,
    or one below float16's range: every code 0), as ``quant._codes`` takes it."""
    return np.float32(scale) if scale != 0 else np.float32(1.0)


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
        error = _candidate_error(group, _step(value), np.float32(low), np.float32(high))
        if error < best_error:  # (the first least on a tie)
            best, best_bits, best_error = value, bits, error
    return best, best_bits


@numba.njit(cache=True)
def _absmax_scale(group, high):
    top = np.float32(0.0)
    for j in range(group.shape[0]):
        top = max(top, abs(group[j]))
    return _half(min(np.float32(top / np.float32(high)), np.float32(FP16_MAX)))


@numba.njit(cache=True)
def _centered_rotated(row, center, rotate, out):
    """out [D] = row [D] less center [D] (zeros for pages without one: x - 0 is x, signed
    zeros included), each group of 32 then times H (``rotate``): ``quant.centered`` and
    ``quant.hadamard_butterflies``'s arithmetic, in their order (no fastmath: no operation
    may be fused or reordered)."""
    for e in range(row.shape[0]):
        out[e] = row[e] - center[e]
    if rotate:
        rotate_row(out)


@numba.njit(nogil=True, cache=True)
def _write_rows(rows, center, rotate, bits, search, slots, data, scales, divisors):
    """rows float32 [T, KV, D] -> centered (less center [KV, D], zeros for none) and
    rotated (``rotate``) groups of 32 -> codes into data [N, KV, W] (uint8 view) and float16
    bits into scales [N, KV, D / 32] (uint16 view) at rows ``slots`` [T]."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.empty(GROUP, np.int64)
    values = np.empty(rows.shape[2], np.float32)
    for t in range(rows.shape[0]):
        slot = slots[t]
        for kvh in range(rows.shape[1]):
            _centered_rotated(rows[t, kvh], center[kvh], rotate, values)
            for g in range(rows.shape[2] // GROUP):
                group = values[g * GROUP : (g + 1) * GROUP]
                if search:
                    value, bits16 = _searched_scale(group, low, high, divisors)
                else:
                    value, bits16 = _absmax_scale(group, high)
                scales[slot, kvh, g] = bits16
                step = _step(value)
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


# Writes of this many rows or more (prompt chunks) are shared among torch's threads; a decode
# step's few rows take ~15 us on one (SmolLM2, 8 rows), less than a pool thread's wake-up.
SHARED_ROWS = 64


def write_slots_cpu(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """``quant.write_slots`` on the CPU (same codes, scales and unquantized rows), the codes
    and scales by ``_write_rows``, over rows taken in turn by torch's threads when there are
    ``SHARED_ROWS`` or more (each row its own slot, so no two threads write one byte)."""
    check_head_dim(x.shape[-1])
    rows = x.float().contiguous().numpy()
    no_center = pages.center is None
    center = _no_center(x.shape[1], x.shape[2]) if no_center else pages.center.numpy()
    slot_ids = slots.long().numpy()
    flat_data = pages.data.view(-1, *pages.data.shape[2:]).view(torch.uint8).numpy()
    scales = float16_bits(pages.scales.view(-1, *pages.scales.shape[2:]))
    search = searches(pages.bits, pages.rotate)

    def write(first: int, last: int) -> None:
        part, ids = rows[first:last], slot_ids[first:last]
        _write_rows(
            part, center, pages.rotate, pages.bits, search, ids, flat_data, scales, _DIVISORS,
        )  # fmt: skip

    if len(slot_ids) >= SHARED_ROWS:
        in_turns(write, len(slot_ids))
    else:
        write(0, len(slot_ids))
    if pages.sinks is not None:
        write_sink_rows(pages, centered(pages, x), slots)


@functools.cache
def _no_center(kv_heads: int, head_dim: int) -> np.ndarray:
    """A center of zeros for pages without one (the kernel's argument types stay fixed)."""
    return np.zeros((kv_heads, head_dim), np.float32)
