"""The quantized-page kernels (engine/cuda/quant_kernels.py) against their torch references
(engine/cuda/quant_reference.py): the fused rotary + quantizing cache write, and the paged
attention reading q8/q6/q4 pages in place (decode, prefill, chunked prefill, split keys).

Without a GPU they run in the simulator: head_dim 32 (one quantization group), page size 4,
contexts of a few pages.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.cache.page_table import RECENT_BLOCKS
from engine.cache.quant import (
    GROUP,
    QUANT_BITS,
    SEARCH_DIVISORS,
    QuantPages,
    allocate_quant_pages,
    rotate_groups,
    write_slots,
)
from engine.cuda import attention, quant_kernels
from engine.cuda._launch import SIMULATOR
from engine.cuda.kv_load import reads_words
from engine.cuda.quant_kernels import paged_attention_quant_cuda, quant_rotary_cache_write_cuda
from engine.cuda.quant_reference import (
    quant_paged_attention_reference,
    quant_rotary_cache_write_reference,
)
from tests.kernels.common import DEVICE, TOL, emulate_warp_shuffles
from tests.kernels.test_attention import make_case, rel_error
from tests.kernels.test_rotary_cache_write import make_inputs


def _pages(
    quant: str,
    rotate: bool,
    num_pages: int,
    page_size: int,
    kv_heads: int,
    dim: int,
    center: torch.Tensor | None = None,
):
    k_bits, v_bits = QUANT_BITS[quant]
    return [
        allocate_quant_pages(num_pages, page_size, kv_heads, dim, k_bits, rotate, DEVICE, center),
        allocate_quant_pages(num_pages, page_size, kv_heads, dim, v_bits, rotate, DEVICE),
    ]


def _copy(p: QuantPages) -> QuantPages:
    return dataclasses.replace(p, data=p.data.clone(), scales=p.scales.clone())


# --- cache write ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "rotate", "dtype", "centered"),
    [
        ("q8", False, torch.float32, False),
        ("q4", False, torch.float16, False),
        ("q6", True, torch.float32, False),
        ("q4", False, torch.float32, True),
        ("q8", True, torch.float16, True),
    ],
)
def test_cache_write_matches_reference(quant, rotate, dtype, centered):
    torch.manual_seed(0)
    # two KV heads of two query heads each: a block per (token, KV head) finds its heads
    q, k, v, cos, sin, _, _ = make_inputs(3, 4, 2, 2 * GROUP, 4, 4, dtype)
    center = torch.randn(2, 2 * GROUP, device=DEVICE) if centered else None
    k_pages, v_pages = _pages(quant, rotate, 4, 4, 2, 2 * GROUP, center)
    ref_k, ref_v = _copy(k_pages), _copy(v_pages)
    slots = torch.tensor([5, -1, 14], device=DEVICE)  # the middle token is padding
    ref_q = quant_rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    out = quant_rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    assert rel_error(out, ref_q) <= TOL[dtype]
    for got, want in ((k_pages, ref_k), (v_pages, ref_v)):
        if not rotate or DEVICE == "cpu":
            # the same float32 operations in the same order, the rotation's butterflies
            # included (quant.hadamard_butterflies, since stop 50): identical codes
            assert torch.equal(got.scales, want.scales)
            assert torch.equal(got.data, want.data)
            continue
        # A GPU may still round a rotated group's search differently (the trials' float64
        # sums, untimed and unchecked there since stop 50): scales agree to fp16 rounding and
        # a code may land one step over at a rounding boundary.
        assert torch.allclose(got.scales.float(), want.scales.float(), rtol=2e-3, atol=0)
        diff = _codes(got) - _codes(want)
        assert diff.abs().max() <= 1 and (diff != 0).float().mean() < 0.05
    written = torch.zeros(16, dtype=torch.bool)
    written[[5, 14]] = True
    scales = k_pages.scales.reshape(16, -1)
    assert torch.all(scales[~written] == 0) and torch.all(scales[written] != 0)


def test_q4_scale_search_matches_reference():
    """The kernel's scale search for rotated 4-bit groups (quant.search_scales) picks the
    reference's scale for every group (most divisors and both signs get chosen here: tokens
    with an outlier channel and without), and the codes are identical."""
    torch.manual_seed(1)
    tokens, kv_heads, dim = 16, 2, 2 * GROUP
    q, k, v, cos, sin, _, _ = make_inputs(tokens, 2, kv_heads, dim, 8, 4, torch.float32)
    k, v = k.clone(), v.clone()
    k[::3, :, 5] *= 12  # an outlier channel in some tokens' first group
    v[1::4, 1, 40] *= -30
    k_pages, v_pages = _pages("q4", True, 4, 4, kv_heads, dim)
    ref_k, ref_v = _copy(k_pages), _copy(v_pages)
    slots = torch.arange(tokens, device=DEVICE)
    quant_rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    quant_rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    for got, want in ((k_pages, ref_k), (v_pages, ref_v)):
        if DEVICE == "cpu":  # the reference's own butterflies: codes exactly
            assert torch.equal(got.scales, want.scales)
            assert torch.equal(got.data, want.data)
            continue
        # a GPU may round a rotated value differently (summation order, FMA): a group's
        # choice can flip only between candidates within rounding of the same error
        same = got.scales == want.scales
        assert same.float().mean() > 0.95
        diff = _codes(got) - _codes(want)
        assert diff.abs().max() <= 1 or not same.all()
    # V is written as given (no rotary), rotated per group: the divisor each group chose is
    # |m| / |scale|
    groups = rotate_groups(v.float()).reshape(-1, GROUP)
    m = groups.gather(-1, groups.abs().argmax(dim=-1, keepdim=True))[:, 0]
    chosen = m.abs() / ref_v.scales.reshape(-1).float().abs()
    nearest = (chosen[:, None] - torch.tensor(SEARCH_DIVISORS, device=DEVICE)).abs().argmin(-1)
    assert len(set(nearest.tolist())) >= 6
    scales = torch.cat((ref_k.scales, ref_v.scales)).reshape(-1).float()
    assert (scales > 0).any() and (scales < 0).any()
    assert torch.cat((_codes(ref_k), _codes(ref_v))).min() == 0  # code -8, never in absmax


def test_q4_scale_search_takes_the_first_of_tied_largest_elements():
    """Two elements of a rotated group tie in magnitude with opposite signs: m is the first
    (as torch's argmax), so the scale -m / d takes the other sign than the second's would.
    The group's values are the 32-point transform of integers, so the kernel's butterflies
    give 32 z / sqrt(32) exactly and the tie survives rounding."""
    torch.manual_seed(4)
    q, k, v, cos, sin, _, _ = make_inputs(1, 1, 1, GROUP, 1, 4, torch.float32)
    z = torch.zeros(GROUP)
    z[3], z[20], z[7], z[11] = 3.0, -3.0, 1.0, -2.0
    signs = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(GROUP)]
                          for i in range(GROUP)], dtype=torch.float32)  # fmt: skip
    v = v.clone()
    v[0, 0] = (signs @ z).to(DEVICE)  # integers: exact in float32
    k_pages, v_pages = _pages("q4", True, 1, 4, 1, GROUP)
    ref_k, ref_v = _copy(k_pages), _copy(v_pages)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    quant_rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    quant_rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    assert ref_v.scales[0, 0, 0, 0] < 0  # m = +3 * 32 / sqrt(32), the first of the pair
    assert torch.equal(v_pages.scales, ref_v.scales)
    assert torch.equal(v_pages.data, ref_v.data)


@pytest.mark.parametrize("threads", [128])
def test_cache_write_is_the_same_at_other_block_sizes(monkeypatch, threads):
    """A warp writes a group of 32 values, and a block with fewer warps than groups runs them
    in turn: a block of 4 warps, one per group here as on a GPU (bench/cache_write_kernel.py
    --threads; the simulator otherwise runs one warp, which takes the 4 groups in turn)
    stores the same codes, scales and sink rows and returns the same q as one warp, and q's
    rotation strides over the block's threads."""
    torch.manual_seed(3)
    tokens, kv_heads, dim = 3, 2, 2 * GROUP
    q, k, v, cos, sin, _, _ = make_inputs(tokens, 2, kv_heads, dim, 8, 4, torch.float32)
    slots = torch.tensor([1, 6, 9], device=DEVICE)
    outputs = []
    for forced in (None, threads):
        monkeypatch.setattr(quant_kernels, "_FORCE_WRITE_THREADS", forced)
        pages = [  # (page 0 a sink page: its rows also stored unquantized)
            allocate_quant_pages(8, 4, kv_heads, dim, 4, True, DEVICE, None, 1, torch.float32)
            for _ in "kv"
        ]
        q_out = quant_rotary_cache_write_cuda(q, k, v, cos, sin, *pages, slots)
        outputs.append((q_out, *(t for p in pages for t in (p.data, p.scales, p.sinks))))
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)
    assert outputs[0][3].abs().sum() > 0  # (the sink page's K rows were written)


def test_the_write_takes_a_warp_per_group_on_small_grids_and_two_on_prompt_sized_ones():
    """The quantized write's block size (``write_warps``; on a GPU only, the simulator runs
    one warp): the H200's timings (8B shape, 132 SMs) had a warp per group fastest for a
    decode batch of 32 tokens and 2 warps for a 2048-token prompt."""
    from engine.cuda.quant_kernels import write_warps

    heads, sms = 8, 132
    assert write_warps(32 * heads, 128, sms) == 8  # (2 x 128 / 32 groups of K and V)
    assert write_warps(2048 * heads, 128, sms) == 2
    assert write_warps(132 * heads, 128, sms) == 2 and write_warps(131 * heads, 128, sms) == 8
    assert write_warps(32 * heads, 64, sms) == 4  # (the 1B shape's head_dim)
    assert write_warps(2048 * heads, 32, sms) == 2  # (never more warps than groups)
    assert write_warps(256, 512, sms) == 8  # (a block of at most _MAX_THREADS)


def test_cache_write_refuses_a_forced_block_of_part_of_a_warp(monkeypatch):
    """A warp takes whole groups: a forced block size that is not whole warps is refused
    before any launch (bench/cache_write_kernel.py --threads takes powers of two from 32)."""
    monkeypatch.setattr(quant_kernels, "_FORCE_WRITE_THREADS", 48)
    q, k, v, cos, sin, _, _ = make_inputs(1, 1, 1, GROUP, 1, 4, torch.float32)
    k_pages, v_pages = _pages("q4", True, 1, 4, 1, GROUP)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="48 threads, not whole warps"):
        quant_rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    assert k_pages.scales.abs().sum() == 0


def _codes(p: QuantPages) -> torch.Tensor:
    if p.bits == 8:
        return p.data.int()
    return torch.cat(((p.data & 15).int(), (p.data >> 4).int()), dim=-1)


# --- attention --------------------------------------------------------------------------------


def _quantized_case(
    specs, quant, rotate, heads=2, kv_heads=1, dtype=torch.float32, seed=0, head_dim=GROUP
):
    q, k, v, batch = make_case(specs, heads, kv_heads, head_dim, dtype, seed=seed)
    pool, page_size = k.shape[:2]
    k_pages, v_pages = _pages(quant, rotate, pool, page_size, kv_heads, head_dim)
    slots = torch.arange(pool * page_size, device=DEVICE)
    write_slots(k_pages, k.reshape(-1, kv_heads, head_dim), slots)
    write_slots(v_pages, v.reshape(-1, kv_heads, head_dim), slots)
    return q, k_pages, v_pages, batch


@pytest.mark.parametrize(
    ("specs", "quant", "rotate", "splits"),
    [
        ([(5, 1), (9, 1)], "q4", False, None),  # decode
        ([(0, 6), (3, 4)], "q8", True, None),  # prefill and chunked prefill
        ([(2, 1), (11, 3)], "q6", True, 2),  # mixed rows, split key range + merge
    ],
)
def test_attention_matches_reference(specs, quant, rotate, splits):
    q, k_pages, v_pages, batch = _quantized_case(specs, quant, rotate)
    scale = GROUP**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=splits)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize(
    ("head_dim", "lanes", "quant"),
    [(64, 16, "q4"), (128, 16, "q8"), (128, 32, "q6"), (64, 16, "q6")],
)
def test_attention_reads_quantized_pages_as_words(monkeypatch, head_dim, lanes, quant):
    """4 or 8 dims per lane: each lane reads its consecutive dims as one word (kv_load)."""
    monkeypatch.setattr(attention, "_FORCE_LANES", lanes)
    q, k_pages, v_pages, batch = _quantized_case(
        [(5, 1), (19, 3)], quant, True, head_dim=head_dim, seed=3
    )
    assert reads_words(k_pages.bits, v_pages.bits, head_dim // lanes)
    scale = head_dim**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=2)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("affine", [True, False])
def test_attention_unpacks_4_bit_words_either_way(monkeypatch, affine):
    """4-bit word codes as 0.5 + nibble / 256 (kv_load.word_affine: q, a per-row bias and the
    output carry the factor and the offset) or as the integer codes: both are the reference's
    attention, with sink pages in the same units too."""
    monkeypatch.setattr(attention, "_FORCE_LANES", 16)
    monkeypatch.setattr(attention, "_FORCE_WORD_AFFINE", affine)
    q, k_pages, v_pages, batch = _sink_case([(5, 1), (19, 3)], "q4", 3, head_dim=128)
    scale = 128**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=2)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("quant", ["q4", "q8"])
def test_decode_tiles_of_the_8b_shape_sum_16_rows_over_16_lanes(monkeypatch, quant):
    """4 query heads per KV head, head_dim 128, 16 lanes and 4 keys per step: the row sums
    take 16 rows over 16 lanes, which a GPU fetches by half-warp shuffles from constant lanes
    (bits.shfl_segment16_sync); the simulator runs the xor form with emulated shuffles."""
    monkeypatch.setattr(attention, "_FORCE_LANES", 16)
    monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", 4)
    if SIMULATOR:
        emulate_warp_shuffles(monkeypatch)
        monkeypatch.setattr(attention, "_SHUFFLES", True)
    q, k_pages, v_pages, batch = _quantized_case(
        [(5, 1), (33, 1)], quant, True, heads=4, kv_heads=1, head_dim=128, seed=11
    )
    scale = 128**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=2)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize(("lanes", "quant"), [(16, "q4"), (16, "q6"), (32, "q8")])
def test_attention_several_keys_per_step_from_words(monkeypatch, lanes, quant):
    """3 keys per step per key group, read as words before any is dequantized (kv_load)."""
    monkeypatch.setattr(attention, "_FORCE_LANES", lanes)
    monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", 3)
    q, k_pages, v_pages, batch = _quantized_case(
        [(0, 1), (10, 1), (19, 3)], quant, True, head_dim=128, seed=5
    )
    scale = 128**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=2)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float32]


def test_attention_fp16_gqa_window():
    q, k_pages, v_pages, batch = _quantized_case(
        [(6, 1), (1, 2)], "q4", True, heads=4, kv_heads=2, dtype=torch.float16, seed=1
    )
    scale = GROUP**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, 3)
    ref = quant_paged_attention_reference(q.float(), k_pages, v_pages, batch, scale, 3)
    assert out.dtype == torch.float16
    assert rel_error(out, ref) <= TOL[torch.float16]


def test_attention_validates_inputs():
    q, k_pages, v_pages, batch = _quantized_case([(3, 1)], "q8", False)
    with pytest.raises(ValueError, match="QuantPages"):
        paged_attention_quant_cuda(q, k_pages.data, v_pages, batch, 1.0)
    other = QuantPages(v_pages.data, v_pages.scales, v_pages.bits, rotate=True)
    with pytest.raises(ValueError, match="rotation"):
        paged_attention_quant_cuda(q, k_pages, other, batch, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention_quant_cuda(q[..., :16], k_pages, v_pages, batch, 1.0)


# --- sink pages ---------------------------------------------------------------------------------


def _sink_case(
    specs,
    quant,
    num_sinks,
    heads=2,
    kv_heads=1,
    dtype=torch.float32,
    head_dim=GROUP,
    recent=False,
):
    """Like ``_quantized_case`` with sink pages, laid out as the page table lays them out:
    every sequence's first page below ``num_sinks``, no other page there. ``recent``: recent
    pages after them, holding each sequence's last RECENT_BLOCKS blocks (not a sink block)."""
    from engine.batch import SequenceInput, build_forward_batch

    page_size = 4
    gen = torch.Generator().manual_seed(7)
    needed = [-(-(c + n) // page_size) for c, n in specs]
    num_recent = RECENT_BLOCKS * len(specs) if recent else 0
    unquantized = num_sinks + num_recent
    pool = unquantized + sum(needed) + 2
    firsts = torch.randperm(num_sinks, generator=gen).tolist()
    recents = (num_sinks + torch.randperm(num_recent, generator=gen)).tolist()
    rest = (unquantized + torch.randperm(pool - unquantized, generator=gen)).tolist()
    seqs = []
    for i, ((cached, new), n_pages) in enumerate(zip(specs, needed, strict=True)):
        pages, rest = rest[:n_pages], rest[n_pages:]
        if num_sinks:
            pages[0] = firsts[i]
        if recent:
            for block in range(max(int(num_sinks > 0), n_pages - RECENT_BLOCKS), n_pages):
                pages[block] = recents.pop()
        seqs.append(SequenceInput(token_ids=[1] * new, num_cached=cached, pages=pages))
    batch = build_forward_batch(seqs, page_size, DEVICE)
    k_bits, v_bits = QUANT_BITS[quant]
    center = torch.randn(kv_heads, head_dim, generator=gen).to(DEVICE)
    k_pages, v_pages = (
        allocate_quant_pages(
            pool, page_size, kv_heads, head_dim, bits, True, DEVICE, c, unquantized, dtype
        )
        for bits, c in ((k_bits, center), (v_bits, None))
    )
    slots = torch.arange(pool * page_size, device=DEVICE)
    for pages in (k_pages, v_pages):
        rows = 3 * torch.randn(pool * page_size, kv_heads, head_dim, generator=gen)
        write_slots(pages, rows.to(DEVICE, dtype), slots)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k_pages, v_pages, batch


@pytest.mark.parametrize(
    ("specs", "quant", "splits", "window", "keys_per_step"),
    [
        ([(5, 1), (9, 1), (2, 1)], "q4", None, None, None),  # decode: sink keys, then codes
        ([(0, 6), (3, 4)], "q8", None, None, None),  # prefill and chunked prefill
        ([(2, 1), (13, 3)], "q6", 2, None, None),  # a split inside and one after the sink page
        ([(9, 2), (1, 1)], "q4", 2, 3, 3),  # a window past the sink page; 3 keys per step
    ],
)
def test_attention_reads_sink_pages_like_the_reference(
    monkeypatch, specs, quant, splits, window, keys_per_step
):
    if keys_per_step is not None:
        monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", keys_per_step)
    q, k_pages, v_pages, batch = _sink_case(specs, quant, num_sinks=len(specs) + 1)
    scale = GROUP**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, window, num_splits=splits)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    assert rel_error(out, ref) <= TOL[torch.float32]
    # the sink rows were read: attention over the codes alone differs
    codes_only = dataclasses.replace(k_pages, sinks=None), dataclasses.replace(v_pages, sinks=None)
    other = quant_paged_attention_reference(q, *codes_only, batch, scale, window)
    assert rel_error(other, ref) > 10 * TOL[torch.float32]


@pytest.mark.parametrize(
    ("specs", "quant", "num_sinks", "splits", "window", "keys_per_step"),
    [
        # decode: a sink block, codes, then one or two recent blocks
        ([(13, 1), (9, 1), (4, 1), (2, 1)], "q4", 4, None, None, None),
        ([(13, 1), (6, 1), (1, 1)], "q8", 0, None, None, None),  # no sinks: block 0 recent
        ([(0, 6), (10, 4)], "q6", 2, None, None, None),  # prefill and chunked prefill
        ([(21, 1), (14, 3)], "q4", 2, 3, None, None),  # splits ending in and before the tail
        ([(21, 2), (3, 1)], "q4", 2, 2, 3, 3),  # a window inside the tail; 3 keys per step
    ],
)
def test_attention_reads_recent_pages_like_the_reference(
    monkeypatch, specs, quant, num_sinks, splits, window, keys_per_step
):
    if keys_per_step is not None:
        monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", keys_per_step)
    q, k_pages, v_pages, batch = _sink_case(specs, quant, num_sinks, recent=True)
    scale = GROUP**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, window, num_splits=splits)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    assert rel_error(out, ref) <= TOL[torch.float32]
    # the recent rows were read: with them zeroed the kernel's result differs
    assert k_pages.sinks.shape[0] > num_sinks
    for pages in (k_pages, v_pages):
        pages.sinks[num_sinks:] = 0
    zeroed = paged_attention_quant_cuda(
        q, k_pages, v_pages, batch, scale, window, num_splits=splits
    )
    assert rel_error(zeroed, ref) > 10 * TOL[torch.float32]


def test_attention_reads_sink_pages_as_words_in_fp16(monkeypatch):
    monkeypatch.setattr(attention, "_FORCE_LANES", 16)
    specs = [(5, 1), (19, 3)]
    q, k_pages, v_pages, batch = _sink_case(
        specs, "q4", 3, heads=4, kv_heads=2, dtype=torch.float16, head_dim=64
    )
    assert reads_words(k_pages.bits, v_pages.bits, 64 // 16)
    scale = 64**-0.5
    out = paged_attention_quant_cuda(q, k_pages, v_pages, batch, scale, num_splits=2)
    ref = quant_paged_attention_reference(q.float(), k_pages, v_pages, batch, scale)
    assert rel_error(out, ref) <= TOL[torch.float16]


@pytest.mark.parametrize(("quant", "dtype"), [("q4", torch.float32), ("q8", torch.float16)])
def test_cache_write_fills_sink_pages_like_the_reference(quant, dtype):
    torch.manual_seed(2)
    q, k, v, cos, sin, _, _ = make_inputs(3, 4, 2, 2 * GROUP, 4, 4, dtype)  # 2 KV heads
    center = torch.randn(2, 2 * GROUP, device=DEVICE)
    k_bits, v_bits = QUANT_BITS[quant]
    k_pages, v_pages = (
        allocate_quant_pages(4, 4, 2, 2 * GROUP, bits, True, DEVICE, c, 2, dtype)
        for bits, c in ((k_bits, center), (v_bits, None))
    )
    ref_k, ref_v = (
        dataclasses.replace(_copy(p), sinks=p.sinks.clone()) for p in (k_pages, v_pages)
    )
    slots = torch.tensor([2, -1, 14], device=DEVICE)  # a sink page's slot, padding, an ordinary
    quant_rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    quant_rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    for got, want in ((k_pages, ref_k), (v_pages, ref_v)):
        assert got.sinks.abs().sum() > 0
        if DEVICE == "cpu":  # the reference's own butterflies: the rows exactly
            assert torch.equal(got.sinks, want.sinks)
        else:  # a GPU may round rotary or a butterfly differently (FMA)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert torch.allclose(got.sinks.float(), want.sinks.float(), rtol=tol, atol=tol)
        written = got.sinks.reshape(8, 2, -1).abs().sum(-1) > 0  # [slot, KV head]
        assert written.tolist() == [[False] * 2] * 2 + [[True] * 2] + [[False] * 2] * 5


# --- the CUDA op set on a mixed batch ---------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_op_set_attends_a_mixed_batchs_decode_rows_with_the_kernel(bits):
    """A prompt chunk, a decode row and a row with drafts to verify in one forward, with
    exact_chunks: the CUDA op set gives the decode row and each token of the verifying row
    (engine/ops.py ``CUDA_VERIFY_ROWS``) to the kernel as a decode batch of their own and the
    chunk to the prompt-chunk route, which still reads the chunk's own rows exactly."""
    from engine.ops import cuda_ops
    from tests.unit.test_exact_chunks import SCALE, VERIFY, _filled

    k_pages, v_pages, batch, q, _, _ = _filled(bits, exact_chunks=True, device=DEVICE)
    out = cuda_ops().paged_attention(q, k_pages, v_pages, batch, SCALE)
    assert batch.attention.decode_split.decode.q_lens == (1,) * (1 + VERIFY[2])
    assert k_pages.written.rows is None  # the reference took the chunk's rows
    k_ref, v_ref, batch_ref, q_ref, _, _ = _filled(bits, exact_chunks=True, device=DEVICE)
    want = quant_paged_attention_reference(q_ref, k_ref, v_ref, batch_ref, SCALE)
    assert rel_error(out, want) <= TOL[torch.float32]
