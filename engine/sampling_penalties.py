"""Repetition / frequency / presence penalties applied only where they change something.

The dense form (``engine.sampling._apply_penalties``) counts every row's context into a
[rows, V] tensor and rewrites whole rows; but a penalty only moves the logits of tokens the
context holds. Here each job keeps its window's distinct token ids and their counts
(``ContextCounts``), extended by the new tokens of each step instead of recounted, and one
step touches only the (row, token) pairs of the penalised rows' windows: one gather, the
same float32 operations in the same order as the dense form (so the results are
bit-identical), one scatter. That is the form for logits off the CPU (or not float32); on
the CPU ``engine.sampling_penalty_table`` keeps every job's window in one table that compiled
loops extend and apply.

Edits go into the caller's logits in place; ``LogitEdits`` remembers the original values of
every position it touches and puts them back (the caller's tensor is left as it came).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.device_copy import upload
from engine.sampling_candidates import compiled_rows


class ContextCounts:
    """One job's penalty window as its distinct token ids and how often each occurs, kept up
    to date across steps: ``sync`` takes only the tokens appended since the last call
    (usually one), adding each to its id's count (a new id extends the id array) and taking
    the token that slides out of a ``penalty_range`` window off its count.

    Contexts change by appending and by dropping a suffix (banned-string rollback, rejected
    drafts) between two calls; a context shorter than the one counted, or whose token at the
    last counted position differs, is counted again from scratch (as is a changed window or
    vocabulary). Ids outside the vocabulary count nowhere (as in the dense form)."""

    __slots__ = ("_counts", "_ids", "_last", "_length", "_slots", "_used", "_vocab", "_window")

    def __init__(self) -> None:
        self._reset((), 0, 0)

    def sync(self, context: Sequence[int], vocab: int, window: int) -> None:
        n = len(context)
        if (
            n < self._length
            or vocab != self._vocab
            or window != self._window
            or (self._length and context[self._length - 1] != self._last)
        ):
            self._reset(context, vocab, window)
        slid = False
        for pos in range(self._length, n):
            self._add(context[pos], 1.0)
            if window and pos >= window:
                self._add(context[pos - window], -1.0)  # slid out of the window
                slid = True
        self._length = n
        self._last = context[-1] if n else None
        # (only a token sliding out makes a count 0: without a window there is nothing to find)
        if slid and self._used > 64 and 2 * self._nonzero() < self._used:
            self._reset(context, vocab, window)  # mostly ids that left the window: compact

    def _nonzero(self) -> int:
        return int(np.count_nonzero(self._counts[: self._used]))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64, counts float32) of the window; a count may be 0 (an id that left)."""
        return self._ids[: self._used], self._counts[: self._used]

    def _reset(self, context: Sequence[int], vocab: int, window: int) -> None:
        """Count the window of ``context`` at once (vectorised)."""
        ids, counts = window_counts(context, vocab, window)
        size = max(64, 2 * len(ids))
        self._ids = np.zeros(size, dtype=np.int64)
        self._counts = np.zeros(size, dtype=np.float32)
        self._ids[: len(ids)] = ids
        self._counts[: len(ids)] = counts
        self._slots = dict(zip(ids.tolist(), range(len(ids)), strict=True))
        self._used = len(ids)
        self._length = len(context)
        self._last = context[-1] if len(context) else None
        self._vocab = vocab
        self._window = window

    def _add(self, token: int, delta: float) -> None:
        if not 0 <= token < self._vocab:
            return
        slot = self._slots.get(token)
        if slot is None:
            slot = self._slots[token] = self._used
            if slot == len(self._ids):  # doubling: appends stay amortised O(1)
                self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            self._ids[slot] = token
            self._used += 1
        self._counts[slot] += delta


def window_counts(context: Sequence[int], vocab: int, window: int) -> tuple:
    """(distinct ids, their counts) of the last ``window`` tokens of ``context`` (0: all of
    it), ids outside the vocabulary left out, counted at once (vectorised)."""
    tokens = np.asarray(context[-window:] if window else context, dtype=np.int64)
    tokens = tokens[(tokens >= 0) & (tokens < vocab)]
    return np.unique(tokens, return_counts=True)


@dataclass(slots=True)
class PenaltyRows:
    """A step's penalised (row, token) pairs: flat positions ``row * vocab + token`` in the
    logits, each one's count in its row's window and its index among the penalised rows."""

    keys: torch.Tensor
    counts: torch.Tensor
    slot: torch.Tensor

    @classmethod
    def gather(
        cls, rows: Sequence[int], windows: Sequence[ContextCounts], vocab: int, device
    ) -> PenaltyRows:
        arrays = [w.arrays() for w in windows]
        lengths = [len(ids) for ids, _ in arrays]
        slot = np.repeat(np.arange(len(rows)), lengths)
        keys = np.asarray(rows, dtype=np.int64)[slot] * vocab + np.concatenate(
            [ids for ids, _ in arrays]
        )
        counts = np.concatenate([c for _, c in arrays])
        return cls(
            keys=upload(keys, device),
            counts=upload(counts, device),
            slot=upload(slot, device),
        )


def penalise(edits: LogitEdits, pairs: PenaltyRows, params: torch.Tensor) -> None:
    """Save the logits at ``pairs.keys`` in ``edits``, then penalise them in place
    (``apply_sparse_penalties``). (Float32 logits on the CPU take
    ``engine.sampling_penalty_table`` instead: its compiled loops keep every job's window.)"""
    values = edits.save(pairs.keys)
    apply_sparse_penalties(edits.flat, pairs, params, values)


def _compiled_flat(flat: torch.Tensor) -> bool:
    """Whether ``flat`` (logits viewed flat) takes ``engine.sampling_cpu``'s loops."""
    return compiled_rows(flat.view(1, -1))


def apply_sparse_penalties(
    flat: torch.Tensor, pairs: PenaltyRows, params: torch.Tensor, values: torch.Tensor
) -> None:
    """Penalise ``flat`` (the logits viewed flat) at ``pairs.keys``, whose current values
    are ``values``; ``params`` [rows, 3]: each penalised row's (repetition, frequency,
    presence) as float32. The dense form's operations, in its order, on those values only."""
    # index_select / index_copy_: a CPU's advanced indexing costs several times as much
    rep, freq, presence = params.index_select(0, pairs.slot).unbind(1)
    counts = pairs.counts
    # Repetition penalty (CTRL style): shrink positive logits, push negative ones further down.
    edited = torch.where(values > 0, values / rep, values * rep)
    # a seen token's ``seen.float() * presence`` in the dense form is exactly ``presence``
    edited = edited - counts * freq - presence
    # ids that left the window: unchanged (the keys are distinct: one per (row, id))
    flat.index_copy_(0, pairs.keys, torch.where(counts > 0, edited, values))


class LogitEdits:
    """Remembers the original values at flat positions before in-place edits and restores
    them: ``save(keys)`` before editing, ``restore()`` once done (idempotent). An editor that
    keeps what it overwrote itself hands over its own undo instead (``undo_with``)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self._saved: list[tuple[torch.Tensor, torch.Tensor] | Callable[[], None]] = []

    def save(self, keys: torch.Tensor) -> torch.Tensor:
        """Remember (and return) the values at ``keys``."""
        values = self.flat.index_select(0, keys)
        self.record(keys, values)
        return values

    def record(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Remember ``values``, read at ``keys`` before they were edited."""
        self._saved.append((keys, values))

    def undo_with(self, undo: Callable[[], None]) -> None:
        """Remember ``undo``, which puts back edits made since the last save (``restore``
        calls it in its turn: last first)."""
        self._saved.append(undo)

    def restore(self) -> None:
        # last saved first: an earlier save holds the value before every later edit
        # (a key twice in one save holds the same value twice: which write wins is moot)
        compiled = _compiled_flat(self.flat)
        if compiled:
            from engine import sampling_cpu
        for entry in reversed(self._saved):
            if callable(entry):
                entry()
                continue
            keys, values = entry
            if compiled and values.dtype == torch.float32:
                sampling_cpu.put(self.flat, keys, values)
            else:
                self.flat.index_copy_(0, keys, values)
        self._saved.clear()
