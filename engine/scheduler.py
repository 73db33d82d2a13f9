"""Token-budget scheduler: which sequences compute how many tokens in the next forward.

Pure Python (no torch). Each step plans ONE forward over a ragged batch:

1. every running sequence that is decoding contributes its pending token(s);
2. running sequences still prefilling contribute chunks from what budget is left;
3. waiting sequences are admitted FIFO (bounded skipping) with their cached prefix reused.

Pages are taken on demand as sequences grow. When a decoding sequence needs a page and none
can be had, the newest running sequence is preempted: its pages go back to the table (full,
hashed ones stay cached) and it waits at the head of the queue to resume, so no job is lost
and no step can deadlock.

A sequence's tokens: [0, num_computed) have K/V in its pages; [num_computed, len) are pending.
A forward that reaches the end of the tokens yields logits to sample the next token.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.cache.page_table import RECENT_BLOCKS, PageTable
from engine.cache.prefix_hash import EmbeddingSpan, PageHash, page_hash, prefix_hashes

# Prompt positions a sequence scoring its prompt computes per step: each returns float32
# logits over the vocabulary (256 x 128k x 4 bytes = 128 MiB for Llama 3)
PROMPT_LOGITS_CHUNK = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int  # sequences running at once
    max_chunk_size: int = 2048  # token budget of one forward (decode + prefill tokens)
    max_q_size: int = 1  # pending tokens a decoding sequence may compute per step
    max_skips: int = 4  # how often a waiting job may be passed over before admission stops

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_chunk_size", "max_q_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_skips < 0:
            raise ValueError(f"max_skips must be >= 0, got {self.max_skips}")


@dataclass(eq=False, slots=True)
class SeqState:
    """The scheduler's view of one job: tokens, progress and the pages that hold them."""

    tokens: list[int]
    owner: Any = None  # the job this sequence belongs to (opaque to the scheduler)
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)  # see the page-list INVARIANT at _grow
    page_hashes: list[PageHash] = field(default_factory=list)  # of the leading full pages
    skips: int = 0  # later jobs admitted while this one could not start
    max_skips: int | None = None  # how many it lets pass (None: SchedulerConfig.max_skips)
    cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    cached_pages: int = 0
    admitted: bool = False  # admitted at least once (preempted sequences resume)
    preemptions: int = 0
    # (token count, hashes of the full pages before the last token) so repeated admission
    # attempts and in-flight checks do not rehash the prompt
    hash_cache: tuple[int, list[PageHash]] | None = None
    # Parent of the first page's hash: a cache salt's root (prefix_hash.salt_root), so only
    # sequences with the same salt share pages; None for unsalted sequences.
    hash_root: PageHash | None = None
    # The job's embedding containers: page hashes cover their identity (prefix_hash), and
    # the runner substitutes their rows for the placeholder ids.
    embeddings: tuple[EmbeddingSpan, ...] = ()
    # Classifier-free guidance: the two rows of one job run as a pair. The leader (positive
    # prompt) is queued; its partner (negative prompt, ``is_partner``) follows it into the
    # running list, and both are admitted, preempted and removed together. Each row keeps its
    # last pending token until the other can compute its own in the same step, so both rows'
    # logits always come from one forward.
    partner: SeqState | None = None
    is_partner: bool = False
    # The job wants its prompt tokens' log-probabilities and lacks some: its prompt chunks
    # return the logits of every position (StepEntry.prompt_rows), and it takes no pages from
    # the cache (their positions would have no logits).
    prompt_logits: bool = False
    # Draft tokens the speculator would like verified in the next decode step (a wish: the
    # scheduler grants what budget, max_q_size and free pages allow, see StepEntry.lookahead).
    lookahead: int = 0
    # tokens of the prompt (the first ones); -1: all the tokens it was created with
    prompt_len: int = -1
    # Blocks on recent pages (a table with them): block index -> the ordinary page the
    # sequence holds in reserve for it, which gets its codes when it settles (_settle).
    spares: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.tokens)
        if self.max_skips is not None and (
            not isinstance(self.max_skips, int) or self.max_skips < 0
        ):
            raise ValueError(f"max_skips must be None or an int >= 0, got {self.max_skips!r}")

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def leader(self) -> SeqState:
        return self.partner if self.is_partner else self

    @property
    def group(self) -> tuple[SeqState, ...]:
        """The sequences scheduled as one: (self,) or (leader, partner)."""
        lead = self.leader
        return (lead,) if lead.partner is None else (lead, lead.partner)

    @property
    def held_tokens(self) -> int:
        """Trailing tokens a prefill chunk leaves pending (1 in a CFG pair, see ``partner``)."""
        return 0 if self.partner is None else 1


@dataclass(frozen=True, slots=True)
class StepEntry:
    seq: SeqState
    start: int  # first position computed in this step (== seq.num_computed before it)
    num_tokens: int  # the sequence's own pending tokens computed (draft tokens not counted)
    lookahead: int = 0  # slots (with pages) granted for draft tokens after them
    drafts: tuple[int, ...] = ()  # the draft tokens filled in (at most ``lookahead``)

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the tokens, so its logits are sampled."""
        return self.start + self.num_tokens == len(self.seq.tokens)

    @property
    def prompt_chunk(self) -> bool:
        """True when this entry computes several tokens, all of the prompt (no drafts): a
        prompt chunk, which a quantized cache's ``exact_chunks`` reads exactly."""
        return (
            self.num_tokens > 1
            and not self.drafts
            and self.start + self.num_tokens <= self.seq.prompt_len
        )

    @property
    def logits_rows(self) -> int:
        """Trailing tokens of this chunk whose logits are sampled (1 when it samples; 1 + k
        once k draft tokens are verified)."""
        return 1 + len(self.drafts) if self.samples else 0

    @property
    def prompt_rows(self) -> int:
        """Positions of this chunk whose logits score the next prompt token (a job that asked
        for its prompt's log-probabilities); they come just before the sampled rows."""
        if not self.seq.prompt_logits:
            return 0
        return max(0, min(self.start + self.num_tokens, self.seq.prompt_len - 1) - self.start)

    @property
    def forward_rows(self) -> int:
        """Trailing tokens of this chunk whose logits the forward must return."""
        return self.prompt_rows + self.logits_rows


@dataclass(slots=True)
class StepPlan:
    entries: list[StepEntry] = field(default_factory=list)
    admitted: list[SeqState] = field(default_factory=list)  # first admissions only
    preempted: list[SeqState] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens + e.lookahead for e in self.entries)


class Scheduler:
    """Owns the waiting queue, the running set, and page allocation through the table."""

    def __init__(self, config: SchedulerConfig, table: PageTable):
        self.config = config
        self.table = table
        self.page_size = table.page_size
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self.preemptions = 0
        # (recent page, ordinary page) copies of codes that the caches must make, in this
        # order, before the next forward reads or writes pages (``take_page_moves``)
        self.page_moves: list[tuple[int, int]] = []

    # -- queue management --------------------------------------------------------------------

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def remove(self, seq: SeqState) -> None:
        """Drop a sequence (finished or cancelled; a CFG pair whole) and return its pages."""
        lead = seq.leader
        if lead in self.running:
            for member in lead.group:
                self.running.remove(member)
        elif lead in self.waiting:
            self.waiting.remove(lead)
        for member in lead.group:
            self._release_pages(member)

    @property
    def admission_window(self) -> int:
        """Waiting jobs considered per step: enough to fill every batch slot even when each
        one passed over (``max_skips``) or deferred behind an in-flight page sits in between.
        (A job with a larger ``max_skips`` of its own is passed over across more steps.)"""
        return 2 * self.config.max_batch_size + self.config.max_skips

    @property
    def max_running(self) -> int:
        """Sequences that may run at once: max_batch_size, and with recent pages as many as
        have RECENT_BLOCKS of them each (so every placement finds its pages, and a token's
        numerics never depend on which pages were free)."""
        if not self.table.num_recent_pages:
            return self.config.max_batch_size
        return min(self.config.max_batch_size, self.table.num_recent_pages // RECENT_BLOCKS)

    def max_skips(self, seq: SeqState) -> int:
        """How many later jobs ``seq`` lets pass before admission waits for it."""
        return self.config.max_skips if seq.max_skips is None else seq.max_skips

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def take_page_moves(self) -> list[tuple[int, int]]:
        """The page copies planned since the last call (each cache sharing the table makes
        them, ``PagedCache.move_pages``, before the next forward), handed over once."""
        moves, self.page_moves = self.page_moves, []
        return moves

    # -- planning ----------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_chunk_size
        budget = self._schedule_decodes(plan, budget)
        budget = self._schedule_prefills(plan, budget)
        self._admit(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan, budget: int) -> int:
        max_q, ps = self.config.max_q_size, self.page_size
        # (the property-free spellings below keep a step's Python cost per sequence small)
        decoding = [
            s
            for s in self.running
            if (
                len(s.tokens) - s.num_computed <= max_q
                if s.partner is None
                else all(m.num_pending <= max_q for m in s.group)
            )
        ]
        for seq in decoding:
            # Membership tests go to plan.preempted (almost always empty), not the running
            # list: a step must stay O(batch), not O(batch^2).
            if plan.preempted and seq in plan.preempted:  # preempted for an older one
                continue
            if budget == 0:
                break
            pending = len(seq.tokens) - seq.num_computed
            lead_of_pair = seq.partner is not None and not seq.is_partner
            if lead_of_pair and budget < pending + seq.partner.num_pending:
                break  # a CFG pair decodes whole or not at all
            n = min(pending, budget)
            if n == 0:
                continue
            extra = self._lookahead(seq, n, budget) if seq.lookahead else 0
            # pages that already cover the tokens need no _grow (the common decode step)
            covered = seq.num_computed + n <= len(seq.pages) * ps
            preempted_itself = False
            while not covered and not preempted_itself and not self._grow(seq, n):
                victim = self.running[-1]
                self._preempt(victim, plan)
                preempted_itself = victim in seq.group
            if not preempted_itself:
                plan.entries.append(StepEntry(seq, seq.num_computed, n, extra))
                budget -= n + extra
        return budget

    def _lookahead(self, seq: SeqState, n: int, budget: int) -> int:
        """Draft slots granted after ``n`` pending tokens: within the budget and max_q_size,
        and only from pages to spare (speculation never preempts anyone)."""
        if not seq.lookahead or n != seq.num_pending:
            return 0
        extra = min(seq.lookahead, budget - n, self.config.max_q_size - n)
        slack = len(seq.pages) * self.page_size - seq.num_computed - n  # slots without new pages
        if extra > slack and self.table.num_available <= len(self.running):
            extra = max(0, slack)  # keep the last pages for the sequences' own tokens
        return extra if extra > 0 and self._grow(seq, n + extra) else 0

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> int:
        scheduled = {id(e.seq) for e in plan.entries}
        for seq in list(self.running):
            if budget == 0:
                break
            if id(seq) in scheduled or (plan.preempted and seq in plan.preempted):
                continue
            if seq.num_pending <= seq.held_tokens:
                continue  # a CFG row waiting for its partner's last chunk
            n = self._chunk(seq, budget)
            if n == 0 and seq.leader is self.running[0]:  # (a CFG pair: either row)
                n = self._make_room_for_oldest(seq, plan, budget)
            if n == 0:
                continue
            self._grow(seq, n)
            plan.entries.append(StepEntry(seq, seq.num_computed, n))
            budget -= n
        return budget

    def _chunk(self, seq: SeqState, budget: int) -> int:
        """Tokens ``seq`` may compute now: its pending ones (a CFG row keeps its last for the
        pair), within the budget and the pages it can get. A sequence scoring its prompt
        returns every position's logits (float32 x the vocabulary each): at most
        ``PROMPT_LOGITS_CHUNK`` of them per step."""
        n = min(seq.num_pending - seq.held_tokens, budget, self._room(seq))
        return min(n, PROMPT_LOGITS_CHUNK) if seq.prompt_logits else n

    def _make_room_for_oldest(self, seq: SeqState, plan: StepPlan, budget: int) -> int:
        """The oldest sequence must always progress: preempt newer ones until it can."""
        while len(self.running) > len(seq.group):
            self._preempt(self.running[-1], plan)
            n = self._chunk(seq, budget)
            if n:
                return n
        return 0

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """FIFO admission; a job that cannot start yet may be passed over by at most
        ``max_skips`` later jobs in total (its own, else the config's), then admission waits
        for it.

        Only the first ``admission_window`` waiting jobs are looked at per step, so a step
        costs the same with ten thousand queued requests (say, behind a full cache, or all
        waiting for one in-flight system-prompt page) as with ten."""
        passed_over: list[SeqState] = []
        in_flight = self._in_flight_hashes()
        for seq in list(itertools.islice(self.waiting, self.admission_window)):
            # a CFG pair counts two sequences against max_batch_size
            if budget == 0 or len(self.running) + len(seq.group) > self.max_running:
                break
            if self._next_page_in_flight(seq, in_flight):
                continue  # another sequence is computing that page now; reuse it next step
            if any(s.skips >= self.max_skips(s) for s in passed_over):
                break
            chunks = self._try_admit_group(seq, budget)
            if chunks is None:
                passed_over.append(seq)
                continue
            for s in passed_over:
                s.skips += 1
            self.waiting.remove(seq)
            self.running.extend(seq.group)
            in_flight.update(self._matchable_hashes(seq)[len(seq.page_hashes) :])
            if not seq.admitted:
                for member in seq.group:  # (a resumed CFG row keeps its first cache hits)
                    member.admitted = True
                plan.admitted.append(seq)
            for member, n in chunks:
                if n:
                    plan.entries.append(StepEntry(member, member.num_computed, n))
                budget -= n

    def _try_admit_group(self, seq: SeqState, budget: int) -> list[tuple[SeqState, int]] | None:
        """``_try_admit`` for each sequence of ``seq``'s group: (sequence, first chunk) each,
        or None (and no change) if one can't start. A CFG row may start with an empty chunk
        (all but its held last token cached)."""
        if seq.partner is None:
            n = self._try_admit(seq, budget)
            return None if n == 0 else [(seq, n)]
        chunks: list[tuple[SeqState, int]] = []
        for member in seq.group:
            n = self._try_admit(member, budget)
            if n is None:
                for started, _ in chunks:
                    self._release_pages(started)
                return None
            chunks.append((member, n))
            budget -= n
        return chunks

    def _try_admit(self, seq: SeqState, budget: int) -> int | None:
        """Attach the cached prefix and pages for a first chunk; 0 (no change) if it can't
        (None in a CFG pair, where an empty first chunk is fine)."""
        failed = 0 if seq.partner is None else None
        hashes = self._matchable_hashes(seq)
        hits = self.table.match_prefix(hashes)
        remaining_pages = -(-len(seq.tokens) // self.page_size) - len(hits)
        if not hits and self.table.num_sink_pages:  # its first page: a sink page
            if not self.table.num_sink_available:
                return failed
            remaining_pages -= 1
        # Keep one page in reserve per running sequence so admission does not immediately
        # force preemptions of the jobs that are decoding.
        if remaining_pages > self.table.num_available - len(self.running):
            return failed
        self.table.acquire(hits)
        seq.pages = list(hits)
        seq.page_hashes = list(hashes[: len(hits)])
        seq.num_computed = len(hits) * self.page_size
        if not seq.admitted:
            seq.cached_pages = len(hits)
            seq.cached_tokens = seq.num_computed
        n = self._chunk(seq, budget)
        if (n == 0 and seq.partner is None) or not self._grow(seq, n):
            self._release_pages(seq)
            return failed
        seq.skips = 0
        return n

    def _matchable_hashes(self, seq: SeqState) -> list[PageHash]:
        # At least one token must be computed to produce logits, so the last token's page
        # is never taken from the cache.
        if seq.prompt_logits:
            return []  # every prompt position's logits are wanted
        if seq.hash_cache is None or seq.hash_cache[0] != len(seq.tokens):
            full_pages = (len(seq.tokens) - 1) // self.page_size
            hashes = prefix_hashes(
                seq.tokens[: full_pages * self.page_size],
                self.page_size,
                parent=seq.hash_root,
                embeddings=seq.embeddings,
            )
            seq.hash_cache = (len(seq.tokens), hashes)
        return seq.hash_cache[1]

    def _in_flight_hashes(self) -> set[PageHash]:
        """Hashes of prompt pages that running sequences are still prefilling."""
        in_flight: set[PageHash] = set()
        max_q = self.config.max_q_size
        for seq in self.running:
            if len(seq.tokens) - seq.num_computed > max_q:  # (num_pending, without the call)
                in_flight.update(self._matchable_hashes(seq)[len(seq.page_hashes) :])
        return in_flight

    def _next_page_in_flight(self, seq: SeqState, in_flight: set[PageHash]) -> bool:
        """True when the first page ``seq`` would have to compute is being computed by
        another sequence: waiting a step turns that work into a cache hit."""
        if not in_flight:
            return False
        hashes = self._matchable_hashes(seq)
        hits = len(self.table.match_prefix(hashes))
        return hits < len(hashes) and hashes[hits] in in_flight

    # -- pages -------------------------------------------------------------------------------

    def _room(self, seq: SeqState) -> int:
        """Tokens ``seq`` could add now: slack in its pages plus every available page (and,
        for a sequence without pages in a table with sink pages, one of those first)."""
        slack = len(seq.pages) * self.page_size - seq.num_computed
        room = slack + self.table.num_available * self.page_size
        if not seq.pages and self.table.num_sink_pages:
            return room + self.page_size if self.table.num_sink_available else 0
        return room

    # INVARIANT (page lists): while a sequence keeps one ``pages`` list object, the entries
    # of its full pages (index < num_computed // page_size, the ones in ``page_hashes``) never
    # change, except the last RECENT_BLOCKS ones in a table with recent pages. The list only
    # changes by (1) ``_grow`` appending pages at its end, (2) ``_register_full_pages``
    # swapping entry i for a cached twin in the commit that makes page i full (so i >=
    # num_computed // page_size at the step's start) and (3) with recent pages, ``_grow``
    # putting new blocks on recent pages and settling (``_settle``) the block that falls out
    # of the last RECENT_BLOCKS, then registering it (so i >= num_computed // page_size -
    # RECENT_BLOCKS at the step's start). Nothing removes or reorders entries in place:
    # releasing (finish, cancel, preemption) and (re-)admission assign a new list object.
    # DecodeGraphs._stage_table_row relies on this to rewrite only the tail of a block-table
    # row whose sequence kept its row; test_scheduler checks it.
    def _grow(self, seq: SeqState, n: int) -> bool:
        """Make the pages cover ``n`` more tokens; False (no change) if the table can't."""
        need = -(-(seq.num_computed + n) // self.page_size) - len(seq.pages)
        if need <= 0:
            return True
        fresh = self.table.allocate(need, first_block=not seq.pages)
        if fresh is None:
            return False
        seq.pages.extend(fresh)
        if self.table.num_recent_pages:
            self._place_recent(seq, len(seq.pages) - need)
        return True

    def _place_recent(self, seq: SeqState, first_new: int) -> None:
        """Keep ``seq``'s last RECENT_BLOCKS blocks (never a sink block) on recent pages: the
        blocks that fall out of them settle, and new blocks among them (``first_new`` on: no
        K/V written yet) move onto recent pages, their fresh ordinary pages kept in reserve.
        """
        last = len(seq.pages)
        for block in [b for b in seq.spares if b < last - RECENT_BLOCKS]:
            self._settle(seq, block)
        lowest = max(first_new, last - RECENT_BLOCKS, 1 if self.table.num_sink_pages else 0)
        for block in range(last - 1, lowest - 1, -1):
            recent = self.table.take_recent()
            if recent is None:  # (max_running leaves RECENT_BLOCKS per sequence)
                raise RuntimeError("no recent page for a running sequence's new block")
            seq.spares[block] = seq.pages[block]
            seq.pages[block] = recent
        self._register_full_pages(seq)  # settled full blocks

    def _settle(self, seq: SeqState, block: int) -> None:
        """Move ``block`` from its recent page to the ordinary page kept for it: the caches
        copy the codes (``page_moves``, before the next forward) and the recent page is free
        for the next block (the copy runs first, in stream order)."""
        recent = seq.pages[block]
        seq.pages[block] = seq.spares.pop(block)
        self.page_moves.append((recent, seq.pages[block]))
        self.table.release([recent])

    def _preempt(self, seq: SeqState, plan: StepPlan) -> None:
        group = seq.group  # a CFG pair goes whole
        for member in group:
            self.running.remove(member)
            self._release_pages(member)
            plan.preempted.append(member)
        plan.entries = [e for e in plan.entries if e.seq not in group]
        group[0].preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(group[0])  # resumes first; its full pages are still cached

    def _release_pages(self, seq: SeqState) -> None:
        if seq.spares:  # full blocks on recent pages settle, to be cached like the others
            full = seq.num_computed // self.page_size
            for block in sorted(b for b in seq.spares if b < full):
                self._settle(seq, block)
            self._register_full_pages(seq)
        self.table.release(reversed(seq.pages))  # tail first, so prefixes outlive tails
        self.table.release(seq.spares.values())  # (unhashed: free again)
        seq.spares = {}
        seq.pages = []  # a new list object, never cleared in place (page-list INVARIANT)
        seq.page_hashes = []
        seq.num_computed = 0

    def truncate(self, seq: SeqState, length: int) -> None:
        """Take back ``seq.tokens[length:]`` (a banned-string rollback, rejected drafts).

        The K/V of kept tokens stays where it can: positions before ``length - 1`` in the
        sequence's own pages. A page that must change but is hashed (shared with the prefix
        cache: never written again) is dropped, and its kept positions are computed again.
        The last kept token is always pending, so the next forward yields logits to sample."""
        if not 1 <= length <= len(seq.tokens):
            raise ValueError(f"cannot truncate {len(seq.tokens)} tokens to {length}")
        del seq.tokens[length:]
        seq.prompt_len = min(seq.prompt_len, length)  # tokens regrown past it are generated
        seq.hash_cache = None  # keyed by length: a regrown sequence must not reuse it
        keep = min(seq.num_computed, length - 1)
        first_dropped = keep // self.page_size
        if first_dropped < len(seq.page_hashes):  # that page is shared: recompute its part
            keep = first_dropped * self.page_size
        else:
            first_dropped += 1  # the page holding position ``keep`` is the sequence's own
        if first_dropped < len(seq.pages):
            self.table.release(reversed(seq.pages[first_dropped:]))
            dropped = [b for b in seq.spares if b >= first_dropped]
            self.table.release(seq.spares.pop(b) for b in dropped)
            # a new list object, never changed in place (page-list INVARIANT at _grow)
            seq.pages = seq.pages[:first_dropped]
        seq.page_hashes = seq.page_hashes[:first_dropped]
        seq.num_computed = keep if seq.pages else 0

    # -- after the forward -------------------------------------------------------------------

    def commit(self, plan: StepPlan) -> None:
        """Advance each scheduled sequence and register the pages it has now filled."""
        ps = self.page_size
        for entry in plan.entries:
            seq = entry.seq
            if not seq.pages:  # removed while its step ran (async scheduling: a late stop)
                continue
            seq.num_computed = entry.start + entry.num_tokens
            if len(seq.page_hashes) < seq.num_computed // ps:  # a page became full
                self._register_full_pages(seq)

    def advance(self, seq: SeqState, accepted: int) -> None:
        """After verification: ``accepted`` draft tokens (now in ``seq.tokens``) had their K/V
        computed in the step, so they count as computed and the pages they fill are
        registered. Rejected drafts' slots stay in the pages, to be overwritten: no hash is
        ever registered for them."""
        if accepted:
            seq.num_computed += accepted
            self._register_full_pages(seq)

    def _register_full_pages(self, seq: SeqState) -> None:
        ps = self.page_size
        while len(seq.page_hashes) < seq.num_computed // ps:
            i = len(seq.page_hashes)
            if i in seq.spares:  # on a recent page: registered once it settles
                break
            parent = seq.page_hashes[-1] if seq.page_hashes else seq.hash_root
            h = page_hash(parent, seq.tokens[i * ps : (i + 1) * ps], embeddings=seq.embeddings)
            # The only in-place change of an entry: page i just became full (page-list
            # INVARIANT at _grow); once hashed it is never swapped again.
            seq.pages[i] = self.table.register(seq.pages[i], h)
            seq.page_hashes.append(h)
