"""The CPU context gather over quantized pages (engine/cpu/kv_gather.py) against its torch
reference (engine/cuda/quant_reference.py ``gather_context``): the same values bit for bit,
in the pages' basis and rotated back, with sink and recent rows and the chunk's own rows
(keys with rotary and a center); and the CPU op set's route for prompt chunks through it."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import allocate_quant_pages, write_slots
from engine.cpu import kv_gather
from engine.cpu.kv_gather import gather_context_cpu, quant_chunk_attention_cpu
from engine.cuda import quant_reference
from engine.cuda.quant_reference import (
    OwnRows,
    quant_paged_attention_reference,
    quant_rotary_cache_write_reference,
)

PAGE, KV, D = 4, 2, 64
PAGES = 10
INDEX = [[5, 1, 7], [2, 6, -1], [0, 9, 4]]  # (-1: a block table's padding)


def _pages(bits, rows, rotate, dtype=torch.float32, seed=0, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    center = kwargs.pop("center", None)
    pages = allocate_quant_pages(PAGES, PAGE, KV, D, bits, rotate, "cpu", center, rows, dtype,
                                 **kwargs)  # fmt: skip
    x = 3 * torch.randn(PAGES * PAGE, KV, D, generator=gen)
    write_slots(pages, x.to(dtype), torch.arange(PAGES * PAGE))
    return pages


def _own(keys: bool, center: torch.Tensor | None = None, dtype=torch.float32) -> OwnRows:
    """Own rows at slots 21..26 (page 5's slots 1..3, page 6's 0..2), written by rows
    3, 2, 1, 0, 5, 4 of a forward of 7 tokens; keys with rotary tables (and a center)."""
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(7, KV, D, generator=gen).to(dtype)
    slots, rows = torch.arange(21, 27), torch.tensor([3, 2, 1, 0, 5, 4])
    if not keys:
        return OwnRows(slots, rows, values)
    angle = torch.rand(7, D // 2, generator=gen) * 6.28
    return OwnRows(slots, rows, values, angle.cos().to(dtype), angle.sin().to(dtype), center)


def _compare(pages, own, unrotate):
    index = torch.tensor(INDEX, dtype=torch.int32)
    got = gather_context_cpu(pages, index, torch.float32, own, unrotate)
    want = quant_reference.gather_context(pages, index, torch.float32, own, unrotate)
    assert got.shape == want.shape == (3, 3 * PAGE, KV, D) and got.dtype == torch.float32
    valid = (index >= 0).repeat_interleave(PAGE, dim=1)
    assert torch.equal(got[valid], want[valid])
    assert not got[~valid].any()
    return got


@pytest.mark.parametrize("unrotate", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize(("bits", "rows", "own"), [(4, 0, False), (4, 3, True), (8, 3, False),
                                                   (8, 0, True)])  # fmt: skip
def test_gather_matches_the_torch_gather_bit_for_bit(bits, rows, own, rotate, unrotate):
    """Code pages, sink/recent pages (ids below ``rows``: their rows), the chunk's own rows of
    values put in (rotated into rotated pages' basis, or the rest rotated back with
    ``unrotate``: by the same butterflies as the reference), zeros at padding."""
    pages = _pages(bits, rows, rotate)
    own_rows = _own(keys=False) if own else None
    got = _compare(pages, own_rows, unrotate)
    if own and not (rotate and not unrotate):  # page 5's slot 1: own row 0, the write's row 3
        assert torch.equal(got[0, 1], own_rows.values[3])
    if rows and not unrotate:  # page 1 is a sink or recent page
        assert torch.equal(got[0, PAGE : 2 * PAGE], pages.sinks[1])
    if unrotate:  # (it did rotate back)
        stored = quant_reference.gather_context(pages, torch.tensor(INDEX), torch.float32)
        assert (got[0, 8:] - stored[0, 8:]).abs().max() > 0.1


@pytest.mark.parametrize("unrotate", [False, True])
@pytest.mark.parametrize("centered", [False, True])
def test_own_rows_of_keys_take_rotary_and_the_center_in_the_kernel(centered, unrotate):
    """K pages that keep written rows (exact chunks): an own row is made from the key before
    rotary, its tables and the center, as ``OwnRows.exact`` makes it in torch."""
    center = torch.randn(KV, D, generator=torch.Generator().manual_seed(4)) if centered else None
    pages = _pages(4, 3, True, exact_chunks=True, center=center)
    own_rows = _own(keys=True, center=center)
    got = _compare(pages, own_rows, unrotate)
    if unrotate:
        exact = own_rows.exact()
        assert (exact - own_rows.values[own_rows.rows]).abs().max() > 0.5  # (rotary applied)
        assert torch.equal(got[0, 1:4], exact[:3])  # page 5's slots 1..3


def test_work_shared_among_threads_gives_the_same_tensor():
    pages = _pages(4, 3, True)
    index = torch.randint(0, PAGES, (4, 9), generator=torch.Generator().manual_seed(5))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gather_context_cpu(pages, index.int(), torch.float32, unrotate=True)
        torch.set_num_threads(2)
        two = gather_context_cpu(pages, index.int(), torch.float32, unrotate=True)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


def test_what_the_kernel_does_not_take_goes_to_the_reference(monkeypatch):
    """A float16 model's gather (pages with float16 rows) is the reference's own result."""
    calls = []
    reference = quant_reference.gather_context
    monkeypatch.setattr(
        quant_reference, "gather_context", lambda *a, **k: calls.append(1) or reference(*a, **k)
    )
    pages = _pages(4, 3, True, dtype=torch.float16)
    index = torch.tensor(INDEX, dtype=torch.int32)
    got = gather_context_cpu(pages, index, torch.float16, _own(False, dtype=torch.float16))
    assert calls == [1] and got.dtype == torch.float16
    assert not kv_gather.takes(pages, torch.float16, None)
    assert not kv_gather.takes(_pages(4, 0, True), torch.float32, _own(False, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"index must be \[B, n\]"):
        gather_context_cpu(_pages(4, 0, True), index[0], torch.float32)


def test_chunk_attention_through_the_gather_equals_the_reference():
    """A prompt chunk of 6 tokens after 5 cached ones (exact chunks: it reads its own rows)
    beside a two-token verify row, over rotated q4 pages with sink pages: the CPU route (the
    model's basis) gives the reference's output (the rotated basis) to float32 rounding."""
    k = _pages(4, 3, True, exact_chunks=True)
    v = _pages(4, 3, True, seed=2)
    seqs = [
        SequenceInput([1] * 6, num_cached=5, pages=[0, 6, 8], prompt_chunk=True),
        SequenceInput([1] * 2, num_cached=7, pages=[1, 4, 9]),
    ]
    batch = build_forward_batch(seqs, PAGE, "cpu")
    gen = torch.Generator().manual_seed(3)
    t = batch.num_tokens
    q, kk, vv = (torch.randn(t, h, D, generator=gen) for h in (4, KV, KV))
    angle = torch.rand(t, D // 2, generator=gen)
    outs = []
    for attention in (
        quant_paged_attention_reference,
        functools.partial(quant_paged_attention_reference, model_basis=True),
        quant_chunk_attention_cpu,
    ):
        qr = quant_rotary_cache_write_reference(
            q, kk, vv, angle.cos(), angle.sin(), k, v, batch.slot_mapping
        )
        outs.append(attention(qr, k, v, batch, D**-0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[2], outs[1])  # (the same gathered values: the same SDPA)


def test_the_cpu_op_set_sends_prompt_chunks_over_quantized_pages_through_the_gather(
    monkeypatch,
):
    from engine.ops import cpu_ops

    calls = []
    counted = kv_gather.gather_context_cpu
    monkeypatch.setattr(
        kv_gather,
        "gather_context_cpu",
        lambda *a: calls.append(kv_gather.takes(a[0], a[2], a[3])) or counted(*a),
    )
    k = _pages(4, 0, True, exact_chunks=True)
    v = _pages(4, 0, True, seed=2)
    batch = build_forward_batch([SequenceInput([1] * 6, 5, [0, 6, 8], prompt_chunk=True)], PAGE,
                                "cpu")  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    q, kk, vv = (torch.randn(6, h, D, generator=gen) for h in (4, KV, KV))
    angle = torch.rand(6, D // 2, generator=gen)
    ops = cpu_ops()
    outs = []
    for attention in (ops.paged_attention, quant_paged_attention_reference):
        qr = ops.rotary_cache_write(q, kk, vv, angle.cos(), angle.sin(), k, v, batch.slot_mapping)
        outs.append(attention(qr, k, v, batch, D**-0.5))  # (each write stashes the own rows)
    assert calls == [True, True]  # K and V, by the kernel
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_16_bit_models_chunks_stay_on_the_reference_in_the_pages_basis():
    """Pages the kernel does not take: the route is the reference as it was (q and the
    output rotated, not the whole context), to the bit."""
    dtype = torch.bfloat16
    k = _pages(4, 0, True, dtype=dtype, exact_chunks=True)
    v = _pages(4, 0, True, dtype=dtype, seed=2)
    batch = build_forward_batch([SequenceInput([1] * 6, 5, [0, 6, 8], prompt_chunk=True)], PAGE,
                                "cpu")  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    q, kk, vv = (torch.randn(6, h, D, generator=gen).to(dtype) for h in (4, KV, KV))
    angle = torch.rand(6, D // 2, generator=gen)
    outs = []
    for attention in (quant_chunk_attention_cpu, quant_paged_attention_reference):
        qr = quant_rotary_cache_write_reference(
            q, kk, vv, angle.cos().to(dtype), angle.sin().to(dtype), k, v, batch.slot_mapping
        )
        outs.append(attention(qr, k, v, batch, D**-0.5))
    assert outs[0].dtype == dtype and torch.equal(outs[0], outs[1])


def test_every_call_takes_the_one_compiled_kernel():
    """Own rows sliced from a fused projection, a block table's column slice, tables of a
    batch's rows: all reach the kernel as one type and layout, so the version the runner's
    warm-up compiled serves every request (another would compile mid-request)."""
    k = _pages(4, 3, True, exact_chunks=True)
    qkv = torch.randn(7, 3 * KV, D, generator=torch.Generator().manual_seed(6))
    angle = torch.rand(9, D, generator=torch.Generator().manual_seed(7))
    own = OwnRows(torch.arange(21, 27), torch.tensor([3, 2, 1, 0, 5, 4], dtype=torch.int32),
                  qkv[:, KV : 2 * KV], angle.cos()[:7, ::2], angle.sin()[:7, ::2],
                  torch.randn(2 * KV, D)[::2])  # fmt: skip
    assert not own.values.is_contiguous() and not own.cos.is_contiguous()
    table = torch.tensor([*INDEX, [3, 3, 3]], dtype=torch.int32).t()[:, :3]  # (strided)
    for args in (
        (table, torch.float32),
        (table, torch.float32, own),
        (table, torch.float32, own, True),
    ):
        got = gather_context_cpu(k, *args)
        want = quant_reference.gather_context(k, *args)
        valid = (table >= 0).repeat_interleave(PAGE, dim=1)
        assert torch.equal(got[valid], want[valid])
    assert len(kv_gather._gather_items.signatures) == 1
