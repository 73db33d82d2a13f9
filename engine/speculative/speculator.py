"""The generator's speculative-decoding hook: choose k, fill drafts, verify, keep stats.

Per step (see DynamicGenerator._step):

1. ``before_schedule``: each decoding job that may speculate gets ``seq.lookahead`` = its k
   (AdaptiveK); n-gram jobs get their proposal now (it needs no forward), so they ask only for
   as many slots as they have drafts.
2. the scheduler grants look-ahead slots (budget, max_q_size, spare pages) per entry;
3. ``fill``: the granted slots get drafts (n-gram: the proposal; draft model: batched draft
   forwards), so the target forward computes 1 + k rows for those entries;
4. ``verify``: the rejection sampler (rejection.py) over all speculating rows at once.

Jobs asking for per-token extras (probabilities, top tokens, logits) do not speculate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from engine.scheduler import SeqState, StepEntry, StepPlan
from engine.speculative.draft import DraftModelProposer
from engine.speculative.ngram import NGramIndex
from engine.speculative.policy import Acceptance, AdaptiveK
from engine.speculative.rejection import DraftRows, Verification, verify

logger = logging.getLogger(__name__)

MIN_NGRAM = 2  # shortest suffix an n-gram draft may follow


@dataclasses.dataclass(slots=True)
class _JobState:
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
    ngram: NGramIndex | None = None
    proposal: list[int] = dataclasses.field(default_factory=list)


class Speculator:
    def __init__(
        self,
        policy: AdaptiveK,
        vocab_limit: int,
        *,
        max_ngram: int = 4,
        draft: DraftModelProposer | None = None,
    ):
        self.policy = policy
        self.vocab_limit = vocab_limit
        self.max_ngram = max_ngram
        self.draft = draft
        self._jobs: dict[int, _JobState] = {}
        self.totals = {"steps": 0, "proposed": 0, "accepted": 0, "rejected": 0}

    @property
    def kind(self) -> str:
        return "draft_model" if self.draft is not None else "ngram"

    def forget(self, job) -> None:
        self._jobs.pop(job.serial, None)
        if self.draft is not None:
            self.draft.forget(job.serial)

    # -- 1. before scheduling --------------------------------------------------------------

    def before_schedule(self, running: Sequence[SeqState]) -> None:
        for s in running:
            s.lookahead = 0
        decoding = [s for s in running if s.num_pending == 1]
        candidates = [s for s in decoding if _may_speculate(s.owner)]
        states = [self._state(s.owner) for s in candidates]
        ks = self.policy.choose([st.acceptance for st in states], len(decoding))
        self.policy.history.append(sum(ks))
        for seq, state, k in zip(candidates, states, ks, strict=True):
            if self.draft is None:
                state.proposal = state.ngram.propose(seq.tokens, k) if k else []
                k = len(state.proposal)
            seq.lookahead = k

    def _state(self, job) -> _JobState:
        state = self._jobs.get(job.serial)
        if state is None:
            # a lone recurring token predicts little (open chat): suffixes of 2+ tokens only
            min_ngram = min(MIN_NGRAM, self.max_ngram)
            ngram = NGramIndex(self.max_ngram, min_ngram) if self.draft is None else None
            state = self._jobs[job.serial] = _JobState(ngram=ngram)
        return state

    # -- 3. drafts into the plan -----------------------------------------------------------

    def fill(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """Put drafts into the plan's entries (in place); returns q per job serial for
        sampled drafts. A failing draft model only costs this step's drafts."""
        for e in plan.entries:
            e.seq.lookahead = 0
        if self.draft is None:
            if any(e.lookahead for e in plan.entries):
                plan.entries = [self._ngram_entry(e) for e in plan.entries]
            return {}
        ks = [e.lookahead for e in plan.entries]
        try:
            proposals = self.draft.propose(plan.entries, ks)
        except Exception:
            logger.exception("draft model failed; this step verifies no drafts")
            plan.entries = [dataclasses.replace(e, lookahead=0) for e in plan.entries]
            return {}
        qs = {}
        for i, (e, (drafts, q)) in enumerate(zip(plan.entries, proposals, strict=True)):
            plan.entries[i] = dataclasses.replace(e, drafts=drafts[: e.lookahead])
            if q is not None:
                qs[e.seq.owner.serial] = q
        return qs

    def _ngram_entry(self, entry: StepEntry) -> StepEntry:
        if not entry.lookahead:
            return entry
        proposal = self._jobs[entry.seq.owner.serial].proposal
        return dataclasses.replace(entry, drafts=tuple(proposal[: entry.lookahead]))

    # -- 4. verification -------------------------------------------------------------------

    def verify(
        self, entries: Sequence[StepEntry], logits: torch.Tensor, qs: dict[int, torch.Tensor]
    ) -> list[Verification]:
        rows = [DraftRows(e.seq.owner, e.drafts, qs.get(e.seq.owner.serial)) for e in entries]
        return verify(rows, logits, self.vocab_limit)

    def record(self, job, result: Verification) -> None:
        job.accepted_draft_tokens += result.accepted
        job.rejected_draft_tokens += result.rejected
        proposed = result.accepted + result.rejected
        self._state(job).acceptance.record(result.accepted, proposed)
        self.totals["steps"] += 1
        self.totals["proposed"] += proposed
        self.totals["accepted"] += result.accepted
        self.totals["rejected"] += result.rejected

    def stats(self) -> dict[str, Any]:
        t = self.totals
        return {
            "spec_method": self.kind,
            "spec_draft_tokens_proposed": t["proposed"],
            "spec_draft_tokens_accepted": t["accepted"],
            "spec_acceptance_rate": t["accepted"] / t["proposed"] if t["proposed"] else 0.0,
            # tokens a job gains per verification step (accepted drafts + the sampled one)
            "spec_mean_accepted_length": 1 + t["accepted"] / t["steps"] if t["steps"] else 0.0,
        }


def _may_speculate(job) -> bool:
    """Per-token extras (probabilities, top tokens, logits, logprobs) come from the one-token
    sampler, and filters, token healing and banned strings act on one token at a time, and a
    CFG job's two rows merge into one before sampling: such jobs decode plainly."""
    if job.return_probs or job.return_top_tokens or job.return_logits:
        return False
    if job.return_logprobs is not None or job.banned_strings:
        return False
    if job.cfg_input_ids is not None:  # a CFG pair samples one merged row from two sequences
        return False
    return job.constraint is None and job.mask_source() is None


def split_logits(
    plan: StepPlan, logits: torch.Tensor
) -> tuple[list[StepEntry], torch.Tensor, list[StepEntry], torch.Tensor]:
    """(plain sampling entries, their logits, speculating entries, their 1 + k rows each)."""
    plain, plain_rows, spec, spec_rows = [], [], [], []
    row = 0
    for e in plan.entries:
        n = e.logits_rows
        if e.drafts:
            spec.append(e)
            spec_rows.extend(range(row, row + n))
        elif n:
            plain.append(e)
            plain_rows.append(row)
        row += n
    index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
    spec_index = torch.tensor(spec_rows, dtype=torch.long, device=logits.device)
    return plain, logits[index], spec, logits[spec_index]
