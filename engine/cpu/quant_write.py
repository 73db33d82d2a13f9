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
float16 by LLVM's conversion to half and back (``bits.float16_rounded``, one instruction each
where the CPU has them; rounding on the float32's bits by hand had taken a fifth of the
search) and stored as its bits. Each candidate's error is one piece of vector code
(``simd.rounding_error``), all candidates before the choice (SmolLM2's K/V rows, one thread:
11.3 -> 8.8 ns per value written). Rows of sink and recent pages are kept unquantized by the
kernel too when they are float32 (the rows it centered and rotated), else by the reference's
own code.
"""

from __future__ import annotations

import functools
import math

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
from engine.cpu.bits import float16_bits, float16_rounded
from engine.cpu.hadamard import rotate_row
from engine.cpu.simd import rounding_error
from engine.cpu.team import share
from engine.numba_cache import cached_njit

_DIVISORS = np.array(SEARCH_DIVISORS, np.float32)


@cached_njit
def _step(scale):
    """The divisor a scale quantizes by: the scale, or 1 for a zero scale (an all-zero group,
    or one below float16's range: every code 0), as ``quant._codes`` takes it."""
    return np.float32(scale) if scale != 0 else np.float32(1.0)


@cached_njit
def _code(x, step, low, high):
    """``floor(x / step + 0.5)`` in float32 steps, clamped to [low, high]."""
    q = math.floor(np.float32(np.float32(x / step) + np.float32(0.5)))
    return min(max(q, low), high)


@cached_njit
def _searched_scale(group, low, high, divisors, errors):
    """quant.search_scales for one group: (scale value, float16 bits). Every candidate's
    error first (into ``errors``), then the first least: with the choice inside the loop each
    candidate waited on the last one's comparison, its long chain of divisions and sums
    no longer overlapping the next one's."""
    first = 0
    for j in range(1, group.shape[0]):
        if abs(group[j]) > abs(group[first]):
            first = j
    m = group[first]
    for i in range(divisors.shape[0]):
        value, _ = _candidate_scale(m, divisors[i])
        # the squares of float32 residuals are exact in float64, so their sum rarely rounds
        # at all, in whatever order (quant.search_scales' argument)
        errors[i] = rounding_error(group, (0,), _step(value), np.float32(low), np.float32(high))
    best = 0
    for i in range(1, divisors.shape[0]):
        if errors[i] < errors[best]:  # (the first least on a tie)
            best = i
    return _candidate_scale(m, divisors[best])


@cached_njit
def _candidate_scale(top, divisor):
    """The scale ``top / -divisor``, within float16's range, rounded to float16: (value,
    bits)."""
    c = np.float32(top / np.float32(-divisor))
    return float16_rounded(min(max(c, np.float32(-FP16_MAX)), np.float32(FP16_MAX)))


@cached_njit
def _absmax_scale(group, high):
    top = np.float32(0.0)
    for j in range(group.shape[0]):
        top = max(top, abs(group[j]))
    return float16_rounded(min(np.float32(top / np.float32(high)), np.float32(FP16_MAX)))


@cached_njit
def _centered_rotated(row, center, rotate, out):
    """out [D] = row [D] less center [D] (zeros for pages without one: x - 0 is x, signed
    zeros included), each group of 32 then times H (``rotate``): ``quant.centered`` and
    ``quant.hadamard_butterflies``'s arithmetic, in their order (no fastmath: no operation
    may be fused or reordered)."""
    for e in range(row.shape[0]):
        out[e] = row[e] - center[e]
    if rotate:
        rotate_row(out)


@cached_njit(nogil=True)
def _write_rows(
    rows, center, rotate, bits, search, slots, data, scales, divisors, sinks, sink_slots,
    first, last,
):  # fmt: skip
    """rows float32 [T, KV, D] [first, last) -> centered (less center [KV, D], zeros for
    none) and rotated (``rotate``) groups of 32 -> codes into data [N, KV, W] (uint8 view)
    and float16 bits into scales [N, KV, D / 32] (uint16 view) at rows ``slots`` [T]; a slot
    below ``sink_slots`` (a sink or recent page's) also keeps those float32 values in sinks
    [sink_slots, KV, D], as ``quant.write_sink_rows`` stores them."""
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.empty(GROUP, np.int64)
    errors = np.empty(divisors.shape[0])  # the search's, per candidate scale
    values = np.empty(rows.shape[2], np.float32)
    for t in range(first, last):
        slot = slots[t]
        for kvh in range(rows.shape[1]):
            _centered_rotated(rows[t, kvh], center[kvh], rotate, values)
            if slot < sink_slots:
                sinks[slot, kvh, :] = values
            for g in range(rows.shape[2] // GROUP):
                group = values[g * GROUP : (g + 1) * GROUP]
                if search:
                    value, bits16 = _searched_scale(group, low, high, divisors, errors)
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


# Writes of this many rows or more (prompt chunks) are shared among torch's threads
# (engine/cpu/team.py); fewer are as fast on this thread alone (SmolLM2's K rows, a call after
# a torch matmul, 2 threads, alone -> shared: 8 rows 72 -> 83 us, 16 85 -> 91, 32 110 -> 105,
# 64 164 -> 129, 128 274 -> 188).
SHARED_ROWS = 32


def write_slots_cpu(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """``quant.write_slots`` on the CPU (same codes, scales and unquantized rows), the codes
    and scales by ``_write_rows``, over rows shared among torch's threads when there are
    ``SHARED_ROWS`` or more (each row its own slot, so no two threads write one byte)."""
    check_head_dim(x.shape[-1])
    rows = x.float().contiguous().numpy()
    no_center = pages.center is None
    center = _no_center(x.shape[1], x.shape[2]) if no_center else pages.center.numpy()
    slot_ids = slots.long().numpy()
    flat_data = pages.data.view(-1, *pages.data.shape[2:]).view(torch.uint8).numpy()
    scales = float16_bits(pages.scales.view(-1, *pages.scales.shape[2:]))
    search = searches(pages.bits, pages.rotate)
    # float32 rows of sink and recent pages (a float32 model's) are stored by the kernel too;
    # others by the reference (~120 us per call of a decode step in torch ops: SmolLM2's 8
    # rows, 30 layers x K and V, ~5% of q4's CPU decode time)
    in_kernel = pages.sinks is not None and pages.sinks.dtype == torch.float32
    if in_kernel:
        sinks = pages.sinks.view(-1, *pages.sinks.shape[2:]).numpy()
        sink_slots = pages.num_sink_pages * pages.sinks.shape[1]
    else:
        sinks, sink_slots = _no_sinks(x.shape[1], x.shape[2]), 0

    args = (
        rows, center, pages.rotate, pages.bits, search, slot_ids, flat_data, scales, _DIVISORS,
        sinks, sink_slots,
    )  # fmt: skip
    if len(slot_ids) >= SHARED_ROWS:
        share(_write_rows, args, len(slot_ids))
    else:
        _write_rows(*args, 0, len(slot_ids))
    if pages.sinks is not None and not in_kernel:
        write_sink_rows(pages, centered(pages, x), slots)


@functools.cache
def _no_center(kv_heads: int, head_dim: int) -> np.ndarray:
    """A center of zeros for pages without one (the kernel's argument types stay fixed)."""
    return np.zeros((kv_heads, head_dim), np.float32)


@functools.cache
def _no_sinks(kv_heads: int, head_dim: int) -> np.ndarray:
    """Sink rows for pages without float32 ones (never written: no slot is below 0)."""
    return np.zeros((1, kv_heads, head_dim), np.float32)
