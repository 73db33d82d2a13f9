"""Adaptive k: how many draft tokens each job gets verified in the next step.

Speculation pays when verifying 1 + k rows costs about what 1 row costs (a small batch: the
forward is bound by reading the weights) and costs when the batch already saturates the
device (every extra row is extra compute, and rejected rows are waste). Two rules:

1. Per job, from its recent acceptance rate a (a decayed count of accepted / verified
   drafts): k = the largest k <= num_draft_tokens whose last draft still has a fair chance,
   a^k >= ``min_tail`` (a = 0.9 -> all k; 0.5 -> 2; 0.3 -> 1; below ``min_tail`` -> 0). A job
   at k = 0 is probed with one draft every ``probe_interval`` steps, so it can recover.
2. Per step, the draft rows of the whole batch fit in ``max_step_tokens - decoding rows``
   (the token count up to which a forward costs about the same as a one-row forward on this
   device); jobs with the highest acceptance are served first. A saturated batch gets k = 0:
   never slower than no speculation by more than the host cost of asking.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past in the acceptance counts (about the last five steps)


@dataclass(slots=True)
class Acceptance:
    """A job's recent draft acceptance (decayed counts) and its speculation bookkeeping."""

    accepted: float = 1.4  # prior: a = 0.7 until the job has shown its own rate
    verified: float = 2.0
    idle_steps: int = 0  # steps since the job last had a draft verified

    @property
    def rate(self) -> float:
        return self.accepted / self.verified

    def record(self, accepted: int, proposed: int) -> None:
        """``accepted`` of ``proposed`` drafts passed (the first rejection ends a run, so a
        run of m < k tells m successes and one failure)."""
        self.accepted = DECAY * self.accepted + accepted
        self.verified = DECAY * self.verified + accepted + (1 if accepted < proposed else 0)
        self.idle_steps = 0


@dataclass(slots=True)
class AdaptiveK:
    num_draft_tokens: int
    max_step_tokens: int
    min_tail: float = 0.15
    probe_interval: int = 8
    adaptive: bool = True
    # draft rows asked for in the latest steps (bounded: a server runs for days)
    history: deque[int] = field(default_factory=lambda: deque(maxlen=1024))

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")

    def wanted(self, acceptance: Acceptance) -> int:
        if not self.adaptive:
            return self.num_draft_tokens
        rate = acceptance.rate
        if rate < self.min_tail:
            return 1 if acceptance.idle_steps >= self.probe_interval else 0
        if rate >= 1.0:
            return self.num_draft_tokens
        return max(1, min(self.num_draft_tokens, int(math.log(self.min_tail) / math.log(rate))))

    def choose(self, acceptances: list[Acceptance], decoding: int) -> list[int]:
        """k per candidate job (in the order given); ``decoding``: rows of this step's
        decode tokens (every running sequence that decodes)."""
        ks = [self.wanted(a) for a in acceptances]
        if self.adaptive:
            budget = max(0, self.max_step_tokens - decoding)
            for i in sorted(range(len(ks)), key=lambda i: -acceptances[i].rate):
                ks[i] = min(ks[i], budget)
                budget -= ks[i]
        for a, k in zip(acceptances, ks, strict=True):
            if k == 0:
                a.idle_steps += 1
        return ks
