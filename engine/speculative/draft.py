"""Draft-model proposals: a smaller model of the same vocabulary drafts k tokens per job.

The draft has its own ``ModelRunner`` over its own K/V storage with the SAME page ids as the
target: the scheduler's pages (and prefix hashes) serve both, so a prompt page the target
finds in its cache is found, with the draft's K/V in it, for the draft. Per step, when any job
speculates, one batched draft forward covers every scheduled row (prefill chunks and catch-up
of positions the draft has not computed yet, each job's pending token with logits), then k - 1
one-row-per-job forwards draft the rest. The draft writes the look-ahead slots the scheduler
granted (rejected drafts' slots are overwritten later).

Draft tokens are picked from the job's own processed distribution over the DRAFT's logits
(greedy jobs: its argmax; sampled jobs: a sample, its probabilities kept as q for the
rejection sampler).

A draft's K/V can lag the target's by the positions it has not computed yet (a job that did
not speculate for a while, or the last accepted draft of a finished job): a page registered
in such a state holds stale draft K/V at those slots. That only lowers the acceptance of the
jobs that reuse it; verification keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import SequenceInput
from engine.model.runner import ModelRunner
from engine.sampling import _inverse_cdf, processed_distribution
from engine.scheduler import StepEntry


@dataclass(slots=True)
class _Drafting:
    entry: StepEntry
    k: int
    drafts: list[int]
    q: list[torch.Tensor]


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, vocab_limit: int):
        self.runner = runner
        self.vocab_limit = vocab_limit
        self._computed: dict[int, int] = {}  # job serial -> positions with draft K/V

    def forget(self, serial: int) -> None:
        self._computed.pop(serial, None)

    def propose(
        self, entries: Sequence[StepEntry], ks: Sequence[int]
    ) -> list[tuple[tuple[int, ...], torch.Tensor | None]]:
        """Drafts (and q, for sampled jobs) per entry; ``ks``: drafts wanted per entry."""
        rows, drafting = [], []
        speculating = any(ks)
        for entry, k in zip(entries, ks, strict=True):
            # Prefill chunks always (their pages may be cached and reused by other jobs);
            # decode rows when someone drafts (else they catch up at the job's next draft).
            seen = entry.seq.owner.serial in self._computed
            if speculating or entry.num_tokens > 1 or not entry.samples or not seen:
                rows.append(self._catch_up_row(entry, k > 0))
            if k > 0:
                drafting.append(_Drafting(entry, k, [], []))
        try:
            if rows:
                logits = self.runner.forward(rows)
            if drafting:
                self._pick(drafting, logits)
                for step in range(1, max(d.k for d in drafting)):
                    active = [d for d in drafting if d.k > step]
                    self._pick(active, self.runner.forward([self._next_row(d) for d in active]))
        except Exception:
            for entry in entries:  # the draft K/V of these rows is unknown now: redo it all
                self._computed[entry.seq.owner.serial] = 0
            raise
        by_entry = {id(d.entry): d for d in drafting}
        out = []
        for entry in entries:
            d = by_entry.get(id(entry))
            if d is None:
                out.append(((), None))
            else:
                q = torch.stack(d.q) if d.q and d.q[0] is not None else None
                out.append((tuple(d.drafts), q))
        return out

    def _catch_up_row(self, entry: StepEntry, wants_logits: bool) -> SequenceInput:
        seq = entry.seq
        serial = seq.owner.serial
        # min: after a preemption the sequence restarts at its cached prefix (or 0)
        start = min(self._computed.get(serial, entry.start), entry.start)
        end = entry.start + entry.num_tokens
        self._computed[serial] = end
        return SequenceInput(seq.tokens[start:end], start, seq.pages, int(wants_logits))

    def _next_row(self, d: _Drafting) -> SequenceInput:
        seq = d.entry.seq
        position = len(seq.tokens) - 1 + len(d.drafts)  # of the last draft, fed back in
        self._computed[seq.owner.serial] = position + 1
        return SequenceInput([d.drafts[-1]], position, seq.pages, 1)

    def _pick(self, drafting: Sequence[_Drafting], logits: torch.Tensor) -> None:
        requests = [d.entry.seq.owner.sample_request(ahead=d.drafts) for d in drafting]
        greedy, q = processed_distribution(logits, requests, self.vocab_limit)
        tokens = greedy
        sampled = [not r.settings.is_greedy for r in requests]
        if q is not None:
            draws = [r.rng.random() if s else 0.0 for r, s in zip(requests, sampled, strict=True)]
            u = torch.tensor(draws, dtype=torch.float64)
            tokens = torch.where(
                torch.tensor(sampled, device=q.device), _inverse_cdf(q, u.to(q.device)), greedy
            )
        for i, (d, token) in enumerate(zip(drafting, tokens.tolist(), strict=True)):
            d.drafts.append(token)
            d.q.append(q[i] if sampled[i] else None)
