"""``PersistentBatch``: a step's ``ForwardBatch`` built from the scheduler's plan, keeping the
block tables across steps.

The reference path (``plan_rows`` + ``build_forward_batch``) makes a ``SequenceInput`` per
entry, loops over every new token in Python and pads a fresh block-table row per sequence, so
a decode step costs O(batch x pages) Python work. Here:

- Row ``i`` of the batch is entry ``i`` of the plan (the same order). The block-table row
  stays in a host array between steps together with the pages list object it was copied from;
  when entry ``i`` brings the same list object again, only the entries from the sequence's
  full-page count at its last write onward are rewritten (the scheduler's page-list
  INVARIANT at ``Scheduler._grow``: full pages' entries never change while the list object
  lives, pages are only appended, and dedup swaps a page only in the commit that fills it).
  A different list (another job in that row, a preempted or truncated sequence) rewrites the
  row and zeroes what the previous one left past its end.
- Positions, slot mapping, context lengths, row offsets and logits rows are computed with
  numpy from one array of start positions and one of row lengths (a few vector ops per step,
  not a Python loop per token).

The result is the reference's batch exactly: same fields, dtypes, shapes and values, rows in
plan order (tests/unit/test_persistent_batch.py compares them over randomized plans).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.embeddings import EmbeddingTableBuilder
from engine.scheduler import StepPlan

_INITIAL_ROWS = 8
_INITIAL_PAGES = 8


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
        num_rows = len(entries)
        self._reserve(num_rows, max(len(e.seq.pages) for e in entries))
        ps = self.page_size
        input_ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        logits_rows: list[int] = []
        num_pages: list[int] = []
        embedded: list[tuple[int, list[int], object]] = []  # (first batch row, ids, containers)
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
            if seq.embeddings:
                ids = tokens[start : start + n] + list(drafts)
                embedded.append((len(input_ids), ids, seq.embeddings))
                input_ids.extend(ids)
            elif q == 1:
                input_ids.append(tokens[start])
            else:
                input_ids.extend(tokens[start : start + n])
                input_ids.extend(drafts)
            starts.append(start)
            q_lens.append(q)
            logits_rows.append(len(drafts) + 1 if start + n == len(tokens) else 0)
            used = len(pages)
            num_pages.append(used)
            # the block-table row: only what may have changed since this row was written
            first = min(frozen[i], used) if row_pages[i] is pages else 0
            base = i * width
            flat_index.extend(range(base + first, base + used))
            flat_value.extend(pages[first:used])
            if written[i] > used:  # the previous sequence of this row had more pages
                self._table[i, used : written[i]] = 0
            row_pages[i], written[i], frozen[i] = pages, used, start // ps
        if flat_index:
            self._table.reshape(-1)[flat_index] = flat_value
            self.table_entries_written += len(flat_index)
        return self._assemble(input_ids, starts, q_lens, logits_rows, num_pages, embedded, num_rows)

    def _assemble(
        self,
        input_ids: list[int],
        starts_list: list[int],
        q_list: list[int],
        logits_list: list[int],
        pages_list: list[int],
        embedded: list,
        num_rows: int,
    ) -> ForwardBatch:
        ps = self.page_size
        starts = np.array(starts_list, dtype=np.int64)
        q = np.array(q_list, dtype=np.int64)
        seq_lens = starts + q
        _check_pages(seq_lens, np.array(pages_list, dtype=np.int64), q, ps)
        ends = np.cumsum(q)
        total = int(ends[-1])
        if total == num_rows:  # one token per row (a decode step)
            rows = np.arange(num_rows)
            positions = starts
        else:
            rows = np.repeat(np.arange(num_rows), q)
            positions = np.arange(total) + np.repeat(starts - (ends - q), q)
        blocks = self._table[rows, positions // ps].astype(np.int64)
        slots = blocks * ps + positions % ps
        query_start_loc = np.zeros(num_rows + 1, dtype=np.int32)
        query_start_loc[1:] = ends
        wanted = _logits_indices(ends, np.array(logits_list, dtype=np.int64))
        table = self._table[:num_rows, : max(pages_list)].copy()  # not a view: kept state
        longs = [np.array(input_ids, dtype=np.int64), positions, slots, wanted]
        ints = [query_start_loc, seq_lens.astype(np.int32), table]
        input_t, positions_t, slots_t, wanted_t, starts_t, lens_t, table_t = self._upload(
            longs, ints
        )
        embeddings = None
        if embedded:
            builder = EmbeddingTableBuilder()
            for first, ids, containers in embedded:
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
            q_lens=tuple(q_list),
            seq_lens_host=tuple(seq_lens.tolist()),
            page_size=ps,
            embeddings=embeddings,
        )

    def _upload(self, longs: list[np.ndarray], ints: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays as tensors on the device, in order (longs then ints)."""
        if not self.pack:
            return [torch.from_numpy(a).to(self.device, non_blocking=True) for a in longs + ints]
        out = []
        for arrays in (longs, ints):
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
            flat = flat.to(self.device, non_blocking=True)
            offset = 0
            for a in arrays:
                out.append(flat[offset : offset + a.size].view(a.shape))
                offset += a.size
        return out

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


def _check_pages(seq_lens: np.ndarray, num_pages: np.ndarray, q: np.ndarray, ps: int) -> None:
    """The reference builder's checks: every row has new tokens and pages for its context."""
    if q.min() < 1:
        raise ValueError("a sequence in a forward batch needs at least one new token")
    short = np.flatnonzero(num_pages * ps < seq_lens)
    if short.size:
        i = int(short[0])
        length = int(seq_lens[i])
        raise ValueError(
            f"sequence of {length} tokens needs {-(-length // ps)} pages "
            f"of {ps}, got {int(num_pages[i])}"
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
