"""The context gather over quantized pages (engine/cuda/kv_gather.py) against its torch
reference (engine/cuda/quant_reference.py ``gather_context``): the same values, bit for bit,
since both round code * scale once to the output dtype."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import allocate_quant_pages, rotate_groups, write_slots
from engine.cuda import quant_reference
from engine.cuda.kv_gather import gather_context, quant_chunk_attention_cuda
from engine.cuda.quant_reference import (
    OwnRows,
    quant_paged_attention_reference,
    quant_rotary_cache_write_reference,
)
from tests.kernels.common import DEVICE, DTYPES, TOL
from tests.kernels.test_attention import rel_error

PAGE, KV, D = 4, 2, 64


def _pages(bits: int, rows: int, dtype: torch.dtype, seed: int = 0, rotate=True, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    pages = allocate_quant_pages(10, PAGE, KV, D, bits, rotate, DEVICE, kwargs.pop("center", None),
                                 rows, dtype, **kwargs)  # fmt: skip
    write_slots(
        pages,
        (3 * torch.randn(10 * PAGE, KV, D, generator=gen)).to(DEVICE),
        torch.arange(10 * PAGE, device=DEVICE),
    )
    return pages


def _own_values(dtype: torch.dtype, seed: int = 1) -> OwnRows:
    """Own rows of values at slots 21..26 (page 5's slots 1..3, page 6's 0..2), written by
    rows 3, 2, 1, 0, 5, 4 of a forward of 7 tokens."""
    values = torch.randn(7, KV, D, generator=torch.Generator().manual_seed(seed))
    rows = torch.tensor([3, 2, 1, 0, 5, 4], device=DEVICE)
    return OwnRows(torch.arange(21, 27, device=DEVICE), rows, values.to(DEVICE, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "rows", "own"), [(4, 0, False), (4, 3, True), (8, 3, False),
                                                   (8, 0, True)])  # fmt: skip
def test_gather_matches_the_torch_gather(dtype, bits, rows, own):
    """Code pages, sink/recent pages (ids below ``rows``: their rows) and the chunk's own rows
    (slots 21..26, pages 5 and 6) put in; a block table's padding (-1) gives zeros. (Pages
    not rotated: a rotated own row is the float32 butterflies' rounding apart, tested below.)"""
    pages = _pages(bits, rows, dtype, rotate=False)
    index = torch.tensor([[5, 1, 7], [2, 6, -1], [0, 9, 4]], dtype=torch.int32, device=DEVICE)
    own_rows = _own_values(dtype) if own else None
    got = gather_context(pages, index, dtype, own_rows)
    want = quant_reference.gather_context(pages, index, dtype, own_rows)
    assert got.shape == want.shape == (3, 3 * PAGE, KV, D) and got.dtype == dtype
    valid = (index >= 0).repeat_interleave(PAGE, dim=1)
    assert torch.equal(got[valid], want[valid])
    assert not got[~valid].any()
    if own:  # (the overlay was exercised: page 5's slot 1 is own row 0, the write's row 3)
        assert torch.equal(got[0, 1], own_rows.values[3])
    if rows:  # (and the rows: page 1 is a sink or recent page)
        assert torch.equal(got[0, PAGE : 2 * PAGE], pages.sinks[1].to(dtype))


@pytest.mark.parametrize(("bits", "rows", "dtype"), [(4, 3, torch.float32), (8, 0, torch.float16)])
def test_gather_rotates_back_into_the_models_basis(bits, rows, dtype):
    """``unrotate``: each stored (rotated) group times H, as ``rotate_groups`` takes it (to
    float32 rounding, then the output dtype's); the own rows are made in that basis and stay
    as they are. Without ``unrotate`` the own rows are rotated into the pages' basis."""
    pages = _pages(bits, rows, dtype)
    index = torch.tensor([[5, 1, 7], [2, 6, 0]], dtype=torch.int32, device=DEVICE)
    own_rows = _own_values(dtype)
    got = gather_context(pages, index, dtype, own_rows, unrotate=True)
    stored = quant_reference.gather_context(pages, index, torch.float32)
    want = rotate_groups(stored)
    own = torch.zeros(got.shape[:2], dtype=torch.bool, device=DEVICE)
    own[0, 1:4] = own[1, PAGE : PAGE + 3] = True
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got[~own].float(), want[~own], atol=tol * want.abs().max(), rtol=0)
    assert torch.equal(got[own], own_rows.values[own_rows.rows])
    assert (got[~own].float() - stored[~own]).abs().max() > 0.1  # (it did rotate)
    # the torch gather does the same (its own rows put in after the rotation)
    torch_gather = quant_reference.gather_context(pages, index, dtype, own_rows, unrotate=True)
    torch.testing.assert_close(torch_gather.float(), got.float(), atol=2 * tol * want.abs().max(),
                               rtol=0)  # fmt: skip
    if DEVICE == "cpu" and dtype == torch.float32:  # the same butterflies (float16: the torch
        assert torch.equal(torch_gather, got)  # gather rounds each code * scale first)
    # in the pages' basis: codes as stored, own rows rotated
    got = gather_context(pages, index, dtype, own_rows)
    want = quant_reference.gather_context(pages, index, dtype, own_rows)
    assert torch.equal(got[~own], want[~own])
    scale = own_rows.values.abs().max()
    torch.testing.assert_close(got[own].float(), want[own].float(), atol=tol * scale, rtol=0)
    if DEVICE == "cpu":  # (the simulator: the same butterflies as the torch gather's)
        assert torch.equal(got[own], want[own])
    assert (got[own].float() - own_rows.values[own_rows.rows].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_own_rows_of_keys_take_rotary_and_the_center_in_the_kernel(dtype):
    """K pages that keep written rows (exact chunks) and subtract a center: the kernel makes
    an own row from the key before rotary, its rotary tables and the center, as
    ``OwnRows.exact`` does in torch (each rotary product and sum rounded to the dtype)."""
    gen = torch.Generator().manual_seed(4)
    center = torch.randn(KV, D, generator=gen).to(DEVICE)
    pages = _pages(4, 3, dtype, exact_chunks=True, center=center)
    keys = torch.randn(7, KV, D, generator=gen).to(DEVICE, dtype)
    angle = torch.rand(7, D // 2, generator=gen).to(DEVICE) * 6.28
    slots = torch.arange(21, 27, device=DEVICE)
    rows = torch.tensor([3, 2, 1, 0, 5, 4], device=DEVICE)  # (on the device: the kernel reads it)
    own_rows = OwnRows(slots, rows, keys, angle.cos().to(dtype), angle.sin().to(dtype), center)
    index = torch.tensor([[5, 1, 7], [2, 6, 0]], dtype=torch.int32, device=DEVICE)
    own = torch.zeros(2, 3 * PAGE, dtype=torch.bool, device=DEVICE)
    own[0, 1:4] = own[1, PAGE : PAGE + 3] = True
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    for unrotate in (True, False):
        got = gather_context(pages, index, dtype, own_rows, unrotate=unrotate)
        want = quant_reference.gather_context(pages, index, dtype, own_rows, unrotate=unrotate)
        scale = want.abs().max()
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)
    exact = own_rows.exact()
    assert (exact - keys[own_rows.rows].float()).abs().max() > 0.5  # (rotary, center applied)
    got = gather_context(pages, index, dtype, own_rows, unrotate=True)
    torch.testing.assert_close(got[own].float(), exact, atol=tol * exact.abs().max(), rtol=0)


def test_gather_refuses_what_it_cannot_take():
    pages = _pages(4, 0, torch.float32)
    index = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"index must be \[B, n\]"):
        gather_context(pages, index, torch.float32)
    with pytest.raises(ValueError, match="float16"):
        gather_context(pages, index[None], torch.float32, _own_values(torch.float16))
    cos = torch.ones(7, D // 2, device=DEVICE)
    keys = dataclasses.replace(_own_values(torch.float32), cos=cos, sin=cos)
    with pytest.raises(ValueError, match="keep written rows"):  # (pages without a stash)
        gather_context(pages, index[None], torch.float32, keys)


def test_chunk_attention_through_the_gather_equals_the_reference():
    """A prompt chunk of 6 tokens after 5 cached ones (exact chunks: it reads its own rows),
    beside a two-token verify row, over q4 pages with sink pages: the CUDA op set's route
    gives the torch reference's output."""
    dtype = torch.float32
    k = _pages(4, 3, dtype, exact_chunks=True)
    v = _pages(4, 3, dtype, seed=2)
    seqs = [
        SequenceInput([1] * 6, num_cached=5, pages=[0, 6, 8], prompt_chunk=True),
        SequenceInput([1] * 2, num_cached=7, pages=[1, 4, 9]),
    ]
    batch = build_forward_batch(seqs, PAGE, DEVICE)
    gen = torch.Generator().manual_seed(3)
    t = batch.num_tokens
    q, kk, vv = (torch.randn(t, h, D, generator=gen).to(DEVICE) for h in (4, KV, KV))
    angle = torch.rand(t, D // 2, generator=gen).to(DEVICE)
    outs = []
    for attention in (
        quant_paged_attention_reference,
        functools.partial(quant_paged_attention_reference, model_basis=True),  # (torch)
        quant_chunk_attention_cuda,
    ):
        qr = quant_rotary_cache_write_reference(
            q, kk, vv, angle.cos(), angle.sin(), k, v, batch.slot_mapping
        )
        outs.append(attention(qr, k, v, batch, D**-0.5))
    # (in the model's basis, and in the rotated one: float32 rounding apart)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[1], atol=1e-5, rtol=1e-5)


class _CountOps(TorchDispatchMode):
    """Counts the torch ops dispatched inside (``detach``: the simulator's argument wrapping,
    which a GPU launch does not do), SDPA as one (``count_sdpa_as_one``): on CUDA, float32
    with a mask takes its math route, ~20 ops of its own (H200, 2026-11-30: 220 and 39 ops
    where the simulator counts 206 and 15), which both routes pay alike."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.inside_sdpa = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside_sdpa:
            self.count += func.overloadpacket.__name__ != "detach"
        return func(*args, **(kwargs or {}))

    def count_sdpa_as_one(self, monkeypatch):
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def counted(*args, **kwargs):
            self.count += 1
            self.inside_sdpa = True
            try:
                return sdpa(*args, **kwargs)
            finally:
                self.inside_sdpa = False

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        return self


def test_chunk_attention_through_the_gather_dispatches_a_seventh_of_the_torch_ops(monkeypatch):
    """The host cost of the prompt-chunk route is its torch ops (each a launch and ~10 us of
    host time on a GPU): a mixed batch's prompt chunk (exact chunks) and 4 decode rows over q4
    pages with sink pages, the rest of the split (engine/cuda/attention.py ``decode_split``)
    as the op set hands it over: 206 torch ops by the reference, 15 here (2026-11-30, SDPA
    counted as one; 118 and 15 on 2026-11-28: 399ffa3's in-place dequantization, which made
    the CPU's route faster, took the reference to 126, and later steps to 138 and 206 were
    not traced; 38 here before the kernel made the own rows (rotary, center and their order
    were torch ops per layer), the attention mask was kept additive (SDPA converted a boolean
    one per call) and q's padding rows took row 0 (no zero row appended per call))."""
    from engine.cuda.attention import decode_split

    k = _pages(4, 3, torch.float32, exact_chunks=True)
    v = _pages(4, 3, torch.float32, seed=2)
    seqs = [SequenceInput([1] * 12, num_cached=10, pages=[0, 5, 6, 7, 8, 9], prompt_chunk=True)]
    seqs += [SequenceInput([1], num_cached=5 + i, pages=[1 + i, 4]) for i in range(2)]
    batch = build_forward_batch(seqs, PAGE, DEVICE)
    rest = decode_split(batch).rest
    gen = torch.Generator().manual_seed(3)
    t = batch.num_tokens
    q, kk, vv = (torch.randn(t, h, D, generator=gen).to(DEVICE) for h in (4, KV, KV))
    angle = torch.rand(t, D // 2, generator=gen).to(DEVICE)
    counts = {}
    for attention in (quant_paged_attention_reference, quant_chunk_attention_cuda):
        for _ in range(2):  # (the second: the forward's plans made)
            qr = quant_rotary_cache_write_reference(
                q, kk, vv, angle.cos(), angle.sin(), k, v, batch.slot_mapping
            )
            with _CountOps().count_sdpa_as_one(monkeypatch) as ops:
                attention(qr, k, v, rest, D**-0.5)
        counts[attention.__name__] = ops.count
    torch_ops, kernel_ops = counts.values()
    assert kernel_ops <= 0.15 * torch_ops, counts


def test_the_mixed_step_profile_runs_both_chunk_routes():
    """bench/kv_forward_profile.py --mixed compares the op set's chunk route with the torch
    gather it replaced (GPU only, so its routes are checked here): both give the reference's
    output on a prompt chunk over q4 pages."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from engine.ops import cuda_ops

    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from kv_forward_profile import chunk_routes

    model = SimpleNamespace(ops=cuda_ops())
    routes = chunk_routes(model, "q4", ["kernel", "torch"])
    assert list(routes) == ["kernel", "torch"] and list(chunk_routes(model, "fp16", [])) == [""]
    k = _pages(4, 3, torch.float32, exact_chunks=True)
    v = _pages(4, 3, torch.float32, seed=2)
    seqs = [SequenceInput([1] * 6, num_cached=5, pages=[0, 6, 8], prompt_chunk=True)]
    batch = build_forward_batch(seqs, PAGE, DEVICE)
    gen = torch.Generator().manual_seed(3)
    q, kk, vv = (torch.randn(6, h, D, generator=gen).to(DEVICE) for h in (4, KV, KV))
    angle = torch.rand(6, D // 2, generator=gen).to(DEVICE)
    outs = []
    for attention in (quant_paged_attention_reference, *routes.values()):
        qr = quant_rotary_cache_write_reference(
            q, kk, vv, angle.cos(), angle.sin(), k, v, batch.slot_mapping
        )
        outs.append(attention(qr, k, v, batch, D**-0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[2], outs[0])  # (the torch route is the reference itself)


@pytest.mark.parametrize("quant", ["fp16", "q4"])
def test_the_verify_steps_cuda_routes_give_the_references_output(quant):
    """bench/kv_quant_decode.py times a step verifying drafts on a GPU through the gather
    route and as decode-kernel rows (its CUDA pairing is checked here, in the simulator): on
    sequences of 1 + 4 tokens, over q4 pages with sink rows and over float pages, both give
    the reference's output, the kernel's as every token a row of its own."""
    from bench import kv_quant_decode
    from engine.cuda.attention import decode_split, paged_attention_reference
    from engine.ops import decode_rows_on

    kernel, gather, takes = kv_quant_decode._decode_kernel_and_gather("cuda", quant)
    assert kernel is kv_quant_decode._attention_kernel(quant)  # (the CUDA op set's kernel)
    short = 1 + kv_quant_decode.VERIFY_DRAFTS
    rows = decode_rows_on(kernel, gather, takes, short=short)
    seqs = [SequenceInput([1] * short, num_cached=n, pages=p)
            for n, p in ((7, [0, 6, 8, 9]), (2, [1, 5]))]  # fmt: skip
    batch = build_forward_batch(seqs, PAGE, DEVICE)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(batch.num_tokens, 4, D, generator=gen).to(DEVICE)
    if quant == "fp16":
        k, v = (torch.randn(10, PAGE, KV, D, generator=gen).to(DEVICE) for _ in range(2))
        reference = paged_attention_reference
    else:
        k, v = _pages(4, 3, torch.float32), _pages(4, 3, torch.float32, seed=2)
        reference = quant_paged_attention_reference
    want = reference(q, k, v, batch, D**-0.5)
    assert rel_error(gather(q, k, v, batch, D**-0.5), want) <= TOL[torch.float32]
    assert rel_error(rows(q, k, v, batch, D**-0.5), want) <= TOL[torch.float32]
    split = decode_split(batch, short)
    assert split.rest is None and split.decode.seq_lens_host == (8, 9, 10, 11, 12, 3, 4, 5, 6, 7)
