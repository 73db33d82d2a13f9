"""Tokens sampled on the device that the host reads one step later (async scheduling).

With ``DynamicGenerator(async_scheduling=True)`` a step samples its tokens into a device
tensor and does not wait for them. Each sampled sequence gets ``PENDING_TOKEN`` as its last
token, so the scheduler plans the next step as usual (every length is known: one more token
per sampled row), and the next forward's input ids for those positions are taken from the
device tensor (``TokenPatch``), never from the host. Only after that forward is launched does
the host read the tokens (``InFlightTokens.read``: it waits for the sampling of the step
before, which precedes the new forward on the device's queue), hand them to their jobs and
make their text, while the device runs. So the host's work for step N+1 (schedule, inputs,
launch) and for step N's results overlaps the device's work instead of sitting between two
forwards.

A job whose token turns out to end it (a stop token, a stop string) has already been
scheduled once more: that row's K/V is written into pages the job then gives back, and its
logits are dropped before sampling (nothing past the stop is taken). Jobs that end by count
(``max_new_tokens``) are known at sampling and are not scheduled again.

On a CPU the same path runs serially (torch's CPU ops are synchronous): it exists there to
stay correct and tested, not to be faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.device_copy import upload

PENDING_TOKEN = -2  # a sequence's last token while its value is still on the device


@dataclass(frozen=True, slots=True)
class TokenPatch:
    """Input-id positions of a forward batch whose values come from the device."""

    positions: torch.Tensor  # [n] long, indices into the batch's flat input ids
    values: torch.Tensor  # [n] long, on the device, in the same order

    def apply(self, input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, self.positions.to(input_ids.device), self.values)


@dataclass(slots=True)
class InFlightTokens:
    """One step's sampled tokens, on their way to the host.

    ``jobs[i]`` sampled ``tokens[i]``. ``flags[i]``: the device path could not sample row i (a
    NaN logit, or every token banned); the host samples it again from ``logits[i]`` when it
    reads the step (``requests[i]`` is what it was sampled with). ``pending[i]``: the job's
    sequences got ``PENDING_TOKEN`` (False for a job whose tokens are complete by count: it
    left the batch at once)."""

    jobs: list[Any]
    requests: list[Any]
    tokens: torch.Tensor
    flags: torch.Tensor | None
    logits: torch.Tensor
    pending: list[bool]
    rows: dict[int, int]  # id(sequence holding PENDING_TOKEN) -> its row in ``tokens``
    _host: torch.Tensor
    _host_flags: torch.Tensor | None
    _ready: Any  # a torch.cuda.Event on a GPU, None on a CPU

    @classmethod
    def launch(
        cls,
        jobs: list[Any],
        requests: list[Any],
        tokens: torch.Tensor,
        flags: torch.Tensor | None,
        logits: torch.Tensor,
        pending: list[bool],
    ) -> InFlightTokens:
        """Start copying ``tokens`` (and ``flags``) to the host without waiting for them."""
        rows: dict[int, int] = {}
        for i, job in enumerate(jobs):
            if pending[i]:
                rows[id(job.seq)] = i
                if job.seq.partner is not None:  # a CFG job's two rows take one token
                    rows[id(job.seq.partner)] = i
        host, host_flags, ready = tokens, flags, None
        if tokens.is_cuda:  # pinned buffers: the copies are queued after the sampling
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            if flags is not None:
                host_flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                host_flags.copy_(flags, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return cls(jobs, requests, tokens, flags, logits, pending, rows, host, host_flags, ready)

    def input_patch(self, entries: Sequence[Any]) -> TokenPatch | None:
        """Where ``entries`` (a step plan's, in batch order) compute a ``PENDING_TOKEN``
        position, and the device values that go there; None when none does."""
        positions: list[int] = []
        sources: list[int] = []
        offset = 0
        rows = self.rows
        for entry in entries:
            seq = entry.seq
            row = rows.get(id(seq))
            if row is not None:
                at = len(seq.tokens) - 1 - entry.start  # PENDING_TOKEN is always the last
                if 0 <= at < entry.num_tokens:
                    positions.append(offset + at)
                    sources.append(row)
            offset += entry.num_tokens + len(entry.drafts)
        if not positions:
            return None
        device = self.tokens.device
        index = upload(sources, device, torch.long)
        # clamp: a row the device could not sample holds a negative code; its job ends when
        # read, but its input id this step must still be a valid embedding row
        values = self.tokens.index_select(0, index).clamp_(min=0)
        return TokenPatch(upload(positions, device, torch.long), values)

    def read(self) -> tuple[list[int], list[bool]]:
        """(token per row, flag per row): waits for the copies (not for later device work)."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host.tolist()
        flags = [False] * len(tokens) if self._host_flags is None else self._host_flags.tolist()
        return tokens, flags

    def holds(self, job: Any) -> bool:
        return any(j is job for j in self.jobs)
