"""Random attention cases for differential tests of the op sets against the torch references
(tests/unit/test_cpu_op_set_fuzz.py, tests/kernels/test_cuda_op_set_fuzz.py).

A case is one forward over a random batch: decode rows, sequences verifying drafts, prompt
chunks after cached tokens and fresh prompts, in one batch, over pages of a random format (fp16,
q8, q6, q4; rotated or not, keys centered or not, exact chunks or not) laid out as a page table
could lay them out: code pages in shuffled order, a sequence's first block on a sink page and
its last blocks on recent pages (engine/cache/page_table.py), a later sequence sharing an
earlier one's first full blocks (prefix reuse), with or without a sliding window. Every slot no
forward writes holds finite garbage, so a read past a sequence's keys, or of another
sequence's slots, moves the output, while a masked one adds exactly 0.

``attend`` runs the case through an op set: an earlier forward writes every cached position
(always by the reference write, so that both sides read the same context), then the op set
writes the batch's own rows (its cache-write kernel) and attends. Both sides draw the same
garbage, K/V and queries from the seed.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field

import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cache.page_table import RECENT_BLOCKS
from engine.cache.quant import QUANT_BITS, allocate_quant_pages
from engine.ops import TORCH_OPS, OpSet

KINDS = ("decode", "decode", "verify", "chunk", "prompt")  # (decode rows twice as likely)


@dataclass(frozen=True)
class Row:
    """One sequence of the batch: ``new`` query tokens after ``cached`` ones."""

    kind: str  # decode | verify (drafts: no prompt chunk) | chunk | prompt (nothing cached)
    cached: int
    new: int

    @property
    def prompt_chunk(self) -> bool:
        return self.kind in ("chunk", "prompt")


@dataclass(frozen=True)
class Case:
    page_size: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    quant: str
    window: int | None
    rotate: bool
    center: bool
    exact_chunks: bool
    sinks: bool  # sink pages: a sequence's first block may be on one
    recent: bool  # recent pages: a sequence's last blocks may be on them
    rows: tuple[Row, ...]

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group


def draw_case(
    rng: random.Random,
    *,
    max_rows: int = 5,
    max_cached: int = 70,
    kinds: tuple[str, ...] = KINDS,
    page_sizes: tuple[int, ...] = (4, 8, 16),
    head_dims: tuple[int, ...] = (32, 64),
    groups: tuple[int, ...] = (1, 2, 4),
    quants: tuple[str, ...] = ("fp16", "q8", "q6", "q4"),
    max_verify: int = 9,
) -> Case:
    quant = rng.choice(quants)
    quantized = quant != "fp16"
    rows = []
    for _ in range(rng.randint(1, max_rows)):
        kind = rng.choice(kinds)
        cached = 0 if kind == "prompt" else rng.randint(0 if kind == "chunk" else 1, max_cached)
        verify_len = rng.randint(2, max_verify)  # (drawn for every row: seeds keep their cases)
        new = 1 if kind == "decode" else verify_len if kind == "verify" else rng.randint(1, 20)
        rows.append(Row(kind, cached, new))
    return Case(
        page_size=rng.choice(page_sizes),
        kv_heads=rng.choice([1, 2]),
        group=rng.choice(groups),
        head_dim=rng.choice(head_dims),
        quant=quant,
        window=rng.choice([None, None, rng.randint(2, 60)]),
        rotate=quantized and rng.random() < 0.8,
        center=quantized and rng.random() < 0.7,
        exact_chunks=quantized and rng.random() < 0.6,
        sinks=quantized and rng.random() < 0.5,
        recent=quantized and rng.random() < 0.5,
        rows=tuple(rows),
    )


@dataclass
class Layout:
    """Each row's page table; pages below ``row_pages`` keep unquantized rows (the sink pages,
    then the recent pages); ``shared[i]``: row i's first blocks that are an earlier row's."""

    pages: list[list[int]]
    shared: list[int]
    num_pages: int
    row_pages: int
    features: set[str] = field(default_factory=set)  # what the layout used (for coverage)


def draw_layout(case: Case, rng: random.Random) -> Layout:
    size = case.page_size
    num_sinks = len(case.rows) if case.sinks else 0
    num_recent = RECENT_BLOCKS * len(case.rows) if case.recent else 0
    row_pages = num_sinks + num_recent
    next_sink, next_recent, next_code = 0, num_sinks, row_pages
    tables, features = [], set()
    for row in case.rows:
        blocks = -(-(row.cached + row.new) // size)
        table: list[int | None] = [None] * blocks
        if case.sinks and rng.random() < 0.7:
            table[0], next_sink = next_sink, next_sink + 1
            features.add("sink page")
        if case.recent and rng.random() < 0.7:  # the last 1..RECENT_BLOCKS blocks
            tail = 0
            for b in range(blocks - 1, max(blocks - 1 - rng.randint(1, RECENT_BLOCKS), -1), -1):
                if table[b] is None:
                    table[b], next_recent, tail = next_recent, next_recent + 1, tail + 1
            if tail:
                features.add(f"{tail} recent pages" if tail > 1 else "recent page")
        for b in range(blocks):
            if table[b] is None:
                table[b], next_code = next_code, next_code + 1
        tables.append(table)
    shared = [0] * len(case.rows)
    for i in range(1, len(case.rows)):  # prefix reuse: an earlier row's first full code blocks
        j = rng.randrange(i)
        full = min(case.rows[i].cached, case.rows[j].cached) // size
        m = 0
        while m < full and min(tables[i][m], tables[j][m]) >= row_pages:
            m += 1
        if m and rng.random() < 0.5:
            shared[i] = rng.randint(1, m)
            tables[i][: shared[i]] = tables[j][: shared[i]]
            features.add("shared prefix")
    code = list(range(row_pages, next_code))  # code pages in shuffled order
    order = code[:]
    rng.shuffle(order)
    remap = dict(zip(code, order, strict=True))
    pages = [[remap.get(p, p) for p in table] for table in tables]
    return Layout(pages, shared, next_code + 1, row_pages, features)


def _garbage_pages(case: Case, layout: Layout, gen: torch.Generator, device, dtype):
    """K and V pages in the case's format with garbage in every slot (finite, far from the
    written rows' scale)."""
    shape = (layout.num_pages, case.page_size, case.kv_heads, case.head_dim)
    if case.quant == "fp16":
        return [(torch.randn(shape, generator=gen) * 50).to(device, dtype) for _ in range(2)]
    center = torch.randn(case.kv_heads, case.head_dim, generator=gen) if case.center else None
    pages = []
    for i, bits in enumerate(QUANT_BITS[case.quant]):
        p = allocate_quant_pages(
            *shape, bits, case.rotate, device, center if i == 0 else None, layout.row_pages,
            dtype, exact_chunks=case.exact_chunks and i == 0,
        )  # fmt: skip
        p.data.copy_(torch.randint(0, 256, p.data.shape, generator=gen).to(p.data.dtype))
        p.scales.copy_(torch.rand(p.scales.shape, generator=gen) * 20 + 1)
        if p.sinks is not None:
            p.sinks.copy_(torch.randn(p.sinks.shape, generator=gen) * 5)
        pages.append(p)
    return pages


def _rows(case: Case, tokens: int, gen: torch.Generator, device, dtype):
    """q, k, v, cos, sin of ``tokens`` new tokens (keys off-center, as real keys are)."""
    q = torch.randn(tokens, case.heads, case.head_dim, generator=gen)
    k = torch.randn(tokens, case.kv_heads, case.head_dim, generator=gen) * 2 + 0.5
    v = torch.randn(tokens, case.kv_heads, case.head_dim, generator=gen)
    theta = torch.rand(tokens, case.head_dim // 2, generator=gen) * 6
    return tuple(t.to(device, dtype) for t in (q, k, v, theta.cos(), theta.sin()))


def attend(
    case: Case,
    layout: Layout,
    seed: int,
    ops: OpSet,
    *,
    device="cpu",
    dtype: torch.dtype = torch.float32,
    round_q=None,
    around=contextlib.nullcontext,
) -> torch.Tensor:
    """The case's attention output through ``ops`` (its cache write, then its attention, inside
    ``around()``); ``round_q(q)`` maps the written q before the attention (both sides alike)."""
    gen = torch.Generator().manual_seed(seed)
    k_pages, v_pages = _garbage_pages(case, layout, gen, device, dtype)
    size = case.page_size
    earlier = [
        SequenceInput([0] * (row.cached - size * m), size * m, table, prompt_chunk=True)
        for row, table, m in zip(case.rows, layout.pages, layout.shared, strict=True)
        if row.cached > size * m  # (a sharer's shared blocks are its donor's to write)
    ]
    if earlier:
        batch = build_forward_batch(earlier, size, device)
        rows = _rows(case, batch.slot_mapping.shape[0], gen, device, dtype)
        TORCH_OPS.rotary_cache_write(*rows, k_pages, v_pages, batch.slot_mapping)
    now = [
        SequenceInput([0] * row.new, row.cached, table, prompt_chunk=row.prompt_chunk)
        for row, table in zip(case.rows, layout.pages, strict=True)
    ]
    batch = build_forward_batch(now, size, device)
    rows = _rows(case, batch.slot_mapping.shape[0], gen, device, dtype)
    q = ops.rotary_cache_write(*rows, k_pages, v_pages, batch.slot_mapping)
    if round_q is not None:
        q = round_q(q)
    with around():
        return ops.paged_attention(q, k_pages, v_pages, batch, case.head_dim**-0.5, case.window)


def row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest |out - ref| of a (token, head) row over that row's largest |ref|: an
    output's error beside the values it averages."""
    diff = (out.double() - ref.double()).abs().amax(-1)
    return (diff / ref.double().abs().amax(-1).clamp_min(1e-6)).max().item()
