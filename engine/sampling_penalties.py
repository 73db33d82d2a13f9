"""Repetition / frequency / presence penalties applied only where they change something.

The dense form (``engine.sampling._apply_penalties``) counts every row's context into a
[rows, V] tensor and rewrites whole rows; but a penalty only moves the logits of tokens the
context holds. Here each job keeps its context as a token-id tensor (``ContextIndex``) that
grows by the new tokens of each step instead of being rebuilt from the list, and one step
touches only the (row, token) pairs of the penalised rows' windows: counted with one
``index_add_`` into a zeroed scratch buffer (put back to zero at once), edited with the same
float32 operations in the same order as the dense form, so the results are bit-identical.

Edits go into the caller's logits in place; ``LogitEdits`` remembers the original values of
every position it touches and puts them back (the caller's tensor is left as it came).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ContextIndex:
    """One job's context token ids as a growing tensor.

    ``sync(context)`` takes the tokens appended since the last call (usually one). Contexts
    change by appending and by dropping a suffix (banned-string rollback, rejected drafts)
    between two calls; a context shorter than the index, or whose token at the index's last
    position differs, is indexed again from scratch."""

    __slots__ = ("_last", "ids", "length")

    def __init__(self) -> None:
        self.ids = torch.empty(0, dtype=torch.long)
        self.length = 0
        self._last: int | None = None

    def sync(self, context: Sequence[int]) -> None:
        n = len(context)
        if n < self.length or (self.length and context[self.length - 1] != self._last):
            self.length = 0
        if n > self.ids.numel():  # room to grow: doubling, so appends stay amortised O(1)
            grown = torch.empty(max(2 * self.ids.numel(), n, 64), dtype=torch.long)
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown
        if n == self.length + 1:
            self.ids[self.length] = context[-1]
        elif n > self.length:
            self.ids[self.length : n] = torch.tensor(context[self.length : n], dtype=torch.long)
        self.length = n
        self._last = context[-1] if n else None

    def window(self, size: int) -> torch.Tensor:
        """The last ``size`` ids (all of them for 0), a view."""
        start = max(0, self.length - size) if size else 0
        return self.ids[start : self.length]


class PenaltyScratch:
    """A zeroed flat float buffer for counting (row, token) pairs, reused across steps."""

    def __init__(self) -> None:
        self.counts = torch.zeros(0)

    def count(self, keys: torch.Tensor, size: int) -> torch.Tensor:
        """How often each key occurs in ``keys`` (one value per key, float32)."""
        if self.counts.numel() < size or self.counts.device != keys.device:
            self.counts = torch.zeros(size, device=keys.device)
        try:
            self.counts.index_add_(0, keys, torch.ones(keys.shape, device=keys.device))
            return self.counts[keys]
        finally:
            self.counts[keys] = 0.0


def penalty_keys(
    rows: Sequence[int], windows: Sequence[torch.Tensor], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions ``row * vocab + token`` of every context token of the given rows and,
    per position, its index into ``rows``. Ids outside the vocabulary count nowhere."""
    tokens = torch.cat(list(windows)).to(device)
    lengths = torch.tensor([w.numel() for w in windows], device=device)
    slot = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    row = torch.tensor(list(rows), dtype=torch.long, device=device)[slot]
    valid = (tokens >= 0) & (tokens < vocab)
    if not bool(valid.all()):
        tokens, row, slot = tokens[valid], row[valid], slot[valid]
    return row * vocab + tokens, slot


def apply_sparse_penalties(
    flat: torch.Tensor,
    keys: torch.Tensor,
    slot: torch.Tensor,
    params: torch.Tensor,
    scratch: PenaltyScratch,
    values: torch.Tensor | None = None,
) -> None:
    """Penalise ``flat`` (the logits viewed flat) at ``keys``; ``params`` [rows, 3]: each
    penalised row's (repetition, frequency, presence) as float32, ``slot`` picks its row.
    The dense form's operations, in its order, on the touched values only (``values``: those
    at ``keys`` when the caller has them already)."""
    counts = scratch.count(keys, flat.numel())
    values = flat[keys] if values is None else values
    rep, freq, presence = params[slot].unbind(1)
    # Repetition penalty (CTRL style): shrink positive logits, push negative ones further down.
    values = torch.where(values > 0, values / rep, values * rep)
    # every touched token is seen: the dense form's ``seen.float() * presence`` is exactly
    # ``presence`` here
    values = values - counts * freq - presence
    flat[keys] = values  # a token seen twice gets the same value twice


class LogitEdits:
    """Remembers the original values at flat positions before in-place edits and restores
    them: ``save(keys)`` before editing, ``restore()`` once done (idempotent)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def save(self, keys: torch.Tensor) -> torch.Tensor:
        """Remember (and return) the values at ``keys``."""
        values = self.flat[keys]
        self._saved.append((keys, values))
        return values

    def restore(self) -> None:
        # last saved first: an earlier save holds the value before every later edit
        for keys, values in reversed(self._saved):
            self.flat[keys] = values
        self._saved.clear()
