"""``PersistentBatch``: a step's ``ForwardBatch`` built from the scheduler's plan, keeping the
block tables across steps.

The reference path (``plan_rows`` + ``build_forward_batch``) makes a ``SequenceInput`` per
entry, loops over every new token in Python and pads a fresh block-table row per sequence, so
a decode step costs O(batch x pages) Python work. Here:

- Row ``i`` of the batch is entry ``i`` of the plan (the same order). The block-table row
  stays in a host array between steps together with the pages list object it was copied from;
  when entry ``i`` brings the same list object again, only the entries from the sequence's
  full-page count at its last write, less RECENT_BLOCKS, onward are rewritten (the
  scheduler's page-list INVARIANT at ``Scheduler._grow``: full pages' entries never change
  while the list object lives, but for the last RECENT_BLOCKS ones, which settle from recent
  pages; pages are only appended, and dedup swaps a page only in the commit that fills it).
  A different list (another job in that row, a preempted or truncated sequence) rewrites the
  row and zeroes what the previous one left past its end.
- Positions, slot mapping, context lengths, row offsets and logits rows are computed with
  numpy from one array of start positions and one of row lengths (a few vector ops per step,
  not a Python loop per token).

The result is the reference's batch exactly: same fields, dtypes, shapes and values, rows in
plan order (tests/unit/test_persistent_batch.py compares them over randomized plans).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.cache.page_table import RECENT_BLOCKS
from engine.embeddings import EmbeddingTableBuilder
from engine.scheduler import StepPlan

_INITIAL_ROWS = 8
_INITIAL_PAGES = 8


@dataclass(slots=True)
class _Rows:
    """Host values of one step's rows, collected in plan order."""

    input_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # first new position (cached tokens)
    q_lens: list[int] = field(default_factory=list)  # new tokens (drafts included)
    logits_rows: list[int] = field(default_factory=list)
    one_logit_each: bool = True  # every row wants exactly one logits row (the common case)
    prompt_chunks: list[bool] = field(default_factory=list)  # (ForwardBatch.prompt_chunks)
    max_pages: int = 0
    # (first batch row, the row's new ids, its embedding containers) of rows that have some
    embedded: list[tuple[int, list[int], Sequence]] = field(default_factory=list)


class PersistentBatch:
    """Builds each step's ``ForwardBatch`` for one runner (``page_size``, ``device``).

    ``pack``: upload the int64 and the int32 fields as one tensor each (two host-to-device
    copies per step, the fields are views of them); default: on any device but the CPU, where
    the host arrays are used as they are."""

    def __init__(self, page_size: int, device: torch.device | str, *, pack: bool | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.pack = self.device.type != "cpu" if pack is None else pack
        self._table = np.zeros((_INITIAL_ROWS, _INITIAL_PAGES), dtype=np.int32)
        # per row: the pages list object the table row was copied from, how many entries it
        # has written (zeros after them) and how many leading ones can no longer change
        self._row_pages: list[list[int] | None] = [None] * _INITIAL_ROWS
        self._row_written = [0] * _INITIAL_ROWS
        self._row_frozen = [0] * _INITIAL_ROWS
        self.table_entries_written = 0  # block-table entries copied so far (tests, stats)

    def build(self, plan: StepPlan) -> ForwardBatch:
        """The forward batch of ``plan``'s entries, equal to
        ``build_forward_batch(plan_rows(plan), page_size, device)``."""
        entries = plan.entries
        if not entries:
            raise ValueError("a forward batch needs at least one sequence")
        self._reserve(len(entries), 0)
        ps = self.page_size
        rows = _Rows()
        input_ids, starts, q_lens, logits_rows = (
            rows.input_ids,
            rows.starts,
            rows.q_lens,
            rows.logits_rows,
        )
        flat_index: list[int] = []  # block-table entries to (re)write this step
        flat_value: list[int] = []
        width = self._table.shape[1]
        row_pages, written, frozen = self._row_pages, self._row_written, self._row_frozen
        for i, entry in enumerate(entries):
            seq = entry.seq
            tokens, pages, start, n, drafts = (
                seq.tokens,
                seq.pages,
                entry.start,
                entry.num_tokens,
                entry.drafts,
            )
            q = n + len(drafts)
            used = len(pages)
            if q < 1 or used * ps < start + q:
                self._forget()  # the rows before this one are half-written
                _refuse(q, start + q, used, ps)
            if seq.embeddings:
                ids = tokens[start : start + n] + list(drafts)
                rows.embedded.append((len(input_ids), ids, seq.embeddings))
                input_ids.extend(ids)
            elif q == 1:
                input_ids.append(tokens[start])
            else:
                input_ids.extend(tokens[start : start + n])
                input_ids.extend(drafts)
            starts.append(start)
            q_lens.append(q)
            rows.prompt_chunks.append(
                q > 1 and entry.prompt_chunk
            )  # (q > 1: no call per decode row)
            # (the flag before the property: ~70 ns less per row)
            wanted = (len(drafts) + 1 if start + n == len(tokens) else 0) + (
                entry.prompt_rows if seq.prompt_logits else 0
            )
            logits_rows.append(wanted)
            if wanted != 1:
                rows.one_logit_each = False
            if used > rows.max_pages:
                rows.max_pages = used
                if used > width:  # (indices already collected stay valid: rows grow too)
                    flat_index = self._widen(used, flat_index, width)
                    width = self._table.shape[1]
            # the block-table row: only what may have changed since this row was written
            first = min(frozen[i], used) if row_pages[i] is pages else 0
            base = i * width
            flat_index.extend(range(base + first, base + used))
            flat_value.extend(pages[first:used])
            if written[i] > used:  # the previous sequence of this row had more pages
                self._table[i, used : written[i]] = 0
            row_pages[i], written[i], frozen[i] = pages, used, max(0, start // ps - RECENT_BLOCKS)
        if flat_index:
            self._table.reshape(-1)[flat_index] = flat_value
            self.table_entries_written += len(flat_index)
        return self._assemble(rows)

    def _assemble(self, rows: _Rows) -> ForwardBatch:
        """The batch's arrays from the collected rows (a few numpy ops, none per token)."""
        ps, num_rows = self.page_size, len(rows.starts)
        starts = np.array(rows.starts, dtype=np.int64)
        total = len(rows.input_ids)
        if total == num_rows:  # one token per row (a decode step)
            ends = np.arange(1, num_rows + 1, dtype=np.int64)
            seq_lens = starts + 1
            table_rows = ends - 1
            positions = starts
        else:
            q = np.array(rows.q_lens, dtype=np.int64)
            ends = np.cumsum(q)
            seq_lens = starts + q
            table_rows = np.repeat(np.arange(num_rows), q)
            positions = np.arange(total) + np.repeat(starts - (ends - q), q)
        blocks = self._table[table_rows, positions // ps].astype(np.int64)
        slots = blocks * ps + positions % ps
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
        query_start_loc[1:] = ends
        if rows.one_logit_each:
            wanted = ends - 1
        else:
            wanted = _logits_indices(ends, np.array(rows.logits_rows, dtype=np.int64))
        table = self._table[:num_rows, : rows.max_pages].copy()  # not a view: kept state
        longs = [np.array(rows.input_ids, dtype=np.int64), positions, slots, wanted]
        ints = [query_start_loc, seq_lens.astype(np.int32), table]
        input_t, positions_t, slots_t, wanted_t, starts_t, lens_t, table_t = self._upload(
            longs, ints
        )
        embeddings = None
        if rows.embedded:
            builder = EmbeddingTableBuilder()
            for first, ids, containers in rows.embedded:
                builder.add(ids, first, containers)
            embeddings = builder.build(self.device)
        return ForwardBatch(
            input_ids=input_t,
            positions=positions_t,
            slot_mapping=slots_t,
            query_start_loc=starts_t,
            seq_lens=lens_t,
            block_tables=table_t,
            logits_indices=wanted_t,
            q_lens=tuple(rows.q_lens),
            seq_lens_host=tuple(seq_lens.tolist()),
            page_size=ps,
            embeddings=embeddings,
            prompt_chunks=tuple(rows.prompt_chunks),
        )

    def _upload(self, longs: list[np.ndarray], ints: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays as tensors on the device, in order (longs then ints)."""
        if not self.pack:
            tensors = [torch.from_numpy(a) for a in longs + ints]
            if self.device.type == "cpu":
                return tensors
            return [t.to(self.device, non_blocking=True) for t in tensors]
        out = []
        for arrays in (longs, ints):
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
            flat = flat.to(self.device, non_blocking=True)
            offset = 0
            for a in arrays:
                out.append(flat[offset : offset + a.size].view(a.shape))
                offset += a.size
        return out

    def _forget(self) -> None:
        """Drop what the kept rows hold: the next build writes every row again."""
        self._table.fill(0)
        n = len(self._row_pages)
        self._row_pages, self._row_written, self._row_frozen = [None] * n, [0] * n, [0] * n

    def _widen(self, num_pages: int, flat_index: list[int], old_width: int) -> list[int]:
        """Grow the table to ``num_pages`` entries a row, mid-build: the flat indices collected
        for the old width, moved to the new one."""
        self._reserve(0, num_pages)
        width = self._table.shape[1]
        return [(k // old_width) * width + k % old_width for k in flat_index]

    def _reserve(self, num_rows: int, num_pages: int) -> None:
        """Grow the kept table (doubling) to hold ``num_rows`` rows of ``num_pages`` entries."""
        rows, width = self._table.shape
        if num_rows <= rows and num_pages <= width:
            return
        new_rows = rows if num_rows <= rows else max(num_rows, 2 * rows)
        new_width = width if num_pages <= width else max(num_pages, 2 * width)
        grown = np.zeros((new_rows, new_width), dtype=np.int32)
        grown[:rows, :width] = self._table
        self._table = grown
        extra = new_rows - rows
        self._row_pages.extend([None] * extra)
        self._row_written.extend([0] * extra)
        self._row_frozen.extend([0] * extra)


def _refuse(q: int, length: int, num_pages: int, ps: int) -> None:
    """The reference builder's errors: a row without new tokens, or without pages for its
    context."""
    if q < 1:
        raise ValueError("a sequence in a forward batch needs at least one new token")
    raise ValueError(
        f"sequence of {length} tokens needs {-(-length // ps)} pages of {ps}, got {num_pages}"
    )


def _logits_indices(ends: np.ndarray, logits_rows: np.ndarray) -> np.ndarray:
    """Batch rows whose logits are wanted: each row's trailing ``logits_rows`` tokens."""
    if (logits_rows == 1).all():
        return ends - 1
    wanted_ends = np.cumsum(logits_rows)
    count = int(wanted_ends[-1]) if wanted_ends.size else 0
    firsts = np.repeat(ends - logits_rows, logits_rows)
    within = np.arange(count) - np.repeat(wanted_ends - logits_rows, logits_rows)
    return firsts + within
