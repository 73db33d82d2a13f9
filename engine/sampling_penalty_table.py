"""Every penalised job's window in one table, kept up to date and applied by compiled loops.

``engine.sampling_penalties`` keeps a ``ContextCounts`` per job and gathers their arrays into
flat (row, token) pairs every step: per row a Python call that extends the counts (numpy
scalar writes) and its share of two concatenations, ~2.6 us a row before one logit is
touched (batch 256: ~0.7 ms of the ~1.1 ms the penalties took, ``bench/host_overhead.py``
penalties, 2-core CPU). Here the windows of all jobs are rows ("slots") of one table: each
slot holds its window's distinct token ids and their counts, as ``ContextCounts`` does. A
step's Python work per row is a few comparisons that find the tokens appended since the last
call; one compiled call counts them in (and takes off those that slid out of a
``penalty_range`` window), one penalises the logits in place, saving what it overwrites, and
one puts those back. Per (row, token) the float32 operations are ``apply_sparse_penalties``'
in its order, so the logits come out bit-identical to the dense form's.

Float32 logits on the CPU only (where ``engine.sampling_cpu``'s loops run); other devices keep
``ContextCounts`` and ``PenaltyRows``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.sampling import SampleRequest
from engine.sampling_cpu import _array, _jit
from engine.sampling_penalties import LogitEdits, window_counts

MIN_CAPACITY = 64  # ids per slot to start with (doubled as a window outgrows it)
COMPACT_ABOVE = 64  # a slot this full, half of it ids that left the window: compacted


@dataclass(slots=True)
class _Window:
    """Where one job's window lives and how much of its context it has counted."""

    slot: int
    length: int  # context tokens counted
    last: int | None  # the context's token at ``length - 1`` when counted
    vocab: int
    window: int  # penalty_range (0: the whole context)


class PenaltyTable:
    """The penalty windows of a sampler's jobs (keyed by ``SampleRequest.key``), as
    ``ContextCounts`` keeps one: contexts grow by appending and lose a suffix (banned-string
    rollback, rejected drafts) between two calls; a context shorter than the one counted, or
    whose token at the last counted position differs, is counted again from scratch, as is a
    changed window or vocabulary. Ids outside the vocabulary count nowhere. A request without
    a key is counted for that call alone."""

    def __init__(self) -> None:
        self._windows: dict[int, _Window] = {}
        self._ids = np.zeros((0, MIN_CAPACITY), np.int64)
        self._counts = np.zeros((0, MIN_CAPACITY), np.float32)
        self._used = np.zeros(0, np.int64)  # ids held per slot (a count may be 0: one that left)
        self._free: list[int] = []
        self._scratch: list[int] = []  # keyless requests' slots, free again at the next call

    def __len__(self) -> int:
        return len(self._windows)

    def penalise(
        self,
        edits: LogitEdits,
        logits: torch.Tensor,
        rows: Sequence[int],
        requests: Sequence[SampleRequest],
        penalties: torch.Tensor,
    ) -> None:
        """Penalise ``logits`` [B, V] (float32, CPU, contiguous) in place at ``rows``, whose
        requests are ``requests``, with ``penalties`` [len(rows), 3] (repetition, frequency,
        presence); ``edits`` puts the logits back on ``restore``."""
        vocab = logits.shape[1]
        slots = self.sync(requests, vocab)
        rows = np.asarray(rows, dtype=np.int64)
        flat = _array(logits).reshape(-1)
        ids, counts, used = self._ids, self._counts, self._used  # (as restore must see them)
        saved = np.empty((len(rows), ids.shape[1]), np.float32)
        _penalise_rows(flat, vocab, rows, slots, ids, counts, used, _array(penalties), saved)
        edits.undo_with(lambda: _restore_rows(flat, vocab, rows, slots, ids, used, saved))

    def sync(self, requests: Sequence[SampleRequest], vocab: int) -> np.ndarray:
        """[len(requests)] int64: the slot of each request's window, brought up to its context."""
        self._release(self._scratch)
        self._scratch = []
        slots = []
        op_slots: list[int] = []  # (slot, token, +1 or -1) for the compiled call
        op_tokens: list[int] = []
        op_deltas: list[float] = []
        for request in requests:
            context = request.context
            window = request.settings.penalty_range
            record = None if request.key is None else self._windows.get(request.key)
            n = len(context)
            if (
                record is None
                or n < record.length
                or vocab != record.vocab
                or window != record.window
                or (record.length and context[record.length - 1] != record.last)
            ):
                record = self._recount(request, vocab, record)
            elif n > record.length:
                slot = record.slot
                for pos in range(record.length, n):
                    op_slots.append(slot)
                    op_tokens.append(context[pos])
                    op_deltas.append(1.0)
                    if window and pos >= window:  # slid out of the window
                        op_slots.append(slot)
                        op_tokens.append(context[pos - window])
                        op_deltas.append(-1.0)
                record.length = n
                record.last = context[-1]
            slots.append(record.slot)
        if op_slots:
            self._count_in(op_slots, op_tokens, op_deltas, vocab)
        return np.asarray(slots, dtype=np.int64)

    def forget_except(self, live: set) -> None:
        """Drop the windows of jobs whose keys are not in ``live``."""
        gone = [key for key in self._windows if key not in live]
        self._release([self._windows.pop(key).slot for key in gone])

    def counts(self, key: int) -> dict[int, int]:
        """The window of job ``key`` as {id: count} (ids whose count is 0 left out)."""
        slot = self._windows[key].slot
        n = self._used[slot]
        return {
            int(i): int(c)
            for i, c in zip(self._ids[slot, :n], self._counts[slot, :n], strict=True)
            if c
        }

    def _count_in(self, op_slots, op_tokens, op_deltas, vocab: int) -> None:
        op_slots = np.asarray(op_slots, dtype=np.int64)
        adds = np.bincount(op_slots, minlength=len(self._used))
        needed = int((self._used + adds).max())
        if needed > self._ids.shape[1]:
            self._widen(needed)
        _count_in(
            self._ids,
            self._counts,
            self._used,
            vocab,
            op_slots,
            np.asarray(op_tokens, dtype=np.int64),
            np.asarray(op_deltas, dtype=np.float32),
        )

    def _recount(self, request: SampleRequest, vocab: int, record: _Window | None) -> _Window:
        """Count the window of ``request``'s context at once (vectorised), in its old slot."""
        context = request.context
        window = request.settings.penalty_range
        ids, counts = window_counts(context, vocab, window)
        slot = self._take_slot() if record is None else record.slot
        if len(ids) > self._ids.shape[1]:
            self._widen(len(ids))
        self._ids[slot, : len(ids)] = ids
        self._counts[slot, : len(ids)] = counts
        self._used[slot] = len(ids)
        last = context[-1] if len(context) else None
        record = _Window(slot, len(context), last, vocab, window)
        if request.key is None:
            self._scratch.append(slot)
        else:
            self._windows[request.key] = record
        return record

    def _take_slot(self) -> int:
        if not self._free:
            old = len(self._used)
            size = max(8, 2 * old)
            self._ids = _grown(self._ids, (size, self._ids.shape[1]))
            self._counts = _grown(self._counts, (size, self._counts.shape[1]))
            self._used = _grown(self._used, (size,))
            self._free.extend(range(size - 1, old - 1, -1))  # (lowest first off the end)
        return self._free.pop()

    def _widen(self, needed: int) -> None:
        capacity = self._ids.shape[1]
        while capacity < needed:  # doubling: appends stay amortised O(1)
            capacity *= 2
        self._ids = _grown(self._ids, (len(self._used), capacity))
        self._counts = _grown(self._counts, (len(self._used), capacity))

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._used[slot] = 0
        self._free.extend(slots)


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``array`` copied into the corner of zeros of ``shape``."""
    out = np.zeros(shape, array.dtype)
    out[tuple(slice(0, n) for n in array.shape)] = array
    return out


@_jit
def _find(ids, n, token):
    """The index of ``token`` among ``ids[:n]``, or -1. A count first (a loop the compiler
    vectorises): a new token, the common miss, is never scanned one id at a time."""
    hits = 0
    for k in range(n):
        hits += ids[k] == token
    if hits == 0:
        return -1
    for k in range(n):
        if ids[k] == token:
            return k
    return -1


@_jit
def _count_in(ids, counts, used, vocab, op_slots, op_tokens, op_deltas):
    """Add each op's delta to its slot's count of its token (a new id is appended); then
    compact the slots a removal left mostly holding ids whose count is 0."""
    for i in range(op_slots.shape[0]):
        token = op_tokens[i]
        if not 0 <= token < vocab:
            continue
        s = op_slots[i]
        k = _find(ids[s], used[s], token)
        if k < 0:  # (a removal always finds its id: it was counted when it came in)
            k = used[s]
            ids[s, k] = token
            counts[s, k] = 0.0
            used[s] = k + 1
        counts[s, k] += op_deltas[i]
    for i in range(op_slots.shape[0]):
        if op_deltas[i] < 0:
            _compact(ids[op_slots[i]], counts[op_slots[i]], used, op_slots[i])


@_jit
def _compact(ids, counts, used, s):
    n = used[s]
    nonzero = 0
    for k in range(n):
        nonzero += counts[k] != 0
    if n <= COMPACT_ABOVE or 2 * nonzero >= n:
        return
    kept = 0
    for k in range(n):
        if counts[k] != 0:
            ids[kept] = ids[k]
            counts[kept] = counts[k]
            kept += 1
    used[s] = kept


@_jit
def _penalise_rows(flat, vocab, rows, slots, ids, counts, used, params, saved):
    # float32 throughout, apply_sparse_penalties' operations in its order (bit-identical)
    for i in range(rows.shape[0]):
        s = slots[i]
        base = rows[i] * vocab
        rep, freq, presence = params[i, 0], params[i, 1], params[i, 2]
        for k in range(used[s]):
            key = base + ids[s, k]
            v = flat[key]
            saved[i, k] = v
            c = counts[s, k]
            if c > 0:  # (an id whose count fell to 0 left the window: unchanged)
                edited = v / rep if v > 0 else v * rep
                flat[key] = edited - c * freq - presence


@_jit
def _restore_rows(flat, vocab, rows, slots, ids, used, saved):
    for i in range(rows.shape[0]):
        s = slots[i]
        base = rows[i] * vocab
        for k in range(used[s]):
            flat[base + ids[s, k]] = saved[i, k]
