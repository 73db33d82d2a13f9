"""The CPU's Numba kernels (engine/cpu/) against the torch references: decode attention read
in place from float pages and from a quantized cache's codes (decode_attention.py), the
cache write's codes and scales (quant_write.py), and the CPU op set that routes to them
(engine/ops.py)."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import (
    GROUP,
    QUANT_BITS,
    allocate_quant_pages,
    hadamard,
    hadamard_butterflies,
    quantize,
    rotate_groups,
    search_scales,
    write_slots,
)
from engine.cpu import bits, decode_attention, quant_write, team, turns
from engine.cpu.decode_attention import (
    VERIFY_ROWS,
    decode_attention_cpu,
    quant_decode_attention_cpu,
    supports,
)
from engine.cpu.quant_write import write_slots_cpu
from engine.cuda.attention import decode_split, paged_attention_reference
from engine.cuda.quant_reference import quant_paged_attention_reference
from engine.ops import cpu_ops
from tests.call_records import record_calls

PAGE = 4
TOL = 1e-5  # float32 both ways, summed in other orders: max error relative to the max output


def _case(
    contexts: list[int],
    quant: str,
    rotate: bool = True,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = GROUP,
    unquantized: bool = False,
    new: int = 1,
    seed: int = 0,
    page: int = PAGE,
):
    """Sequences of ``contexts`` tokens (the last ``new`` of each new in this forward) on a
    shuffled subset of a pool of pages holding random rows (a wrong page read shows). With
    ``unquantized`` (sink and recent pages: the lowest ids, read from their rows), each
    sequence's first and last pages are such pages, and every such page is one of them."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // page) for c in contexts]
    unquantized = sum(min(n, 2) for n in needed) if unquantized else 0
    pool = unquantized + sum(needed) + 3
    exact = torch.randperm(unquantized, generator=gen).tolist()
    rest = (unquantized + torch.randperm(pool - unquantized, generator=gen)).tolist()
    seqs = []
    for context, n_pages in zip(contexts, needed, strict=True):
        pages, rest = rest[:n_pages], rest[n_pages:]
        for block in {0, n_pages - 1} if unquantized else ():
            pages[block] = exact.pop()
        seqs.append(SequenceInput([1] * new, num_cached=context - new, pages=pages))
    batch = build_forward_batch(seqs, page)
    k_bits, v_bits = QUANT_BITS[quant]
    center = torch.randn(kv_heads, head_dim, generator=gen)
    k_pages, v_pages = (
        allocate_quant_pages(
            pool, page, kv_heads, head_dim, bits, rotate, "cpu", c, unquantized, torch.float32
        )
        for bits, c in ((k_bits, center), (v_bits, None))
    )
    slots = torch.arange(pool * page)
    for pages in (k_pages, v_pages):
        rows = 3 * torch.randn(pool * page, kv_heads, head_dim, generator=gen)
        rows[::5, :, 3] *= 10  # an outlier channel in some rows
        write_slots(pages, rows, slots)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen)
    return q, k_pages, v_pages, batch


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize(
    ("contexts", "quant", "rotate", "heads", "kv_heads", "head_dim", "window", "unquantized"),
    [
        ([1, 4, 9], "q4", True, 2, 1, GROUP, None, False),  # 1 key, a whole page, 3 pages
        ([13, 6], "q8", False, 4, 2, 2 * GROUP, None, False),  # GQA, two groups per head
        ([17, 2], "q6", True, 3, 1, 2 * GROUP, 6, False),  # a window across pages
        ([11, 23, 5], "q4", True, 2, 1, 4 * GROUP, 3, False),  # a window inside a page
        ([14, 9, 3], "q4", True, 2, 1, GROUP, None, True),  # sink and recent pages
        ([21, 10], "q6", False, 4, 2, 2 * GROUP, 7, True),  # exact pages inside a window
    ],
)
def test_decode_matches_reference(
    contexts, quant, rotate, heads, kv_heads, head_dim, window, unquantized
):
    q, k_pages, v_pages, batch = _case(
        contexts, quant, rotate, heads, kv_heads, head_dim, unquantized
    )
    scale = head_dim**-0.5
    out = quant_decode_attention_cpu(q, k_pages, v_pages, batch, scale, window)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_error(out, ref) <= TOL


@pytest.mark.parametrize(
    ("quant", "page", "head_dim", "window", "unquantized"),
    [
        ("q4", 64, 2 * GROUP, None, True),  # tiles of 32 rows, sink and recent pages among them
        ("q8", 64, 2 * GROUP, 40, False),  # a window that starts inside a page's second tile
        ("q6", 16, 8 * GROUP, 21, False),  # head size 256: tiles of 8 rows
    ],
)
def test_pages_larger_than_a_tile_are_read_a_tile_at_a_time(
    quant, page, head_dim, window, unquantized
):
    """A page whose rows fill more than TILE_FLOATS is read in tiles that divide it: every
    key of every tile counts once, a context ending inside a tile, or a window starting
    inside one, as the reference has it."""
    assert decode_attention._tile_rows(page, head_dim) < page
    contexts = [70, 33, 100, 1, 64]
    q, k_pages, v_pages, batch = _case(
        contexts, quant, True, 4, 2, head_dim, unquantized, page=page
    )
    scale = head_dim**-0.5
    out = quant_decode_attention_cpu(q, k_pages, v_pages, batch, scale, window)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    assert _rel_error(out, ref) <= TOL


def test_decode_reads_the_codes_it_is_given():
    """Not a copy of the reference's numbers: changing one key's codes changes the kernel's
    output for its sequence only, as it does the reference's."""
    q, k_pages, v_pages, batch = _case([9, 9], "q4", seed=3)
    before = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    page = int(batch.block_tables[1, 1])
    k_pages.data[page, 2] ^= 0x5A  # every nibble of one key of the second sequence flips
    after = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, 0.3)
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])
    assert _rel_error(after, ref) <= TOL


def test_decode_fp16_queries_and_threads(monkeypatch):
    """A float16 query comes back in float16; the result does not depend on how many threads
    take the work items, and two callers at once each get their own."""
    monkeypatch.setattr(decode_attention, "SHARED_KEY_HEADS", 0)  # (a small batch, shared)
    q, k_pages, v_pages, batch = _case([7, 12, 3, 9], "q8", heads=4, kv_heads=2, seed=5)
    threads = torch.get_num_threads()
    results = {}
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results[n] = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[1], results[3])  # each item is one thread's, in one order
    half = quant_decode_attention_cpu(q.half(), k_pages, v_pages, batch, 0.2)
    assert half.dtype == torch.float16
    assert _rel_error(half, results[1]) <= 2e-3
    outs = [None, None]

    def call(i: int) -> None:
        outs[i] = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)

    callers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert all(torch.equal(out, results[1]) for out in outs)


def test_small_decode_batches_stay_on_this_thread_and_large_ones_are_shared(monkeypatch):
    """Below ``SHARED_KEY_HEADS`` (key, KV head) pairs the kernel runs on the calling thread (a
    pool thread's wake-up costs more than it saves); from there on torch's threads take its
    items in turn; the output is the same either way. Pairs count within the window."""
    contexts = [7, 12, 3, 9]
    q, k_pages, v_pages, batch = _case(contexts, "q8", heads=4, kv_heads=2, seed=5)
    shared = record_calls(monkeypatch, decode_attention, "share", 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)
        assert shared == []
        monkeypatch.setattr(decode_attention, "SHARED_KEY_HEADS", sum(contexts) * 2)
        together = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)
        assert shared == [len(contexts) * 2]  # (work items: sequences x KV heads)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)
    assert decode_attention._key_heads(batch, 5, 2) == (5 + 5 + 3 + 5) * 2


def test_decode_does_not_wait_for_a_pool_thread_that_never_starts(monkeypatch):
    """The calling thread takes every chunk the pool has not: a pool whose thread is busy
    (or gone, as in a forked child) does not hold the call up, and the result is whole."""
    monkeypatch.setattr(decode_attention, "SHARED_KEY_HEADS", 0)  # (a small batch, shared)
    q, k_pages, v_pages, batch = _case([7, 12, 3, 9], "q4", heads=4, kv_heads=2, seed=6)
    want = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)
    busy = ThreadPoolExecutor(max_workers=1)
    release = threading.Event()
    busy.submit(release.wait)
    monkeypatch.setattr(team, "team_runtime", lambda pid: None)  # (our pool, not torch's team)
    monkeypatch.setattr(turns, "_pool", lambda workers, pid: busy)
    watchdog = threading.Timer(30, release.set)  # (a call that waits returns only after it)
    threads = torch.get_num_threads()
    try:
        watchdog.start()
        torch.set_num_threads(2)
        got = quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.2)
        waited = release.is_set()
    finally:
        torch.set_num_threads(threads)
        watchdog.cancel()
        release.set()
        busy.shutdown()
    assert not waited
    assert torch.equal(got, want)


def test_decode_refuses_what_it_does_not_take():
    q, k_pages, v_pages, batch = _case([6, 9], "q4", new=2)
    with pytest.raises(ValueError, match="max_query_len=2"):
        quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    q, k_pages, v_pages, batch = _case([6], "q4")
    with pytest.raises(ValueError, match="sliding_window must be positive, got 0"):
        quant_decode_attention_cpu(q, k_pages, v_pages, batch, 0.3, 0)
    with pytest.raises(ValueError, match="does not fit"):
        quant_decode_attention_cpu(q[..., :16], k_pages, v_pages, batch, 0.3)
    # float pages of a head size the vector code does not take go to the reference
    q, k_pages, v_pages, batch = _float_case([6, 9], 2, 1, 12)
    assert not supports(q, k_pages, batch)
    with pytest.raises(ValueError, match="head size 12"):
        decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    decode_attention.warm_up_decode_attention_cpu(torch.float32, 2, 1, 12)  # (nothing to warm)


def test_cpu_ops_route_decode_rows_to_the_kernel(monkeypatch):
    """In a batch with a prompt chunk and decode rows, the decode rows go to the kernel and
    the chunk to the reference: the op's output is the reference's either way."""
    calls = record_calls(monkeypatch, decode_attention, "_run_items", 1)
    gen = torch.Generator().manual_seed(9)
    seqs = [
        SequenceInput([1], num_cached=6, pages=[0, 1]),
        SequenceInput([1] * 3, num_cached=2, pages=[2, 3], prompt_chunk=True),
        SequenceInput([1], num_cached=9, pages=[4, 5, 6]),
    ]
    batch = build_forward_batch(seqs, PAGE)
    k_pages, v_pages = (
        allocate_quant_pages(8, PAGE, 1, GROUP, bits, True, "cpu") for bits in (4, 8)
    )
    for pages in (k_pages, v_pages):
        write_slots(pages, torch.randn(8 * PAGE, 1, GROUP, generator=gen), torch.arange(8 * PAGE))
    q = torch.randn(batch.num_tokens, 2, GROUP, generator=gen)
    out = cpu_ops().paged_attention(q, k_pages, v_pages, batch, 0.25)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, 0.25)
    assert calls == [2]  # one kernel call: the two decode rows' items
    assert _rel_error(out, ref) <= TOL


@pytest.mark.parametrize("window", [None, 3])
def test_cpu_ops_attend_drafts_to_verify_as_one_token_rows_of_the_kernel(monkeypatch, window):
    """Over quantized pages a sequence of at most VERIFY_ROWS tokens that is not a prompt chunk
    (drafts to verify) goes to the kernel, each token a row with its own causal limit (and
    window); a prompt chunk and a longer query go to the chunk route. The op's output is the
    reference's, which gives each token of a sequence its own limit."""
    calls = record_calls(monkeypatch, decode_attention, "_run_items", 1)
    gen = torch.Generator().manual_seed(4)
    seqs = [
        SequenceInput([1], num_cached=6, pages=[0, 1]),  # a decode row
        SequenceInput([1] * 4, num_cached=5, pages=[2, 3, 4]),  # 3 drafts to verify
        SequenceInput([1] * 3, num_cached=2, pages=[5, 6], prompt_chunk=True),
        SequenceInput([1] * (VERIFY_ROWS + 1), num_cached=2, pages=list(range(7, 12))),
    ]
    batch = build_forward_batch(seqs, PAGE)
    k_pages, v_pages = (
        allocate_quant_pages(12, PAGE, 2, GROUP, bits, True, "cpu") for bits in (4, 8)
    )
    for pages in (k_pages, v_pages):
        rows = torch.randn(12 * PAGE, 2, GROUP, generator=gen)
        write_slots(pages, rows, torch.arange(12 * PAGE))
    q = torch.randn(batch.num_tokens, 4, GROUP, generator=gen)
    out = cpu_ops().paged_attention(q, k_pages, v_pages, batch, 0.25, window)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, 0.25, window)
    # 5 rows (the decode row, the drafts' 4) in 2 groups (the drafts' rows read their
    # sequence's keys together), 2 KV heads each
    assert calls == [4]
    assert _rel_error(out, ref) <= TOL


def test_a_batch_of_drafts_to_verify_is_the_kernels_alone(monkeypatch):
    """No prompt chunk and no longer query: every row goes to the kernel in one call."""
    calls = record_calls(monkeypatch, decode_attention, "_run_items", 1)
    q, k_pages, v_pages, batch = _case([9, 14], "q4", new=3)
    out = cpu_ops().paged_attention(q, k_pages, v_pages, batch, 0.3)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, 0.3)
    assert calls == [2]  # a group of 3 rows per sequence
    assert _rel_error(out, ref) <= TOL


def test_a_sequences_rows_verifying_drafts_are_one_group():
    """The kernel reads a context once for the rows of one sequence's tokens (limits one
    apart, one table), across a page boundary too, up to a group's most rows (a longer run
    cut into near-equal groups); rows whose limits climb by one on other pages, even sharing
    the first, are groups of their own, as every decode row is."""
    seqs = [
        SequenceInput([1], num_cached=6, pages=[0, 1]),  # a decode row
        SequenceInput([1] * 4, num_cached=2, pages=[2, 3]),  # limits 3..6, across a page
        SequenceInput([1] * 3, num_cached=4, pages=[4, 5]),  # limits 5..7
        SequenceInput([1], num_cached=7, pages=[4, 6]),  # limit 8, the first page shared
        SequenceInput([1], num_cached=8, pages=[7, 8, 9]),  # limit 9, other pages
    ]
    batch = build_forward_batch(seqs, PAGE)
    split = decode_split(batch, VERIFY_ROWS)
    tables = split.decode.block_tables.to(torch.int32).numpy()
    limits = split.decode.seq_lens.to(torch.int32).numpy()
    groups = decode_attention._row_groups(tables, limits, PAGE, 4)
    gen = torch.Generator().manual_seed(8)
    k_pages, v_pages = (
        allocate_quant_pages(10, PAGE, 1, GROUP, bits, True, "cpu") for bits in (4, 8)
    )
    for pages in (k_pages, v_pages):
        write_slots(pages, torch.randn(10 * PAGE, 1, GROUP, generator=gen), torch.arange(10 * PAGE))
    q = torch.randn(batch.num_tokens, 2, GROUP, generator=gen)
    out = quant_decode_attention_cpu(q[split.rows], k_pages, v_pages, split.decode, 0.3)
    ref = quant_paged_attention_reference(q, k_pages, v_pages, batch, 0.3)
    assert _rel_error(out, ref[split.rows]) <= TOL
    assert groups.tolist() == [0, 1, 5, 8, 9, 10]
    # at most 3 rows a group: the run of 4 is cut in two, the run of 3 kept
    assert decode_attention._row_groups(tables, limits, PAGE, 3).tolist() == [0, 1, 3, 5, 8, 9, 10]
    assert decode_attention._row_groups(tables, limits, PAGE, 1).tolist() == list(range(11))


@pytest.mark.parametrize(
    ("quant", "heads", "kv_heads", "window", "unquantized"),
    [
        ("q4", 4, 2, None, True),  # GQA; the drafts' rows on a recent page
        ("q4", 2, 1, 5, True),  # a window that starts later for each draft
        ("q8", 3, 1, 9, False),  # a window across pages
        (None, 4, 2, 6, False),  # float pages
    ],
)
def test_grouped_rows_give_each_token_its_own_limit(
    quant, heads, kv_heads, window, unquantized, monkeypatch, torch_threads
):
    """Rows verifying drafts, read as groups by the kernel itself (not through the op set):
    each token attends to its own keys, up to its own position and within its own window,
    as the reference's causal rule has it, over codes, sink and recent rows, and float pages;
    the groups' items shared among 2 threads give what one thread gives."""
    contexts, new = [13, 22, 7], [4, 5, 1]
    q, k_pages, v_pages, batch = _case(
        contexts, quant or "q4", True, heads, kv_heads, GROUP, unquantized, max(new)
    )
    seqs = [
        SequenceInput([1] * n, num_cached=c - n, pages=batch.block_tables[i].tolist())
        for i, (c, n) in enumerate(zip(contexts, new, strict=True))
    ]
    batch = build_forward_batch(seqs, PAGE)
    q = q[: batch.num_tokens]
    if quant is None:  # the same pages' values, as float32 rows
        k_pages, v_pages = (
            torch.randn(k_pages.data.shape[0], PAGE, kv_heads, GROUP, generator=gen)
            for gen in (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
        )
    split = decode_split(batch, VERIFY_ROWS)
    kernel = decode_attention_cpu if quant is None else quant_decode_attention_cpu
    reference = paged_attention_reference if quant is None else quant_paged_attention_reference
    out = kernel(q[split.rows], k_pages, v_pages, split.decode, 0.3, window)
    ref = reference(q, k_pages, v_pages, batch, 0.3, window)
    assert _rel_error(out, ref[split.rows]) <= TOL
    monkeypatch.setattr(decode_attention, "SHARED_KEY_HEADS", 0)  # (a small batch, shared)
    torch_threads(2)
    assert torch.equal(kernel(q[split.rows], k_pages, v_pages, split.decode, 0.3, window), out)


def _float_case(contexts: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Decode rows of ``contexts`` tokens on shuffled pages of a pool of float32 pages
    [P, PAGE, KV, D] holding random rows."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-c // PAGE) for c in contexts]
    pool = sum(needed) + 3
    order = torch.randperm(pool, generator=gen).tolist()
    seqs = []
    for context, n_pages in zip(contexts, needed, strict=True):
        pages, order = order[:n_pages], order[n_pages:]
        seqs.append(SequenceInput([1], num_cached=context - 1, pages=pages))
    batch = build_forward_batch(seqs, PAGE)
    k_pages, v_pages = 3 * torch.randn(2, pool, PAGE, kv_heads, head_dim, generator=gen)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen)
    return q, k_pages, v_pages, batch


@pytest.mark.parametrize(
    ("contexts", "heads", "kv_heads", "head_dim", "window"),
    [
        ([1, 4, 9], 2, 1, 64, None),  # 1 key, a whole page, 3 pages
        ([13, 6], 4, 2, 48, None),  # GQA, a head size no quantized page has
        ([17, 2], 3, 1, 80, 6),  # a window across pages
        ([11, 23, 5], 2, 2, 16, 3),  # a window inside a page, one query head per KV head
    ],
)
def test_float_decode_matches_reference(contexts, heads, kv_heads, head_dim, window):
    q, k_pages, v_pages, batch = _float_case(contexts, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = decode_attention_cpu(q, k_pages, v_pages, batch, scale, window)
    ref = paged_attention_reference(q, k_pages, v_pages, batch, scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _rel_error(out, ref) <= TOL
    half = decode_attention_cpu(q.half(), k_pages, v_pages, batch, scale, window)
    assert half.dtype == torch.float16 and _rel_error(half, ref) <= 2e-3


def test_float_decode_reads_the_pages_it_is_given():
    """Changing one cached value changes the output of its sequence only, as in the
    reference; the kernel reads a page's rows where they lie."""
    q, k_pages, v_pages, batch = _float_case([9, 9], 2, 1, 32, seed=3)
    before = decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    v_pages[int(batch.block_tables[1, 1]), 2] += 5.0
    after = decode_attention_cpu(q, k_pages, v_pages, batch, 0.3)
    ref = paged_attention_reference(q, k_pages, v_pages, batch, 0.3)
    assert torch.equal(after[0], before[0]) and not torch.allclose(after[1], before[1])
    assert _rel_error(after, ref) <= TOL


def test_float_decode_takes_float32_pages_only():
    """bfloat16 pages (a bfloat16 model's cache) are not the kernel's: refused by name, and
    the CPU op set sends them to the reference; so do K and V pages that differ."""
    q, k_pages, v_pages, batch = _float_case([6, 3], 2, 1, 32)
    k16, v16 = k_pages.bfloat16(), v_pages.bfloat16()
    with pytest.raises(ValueError, match="float32 rows"):
        decode_attention_cpu(q, k16, v16, batch, 0.3)
    with pytest.raises(ValueError, match="differ"):
        decode_attention_cpu(q, k_pages, v16, batch, 0.3)
    out = cpu_ops().paged_attention(q, k16, v16, batch, 0.3)
    assert torch.equal(out, paged_attention_reference(q, k16, v16, batch, 0.3))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decode_contexts", [(2, 13), (7, 10)])
def test_cpu_ops_route_float_decode_rows_to_the_kernel(
    decode_contexts, threads, monkeypatch, torch_threads
):
    """Float pages: a mixed batch's decode rows go to the kernel, even or ragged, on one
    thread or two, and its prompt chunk to the reference; the op's output is the
    reference's either way."""
    torch_threads(threads)
    calls = record_calls(monkeypatch, decode_attention, "_run_items", 1)
    gen = torch.Generator().manual_seed(9)
    first, second = decode_contexts
    seqs = [
        SequenceInput([1], num_cached=first - 1, pages=[0, 1]),
        SequenceInput([1] * 3, num_cached=2, pages=[2, 3]),
        SequenceInput([1], num_cached=second - 1, pages=[4, 5, 6, 7]),
    ]
    batch = build_forward_batch(seqs, PAGE)
    k_pages, v_pages = torch.randn(2, 8, PAGE, 2, 24, generator=gen)
    q = torch.randn(batch.num_tokens, 4, 24, generator=gen)
    out = cpu_ops().paged_attention(q, k_pages, v_pages, batch, 0.25)
    ref = paged_attention_reference(q, k_pages, v_pages, batch, 0.25)
    assert calls == [4]  # the two decode rows' items, 2 KV heads each
    assert _rel_error(out, ref) <= TOL


@pytest.fixture
def torch_threads():
    """Sets torch's thread count for the test."""
    threads = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(threads)


def test_float_kernel_pays_where_the_lengths_are_known_on_the_host():
    seqs = [SequenceInput([1], num_cached=c - 1, pages=list(range(9))) for c in (30, 30, 1)]
    batch = build_forward_batch(seqs, PAGE)
    assert decode_attention.float_kernel_pays(batch)
    assert not decode_attention.float_kernel_pays(dataclasses.replace(batch, seq_lens_host=()))


@pytest.mark.parametrize(
    ("bits", "rotate", "center", "unquantized", "sink_dtype"),
    [
        (8, False, False, 0, torch.float32),
        (8, True, True, 3, torch.float16),
        (8, True, True, 3, torch.float32),
        (4, False, True, 0, torch.float32),
        (4, True, False, 3, torch.float16),
        (4, True, False, 3, torch.float32),
        (4, False, True, 3, torch.float32),
    ],
)
def test_write_gives_the_reference_codes_bit_for_bit(bits, rotate, center, unquantized, sink_dtype):
    """Codes, float16 scales (their bits: signs of zero too) and unquantized rows as the
    reference writes them (float32 ones by the kernel, others by the reference's code), over
    rows that exercise the scale search's choices, all-zero groups (+0 and -0), values far
    below and near float16's range."""
    gen = torch.Generator().manual_seed(bits + 2 * rotate + 4 * center)
    kv, dim, rows = 2, 2 * GROUP, 300
    x = torch.randn(rows, kv, dim, generator=gen)
    x[::3, :, 5] *= 30  # outlier channels: the search clips them
    x[1] = 0.0
    x[2, 0, :GROUP] = -0.0
    x[4] *= 1e-6  # scales below float16's normal range
    x[5] *= 3e5 if bits == 4 else 2e6  # scales at float16's largest
    c = torch.randn(kv, dim, generator=gen) if center else None
    slots = torch.randperm(160 * PAGE, generator=gen)[:rows]
    written = []
    for write in (write_slots, write_slots_cpu):
        pages = allocate_quant_pages(
            160, PAGE, kv, dim, bits, rotate, "cpu", c, unquantized, sink_dtype
        )
        write(pages, x, slots)
        written.append(pages)
    ref, got = written
    assert torch.equal(got.data, ref.data)
    assert torch.equal(got.scales.view(torch.int16), ref.scales.view(torch.int16))
    if bits == 4 and rotate and not center:  # the search scales a zero group by -0 / d
        assert (ref.scales.view(torch.int16) == -32768).any()
    if unquantized:
        assert torch.equal(got.sinks, ref.sinks)
        assert got.sinks.abs().sum() > 0  # (some of the 300 slots lie in the 3 pages)


def test_a_prompt_chunks_write_is_shared_among_threads_and_a_decode_steps_is_not(monkeypatch):
    """A write of ``SHARED_ROWS`` rows or more goes to the kernel shared among torch's
    threads (engine/cpu/team.py), fewer in one call on this thread; the codes are the
    reference's either way."""
    shared = record_calls(monkeypatch, quant_write, "share", 2)
    gen = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (quant_write.SHARED_ROWS - 1, 300):
            x = torch.randn(rows, 2, 2 * GROUP, generator=gen)
            slots = torch.randperm(160 * PAGE, generator=gen)[:rows]
            shared.clear()
            pages = [allocate_quant_pages(160, PAGE, 2, 2 * GROUP, 4, True, "cpu") for _ in "ab"]
            write_slots(pages[0], x, slots)
            write_slots_cpu(pages[1], x, slots)
            assert torch.equal(pages[1].data, pages[0].data)
            assert torch.equal(pages[1].scales.view(torch.int16), pages[0].scales.view(torch.int16))
            assert shared == ([] if rows < quant_write.SHARED_ROWS else [rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("use_center", [False, True])
def test_kernel_centers_and_rotates_rows_as_the_reference_bit_for_bit(use_center):
    """The kernel's centering and butterflies are the reference's float32 operations in the
    same order: every value equal (a rounding anywhere else, e.g. the 1/sqrt(32) taken at
    the first stage, changes some values by an ulp, which codes would rarely show). The
    reference's butterflies are H's transform up to rounding."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 2, 4 * GROUP, generator=gen) * 5
    center = torch.randn(2, 4 * GROUP, generator=gen)
    centered = rows - center if use_center else rows
    want = hadamard_butterflies(centered.reshape(40, 2, 4, GROUP)).reshape(40, 2, -1)
    got = np.empty(4 * GROUP, np.float32)
    for t in range(40):
        for kvh in range(2):
            given = center[kvh] if use_center else torch.zeros(4 * GROUP)
            quant_write._centered_rotated(rows[t, kvh].numpy(), given.numpy(), True, got)
            assert np.array_equal(got, want[t, kvh].numpy())
    by_matmul = centered.reshape(40, 2, 4, GROUP) @ hadamard("cpu")
    torch.testing.assert_close(want, by_matmul.reshape(40, 2, -1), rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, by_matmul.reshape(40, 2, -1))  # (rounded in another order)


@pytest.mark.parametrize(("bits", "search"), [(4, True), (4, False), (8, False)])
def test_kernel_scales_and_codes_on_crafted_groups(bits, search):
    """The kernel's per-group rules on groups as given (no rotation): a tie between two
    divisors (the first wins), a scale exactly halfway between two float16 values (to even),
    all-zero groups of both signs, and random rotated groups; codes as ``quantize`` packs."""
    gen = torch.Generator().manual_seed(bits)
    x = rotate_groups(torch.randn(64, 4 * GROUP, generator=gen) * 3)
    x[0, :GROUP] = 0.0
    x[1, :GROUP] = -0.0
    x[2, :GROUP] = 0.0
    x[2, 3] = 56.0  # exact under d = 7 and d = 8 alike: the search keeps d = 7 (scale -8)
    x[3, :GROUP] = 0.0
    x[3, 5] = (2**bits // 2 - 1) * (1 + 2**-11)  # absmax / qmax halfway above 1.0: to 1.0
    groups = x.reshape(64, 1, 4, GROUP).contiguous()
    data = torch.zeros(64, 1, 4 * GROUP * bits // 8, dtype=torch.uint8)
    scales = torch.zeros(64, 1, 4, dtype=torch.int16)
    no_center = np.zeros((1, 4 * GROUP), np.float32)
    quant_write._write_rows(
        x.reshape(64, 1, -1).numpy(), no_center, False, bits, search,
        torch.arange(64).numpy(), data.numpy(), scales.numpy().view("uint16"),
        quant_write._DIVISORS, quant_write._no_sinks(1, 4 * GROUP), 0, 0, 64,
    )  # fmt: skip
    want_data, want_scales = quantize(x.reshape(64, 1, -1), bits, False, search)
    if search:
        assert torch.equal(
            want_scales.view(torch.int16), search_scales(groups, bits).view(torch.int16)
        )
        assert float(want_scales[2, 0, 0]) == -8.0
    else:
        assert float(want_scales[3, 0, 0]) == 1.0
    assert torch.equal(scales, want_scales.view(torch.int16))  # signs of zero too
    assert torch.equal(data, want_data.view(torch.uint8))


_ROUNDINGS = [
    pytest.param(bits.float16_by_bits, id="by_bits"),
    pytest.param(
        bits.float16_by_conversion,
        id="by_conversion",
        marks=pytest.mark.skipif(
            not bits.converts_float16(), reason="this CPU has no float16 conversion"
        ),
    ),
]


@pytest.mark.parametrize("rounding", _ROUNDINGS)
def test_float16_rounding_is_torchs(rounding):
    """The write kernel's float16 rounding (by the CPU's conversion, or on the float32's bits
    where it has none) against torch's conversion: random values over every float16
    exponent, subnormals included, and every value exactly halfway between two float16s (to
    even), of both signs; value and bits alike."""
    rng = np.random.default_rng(0)
    count = 200_000
    x = rng.random(count) * 2.0 ** rng.integers(-30, 16, count) * rng.choice([-1, 1], count)
    h = np.arange(0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float64)
    halfway = (h[:-1] + h[1:]) / 2  # exact in float32
    edges = [0.0, -0.0, 65504.0, 2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 1e-40]
    x = np.concatenate([x, halfway, -halfway, edges, np.negative(edges)]).astype(np.float32)
    values, bit_patterns = np.empty(x.shape[0]), np.empty(x.shape[0], np.int64)
    _round_all(rounding, x, values, bit_patterns)
    want = torch.from_numpy(x).half()
    assert np.array_equal(bit_patterns, want.view(torch.int16).numpy().astype(np.int64) & 0xFFFF)
    assert np.array_equal(values, want.double().numpy())
    assert np.array_equal(np.signbit(values), np.signbit(want.double().numpy()))


def _round_all(rounding, x, values, bit_patterns):
    @numba.njit
    def run(x, values, bit_patterns):  # (an intrinsic is not a value: ``rounding`` is frozen)
        for i in range(x.shape[0]):
            values[i], bit_patterns[i] = rounding(x[i])

    run(x, values, bit_patterns)


@pytest.mark.parametrize(
    ("features", "machine", "converts"),
    [
        ("+sse2,+f16c,+avx2", "x86_64", True),
        ("+sse2,-f16c,+avx", "x86_64", False),
        ("", "AMD64", False),
        ("", "aarch64", True),
        ("", "ppc64le", False),
    ],
)
def test_the_float16_conversion_is_used_only_where_the_target_has_it(features, machine, converts):
    assert bits.converts_float16(features, machine) is converts


@pytest.mark.parametrize("setting", [None, "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_shared_work_advises_a_spin_count_once_unless_one_is_set(monkeypatch, caplog, setting):
    """Work shared among threads logs, once per process, how to keep torch's OpenMP workers
    from spinning on the kernels' cores, unless the environment already bounds them."""
    for name in turns.SPIN_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    if setting is not None:
        monkeypatch.setenv(setting, "20000" if setting == "GOMP_SPINCOUNT" else "PASSIVE")
    turns.advise_spin_count.cache_clear()
    done = []
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with caplog.at_level("INFO", logger="engine.cpu.turns"):
            for _ in range(2):
                turns.in_turns(lambda first, last: done.extend(range(first, last)), 16)
    finally:
        torch.set_num_threads(threads)
        turns.advise_spin_count.cache_clear()
    assert sorted(done) == sorted(list(range(16)) * 2)  # every item, once per call
    advice = [r for r in caplog.records if "GOMP_SPINCOUNT=20000" in r.getMessage()]
    assert len(advice) == (1 if setting is None else 0)
