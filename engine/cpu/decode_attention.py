"""Decode attention over the paged cache on the CPU: a Numba kernel that reads each key and
value where it lies in the cache (float rows, or the codes of a quantized page: q8/q6/q4), the
way the GPU kernels do, instead of the torch reference, which copies the batch's context into
a padded tensor for SDPA (engine/cuda/attention.py, engine/cuda/quant_reference.py): for a
quantized cache it dequantizes all of it, every layer of every step, and for float pages the
copy alone grows past the caches (SmolLM2, 8 x 4k context, 2 cores: 18 ms per layer).

One work item per (group of rows, KV head), where a group is one decode row, or the rows of
a sequence's tokens verifying drafts (each a row with its own causal limit, on one context:
``_row_groups``): its rows' G = H / KV query heads each (scaled; rotated into the pages'
basis by the item when the pages are, by the write's butterflies, and the output rotated
back at its end: as torch matmuls around the kernel the two rotations had cost ~1 ms of a q4
decode step's attention at 8 x 1k, 30 layers, one or two threads, 2-3%) are held in a small
array. The group's context is read a tile at a time (a page's rows, at most ``TILE_FLOATS``
floats: codes dequantized, or float rows copied, into a block that stays in the L1 cache),
each key once for all of the group's query rows: their scores in float32, eight keys at a
time (engine/cpu/simd.py ``score_rows``), a softmax per query row over its own keys, then
every value once, accumulated per query row in registers across the tile (``weigh_rows``)
and divided by the softmax's sum. Float pages, and the sink and recent pages of a
quantized cache (ids below ``QuantPages.sinks``' rows), are read from their rows. The key
center is not added back: ``q . c`` is the same for every key of a query, so the softmax does
not see it (the references drop it the same way).

Layout (engine/cache/quant.py): 8-bit codes one per byte (int8), 4-bit codes as split halves
(byte j of a group: element j in the low nibble, j + 16 in the high one, each + 8), a float16
scale per group, read here through a 65536-entry table of their float32 values (Numba has no
float16 on the CPU; the table converts exactly). Float pages must be float32 (the CPU build's
run dtype); others go to the reference.

Work items are taken in turn by ``torch.get_num_threads()`` threads: torch's OpenMP team
(engine/cpu/team.py).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
import torch

from engine.batch import ForwardBatch, SequenceInput, build_forward_batch
from engine.cache.quant import GROUP, QuantPages
from engine.cpu.bits import float16_bits, float_from_bits
from engine.cpu.hadamard import rotate_row
from engine.cpu.simd import (
    BYTES_4BIT,
    LANES,
    dequantize_4bit_group,
    dequantize_8bit_group,
    score_rows,
    weigh_rows,
)
from engine.cpu.team import prepare, share
from engine.cuda.quant_reference import check_pair
from engine.numba_cache import cached_njit

# reassociation lets LLVM vectorize the dot products and sums; no assumption about NaN or inf
_FASTMATH = {"reassoc", "contract", "nsz"}


# exp(x) for x <= 0 as 2^n * 2^f (n = round(x log2 e), |f| <= 1/2), 2^f by its Taylor
# polynomial to degree 6 (relative error ~1e-7), 2^n from its float bits: vectorizable, where
# Numba's np.exp calls libm once per element (9 of a decode key's ~60 ns on SmolLM2's shape)
_LOG2E = np.float32(1.4426950408889634)
_EXP2_TAYLOR = tuple(np.float32(math.log(2) ** k / math.factorial(k)) for k in range(7))
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = _EXP2_TAYLOR


@numba.njit(inline="always", fastmath=_FASTMATH)
def _exp_nonpositive(x):
    """exp(x) for x <= 0 (below 2^-126: 2^-126, which no softmax sum notices)."""
    y = max(x * _LOG2E, np.float32(-126.0))
    n = np.floor(y + np.float32(0.5))
    f = y - n
    p = ((((_C6 * f + _C5) * f + _C4) * f + _C3) * f + _C2) * f
    p = (p + _C1) * f + _C0
    return p * float_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


@cached_njit(nogil=True, fastmath=_FASTMATH)
def _attend_items(
    q,  # float32 [R, H, D]: scaled queries, one row per query token
    k_data,  # uint8 [P, S, KV, W_k]
    v_data,  # uint8 [P, S, KV, W_v]
    k_scales,  # uint16 [P, S, KV, D / 32]: float16 bits
    v_scales,
    k_bits,
    v_bits,
    k_rows,  # float32 [Z, S, KV, D]: pages below Z read here (Z may be 0)
    v_rows,
    tables,  # int32 [R, n]
    seq_lens,  # int32 [R]: each row's causal limit
    groups,  # int32 [N + 1]: rows groups[i]..groups[i + 1] - 1 read one context (row_groups)
    window,  # keys within ``window`` positions of the query's (0: all)
    half,  # float32 [65536]: float16 bits -> value
    rotate,  # rotated pages: q into their basis, the output back (H is its own inverse)
    out,  # float32 [R, H, D]
    first,
    last,  # work items [first, last) of N * KV
):
    kv_heads = k_data.shape[2]
    heads = q.shape[1] // kv_heads
    page_size = k_data.shape[1]
    block = np.empty((_tile_rows(page_size, q.shape[2]), q.shape[2]), np.float32)
    for item in range(first, last):
        g = item // kv_heads
        kvh = item - g * kv_heads
        r0, r1 = groups[g], groups[g + 1]
        limits = seq_lens[r0:r1]
        # the group's context: from the window of its shortest row to its longest row's end
        start = _window_start(limits[0], window)
        end = limits[r1 - r0 - 1]
        rows = _group_queries(q, r0, r1, kvh * heads, heads)
        if rotate:
            _rotate_rows(rows)
        keys = (k_data, k_scales, k_bits, k_rows)
        scores = _scores(rows, keys, half, tables[r0], kvh, start, end, block)
        sums = _softmax(scores, heads, limits, window, start - start % page_size)
        values = (v_data, v_scales, v_bits, v_rows)
        _weigh_values(scores, sums, values, half, tables[r0], kvh, start, block, rows)
        if rotate:
            _rotate_rows(rows)
        _scatter_rows(rows, out, r0, r1, kvh * heads, heads)


@numba.njit(inline="always")
def _window_start(end, window):
    return end - window if 0 < window < end else 0


@numba.njit(inline="always")
def _group_queries(q, r0, r1, head0, heads):
    """[T * G, D] copy of rows r0..r1-1's query heads head0..head0+G-1 (row t's head h at
    t * G + h): the item's queries, read against each key at once."""
    dim = q.shape[2]
    rows = np.empty(((r1 - r0) * heads, dim), np.float32)
    for t in range(r1 - r0):
        for h in range(heads):
            for d in range(dim):
                rows[t * heads + h, d] = q[r0 + t, head0 + h, d]
    return rows


@numba.njit(inline="always")
def _scatter_rows(rows, out, r0, r1, head0, heads):
    """``_group_queries``' inverse, into ``out``."""
    for t in range(r1 - r0):
        for h in range(heads):
            for d in range(rows.shape[1]):
                out[r0 + t, head0 + h, d] = rows[t * heads + h, d]


@numba.njit(inline="always")
def _rotate_rows(rows):
    """Each row of ``rows`` [G, D] times H per group of 32, in place (the write's butterflies:
    where torch's matmul did it around the kernel, two ops per layer ran on torch's threads,
    whose OpenMP workers then spun beside the kernel's)."""
    for r in range(rows.shape[0]):
        rotate_row(rows[r])


@numba.njit(inline="always", fastmath=_FASTMATH)
def _scores(qg, keys, half, table, kvh, start, end, block):
    """[T * G, span] scores of the item's query rows against keys start..end-1, by whole
    pages from the window's first (entry i: key i + its first page's first key; entries
    before ``start``, and past a row's own limit, are written and ignored), a tile of rows
    (``block``) at a time."""
    data, scales, bits, rows = keys
    page_size, tile = data.shape[1], block.shape[0]
    first_block = start // page_size
    scores = np.empty((qg.shape[0], end - first_block * page_size), np.float32)
    blk, first, at = first_block, 0, 0  # (one loop over tiles: a loop per page cost 7%)
    while at < scores.shape[1]:
        n = min(tile, scores.shape[1] - at)
        _load_block(data, scales, bits, rows, table[blk], kvh, first, n, half, block)
        for h in range(qg.shape[0]):
            score_rows(scores, (h, at), qg, (h, 0), block, n)
        blk, first, at = _next_tile(blk, first, at, n, page_size)
    return scores


@numba.njit(inline="always")
def _next_tile(blk, first, at, n, page_size):
    """The next tile's (index in the page table, first row in its page, first entry in the
    scores) after a tile of ``n`` rows at those (``_scores``' and ``_weigh_values``' walk; as
    a helper it costs nothing measurable: SmolLM2's heads, 32 x 1024 q4, 2.37 -> 2.27 ms per
    layer on one thread, 1.110 -> 1.105 on two, within this box's noise)."""
    first += n
    if first == page_size:
        return blk + 1, 0, at + n
    return blk, first, at + n


@numba.njit(inline="always", fastmath=_FASTMATH)
def _softmax(scores, heads, limits, window, base):
    """Each row of ``scores`` (``_scores``' entries: key ``base`` + i at entry i) over its
    query token's keys, within the window and below its limit (row t * heads + h: token t,
    limit ``limits[t]``) -> exp(score - their max), other entries -> 0; returns the rows'
    sums."""
    sums = np.empty(scores.shape[0], np.float32)
    for h in range(scores.shape[0]):
        end = limits[h // heads]
        skip = _window_start(end, window) - base
        stop = end - base
        top = _row_max(scores, h, skip, stop)
        total = np.float32(0.0)
        for t in range(scores.shape[1]):
            live = skip <= t < stop
            p = _exp_nonpositive(scores[h, t] - top) if live else np.float32(0.0)
            scores[h, t] = p
            total += p
        sums[h] = total
    return sums


@numba.njit(inline="always")
def _row_max(scores, h, first, stop):
    """max(scores[h, first:stop]) (first < stop) in eight running maxima: one maximum's chain
    waited on each comparison, and without NaN assumed LLVM does not vectorize it."""
    whole = first + (stop - first) // 8 * 8
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = scores[h, first]
    for t in range(first, whole, 8):
        m0 = max(m0, scores[h, t])
        m1 = max(m1, scores[h, t + 1])
        m2 = max(m2, scores[h, t + 2])
        m3 = max(m3, scores[h, t + 3])
        m4 = max(m4, scores[h, t + 4])
        m5 = max(m5, scores[h, t + 5])
        m6 = max(m6, scores[h, t + 6])
        m7 = max(m7, scores[h, t + 7])
    top = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for t in range(whole, stop):
        top = max(top, scores[h, t])
    return top


@numba.njit(inline="always", fastmath=_FASTMATH)
def _weigh_values(weights, sums, values, half, table, kvh, start, block, out):
    """out [G, D] = the values of ``_scores``' entries (from the first key of ``start``'s
    page on) weighted by ``weights``, over ``sums``, a tile of rows (``block``) at a time."""
    data, scales, bits, rows = values
    page_size, tile = data.shape[1], block.shape[0]
    first_block = start // page_size
    acc = np.zeros(out.shape, np.float32)
    blk, first, at = first_block, 0, 0
    while at < weights.shape[1]:
        n = min(tile, weights.shape[1] - at)
        _load_block(data, scales, bits, rows, table[blk], kvh, first, n, half, block)
        for h in range(out.shape[0]):
            weigh_rows(acc, (h, 0), weights, (h, at), block, n)
        blk, first, at = _next_tile(blk, first, at, n, page_size)
    for h in range(out.shape[0]):
        inv = np.float32(1.0) / sums[h]
        for d in range(out.shape[1]):
            out[h, d] = acc[h, d] * inv


@numba.njit(inline="always", fastmath=_FASTMATH)
def _load_block(data, scales, bits, rows, page, kvh, first, count, half, block):
    """Rows first..first+count-1 of one page for one KV head into ``block`` (float32
    [tile, D]): the unquantized rows for pages below their count, else the codes times their
    groups' scales, a group at a time in vector code (engine/cpu/simd.py). (Indices are
    unsigned so that Numba emits no negative-index wraparound, which kept LLVM from
    vectorizing the loop, and with a signed row index cost the kernel 4-10%; the loop's
    bound is not a constant, so it is vectorized rather than unrolled: Numba turns LLVM's SLP
    vectorizer off.) The group loop is also kv_gather._dequantized's: one njit helper for
    both, even with inline="always", made this kernel 1.75x slower (SmolLM2 heads, q4, 8 x
    1k, one thread: 0.87 -> 1.53 ms per layer, stop 54), so each keeps its own."""
    dim = np.uintp(block.shape[1])
    first = np.uintp(first)
    if page < rows.shape[0]:
        for i in range(np.uintp(count)):
            for d in range(dim):
                block[i, d] = rows[page, first + i, kvh, d]
        return
    for i in range(np.uintp(count)):
        slot = first + i
        for grp in range(scales.shape[3]):
            scale = half[scales[page, slot, kvh, grp]]
            at = (i, grp * GROUP)
            if bits == 8:
                dequantize_8bit_group(data, (page, slot, kvh, grp * GROUP), block, at, scale)
            else:
                dequantize_4bit_group(data, (page, slot, kvh, grp * BYTES_4BIT), block, at, scale)


# floats of the tile of keys or values the kernel makes at a time (a page's rows, or part of a
# page's): 8 KB, which stays in the L1 cache beside the scores it feeds. A whole page of 256
# rows had been 64 KB for SmolLM2's heads (q4, 32 x 4096, 2 threads: 8.4 against 6.9 ms per
# layer at pages of 16, the same keys).
TILE_FLOATS = 2048


@numba.njit(inline="always")
def _tile_rows(page_size, dim):
    """Rows of a tile: a page's, or the page's halved while they fill more than TILE_FLOATS
    (down to LANES rows), so that tiles divide pages."""
    rows = page_size
    while rows * dim > TILE_FLOATS and rows % 2 == 0 and rows > LANES:
        rows //= 2
    return rows


@functools.cache
def half_table() -> np.ndarray:
    """float32 value of every float16 bit pattern (index: the bits as uint16)."""
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.float16).float().numpy()


def supports(q: torch.Tensor, k_pages: torch.Tensor | QuantPages, batch: ForwardBatch) -> bool:
    """Whether the kernel takes this call: a CPU decode batch (one query row per sequence)
    whose rows read unquantized are float32 (the CPU build's run dtype): float pages, or a
    quantized cache's sink and recent rows, if any (a bfloat16 or float16 model's go to the
    reference), with a head size its vector code takes: a multiple of ``LANES`` (a quantized
    page's always is, a multiple of 32)."""
    if q.device.type != "cpu" or batch.max_query_len != 1 or q.shape[-1] % LANES:
        return False
    if isinstance(k_pages, QuantPages):
        return k_pages.sinks is None or k_pages.sinks.dtype == torch.float32
    return k_pages.dtype == torch.float32


def float_kernel_pays(batch: ForwardBatch) -> bool:
    """Whether the kernel takes a decode batch over float pages: whenever the batch's lengths
    are known on the host. The reference copies every sequence's keys into a [B, longest
    context] tensor for SDPA; the kernel reads them in place. Since stop 53 the kernel's work
    runs on torch's OpenMP team (engine/cpu/team.py), and it beats the reference at every
    shape measured (SmolLM2's heads, 2 threads, per layer after a torch matmul, kernel /
    reference: 1 x 64 0.13 / 0.24 ms, 8 x 32 0.18 / 0.71, 8 x 256 0.39 / 1.40, 8 x 1k
    1.29 / 2.71, 1 x 2048 0.42 / 0.92, 32 x 1k 4.88 / 12.68, 32 x 4k 28.7 / 126.1). Before,
    on a pool of our own, its second thread shared a core with a spinning torch worker, so
    only a batch ragged enough took it on several threads (one whose padded copy held 1.5x
    its keys: 8 contexts from 4000 tokens halving, fp16 decode 22.5 -> 71.8 tok/s,
    bench/results/kv_cpu_decode_ragged.json); on one thread it took every batch."""
    return bool(batch.seq_lens_host)


def decode_attention_cpu(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``paged_attention_reference`` for a decode batch (``supports``) over float32 pages
    [P, S, KV, D], read in place: q [B, H, D] -> [B, H, D] in q's dtype."""
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"K pages {tuple(k_pages.shape)} {k_pages.dtype} and V pages "
            f"{tuple(v_pages.shape)} {v_pages.dtype} differ"
        )
    _check_call(q, k_pages, batch, sliding_window, tuple(k_pages.shape))
    args, items, out = _float_args(q, k_pages, v_pages, batch, scale, sliding_window)
    _run_items(args, items, _key_heads(batch, sliding_window, k_pages.shape[2]))
    return out.to(q.dtype)


def _float_args(
    q, k_pages, v_pages, batch, scale, sliding_window
) -> tuple[tuple, int, torch.Tensor]:
    """The kernel's arguments over float pages (but the work items), their number, and the
    kernel's output."""
    _, page_size, kv_heads, _ = k_pages.shape
    # no codes: every page id is below the rows' count, so the kernel reads only rows
    no_codes = np.zeros((0, page_size, kv_heads, 1), np.uint8)
    no_scales = np.zeros((0, page_size, kv_heads, 1), np.uint16)
    queries = q.float() * scale
    out = torch.empty_like(queries)
    codes = (no_codes, no_codes, no_scales, no_scales, 0, 0)
    rows = (_float_rows(k_pages), _float_rows(v_pages))
    return *_kernel_args(queries, codes, rows, batch, sliding_window, out), out


def warm_up_decode_attention_cpu(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int):
    """Compile (or load from Numba's cache) the kernel, on two pages of float rows, and its
    callback for torch's team (engine/cpu/team.py); quantized pages take the same compiled
    code. Nothing for a run dtype or head size the kernel does not take."""
    if dtype != torch.float32 or head_dim % LANES:
        return
    seqs = [SequenceInput([0], num_cached=0, pages=[0]), SequenceInput([0], 0, pages=[1])]
    batch = build_forward_batch(seqs, 1)
    k_pages = torch.zeros((2, 1, kv_heads, head_dim))
    q = torch.zeros((2, heads, head_dim))
    decode_attention_cpu(q, k_pages, k_pages, batch, 1.0)
    prepare(_attend_items, _float_args(q, k_pages, k_pages, batch, 1.0, None)[0])


def quant_decode_attention_cpu(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``quant_paged_attention_reference`` for a decode batch (``supports``), read from the
    codes in place: q [B, H, D] -> [B, H, D] in q's dtype."""
    check_pair(k_pages, v_pages)
    _check_call(q, k_pages, batch, sliding_window, k_pages.shape)
    head_dim = k_pages.shape[3]
    queries = q.float() * scale
    out = torch.empty_like(queries)
    codes = (
        _bytes(k_pages),
        _bytes(v_pages),
        float16_bits(k_pages.scales),
        float16_bits(v_pages.scales),
        k_pages.bits,
        v_pages.bits,
    )
    rows = (_rows(k_pages, head_dim), _rows(v_pages, head_dim))
    args, items = _kernel_args(queries, codes, rows, batch, sliding_window, out, k_pages.rotate)
    _run_items(args, items, _key_heads(batch, sliding_window, k_pages.shape[2]))
    return out.to(q.dtype)


def _check_call(
    q: torch.Tensor,
    k_pages: torch.Tensor | QuantPages,
    batch: ForwardBatch,
    sliding_window: int | None,
    shape: tuple[int, ...],
) -> None:
    """ValueError unless the kernel takes q over pages of ``shape`` [P, S, KV, D]."""
    if not supports(q, k_pages, batch):
        raise ValueError(
            "the CPU decode attention takes CPU decode batches (one query row per "
            f"sequence, float32 rows, a head size that is a multiple of {LANES}); got "
            f"max_query_len={batch.max_query_len}, device={q.device.type}, head size "
            f"{q.shape[-1]}"
        )
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    _, _, kv_heads, head_dim = shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit pages {tuple(shape)}")


def _kernel_args(
    queries: torch.Tensor,
    codes: tuple,
    rows: tuple[np.ndarray, np.ndarray],
    batch: ForwardBatch,
    sliding_window: int | None,
    out: torch.Tensor,
    rotate: bool = False,
) -> tuple[tuple, int]:
    """``_attend_items``' arguments but the work items, and their number: (K codes, V codes,
    K scales, V scales, K bits, V bits) and the (K, V) rows read unquantized; ``rotate``: the
    pages are rotated (the kernel rotates the queries into their basis and the output back)."""
    tables = batch.block_tables.to(torch.int32).numpy()
    seq_lens = batch.seq_lens.to(torch.int32).numpy()
    kv_heads = rows[0].shape[2]
    heads = queries.shape[1] // kv_heads
    groups = _row_groups(tables, seq_lens, batch.page_size, max(1, GROUP_QUERY_ROWS // heads))
    args = (
        queries.contiguous().numpy(),
        *codes,
        *rows,
        tables,
        seq_lens,
        groups,
        sliding_window or 0,
        half_table(),
        rotate,
        out.numpy(),
    )
    return args, (len(groups) - 1) * kv_heads


@cached_njit
def _row_groups(tables, seq_lens, page_size, most):
    """int32 [N + 1]: the decode rows' groups (rows groups[i]..groups[i + 1] - 1), each at
    most ``most`` rows of a run that read one context: each row's limit one past the
    previous row's, and their tables the same over its pages. Those are a sequence's tokens
    verifying drafts, which ``decode_split`` makes into rows of their own; the kernel reads
    each key once for a group's rows instead of once per row. A run longer than ``most`` is
    cut into near-equal groups (``GROUP_QUERY_ROWS``); a decode batch's rows are groups of
    one."""
    n = seq_lens.shape[0]
    groups = np.empty(n + 1, np.int32)
    groups[0] = 0
    count = 0
    run = 0
    for r in range(1, n + 1):
        if r < n and _same_context(tables, seq_lens, r, page_size):
            continue
        length = r - run
        parts = (length + most - 1) // most
        for part in range(1, parts + 1):
            count += 1
            groups[count] = run + length * part // parts
        run = r
    return groups[: count + 1]


@numba.njit(inline="always")
def _same_context(tables, seq_lens, r, page_size):
    """Whether row r reads row r - 1's context and one more key."""
    if seq_lens[r] != seq_lens[r - 1] + 1:
        return False
    for page in range((seq_lens[r] + page_size - 1) // page_size):
        if tables[r, page] != tables[r - 1, page]:
            return False
    return True


# The query rows (tokens x query heads per KV head) of one work item at most, when rows of a
# sequence's tokens verifying drafts read their context together (``_row_groups``): each key
# is then read once for the group's rows, but the group's scores, which the kernel keeps for
# its whole context, grow with them. SmolLM2's heads (3 per KV head), q4 rotated pages of 16
# (the cache's default), 2 threads, per layer, medians of 5 interleaved, a row per item / 3
# tokens a group (9 rows, as shipped) / every token in one: 1 x 4096 context, 5 tokens 1.38
# / 1.25 / 1.22 ms, 9 tokens 1.97 / 1.59 / 2.09; 8 x 1024, 5 tokens 2.10 / 1.80 / 1.78; 32 x
# 1024, 5 tokens 8.12 / 7.12 / 6.96 (float pages 8 x 1024 x 5 3.53 / 2.56 / 2.15, 1 x 4096 x
# 9 2.11 / 1.69 / 2.29). End to end, n-gram decode at 1 x 4096 (q4, medians of 4 alternating
# runs in one process), a verifying step's attention 38.2 -> 32.5 ms (stop 57).
GROUP_QUERY_ROWS = 9

# A sequence of at most this many query tokens that is not a prompt chunk (drafts to verify:
# num_draft_tokens + 1, 5 by default) has its tokens attended here over quantized pages, each
# as a one-token row with its own causal limit (engine/cuda/attention.py ``decode_split``),
# instead of by the prompt-chunk route, which dequantizes the sequence's whole context into
# a tensor for SDPA every layer (engine/cpu/kv_gather.py). The kernel reads the keys once per
# group of rows (GROUP_QUERY_ROWS), so its cost grows with the query; the route's mostly with
# the context. Per layer, SmolLM2's heads, q4 rotated pages, 2 threads, route -> kernel (one
# run each), a row per work item (stop 55): 1 x 4096 context, 5 tokens 3.91 -> 1.11 ms, 9
# tokens 2.96 -> 2.07, 17 tokens 5.16 -> 3.80, 33 tokens 5.35 -> 6.82; 8 x 1024, 5 tokens
# 5.66 -> 2.11, 17 tokens 11.08 -> 7.68, 33 tokens 9.60 -> 13.62; 1 x 1024, 5 tokens 0.90 ->
# 0.33. With the rows grouped, pages of 256: 1 x 4096, 5 tokens 3.14 -> 1.16, 17 tokens
# 6.22 -> 3.28, 25 tokens 6.52 -> 5.41, 33 tokens 7.80 -> 6.44; 8 x 1024, 17 tokens 9.44 ->
# 6.32 (the route's own times spread by ~20% from run to run, so the limit stays where stop
# 55 set it). Both read a draft's own rows through their codes, as the decode steps without
# drafts do.
# Float pages keep SDPA for such rows: per layer, with the pages in the caches, the grouped
# kernel is the faster (pages of 16, 1 x 4096 context: 5 tokens 1.33 -> 0.94 ms, 9 tokens
# 1.75 -> 1.99), but end to end, n-gram decode at 1 x 4096, a verifying step's attention
# was 42 ms both ways in this box's quiet runs: each layer reads its 6 MB of float32 K/V
# from memory, whichever reads it (stop 57).
VERIFY_ROWS = 16

# A decode batch's work items are shared among torch's threads when they read this many
# (key, KV head) pairs or more; below, this thread alone is as fast. On torch's OpenMP team
# (engine/cpu/team.py; SmolLM2, q4, 8 sequences, 2 threads, per layer after a torch matmul,
# this thread alone -> team): 16 keys each 58 -> 69 us, 32 keys 72 -> 78, 64 keys 103 -> 94,
# 128 keys 166 -> 128. (On our own pool, whose wake-up cost ~110 us a call, it was 4096.)
SHARED_KEY_HEADS = 1024


def _key_heads(batch: ForwardBatch, sliding_window: int | None, kv_heads: int) -> int:
    """The (key, KV head) pairs a decode batch reads (within the window, if any), counting
    each row's keys: a group of rows verifying drafts reads them once, so the count runs
    high there, and such a batch is shared sooner."""
    lens = batch.seq_lens_host
    if not lens:  # (not known on the host: shared, as every batch was before)
        return SHARED_KEY_HEADS
    keys = sum(min(n, sliding_window) for n in lens) if sliding_window else sum(lens)
    return keys * kv_heads


def _run_items(args: tuple, items: int, key_heads: int) -> None:
    """The kernel over its work items: shared among torch's threads (engine/cpu/team.py)
    when they read ``SHARED_KEY_HEADS`` pairs or more, else on this thread."""
    if key_heads < SHARED_KEY_HEADS:
        _attend_items(*args, 0, items)
    else:
        share(_attend_items, args, items)


def _bytes(pages: QuantPages) -> np.ndarray:
    return pages.data.view(torch.uint8).numpy()


def _float_rows(pages: torch.Tensor) -> np.ndarray:
    """Float pages as the kernel's rows: C-contiguous, as it was compiled for (a copy
    otherwise, which only a caller slicing pages would pay)."""
    return np.ascontiguousarray(pages.numpy())


def _rows(pages: QuantPages, head_dim: int) -> np.ndarray:
    if pages.sinks is None:
        return np.zeros((0, 1, pages.shape[2], head_dim), np.float32)
    return pages.sinks.numpy()
