"""The torch reference attention groups a forward's sequences by query length (padding a decode
row to a prefill chunk's length would multiply its work). Grouped results must equal attention
computed one sequence at a time, for plain and quantized pages, with and without a window."""

from __future__ import annotations

import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import allocate_quant_pages, dequantize_pages, rotate_groups, write_slots
from engine.cuda import attention
from engine.cuda.attention import attention_groups, paged_attention_reference
from engine.cuda.quant_reference import quant_paged_attention_reference

PAGE = 4
MIXED = [(5, 1), (0, 7), (12, 1), (3, 3), (20, 1), (0, 2), (9, 12)]  # (cached, new) per sequence


def make_batch(specs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // PAGE) for c, n in specs]
    pool = sum(needed) + 3
    ids = torch.randperm(pool, generator=gen).tolist()
    seqs = []
    for (cached, new), n_pages in zip(specs, needed, strict=True):
        pages, ids = ids[:n_pages], ids[n_pages:]
        seqs.append(SequenceInput(token_ids=[1] * new, num_cached=cached, pages=pages))
    return seqs, build_forward_batch(seqs, PAGE), pool, gen


def per_sequence(q, k_pages, v_pages, seqs, scale, window):
    """Attention of each sequence's new tokens, one sequence at a time, in float64."""
    out, row = [], 0
    for seq in seqs:
        total = seq.num_cached + len(seq.token_ids)
        k = k_pages[list(seq.pages)].reshape(-1, *k_pages.shape[2:])[:total].double()
        v = v_pages[list(seq.pages)].reshape(-1, *v_pages.shape[2:])[:total].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [total, H, D]
        for j in range(len(seq.token_ids)):
            p = seq.num_cached + j
            keys = torch.arange(total)
            seen = (keys <= p) & ((keys > p - window) if window else True)
            scores = torch.einsum("hd,khd->hk", q[row].double(), k) * scale
            scores[:, ~seen] = float("-inf")
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
            row += 1
    return torch.stack(out)


def test_groups_are_power_of_two_query_buckets_covering_every_row_once():
    _, batch, _, _ = make_batch(MIXED)
    groups = attention_groups(batch)
    # query lengths 1,7,1,3,1,2,12 -> buckets {1}, {2,3}, {4..7}, {8..15}
    assert len(groups) == 4
    rows = torch.cat([g.rows for g in groups]).sort().values
    assert torch.equal(rows, torch.arange(batch.num_tokens))
    assert attention_groups(batch) is groups  # built once per forward


def test_decode_only_batch_is_one_group_without_a_row_gather():
    _, batch, _, _ = make_batch([(3, 1), (8, 1), (0, 1)])
    (group,) = attention_groups(batch)
    assert group.rows is None


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_mixed_batch_matches_attention_per_sequence(window, heads, kv_heads):
    seqs, batch, pool, gen = make_batch(MIXED, seed=1)
    q = torch.randn(batch.num_tokens, heads, 8, generator=gen)
    k = torch.randn(pool, PAGE, kv_heads, 8, generator=gen)
    v = torch.randn(pool, PAGE, kv_heads, 8, generator=gen)
    out = paged_attention_reference(q, k, v, batch, 0.3, window)
    want = per_sequence(q, k, v, seqs, 0.3, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits,rotate", [(8, False), (4, True)])
def test_quantized_mixed_batch_matches_attention_per_sequence(bits, rotate):
    """Quantized pages: the grouped reference equals exact attention over the dequantized
    values (the rotation is undone exactly, up to float rounding)."""
    seqs, batch, pool, gen = make_batch(MIXED, seed=2)
    q = torch.randn(batch.num_tokens, 4, 32, generator=gen)
    pages = []
    for _ in range(2):
        quant = allocate_quant_pages(pool, PAGE, 2, 32, bits, rotate, "cpu")
        values = torch.randn(pool * PAGE, 2, 32, generator=gen)
        write_slots(quant, values, torch.arange(pool * PAGE))
        pages.append(quant)
    out = quant_paged_attention_reference(q, *pages, batch, 0.2)
    every_page = torch.arange(pool)
    plain = [dequantize_pages(p, every_page, torch.float32) for p in pages]
    if rotate:  # stored in the rotated basis: back to the values' own
        plain = [rotate_groups(x) for x in plain]
    want = per_sequence(q, *plain, seqs, 0.2, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


FRESH = [(0, 5), (0, 7), (0, 4), (6, 2), (0, 1)]  # the 4..7 bucket starts at position 0


def causal_calls(monkeypatch) -> list[bool]:
    """Records each SDPA call's is_causal (the reference's choice of SDPA's own causal rule
    over a mask)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, is_causal=False, **kwargs):
        calls.append(is_causal)
        return sdpa(*args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize(
    "window,causal_groups",
    [(None, 2), (7, 2), (6, 1), (3, 1)],  # 2: the 4..7 group and the lone 1-token prompt
)
def test_groups_of_fresh_prompts_take_sdpas_causal_rule(monkeypatch, window, causal_groups):
    """A group whose every sequence starts at position 0 (ragged lengths padded to the
    longest) runs SDPA's own causal rule instead of a mask, unless a window shorter than its
    longest query cuts in; either way each row equals attention one sequence at a time."""
    seqs, batch, pool, gen = make_batch(FRESH, seed=3)
    q = torch.randn(batch.num_tokens, 4, 8, generator=gen)
    k = torch.randn(pool, PAGE, 2, 8, generator=gen)
    v = torch.randn(pool, PAGE, 2, 8, generator=gen)
    calls = causal_calls(monkeypatch)
    out = paged_attention_reference(q, k, v, batch, 0.3, window)
    assert len(calls) == 3 and sum(calls) == causal_groups
    want = per_sequence(q, k, v, seqs, 0.3, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "specs,sdpa_calls",
    [
        ([(0, 9), (0, 14)], [True]),  # a first chunk: SDPA's causal rule
        ([(21, 7), (21, 7)], []),  # a later chunk after one prefix: the split (thresholds lowered)
    ],
)
def test_quantized_prompt_chunks_attend_as_plain_ones(
    monkeypatch, split_from_small_prefixes, specs, sdpa_calls
):
    """The quantized reference pads the same way: over q4 pages a first chunk is causal and
    a later chunk after one cached prefix splits, over the gathered (dequantized) context."""
    seqs, batch, pool, gen = make_batch(specs, seed=4)
    q = torch.randn(batch.num_tokens, 4, 32, generator=gen)
    pages = []
    for _ in range(2):
        quant = allocate_quant_pages(pool, PAGE, 2, 32, 4, True, "cpu")
        values = torch.randn(pool * PAGE, 2, 32, generator=gen)
        write_slots(quant, values, torch.arange(pool * PAGE))
        pages.append(quant)
    calls = causal_calls(monkeypatch)
    out = quant_paged_attention_reference(q, *pages, batch, 0.2)
    assert calls == sdpa_calls
    plain = [rotate_groups(dequantize_pages(p, torch.arange(pool), torch.float32)) for p in pages]
    want = per_sequence(q, *plain, seqs, 0.2, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def split_from_small_prefixes(monkeypatch):
    """The prefix/chunk split's thresholds lowered, so tiny shapes exercise it."""
    monkeypatch.setattr(attention, "SPLIT_MIN_PREFIX", 8)
    monkeypatch.setattr(attention, "SPLIT_MIN_CHUNK", 4)
    monkeypatch.setattr(attention, "SPLIT_MIN_ROWS", 6)


@pytest.mark.parametrize(
    "specs,window,split",
    [
        ([(13, 6), (13, 6), (13, 6)], None, True),  # one prefix length, one chunk length
        ([(13, 6), (12, 6)], None, True),  # prefixes differ: one sequence at a time
        ([(13, 6), (17, 7), (9, 6)], None, True),  # chunks differ too
        ([(13, 4), (12, 4)], None, False),  # one at a time: too few rows per call
        ([(13, 4), (13, 4)], None, True),  # in one call: enough
        ([(13, 6), (13, 6)], 19, True),  # a window that hides no key
        ([(13, 6), (16, 6)], 21, False),  # one that does (for the longer sequence)
        ([(13, 6), (7, 6)], None, False),  # a prefix under the threshold
        ([(13, 6), (13, 3)], None, False),  # a chunk under it
        ([(13, 5)], None, False),  # fewer query rows in the group than the threshold
        ([(13, 6)], None, True),  # as many
    ],
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_later_chunks_after_one_prefix_split_instead_of_masking(
    monkeypatch, split_from_small_prefixes, specs, window, split, heads, kv_heads
):
    """A group whose sequences bring long enough chunks after long enough cached prefixes
    attends prefix and chunk apart and merges them (no SDPA call, no mask), in one batch or
    one sequence at a time; each row still equals attention one sequence at a time."""
    seqs, batch, pool, gen = make_batch(specs, seed=5)
    q = torch.randn(batch.num_tokens, heads, 8, generator=gen)
    k = torch.randn(pool, PAGE, kv_heads, 8, generator=gen)
    v = torch.randn(pool, PAGE, kv_heads, 8, generator=gen)
    calls = causal_calls(monkeypatch)
    out = paged_attention_reference(q, k, v, batch, 0.3, window)
    assert (calls == []) is split
    assert all(not group.masks for group in attention_groups(batch)) is split
    want = per_sequence(q, k, v, seqs, 0.3, window)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_chunk_after_the_default_threshold_splits(monkeypatch, dtype, tol):
    """At the engine's own thresholds (1024 cached tokens, 64-token chunks, 256 rows) the
    split is taken, in float32 and bfloat16 (merged in float32)."""
    prefix, chunk = attention.SPLIT_MIN_PREFIX, attention.SPLIT_MIN_CHUNK
    sequences = attention.SPLIT_MIN_ROWS // chunk
    seqs, batch, pool, gen = make_batch([(prefix, chunk)] * sequences, seed=6)
    q = torch.randn(batch.num_tokens, 6, 8, generator=gen)
    k = torch.randn(pool, PAGE, 2, 8, generator=gen)
    v = torch.randn(pool, PAGE, 2, 8, generator=gen)
    calls = causal_calls(monkeypatch)
    out = paged_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), batch, 0.3)
    assert calls == [] and out.dtype == dtype
    want = per_sequence(q.to(dtype), k.to(dtype), v.to(dtype), seqs, 0.3, None)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.fixture
def chunk_split(monkeypatch):
    """Sets ``ENGINE_CHUNK_SPLIT`` for the test (its reading is cached per process)."""

    def set_to(choice: str) -> None:
        monkeypatch.setenv(attention.CHUNK_SPLIT_ENV, choice)
        attention.chunk_split_devices.cache_clear()

    yield set_to
    attention.chunk_split_devices.cache_clear()  # (before monkeypatch restores the variable)


def test_chunk_split_choice_names_the_devices_that_split(chunk_split):
    for choice, devices in [("auto", ("cpu",)), ("", ("cpu",)), ("ON", ("cpu", "cuda"))]:
        chunk_split(choice)
        assert attention.chunk_split_devices() == devices
    chunk_split("off")
    assert attention.chunk_split_devices() == ()


def test_a_bad_chunk_split_value_stops_the_op_sets_selection(chunk_split):
    from engine.ops import select_ops

    chunk_split("sometimes")
    with pytest.raises(ValueError, match="ENGINE_CHUNK_SPLIT='sometimes' is not one of auto"):
        select_ops("cpu")


def test_flash_op_per_device_dtype_and_head_size(chunk_split):
    """A GPU splits only when asked to (``on``: untimed there), and only where CUDA's flash
    op takes the queries: float16 or bfloat16, a head size a multiple of 8 up to 256."""
    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cuda_op = torch.ops.aten._scaled_dot_product_flash_attention
    chunk_split("auto")
    assert attention.flash_attention_op("cpu", torch.float32, 64) is cpu_op
    assert attention.flash_attention_op("cuda", torch.float16, 64) is None
    chunk_split("on")
    assert attention.flash_attention_op("cpu", torch.bfloat16, 60) is cpu_op
    assert attention.flash_attention_op("cuda", torch.float16, 128) is cuda_op
    assert attention.flash_attention_op("cuda", torch.bfloat16, 256) is cuda_op
    for dtype, head_dim in [(torch.float32, 64), (torch.float16, 60), (torch.float16, 264)]:
        assert attention.flash_attention_op("cuda", dtype, head_dim) is None
    assert attention.flash_attention_op("meta", torch.float16, 64) is None
    chunk_split("off")
    assert attention.flash_attention_op("cpu", torch.float32, 64) is None


def test_off_keeps_the_mask_for_later_chunks(monkeypatch, split_from_small_prefixes, chunk_split):
    chunk_split("off")
    seqs, batch, pool, gen = make_batch([(13, 6)] * 3, seed=5)
    q = torch.randn(batch.num_tokens, 6, 8, generator=gen)
    k, v = (torch.randn(pool, PAGE, 2, 8, generator=gen) for _ in range(2))
    calls = causal_calls(monkeypatch)
    out = paged_attention_reference(q, k, v, batch, 0.3)
    assert calls == [False] and attention_groups(batch)[0].masks  # the masked SDPA call
    want = per_sequence(q, k, v, seqs, 0.3, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "specs",
    [
        [(40, 24)] * 3,  # one batched split
        [(40, 24), (57, 24), (33, 30)],  # one sequence at a time
        [(1030, 96), (1030, 96)],  # past the engine's own thresholds
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_later_chunks_split_through_the_flash_op(
    monkeypatch, split_from_small_prefixes, chunk_split, specs, dtype
):
    """``ENGINE_CHUNK_SPLIT=on``: on a GPU a later chunk attends prefix and chunk apart
    through CUDA's flash op and merges them (no SDPA call, no mask), matching attention one
    sequence at a time as closely as the masked call does. (Run by bench/gpu_session.sh.)"""
    chunk_split("on")
    seqs, batch, pool, gen = make_batch(specs, seed=7)
    q = torch.randn(batch.num_tokens, 8, 64, generator=gen)
    k, v = (torch.randn(pool, PAGE, 2, 64, generator=gen) for _ in range(2))
    want = per_sequence(q.to(dtype), k.to(dtype), v.to(dtype), seqs, 0.125, None)
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    batch = build_forward_batch(seqs, PAGE, device="cuda")
    calls = causal_calls(monkeypatch)
    out = paged_attention_reference(q, k, v, batch, 0.125)
    assert calls == [] and out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-2, atol=2e-2)
    chunk_split("off")
    masked = paged_attention_reference(
        q, k, v, build_forward_batch(seqs, PAGE, device="cuda"), 0.125
    )
    assert calls == [False]
    error = (out.cpu().double() - want).abs().max()
    assert error <= 2 * (masked.cpu().double() - want).abs().max() + 1e-3


def test_split_reads_one_log_sum_exp_per_query_row(monkeypatch, split_from_small_prefixes):
    """An op that pads its log-sum-exps' row count (as some attention ops round rows up)
    changes nothing: the split reads the first row of each."""
    cpu_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def padding_op(*args, **kwargs):
        out, lse = cpu_op(*args, **kwargs)[:2]
        return out, torch.cat((lse, torch.full((*lse.shape[:-1], 5), 1e9)), dim=-1)

    monkeypatch.setattr(attention, "flash_attention_op", lambda *_: padding_op)
    seqs, batch, pool, gen = make_batch([(13, 6), (13, 6), (17, 7)], seed=8)
    q = torch.randn(batch.num_tokens, 6, 8, generator=gen)
    k, v = (torch.randn(pool, PAGE, 2, 8, generator=gen) for _ in range(2))
    out = paged_attention_reference(q, k, v, batch, 0.3)
    want = per_sequence(q, k, v, seqs, 0.3, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
