"""The tensor-core decode kernel over 4-bit pages (engine/cuda/attention_mma.py) and its
device functions (engine/cuda/mma.py).

In the simulator the MMAs and shuffles are emulated from the PTX fragment layouts; on a GPU
the same tests run the real instructions, so they check the layout reading too.

The kernel rounds q to signed bytes per head (after the rotation) and P and V's code * scale
to fp16. The comparison is against the torch reference fed that same q: what is left is
P's and V's fp16 rounding, each at most 2^-11 relative, so |out - ref| <= 2^-10 * max|V|
(the dequantized values) plus float32 slack. A second check against the reference with the
unrounded q holds the bound that q's rounding implies.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from engine.cache.page_table import RECENT_BLOCKS
from engine.cache.quant import (
    QUANT_BITS,
    allocate_quant_pages,
    dequantize_pages,
    rotate_groups,
    write_slots,
)
from engine.cuda import mma
from engine.cuda._launch import SIMULATOR, cuda
from engine.cuda.attention import paged_attention_reference
from engine.cuda.attention_mma import (
    decode_attention_mma,
    decode_attention_mma_fp16,
    round_q_bytes,
    supports,
)
from engine.cuda.quant_reference import quant_paged_attention_reference
from tests.kernels.common import DEVICE
from tests.kernels.test_attention import make_case

PAGE = 16


def _case(
    lens, heads, kv_heads, head_dim, rotate, seed=0, specs=None, center=False, sinks=0,
    quant="q4", recent=False, sink_blocks=True,
):  # fmt: skip
    """q4 pages holding random K/V; one decode token per sequence of each length in ``lens``
    (or ``specs``: [(num_cached, num_new)]); ``center``: keys stored less a random center;
    ``sinks``: pages 0..sinks-1 are fp16 sink pages, every sequence's first page one of them.
    ``recent``: each sequence's last RECENT_BLOCKS blocks after block 0 are fp16 pages too,
    right after the sink pages (``sinks`` counts them); ``sink_blocks`` False: no sink pages,
    so block 0 is a recent one when it is among the last."""
    specs = specs or [(n - 1, 1) for n in lens]
    q, k, v, batch = make_case(specs, heads, kv_heads, head_dim, torch.float32, PAGE, seed)
    pool = k.shape[0]
    if recent:
        table = _recent_pages_first(batch.block_tables, specs, pool, sink_blocks)
        batch.block_tables.copy_(table)
    elif sinks:
        batch.block_tables.copy_(_first_pages_first(batch.block_tables, pool))
    mean = torch.randn(kv_heads, head_dim, device=DEVICE) if center else None
    k_pages, v_pages = (
        allocate_quant_pages(pool, PAGE, kv_heads, head_dim, bits, rotate, DEVICE, c, sinks)
        for bits, c in zip(QUANT_BITS[quant], (mean, None), strict=True)
    )
    slots = torch.arange(pool * PAGE, device=DEVICE)
    write_slots(k_pages, k.reshape(-1, kv_heads, head_dim), slots)
    write_slots(v_pages, v.reshape(-1, kv_heads, head_dim), slots)
    return q, k_pages, v_pages, batch


def _first_pages_first(table: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``table`` with its page ids renamed (a bijection) so that sequence i's first page is
    page i, as the page table gives sink pages."""
    firsts = table[:, 0].long()
    rest = torch.ones(num_pages, dtype=torch.bool, device=table.device)
    rest[firsts] = False
    order = torch.cat((firsts, torch.nonzero(rest).flatten()))  # new id -> old id
    rename = torch.empty_like(order)
    rename[order] = torch.arange(num_pages, device=table.device)
    return rename[table.long()].to(table.dtype)


def _recent_pages_first(
    table: torch.Tensor, specs, num_pages: int, sink_blocks: bool = True
) -> torch.Tensor:
    """``table`` renamed so that the sequences' first pages come first (``sink_blocks``), then
    the pages of their last RECENT_BLOCKS blocks (after block 0 when that is a sink), as the
    page table lays out sink and recent pages."""
    used = [-(-(c + n) // PAGE) for c, n in specs]
    firsts = [int(table[i, 0]) for i in range(len(specs))] if sink_blocks else []
    after = int(sink_blocks)
    lasts = [
        int(table[i, b])
        for i, n in enumerate(used)
        for b in range(max(after, n - RECENT_BLOCKS), n)
    ]
    chosen = firsts + lasts
    order = chosen + [p for p in range(num_pages) if p not in set(chosen)]  # new id -> old id
    rename = torch.empty(num_pages, dtype=torch.long)
    rename[torch.tensor(order)] = torch.arange(num_pages)
    return rename.to(table.device)[table.long()].to(table.dtype)


def unquantized_pages(specs, sink_blocks: bool = True) -> int:
    """Sink and recent pages of ``_recent_pages_first``'s layout."""
    used = [-(-(c + n) // PAGE) for c, n in specs]
    if not sink_blocks:
        return sum(min(RECENT_BLOCKS, n) for n in used)
    return sum(1 + min(RECENT_BLOCKS, n - 1) for n in used)


def _grid_q(q: torch.Tensor, rotate: bool) -> torch.Tensor:
    """A q whose rotated values are multiples of 1/16 up to 127/16 in magnitude, reached in
    every head: the kernel's byte rounding and its fp16 q (sink pages) both hold it exactly."""
    gen = torch.Generator().manual_seed(5)
    ints = torch.randint(-127, 128, q.shape, generator=gen).float()
    ints[..., 0] = 127
    rotated = (ints / 16).to(q.device)
    return rotate_groups(rotated) if rotate else rotated


def _run(lens, heads, kv_heads, head_dim, rotate, splits, seed=0, center=False):
    q, k_pages, v_pages, batch = _case(lens, heads, kv_heads, head_dim, rotate, seed, None, center)
    scale = head_dim**-0.5
    out = decode_attention_mma(
        q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
        rotate=rotate, num_splits=splits,
    )  # fmt: skip
    rounded_q = round_q_bytes(q, rotate)
    ref = quant_paged_attention_reference(rounded_q, k_pages, v_pages, batch, scale)
    v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2**-10 * v_max + 1e-5, f"max |out - ref| {err:.2e} (max |V| {v_max:.2f})"
    # against the unrounded q: scores move by at most scale * |k|_1 * max|q| / 254 per head
    exact = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    keys = dequantize_pages(k_pages, batch.block_tables, torch.float32)
    k_l1 = keys.abs().sum(dim=-1).max().item()
    q_max = (rotate_groups(q) if rotate else q).abs().max().item()
    shift = scale * k_l1 * q_max / 254
    bound = (math.exp(2 * shift) - 1 + 2**-10) * v_max + 1e-5
    assert (out.float() - exact.float()).abs().max().item() <= bound
    return out, ref


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "head_dim", "rotate", "splits", "center"),
    [
        ([17, 40], 4, 1, 64, False, 1, False),  # a partial tile, three tiles over three pages
        ([80, 5], 4, 1, 64, True, 2, False),  # rotated, 64 + 16 keys merged; an empty split
        ([16], 6, 2, 128, True, 1, False),  # 3 heads per KV head (dead MMA columns), a page
        ([9], 2, 1, 256, True, 1, False),  # every lane's output dims in one group's 16 bytes
        # centered keys (the serving default): the reference adds the center back, which
        # moves every score of a query by q . center, and softmax does not see that
        ([21], 2, 1, 64, True, 1, True),
    ],
)
def test_mma_decode_matches_the_reference_with_q_rounded_as_the_kernel_does(
    lens, heads, kv_heads, head_dim, rotate, splits, center
):
    _run(lens, heads, kv_heads, head_dim, rotate, splits, center=center)


def test_mma_decode_ignores_garbage_past_the_context():
    """Slots past a sequence's length in its last page hold NaN scales: no effect."""
    q, k_pages, v_pages, batch = _case([20], 2, 1, 64, False)
    last_page = batch.block_tables[0, 1].item()
    k_pages.scales[last_page, 4:] = float("nan")
    v_pages.scales[last_page, 4:] = float("nan")
    out = decode_attention_mma(
        q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, 64**-0.5,
        rotate=False, num_splits=1,
    )  # fmt: skip
    assert torch.isfinite(out).all()


def test_supports_names_what_the_kernel_serves():
    assert supports(4, 4, None, 128, 4, 16, 1)
    assert supports(4, 4, torch.float16, 128, 4, 16, 1)  # fp16 sink pages
    assert not supports(4, 4, torch.bfloat16, 128, 4, 16, 1)  # bf16 sink pages
    assert supports(8, 8, None, 128, 4, 16, 1)  # q8 pages
    assert supports(8, 4, None, 128, 4, 16, 1)  # q6 pages
    assert not supports(4, 8, None, 128, 4, 16, 1)  # no cache mode stores these
    assert not supports(4, 4, None, 128, 16, 16, 1)  # 16 heads per KV head
    assert not supports(4, 4, None, 128, 4, 8, 1)  # page of 8 slots
    assert not supports(4, 4, None, 96, 4, 16, 1)  # a lane's V bytes would span groups
    assert not supports(4, 4, None, 128, 4, 16, 3)  # drafts to verify


def test_mma_decode_refuses_what_it_does_not_serve():
    q, k_pages, v_pages, batch = _case([5], 2, 1, 64, False)
    with pytest.raises(ValueError, match="query rows"):
        decode_attention_mma(
            q[:0], k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, 1.0,
            rotate=False,
        )  # fmt: skip


# --- the device functions ---------------------------------------------------------------------


def _fragments_kernel(kind: str):
    op = mma.mma_u8s8 if kind == "u8s8" else mma.mma_f16

    @cuda.jit
    def run(a, b, c, d):
        lane = cuda.threadIdx.x
        d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3] = op(
            a[lane, 0], a[lane, 1], a[lane, 2], a[lane, 3], b[lane, 0], b[lane, 1],
            c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3],
        )  # fmt: skip

    return run


def _a_fragments(A: np.ndarray, per_reg: int) -> np.ndarray:
    """A [16, K] into the per-lane registers the PTX layout names (elements low to high)."""
    regs = np.zeros((32, 4, per_reg), dtype=A.dtype)
    half = A.shape[1] // 2
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, k0) in enumerate([(g, 0), (g + 8, 0), (g, half), (g + 8, half)]):
            regs[lane, r] = A[row, k0 + per_reg * t : k0 + per_reg * (t + 1)]
    return regs


def _b_fragments(B: np.ndarray, per_reg: int) -> np.ndarray:
    regs = np.zeros((32, 2, per_reg), dtype=B.dtype)
    half = B.shape[0] // 2
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, k0 in enumerate([0, half]):
            regs[lane, r] = B[k0 + per_reg * t : k0 + per_reg * (t + 1), g]
    return regs


def _d_matrix(d: np.ndarray) -> np.ndarray:
    D = np.zeros((16, 8), dtype=d.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        D[g, 2 * t : 2 * t + 2] = d[lane, :2]
        D[g + 8, 2 * t : 2 * t + 2] = d[lane, 2:]
    return D


def _words(regs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(regs).view(np.int32).reshape(32, -1)


@pytest.mark.parametrize("kind", ["u8s8", "f16"])
def test_mma_computes_a_times_b_plus_c_from_the_ptx_fragments(kind):
    rng = np.random.default_rng(1)
    if kind == "u8s8":
        A = rng.integers(0, 16, (16, 32)).astype(np.uint8)
        B = rng.integers(-127, 128, (32, 8)).astype(np.int8)
        C = rng.integers(-1000, 1000, (16, 8)).astype(np.int32)
        per_reg, want = 4, A.astype(np.int64) @ B.astype(np.int64) + C
    else:
        A = rng.standard_normal((16, 16)).astype(np.float16)
        B = rng.standard_normal((16, 8)).astype(np.float16)
        C = rng.standard_normal((16, 8)).astype(np.float32)
        per_reg, want = 2, A.astype(np.float64) @ B.astype(np.float64) + C
    a, b = _words(_a_fragments(A, per_reg)), _words(_b_fragments(B, per_reg))
    c = np.zeros((32, 4), dtype=C.dtype)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    d = np.zeros_like(c)
    _fragments_kernel(kind)[1, 32](a, b, c, d)
    got = _d_matrix(d)
    if kind == "u8s8":
        assert (got == want).all()
    else:
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's fp16 helpers (the GPU's are PTX)")
def test_half2_helpers_round_like_fp16():
    x = mma._from_halves(np.float16(1030.0), np.float16(1024.0))
    assert mma._halves(mma._hsub2_sim(x, mma.HALF2_1032)).tolist() == [-2.0, -8.0]
    y = mma._pack_half2_sim(0.1, -3.0)
    assert mma._halves(y).tolist() == [np.float16(0.1), -3.0]
    assert mma._halves(mma._hmul2_sim(y, y)).tolist() == [np.float16(0.1) * np.float16(0.1), 9.0]


@pytest.mark.parametrize(("enabled", "specs", "used"), [
    (True, [(4, 1), (20, 1)], True),  # a decode batch
    (True, [(4, 1), (20, 3)], False),  # drafts to verify: the CUDA-core kernel
    (False, [(4, 1), (20, 1)], False),  # not asked for
])  # fmt: skip
def test_quant_op_sends_4_bit_decode_batches_to_tensor_cores_when_enabled(
    monkeypatch, enabled, specs, used
):
    from engine.cuda import attention_mma, quant_kernels

    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(attention_mma, "MODE", "1" if enabled else "0")
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, k_pages, v_pages, batch = _case(None, 2, 1, 64, True, specs=specs)
    out = quant_kernels.paged_attention_quant_cuda(q, k_pages, v_pages, batch, 64**-0.5)
    assert bool(calls) == used  # (the numerics: the tests above)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize(("capturing", "used"), [(True, True), (False, False)])
def test_by_default_decode_batches_go_to_tensor_cores_inside_cuda_graphs(
    monkeypatch, capturing, used
):
    """ENGINE_TENSOR_CORE_DECODE's default ("graphs"): the graph runner's decode steps (a CUDA
    graph capturing) take this kernel, eager decode batches attention.py's."""
    from engine.cuda import attention_mma, quant_kernels

    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(attention_mma, "MODE", "graphs")
    monkeypatch.setattr(attention_mma, "_capturing", lambda q: capturing)
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q, k_pages, v_pages, batch = _case(None, 2, 1, 64, True, specs=[(4, 1), (20, 1)])
    out = quant_kernels.paged_attention_quant_cuda(q, k_pages, v_pages, batch, 64**-0.5)
    assert bool(calls) == used
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_cuda_op_set_gives_a_mixed_batchs_decode_rows_to_tensor_cores(monkeypatch):
    """A prompt chunk beside two decode rows: with the switch on, the decode rows (their own
    decode batch, ``decode_split``) go through this kernel and the chunk through the torch
    reference."""
    from engine.cuda import attention_mma, quant_kernels
    from engine.ops import by_query_length

    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(attention_mma, "MODE", "1")
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    specs = [(0, 5), (18, 1), (33, 1)]
    q, k_pages, v_pages, batch = _case(None, 4, 1, 64, True, specs=specs)
    scale = 64**-0.5
    op = by_query_length(quant_kernels.paged_attention_quant_cuda, quant_paged_attention_reference)
    out = op(q, k_pages, v_pages, batch, scale)
    assert calls == [1]
    exact = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    torch.testing.assert_close(out[:5], exact[:5], atol=1e-5, rtol=1e-5)  # the chunk
    rounded = quant_paged_attention_reference(
        round_q_bytes(q, True), k_pages, v_pages, batch, scale
    )
    v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    assert (out[5:] - rounded[5:]).abs().max().item() <= 2**-10 * v_max + 1e-5


@pytest.mark.parametrize(
    ("lens", "head_dim", "splits", "recent"),
    [([20, 9], 64, 1, False), ([9], 128, 1, False), ([20, 9, 2], 64, 2, True)],
)
def test_mma_decode_reads_sink_pages_from_their_fp16_rows(lens, head_dim, splits, recent):
    """Every sequence's first page a sink page (and with ``recent`` its last blocks recent
    pages): those tiles' scores and values come from the fp16 rows. q on the byte grid, so
    both of the kernel's q forms are exact and what is left is P's and V's fp16 rounding (the
    bound of the tests above)."""
    exact = unquantized_pages([(n - 1, 1) for n in lens]) if recent else len(lens)
    q, k_pages, v_pages, batch = _case(lens, 4, 1, head_dim, True, sinks=exact, recent=recent)
    q = _grid_q(q, True)
    assert k_pages.sinks is not None and k_pages.sinks.dtype == torch.float16
    scale = head_dim**-0.5
    out = decode_attention_mma(
        q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
        rotate=True, k_sinks=k_pages.sinks, v_sinks=v_pages.sinks, num_splits=splits,
    )  # fmt: skip
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    err = (out - ref).abs().max().item()
    assert err <= 2**-10 * v_max + 1e-5, f"max |out - ref| {err:.2e} (max |V| {v_max:.2f})"
    # the sink rows differ from the codes: reading the codes instead would miss the bound
    codes = dataclasses.replace(k_pages, sinks=None), dataclasses.replace(v_pages, sinks=None)
    through_codes = quant_paged_attention_reference(q, *codes, batch, scale)
    assert (through_codes - ref).abs().max().item() > 10 * (2**-10 * v_max + 1e-5)


@pytest.mark.parametrize(("quant", "pipeline", "splits", "window", "sink_blocks"), [
    ("q4", 1, 2, None, True),  # a split whose tail block is recent, the next all recent
    ("q4", 2, 3, None, True),
    ("q4", 0, 2, 37, True),  # a window past the sink block
    ("q8", 1, 3, None, False),  # no sinks: block 0 recent when among the last two
    ("q6", 2, 2, 100, False),
])  # fmt: skip
def test_mma_decode_reads_recent_pages_around_pipelined_code_tiles(
    monkeypatch, quant, pipeline, splits, window, sink_blocks
):
    """Sink and recent tiles read from their fp16 rows before and after a split's code tiles,
    in every load pipeline: lengths of 1 to 13 blocks, splits that start and end among the
    recent blocks (80 keys in 2 splits: block 3 closes the first, block 4 is the second).
    Bound as above; reading the codes instead of the rows would miss it."""
    from engine.cuda import attention_mma

    monkeypatch.setattr(attention_mma, "_PIPELINE", pipeline)
    lens = [200, 80, 12, 33, 17]
    exact = unquantized_pages([(n - 1, 1) for n in lens], sink_blocks)
    q, k_pages, v_pages, batch = _case(lens, 4, 1, 64, True, seed=5, sinks=exact, quant=quant,
                                       recent=True, sink_blocks=sink_blocks)  # fmt: skip
    q = _grid_q(q, True)
    scale = 64**-0.5

    out = decode_attention_mma(
        q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
        rotate=True, k_bits=k_pages.bits, v_bits=v_pages.bits, k_sinks=k_pages.sinks,
        v_sinks=v_pages.sinks, sliding_window=window, num_splits=splits,
    )  # fmt: skip
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    bound = 2**-10 * v_max + 1e-5
    err = (out - ref).abs().max().item()
    assert err <= bound, f"max |out - ref| {err:.2e} (max |V| {v_max:.2f})"
    # (a kernel reading the codes would come within the bound of reading them in the
    # reference, so at least 2 bounds from ``ref``: 8 here for q8, whose codes are close)
    codes = dataclasses.replace(k_pages, sinks=None), dataclasses.replace(v_pages, sinks=None)
    through_codes = quant_paged_attention_reference(q, *codes, batch, scale, window)
    assert (through_codes - ref).abs().max().item() > 3 * bound


# --- fp16 pages ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "head_dim", "splits"),
    [([17, 70], 4, 1, 64, 2), ([16], 8, 1, 128, 1), ([5], 4, 2, 64, 1)],
)
def test_mma_decode_over_fp16_pages_matches_the_reference(lens, heads, kv_heads, head_dim, splits):
    """fp16 pages, q on the byte grid (exact in fp16): only P's rounding to fp16 and the
    output's are left, within 2^-10 * max|V|."""
    specs = [(n - 1, 1) for n in lens]
    q, k, v, batch = make_case(specs, heads, kv_heads, head_dim, torch.float16, PAGE, 3)
    q = _grid_q(q.float(), False).half()
    scale = head_dim**-0.5
    out = decode_attention_mma_fp16(q, k, v, batch, scale, num_splits=splits)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, scale)
    assert out.dtype == torch.float16
    err = (out.float() - ref).abs().max().item()
    assert err <= 2**-10 * v.float().abs().max().item() + 1e-5, err


@pytest.mark.parametrize(("enabled", "dtype", "used"), [
    (True, torch.float16, True),
    (True, torch.float32, False),  # fp32 pages: the CUDA-core kernel
    (False, torch.float16, False),
])  # fmt: skip
def test_fp16_op_sends_decode_batches_to_tensor_cores_when_enabled(monkeypatch, enabled, dtype,
                                                                   used):  # fmt: skip
    from engine.cuda import attention, attention_mma

    calls = []
    real = attention_mma.decode_attention_mma_fp16
    monkeypatch.setattr(attention_mma, "MODE", "1" if enabled else "0")
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma_fp16",
        lambda *a, **k: calls.append(1) or real(*a, **k),
    )  # fmt: skip
    q, k, v, batch = make_case([(4, 1), (20, 1)], 2, 1, 64, dtype, PAGE, 0)
    out = attention.paged_attention_cuda(q, k, v, batch, 64**-0.5)
    assert bool(calls) == used
    assert out.shape == q.shape and torch.isfinite(out).all()


# --- 8-bit keys (q6, q8) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "lens", "head_dim", "rotate", "splits"),
    [("q8", [17, 30], 64, True, 1), ("q6", [9, 33], 128, False, 1), ("q8", [20], 256, False, 1)],
)
def test_mma_decode_over_8_bit_keys_matches_the_reference(quant, lens, head_dim, rotate, splits):
    """q8 (8-bit K and V) and q6 (8-bit K, 4-bit V): the keys' codes become exact fp16 pairs
    for fp16 MMAs with q in fp16; q on the byte grid, so what is left is P's and V's fp16
    rounding."""
    q, k_pages, v_pages, batch = _case(lens, 4, 1, head_dim, rotate, quant=quant)
    q = _grid_q(q, rotate)
    scale = head_dim**-0.5
    out = decode_attention_mma(
        q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
        rotate=rotate, k_bits=k_pages.bits, v_bits=v_pages.bits, num_splits=splits,
    )  # fmt: skip
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale)
    v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    err = (out - ref).abs().max().item()
    assert err <= 2**-10 * v_max + 1e-5, f"max |out - ref| {err:.2e} (max |V| {v_max:.2f})"


# --- sliding window -----------------------------------------------------------------------------


@pytest.mark.parametrize(("quant", "window", "splits"), [("q4", 21, 1), ("fp16", 50, 2)])
def test_mma_decode_keeps_to_a_sliding_window(quant, window, splits):
    """Each query sees its last ``window`` keys: the first tile starts below them (masked) and
    a split's share counts from there. q on the byte grid, the bound of the tests above."""
    _check_window_case(quant, window, splits)


@pytest.mark.parametrize(("quant", "pipeline", "window"), [
    ("q4", 0, None), ("q4", 2, 21), ("q6", 0, 21), ("q8", 2, None),
])  # fmt: skip
def test_load_pipelines_match_the_reference(monkeypatch, quant, pipeline, window):
    """Code tiles whose V loads follow the scores (0) or go out one tile ahead of their use
    with K's (2) give the results of the default (1, the tests above): partial tiles, tiles
    over pages, a window, an empty split."""
    from engine.cuda import attention_mma

    monkeypatch.setattr(attention_mma, "_PIPELINE", pipeline)
    _check_window_case(quant, window, 2)


def _check_window_case(quant, window, splits):
    lens, scale = [40, 90, 12], 64**-0.5
    if quant == "fp16":
        specs = [(n - 1, 1) for n in lens]
        q, k, v, batch = make_case(specs, 4, 1, 64, torch.float16, PAGE, 4)
        q = _grid_q(q.float(), False).half()
        out = decode_attention_mma_fp16(q, k, v, batch, scale, sliding_window=window,
                                        num_splits=splits)  # fmt: skip
        ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, scale, window)
        v_max = v.float().abs().max().item()
    else:
        q, k_pages, v_pages, batch = _case(lens, 4, 1, 64, True, seed=4, quant=quant)
        q = _grid_q(q, True)
        out = decode_attention_mma(
            q, k_pages.data, v_pages.data, k_pages.scales, v_pages.scales, batch, scale,
            rotate=True, k_bits=k_pages.bits, v_bits=v_pages.bits, sliding_window=window,
            num_splits=splits,
        )  # fmt: skip
        ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
        v_max = dequantize_pages(v_pages, batch.block_tables, torch.float32).abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2**-10 * v_max + 1e-5, f"max |out - ref| {err:.2e} (max |V| {v_max:.2f})"


@pytest.mark.parametrize(
    ("items", "max_len", "want"),
    [
        (256, 4096, 8),  # 8B decode at batch 32: 9 splits fill 4 blocks per SM; whole blocks
        (8, 4096, 16),  # one sequence: as many as 256-key splits allow
        (256, 300, 1),  # short contexts do not split
        (2048, 4096, 2),  # a large batch: fewer than a block's warps, kept as they are
    ],
)
def test_split_count_fills_the_sms_in_whole_blocks(monkeypatch, items, max_len, want):
    from engine.cuda import attention_mma

    monkeypatch.setattr(attention_mma, "_WARPS", 4)  # (the GPU's block; the simulator runs 1)
    assert attention_mma.split_count(items, max_len, 132) == want
