"""``exact_chunks`` (engine/cuda/quant_reference.py): a prompt chunk of several tokens reads the
K/V those tokens wrote exactly and every earlier token through its code; a decode row and a
multi-token row that is no prompt chunk (drafts to verify) read their own keys through their
codes too. Checked against the fp32 reference attention over pages filled with exactly what
each row should see."""

from __future__ import annotations

import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import allocate_quant_pages, dequantize_pages, rotate_groups
from engine.cuda.attention import paged_attention_reference
from engine.cuda.quant_reference import (
    quant_paged_attention_reference,
    quant_rotary_cache_write_reference,
)
from engine.cuda.rotary import rotary_reference

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 64, 4
NUM_PAGES = 8
SCALE = HEAD_DIM**-0.5
# (pages, cached, new tokens, prompt chunk): a prompt chunk of 6 tokens after 7 cached ones,
# a decode row after 9, a token and two drafts to verify after 5.
CHUNK = ([3, 1, 5, 0], 7, 6, True)
DECODE = ([2, 6], 5, 1, False)
VERIFY = ([7, 4], 5, 3, False)
ROWS = (CHUNK, DECODE, VERIFY)


def _inputs(seed: int, tokens: int, device: torch.device | str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) * 2 + 1  # off-center keys
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
    theta = torch.rand(tokens, HEAD_DIM // 2, generator=gen) * 6.0
    return tuple(t.to(device) for t in (q, k, v, theta.cos(), theta.sin()))


def _pages(bits: int, exact_chunks: bool, device: torch.device | str = "cpu"):
    center = torch.linspace(-1, 1, KV_HEADS * HEAD_DIM, device=device)
    center = center.reshape(KV_HEADS, HEAD_DIM)
    shape = (NUM_PAGES, PAGE, KV_HEADS, HEAD_DIM)
    k = allocate_quant_pages(*shape, bits, True, device, center, exact_chunks=exact_chunks)
    return k, allocate_quant_pages(*shape, bits, True, device)


def _write(k_pages, v_pages, seqs, seed: int):
    """One forward's write of new rows for ``seqs`` (on the pages' device): (its batch,
    rotated q, rotated k, v)."""
    device = k_pages.data.device
    batch = _batch(seqs, device)
    q, k, v, cos, sin = _inputs(seed, batch.slot_mapping.shape[0], device)
    q_rot = quant_rotary_cache_write_reference(
        q, k, v, cos, sin, k_pages, v_pages, batch.slot_mapping
    )
    return batch, q_rot, rotary_reference(q, k, cos, sin)[1], v


def _batch(seqs, device: torch.device | str = "cpu"):
    inputs = [SequenceInput([0] * n, c, p, prompt_chunk=prompt) for p, c, n, prompt in seqs]
    return build_forward_batch(inputs, PAGE, device)


def _stored(k_pages, v_pages):
    """The fp32 pages every row reads through its code (rotated back, center added back)."""
    index = torch.arange(NUM_PAGES)
    k = rotate_groups(dequantize_pages(k_pages, index, torch.float32)) + k_pages.center
    return k, rotate_groups(dequantize_pages(v_pages, index, torch.float32))


def _filled(bits: int, exact_chunks: bool, device: torch.device | str = "cpu"):
    """Pages where an earlier forward wrote every position the second forward reads, then
    the second forward's write: (k pages, v pages, its batch, q, exact k, exact v)."""
    k_pages, v_pages = _pages(bits, exact_chunks, device)
    _write(k_pages, v_pages, [(p, 0, c, True) for p, c, _, _ in ROWS], seed=1)
    return (k_pages, v_pages, *_write(k_pages, v_pages, ROWS, seed=2))


@pytest.mark.parametrize("bits", [4, 8])
def test_chunk_reads_its_own_rows_exactly_and_the_rest_through_codes(bits):
    k_pages, v_pages, batch, q, k, v = _filled(bits, exact_chunks=True)
    out = quant_paged_attention_reference(q, k_pages, v_pages, batch, SCALE)
    want_k, want_v = _stored(k_pages, v_pages)
    chunk_rows = slice(0, CHUNK[2])
    flat_k, flat_v = want_k.view(-1, KV_HEADS, HEAD_DIM), want_v.view(-1, KV_HEADS, HEAD_DIM)
    slots = batch.slot_mapping[chunk_rows]
    flat_k[slots], flat_v[slots] = k[chunk_rows], v[chunk_rows]
    want = paged_attention_reference(q, want_k, want_v, batch, SCALE)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    # the decode and verify rows read their own keys through their codes: as with
    # exact_chunks off
    k_codes, v_codes, batch_codes, q_codes, _, _ = _filled(bits, exact_chunks=False)
    codes = quant_paged_attention_reference(q_codes, k_codes, v_codes, batch_codes, SCALE)
    torch.testing.assert_close(out[CHUNK[2] :], codes[CHUNK[2] :], atol=0, rtol=0)
    # ... and the chunk rows did differ from reading the codes, by the quantization error
    assert (out[chunk_rows] - codes[chunk_rows]).abs().max() > 1e-3
    assert k_pages.written.rows is None  # taken by the attention


def test_rows_are_read_only_by_the_forward_that_wrote_them():
    k_pages, v_pages, batch, q, _, _ = _filled(4, exact_chunks=True)
    # the same rows in another batch tensor: another forward's, so attention reads codes
    again = _batch(ROWS)
    assert torch.equal(again.slot_mapping, batch.slot_mapping)
    out = quant_paged_attention_reference(q, k_pages, v_pages, again, SCALE)
    k_codes, v_codes, batch_codes, q_codes, _, _ = _filled(4, exact_chunks=False)
    codes = quant_paged_attention_reference(q_codes, k_codes, v_codes, batch_codes, SCALE)
    torch.testing.assert_close(out, codes, atol=0, rtol=0)
    assert k_pages.written.rows is None  # dropped, not kept for a later forward


def test_exact_chunks_off_keeps_no_rows():
    k_pages, _, _, _, _, _ = _filled(4, exact_chunks=False)
    assert k_pages.written is None
