"""Token-budget scheduler driven by a fake generator (no torch, no model).

Each simulated step mirrors the real generator: ``plan = schedule()``, "run the forward"
(here: write each entry's tokens into a fake K/V store keyed by page), ``commit(plan)``, then
append a fake sampled token to every entry that samples and remove finished sequences.
The fake K/V store lets the tests check what matters for correctness: every position a
sequence counts as computed holds that sequence's token in the page it points at, so prefix
hits, page convergence and preemption never serve wrong or overwritten content. Every step
also checks the page-list INVARIANT (engine/scheduler.py) that the decode graphs' block-table
staging relies on.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.cache.page_table import RECENT_BLOCKS, PageTable, pages_for_rows
from engine.cache.prefix_hash import prefix_hashes
from engine.scheduler import Scheduler, SchedulerConfig, SeqState, StepPlan


class Sim:
    """A scheduler, its table, and a fake generator loop with invariant checks."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        sampler=None,
        sink_pages: int = 0,
        recent_pages: int = 0,
        **config,
    ):
        self.table = PageTable(num_pages, page_size, sink_pages, recent_pages)
        self.ps = page_size
        self.sched = Scheduler(SchedulerConfig(**config), self.table)
        self.config = self.sched.config
        self.kv: dict[int, list[int | None]] = {i: [None] * page_size for i in range(num_pages)}
        self.target: dict[int, int] = {}  # id(seq) -> number of tokens to generate
        self.prompt_len: dict[int, int] = {}
        self.produced: dict[int, int] = {}
        self.finished: list[SeqState] = []
        self.plans: list[StepPlan] = []
        self.page_content: dict[int, list[int]] = {}  # page hash -> tokens it was made from
        self.counter = 10_000  # fake sampled tokens never collide with prompt tokens
        # id(seq) -> (its pages list object, a copy, full pages) when last in a plan
        self.staged: dict[int, tuple[list[int], list[int], int]] = {}
        self.swaps_seen = 0  # in-place entry changes the page-list check saw (dedup swaps)
        self.settles_seen = 0  # in-place entry changes from a recent page to its spare
        self.moves = 0  # page copies the scheduler asked for (recent pages settling)
        # seq -> next token; None: a counter (all generated pages unique). A function of the
        # tokens makes identical prompts decode identically: generated pages then dedup too.
        self.sampler = sampler
        self.on_plan = None  # called with each plan between schedule() and commit()

    # -- driving -----------------------------------------------------------------------------

    def add(self, prompt: list[int], generate: int = 1, max_skips: int | None = None) -> SeqState:
        seq = SeqState(list(prompt), max_skips=max_skips)
        self.target[id(seq)] = generate
        self.prompt_len[id(seq)] = len(prompt)
        self.produced[id(seq)] = 0
        self.sched.add(seq)
        return seq

    def cancel(self, seq: SeqState) -> None:
        self.sched.remove(seq)
        self._apply_moves()
        assert not seq.pages and seq.num_computed == 0

    def step(self) -> StepPlan:
        sched = self.sched
        decoding_before = {id(s) for s in sched.running if s.num_pending <= self.config.max_q_size}
        plan = sched.schedule()
        self.check_plan(plan, decoding_before)
        self.check_page_lists(plan)
        if self.on_plan is not None:
            self.on_plan(plan)
        self._forward(plan)
        sched.commit(plan)
        for entry in plan.entries:
            seq = entry.seq
            # record content before removals: every full block's, registered or not (blocks
            # on recent pages are registered when they settle, maybe at their release)
            full = seq.num_computed // self.ps
            for i, h in enumerate(prefix_hashes(seq.tokens[: full * self.ps], self.ps)):
                self.page_content.setdefault(h, list(seq.tokens[i * self.ps : (i + 1) * self.ps]))
            if not entry.samples:
                continue
            self.counter += 1
            seq.tokens.append(self.counter if self.sampler is None else self.sampler(seq))
            self.produced[id(seq)] += 1
            if self.produced[id(seq)] == self.target[id(seq)]:
                sched.remove(seq)
                self.finished.append(seq)
        self._apply_moves()  # (those of releases: the generator's come before its next forward)
        self.check_state()
        self.plans.append(plan)
        return plan

    def run(self, max_steps: int = 2000) -> int:
        """Step until nothing is left; returns the number of steps."""
        for n in range(max_steps):
            if self.sched.num_unfinished == 0:
                return n
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: possible livelock")

    def _apply_moves(self) -> None:
        """The settled recent pages' content (the generator's PagedCache.move_pages)."""
        for source, target in self.sched.take_page_moves():
            assert self.table.is_recent(source) and not self.table.is_recent(target)
            self.kv[target] = list(self.kv[source])
            self.moves += 1

    def _forward(self, plan: StepPlan) -> None:
        self._apply_moves()
        # a free page's old content must never be read back: wipe it
        for page in self.table.pages:
            if page.ref_count == 0 and page.hash is None:
                self.kv[page.index] = [None] * self.ps
        for e in plan.entries:
            for pos in range(e.start, e.start + e.num_tokens):
                page = e.seq.pages[pos // self.ps]
                # a job only writes to pages it holds alone, and never into a hashed page
                assert self.table.pages[page].ref_count == 1, "write into a shared page"
                assert self.table.pages[page].hash is None, "write into a hashed page"
                self.kv[page][pos % self.ps] = e.seq.tokens[pos]

    # -- checks ------------------------------------------------------------------------------

    def check_plan(self, plan: StepPlan, decoding_before: set[int]) -> None:
        sched, cfg = self.sched, self.config
        assert plan.num_tokens <= cfg.max_chunk_size
        assert len(sched.running) <= sched.max_running <= cfg.max_batch_size
        seqs = [id(e.seq) for e in plan.entries]
        assert len(seqs) == len(set(seqs)), "a sequence appears twice in one plan"
        running = {id(s) for s in sched.running}
        for e in plan.entries:
            assert id(e.seq) in running
            assert e.num_tokens >= 1
            assert e.start == e.seq.num_computed
            assert e.start + e.num_tokens <= len(e.seq.tokens)
            assert len(e.seq.pages) * self.ps >= e.start + e.num_tokens, "pages do not cover"
        # decodes come first: nothing else precedes an entry of a sequence that was decoding
        preempted = {id(s) for s in plan.preempted}
        seen_other = False
        for e in plan.entries:
            if id(e.seq) in decoding_before and id(e.seq) not in preempted:
                assert not seen_other, "a decode entry is scheduled after a prefill chunk"
                assert e.num_tokens <= cfg.max_q_size
            else:
                seen_other = True
        for s in plan.admitted:
            assert s.admitted and id(s) in running

    def check_page_lists(self, plan: StepPlan) -> None:
        """The page-list INVARIANT, between a sequence's last plan and this one (what the
        decode graphs' staging assumes of a block-table row whose sequence kept its row):
        with the same list object, nothing was removed, entries of pages full back then are
        unchanged, and any other changed entry is a page that has since become full and was
        swapped for its hashed twin, or (with recent pages, among the last RECENT_BLOCKS
        full ones) a recent page that settled onto its spare. Preemption and re-admission
        give a new list object."""
        ps = self.ps
        for e in plan.entries:
            seq, before = e.seq, self.staged.get(id(e.seq))
            if before is None or before[0] is not seq.pages:
                continue
            _, old, full = before
            new = seq.pages
            assert len(new) >= len(old), "entries removed from a pages list in place"
            assert new[:full] == old[:full], "an entry of a full page changed"
            for i in range(full, len(old)):
                if new[i] != old[i] and self.table.is_recent(old[i]):
                    self.settles_seen += 1
                    assert not self.table.is_recent(new[i]) and i not in seq.spares
                elif new[i] != old[i]:
                    self.swaps_seen += 1
                    assert i < seq.num_computed // ps, "a page swapped before it was full"
                    assert self.table.pages[new[i]].hash == seq.page_hashes[i]
        for seq in plan.preempted:
            before = self.staged.get(id(seq))
            assert before is None or before[0] is not seq.pages, "preempted, same list"
        lag = RECENT_BLOCKS  # (what PersistentBatch and the decode graphs rewrite)
        self.staged = {
            id(e.seq): (e.seq.pages, list(e.seq.pages), max(0, e.seq.num_computed // ps - lag))
            for e in plan.entries
        }

    def check_state(self) -> None:
        table, sched, ps = self.table, self.sched, self.ps
        table.check_invariants()
        assert table.num_free + table.num_referenced + table.num_cached == table.num_pages
        held: dict[int, int] = {}
        for seq in sched.running:
            assert len(seq.pages) * ps >= seq.num_computed
            assert len(seq.pages) == len(set(seq.pages))
            for p in [*seq.pages, *seq.spares.values()]:
                held[p] = held.get(p, 0) + 1
            # full computed pages carry the chained hash of their content, but for those on
            # recent pages (registered once they settle)
            full = seq.num_computed // ps
            registered = len(seq.page_hashes)
            assert registered == full or registered in seq.spares
            assert seq.page_hashes == prefix_hashes(seq.tokens[: registered * ps], ps)
            self.check_recent(seq)
            for i, h in enumerate(seq.page_hashes):
                assert table.pages[seq.pages[i]].hash == h
                self.page_content.setdefault(h, list(seq.tokens[i * ps : (i + 1) * ps]))
            # what the pages hold is what the sequence thinks it has computed
            for pos in range(seq.num_computed):
                assert self.kv[seq.pages[pos // ps]][pos % ps] == seq.tokens[pos], (
                    f"position {pos} holds the wrong token"
                )
            assert seq.cached_tokens % ps == 0
            assert seq.cached_tokens <= self.prompt_len[id(seq)] - 1
        for seq in sched.waiting:
            assert seq.pages == [] and seq.num_computed == 0
        for page in table.pages:
            assert page.ref_count == held.get(page.index, 0), "ref counts out of sync"
        # every hashed page, referenced or only cached, still holds the content it was
        # registered with: nothing overwrote a page that later jobs may hit
        for page in table.pages:
            if page.hash is not None:
                assert self.kv[page.index] == self.page_content[page.hash]
        assert len(sched.running) <= self.config.max_batch_size

    def check_recent(self, seq: SeqState) -> None:
        """With recent pages, only blocks among the last RECENT_BLOCKS (not a sink block)
        are on them, each with an ordinary spare, and the last block is whenever the sequence
        wrote it (not a prefix hit: pages are placed when a block is new)."""
        table = self.table
        if not table.num_recent_pages:
            assert not seq.spares
            return
        first = 1 if table.num_sink_pages else 0
        last = set(range(max(first, len(seq.pages) - RECENT_BLOCKS), len(seq.pages)))
        assert set(seq.spares) <= last
        for block, page in enumerate(seq.pages):
            assert table.is_recent(page) == (block in seq.spares)
        tail = len(seq.pages) - 1
        if tail in last and table.pages[seq.pages[tail]].hash is None:
            assert tail in seq.spares
        for spare in seq.spares.values():
            assert table._kind(spare) == 0 and table.pages[spare].hash is None

    def check_done(self) -> None:
        assert self.sched.num_unfinished == 0
        for seq in self.finished:
            assert self.produced[id(seq)] == self.target[id(seq)]
            assert len(seq.tokens) == self.prompt_len[id(seq)] + self.target[id(seq)]
        assert self.table.num_referenced == 0
        self.table.check_invariants()


# -- budgets, ordering, chunking ---------------------------------------------------------------


def test_budget_batch_size_and_decode_first():
    sim = Sim(64, 4, max_batch_size=3, max_chunk_size=10, max_skips=2)
    for i in range(7):
        sim.add([i % 3] * (3 + 5 * i), generate=4 + i)
    sim.run()
    sim.check_done()
    assert len(sim.finished) == 7
    assert max(p.num_tokens for p in sim.plans) == 10  # the budget was actually used up
    # some step mixed decodes and prefill chunks, decodes first
    mixed = [p for p in sim.plans if any(e.num_tokens == 1 for e in p.entries) and p.num_tokens > 5]
    assert mixed
    assert max(len(p.entries) for p in sim.plans) == 3


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sim = Sim(32, 4, max_batch_size=2, max_chunk_size=8)
    seq = sim.add(list(range(50)), generate=3)
    chunks = []
    while sim.sched.num_unfinished:
        plan = sim.step()
        chunks += [(e.start, e.num_tokens) for e in plan.entries if e.seq is seq]
    prefill = chunks[:-2]  # the last two entries are decodes
    assert [n for _, n in prefill] == [8, 8, 8, 8, 8, 8, 2]
    assert [s for s, _ in prefill] == list(range(0, 50, 8))
    assert chunks[-2:] == [(50, 1), (51, 1)]
    sim.check_done()


def test_prefill_of_a_new_job_fills_only_the_budget_left_by_decodes():
    sim = Sim(64, 4, max_batch_size=4, max_chunk_size=6)
    a = sim.add([1, 2], generate=20)
    b = sim.add([3, 4], generate=20)
    sim.step()  # both admitted and prefilled (2 + 2 tokens)
    assert a in sim.sched.running and b in sim.sched.running
    c = sim.add(list(range(40)), generate=2)
    plan = sim.step()
    assert [(e.seq, e.num_tokens) for e in plan.entries] == [(a, 1), (b, 1), (c, 4)]
    plan = sim.step()
    assert [(e.seq, e.num_tokens) for e in plan.entries] == [(a, 1), (b, 1), (c, 4)]
    sim.run()
    sim.check_done()


def test_sequence_max_skips_validation():
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="max_skips must be None or an int >= 0"):
            SeqState([1], max_skips=bad)


def test_config_validation():
    for bad in (
        {"max_batch_size": 0},
        {"max_batch_size": 1, "max_chunk_size": 0},
        {"max_batch_size": 1, "max_q_size": 0},
        {"max_batch_size": 1, "max_skips": -1},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)


# -- prefix reuse ------------------------------------------------------------------------------


def test_second_sequence_reuses_committed_prefix_pages():
    ps = 4
    sim = Sim(32, ps, max_batch_size=4, max_chunk_size=64)
    shared = list(range(100, 112))  # three full pages
    a = sim.add([*shared, 1, 2], generate=10)
    sim.step()  # a is prefilled and its three full pages are registered
    assert a.num_computed == 14
    b = sim.add([*shared, 7, 8, 9], generate=3)
    plan = sim.step()
    assert b in plan.admitted
    assert b.cached_tokens == 3 * ps and b.cached_pages == 3
    assert b.pages[:3] == a.pages[:3]
    for p in a.pages[:3]:
        assert sim.table.pages[p].ref_count == 2
    (entry,) = [e for e in plan.entries if e.seq is b]
    assert (entry.start, entry.num_tokens) == (12, 3)  # only the uncached tail is computed
    # the fourth pages differ in content, so they are not shared
    assert b.pages[3] != a.pages[3]
    sim.run()
    sim.check_done()
    # after both finish, the shared prefix stays cached for later jobs
    c = sim.add([*shared, 5], generate=1)
    sim.step()
    assert c.cached_tokens == 12 and c in sim.finished
    sim.check_done()


def test_last_prompt_token_is_never_served_from_cache():
    ps = 4
    sim = Sim(32, ps, max_batch_size=4, max_chunk_size=64)
    prompt = list(range(200, 212))  # exactly three full pages
    a = sim.add(prompt, generate=5)
    sim.step()
    b = sim.add(prompt, generate=5)
    plan = sim.step()
    assert b.cached_tokens == 2 * ps  # (N-1) pages: the last page is recomputed
    (entry,) = [e for e in plan.entries if e.seq is b]
    assert (entry.start, entry.num_tokens) == (8, 4)  # reaches the end: it samples
    # once computed, b's copy of page 3 converges on a's identical page
    assert b.pages[:3] == a.pages[:3]
    assert sim.table.pages[a.pages[2]].ref_count == 2
    sim.run()
    sim.check_done()
    # a one-token prompt can never be a cache hit
    sim.add([200], generate=1)
    sim.step()
    c = sim.add([200], generate=1)
    sim.step()
    assert c.cached_tokens == 0
    sim.check_done()


def test_identical_prompts_enqueued_together_wait_for_the_shared_page():
    """The second copy is deferred while the first computes the shared page, then hits it."""
    ps = 4
    sim = Sim(16, ps, max_batch_size=2, max_chunk_size=64)
    a = sim.add([5, 6, 7, 8, 9], generate=6)
    b = sim.add([5, 6, 7, 8, 9], generate=2)
    plan = sim.step()
    assert plan.admitted == [a] and b in sim.sched.waiting
    assert b.skips == 0  # being deferred is not a skip
    plan = sim.step()
    assert b in plan.admitted and b.cached_tokens == ps
    assert b.pages[0] == a.pages[0] and sim.table.pages[a.pages[0]].ref_count == 2
    sim.run()
    sim.check_done()


def test_concurrently_computed_identical_pages_converge():
    """Two sequences computing the same full page in one step end up sharing one page."""
    ps = 4
    sim = Sim(16, ps, max_batch_size=2, max_chunk_size=6)
    a = sim.add(list(range(8)), generate=3)  # exactly two pages: page 1 is not matchable
    b = sim.add([*range(8), 1, 2], generate=3)
    sim.step()  # a computes 0..5; b waits for page 0
    assert b in sim.sched.waiting
    plan = sim.step()  # a computes 6..7; b hits page 0 and computes 4..7 alongside
    assert [(e.seq, e.start, e.num_tokens) for e in plan.entries] == [(a, 6, 2), (b, 4, 4)]
    assert b.pages[:2] == a.pages[:2]
    assert sim.table.pages[a.pages[1]].ref_count == 2
    sim.run()
    sim.check_done()
    assert sim.swaps_seen == 1  # b's page 1, swapped in the commit that filled it


# -- preemption --------------------------------------------------------------------------------


def test_preemption_without_deadlock_or_loss():
    ps = 4
    sim = Sim(6, ps, max_batch_size=4, max_chunk_size=16)
    seqs = [sim.add([i] * 8, generate=12) for i in range(4)]  # 20 tokens = 5 pages each
    sim.run(max_steps=500)
    sim.check_done()
    assert set(map(id, sim.finished)) == set(map(id, seqs))
    assert sim.sched.preemptions > 0
    assert sum(s.preemptions for s in seqs) == sim.sched.preemptions
    assert any(p.preempted for p in sim.plans)
    assert sim.table.num_referenced == 0


def test_preempted_sequence_resumes_from_its_cached_full_pages():
    ps = 4
    sim = Sim(6, ps, max_batch_size=2, max_chunk_size=32)
    a = sim.add([1] * 5, generate=15)  # grows to 20 tokens = 5 pages
    b = sim.add([2] * 5, generate=12)  # grows to 17 tokens = 5 pages
    sim.step()
    assert sim.sched.running == [a, b]
    preempted_at = None
    resumed = []
    while sim.sched.num_unfinished:
        plan = sim.step()
        if plan.preempted and preempted_at is None:
            assert plan.preempted[0] is b  # the newest running sequence makes room
            assert a in sim.sched.running
            preempted_at = len(b.tokens)
        if preempted_at is not None:
            resumed += [e for e in plan.entries if e.seq is b and e.start < preempted_at - 1]
    assert preempted_at is not None and b.preemptions >= 1
    # b resumed: it recomputed what it had lost, starting after its cached full pages
    assert resumed and resumed[0].start > 0 and resumed[0].start % ps == 0
    sim.check_done()


def test_remove_waiting_and_running_sequences():
    sim = Sim(16, 4, max_batch_size=1, max_chunk_size=8)
    a = sim.add(list(range(20)), generate=5)
    b = sim.add([1, 2, 3], generate=5)
    sim.step()
    assert a in sim.sched.running and b in sim.sched.waiting
    sim.cancel(b)
    sim.cancel(a)
    assert sim.sched.num_unfinished == 0
    assert sim.table.num_referenced == 0
    sim.check_state()


# -- FIFO with bounded skipping -----------------------------------------------------------------


def _blocked_head_setup(
    max_skips: int, head_skips: int | None = None
) -> tuple[Sim, SeqState, SeqState]:
    """A long-running job R holds 4 of 10 pages; the head H needs 7 and cannot be admitted
    while R runs (plus one reserved page)."""
    ps = 4
    sim = Sim(10, ps, max_batch_size=8, max_chunk_size=64, max_skips=max_skips)
    r = sim.add(list(range(16)), generate=12)
    sim.step()
    h = sim.add(list(range(100, 128)), generate=1, max_skips=head_skips)  # 28 tokens = 7 pages
    return sim, r, h


@pytest.mark.parametrize(
    ("config_skips", "head_skips"), [(0, None), (1, None), (3, None), (3, 0), (0, 2)]
)
def test_head_lets_at_most_max_skips_jobs_pass(config_skips, head_skips):
    # the head's own max_skips, when set, replaces the config's
    max_skips = config_skips if head_skips is None else head_skips
    sim, _r, h = _blocked_head_setup(config_skips, head_skips)
    passed = []
    small = []
    for i in range(8):  # one small job arrives per step
        small.append(sim.add([50 + i, 1, 2], generate=1))
        plan = sim.step()
        if h in sim.sched.waiting:
            passed += [s for s in plan.admitted if s is not h]
    assert h in sim.sched.waiting  # R still runs, so H is still blocked
    assert len(passed) == max_skips
    assert all(s in sim.sched.waiting for s in small[max_skips:])
    sim.run()
    sim.check_done()
    # H is admitted before every job that arrived after admission stopped
    order = [s for p in sim.plans for s in p.admitted]
    assert all(order.index(h) < order.index(s) for s in small[max_skips:])


def test_head_is_not_overtaken_by_a_burst():
    sim, _r, h = _blocked_head_setup(max_skips=1)
    small = [sim.add([60 + i, 1, 2], generate=1) for i in range(4)]
    plan = sim.step()
    assert h in sim.sched.waiting
    passed = [s for s in plan.admitted if s in small]
    assert len(passed) <= 1


def test_admission_looks_at_a_bounded_window_of_the_queue(monkeypatch):
    # A full cache and a long queue: each step tries only the window, not every waiting job.
    ps = 4
    sim = Sim(8, ps, max_batch_size=2, max_chunk_size=64, max_skips=1)
    running = sim.add(list(range(24)), generate=4)  # holds 6-7 of 8 pages (+1 reserved)
    sim.step()
    queued = [sim.add([300 + i] * 12, generate=1) for i in range(300)]  # 3 pages each
    tried: list[SeqState] = []
    real = sim.sched._try_admit
    monkeypatch.setattr(
        sim.sched, "_try_admit", lambda seq, budget: tried.append(seq) or real(seq, budget)
    )
    sim.step()
    assert 0 < len(tried) <= sim.sched.admission_window == 5
    assert tried == queued[: len(tried)]  # FIFO from the head
    assert running in sim.sched.running
    sim.run()
    sim.check_done()


def test_deferred_jobs_do_not_hide_the_window(monkeypatch):
    # 8 copies of one prompt wait on the first copy's in-flight page; a different prompt right
    # behind them is still inside the window and starts in the same step as the first copy.
    ps = 4
    sim = Sim(64, ps, max_batch_size=4, max_chunk_size=64)
    copies = [sim.add([7, 7, 7, 7, 8], generate=1) for _ in range(8)]
    other = sim.add([9, 9], generate=1)
    plan = sim.step()
    assert plan.admitted == [copies[0], other]
    sim.run()
    sim.check_done()


# -- random interleavings ---------------------------------------------------------------------


def content_sampler(seq: SeqState) -> int:
    """A next token that depends only on the tokens so far (like greedy decoding)."""
    return 20_000 + sum(seq.tokens[-3:]) % 3


def test_identical_greedy_continuations_dedup_while_decoding():
    # Two copies of a prompt decode the same tokens: the second copy's generated pages are
    # swapped for the first copy's in the commits that fill them, while both decode.
    sim = Sim(32, 4, sampler=content_sampler, max_batch_size=2, max_chunk_size=16)
    a = sim.add([1, 2, 3, 4, 5, 6], generate=14)
    b = sim.add([1, 2, 3, 4, 5, 6], generate=14)
    sim.run()
    sim.check_done()
    assert a.tokens == b.tokens
    assert sim.swaps_seen >= 2  # generated pages 2 and 3 at least (page 1 too, maybe)


class SchedulerMachine(RuleBasedStateMachine):
    """Random enqueues, steps and cancellations on a small table; a drain at the end."""

    PAGE_SIZE = 4

    def __init__(self):
        super().__init__()
        self.sim: Sim | None = None

    @initialize(
        num_pages=st.sampled_from([10, 12, 16]),
        batch=st.integers(1, 4),
        chunk=st.integers(1, 16),
        skips=st.integers(0, 3),
        echo=st.booleans(),
        recent=st.booleans(),
    )
    def setup(self, num_pages, batch, chunk, skips, echo, recent):
        recent_pages = RECENT_BLOCKS * batch if recent else 0
        self.sim = Sim(
            num_pages + recent_pages,
            self.PAGE_SIZE,
            sampler=content_sampler if echo else None,
            sink_pages=1 if recent and batch == 1 else 0,
            recent_pages=recent_pages,
            max_batch_size=batch,
            max_chunk_size=chunk,
            max_skips=skips,
        )

    @precondition(lambda self: self.sim.sched.num_unfinished < 8)
    @rule(
        shared=st.integers(0, 32),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=40),
        generate=st.integers(1, 24),
    )
    def enqueue(self, shared, tail, generate):
        # a prefix of one fixed prompt plus a random tail: prefixes repeat often
        prompt = (([1, 2, 0, 1] * 8)[:shared] + tail)[:40]
        # every sequence must fit the table alone (prompt + generated tokens)
        table = self.sim.table
        capacity = (
            pages_for_rows(table.num_pages, table.num_sink_pages, 1, table.num_recent_pages)
            * self.PAGE_SIZE
        )
        prompt = prompt[: capacity - 1]
        self.sim.add(prompt, min(generate, capacity - len(prompt)))

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.sim.step()

    @precondition(lambda self: self.sim.sched.num_unfinished > 0)
    @rule(data=st.data())
    def cancel(self, data):
        sched = self.sim.sched
        live = list(sched.running) + list(sched.waiting)
        seq = data.draw(st.sampled_from(live))
        self.sim.cancel(seq)

    @rule()
    def drain(self):
        self.sim.run(max_steps=3000)
        self.sim.check_done()

    @invariant()
    def consistent(self):
        if self.sim is not None:
            self.sim.check_state()

    def teardown(self):
        if self.sim is not None:
            self.sim.run(max_steps=3000)
            self.sim.check_done()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- recent pages ------------------------------------------------------------------------------


def test_recent_pages_settle_with_their_content_through_preemption():
    """Each sequence's last blocks on recent pages; as it grows the oldest settles onto its
    spare (a page copy, then registered); preemption returns recent pages and spares alike.
    The fake K/V store checks that every settled block holds the sequence's tokens."""
    ps = 4
    sim = Sim(6 + RECENT_BLOCKS * 4, ps, recent_pages=RECENT_BLOCKS * 4, max_batch_size=4)
    seqs = [sim.add([i] * 8, generate=12) for i in range(4)]  # 20 tokens = 5 blocks each
    sim.run(max_steps=500)
    sim.check_done()
    assert set(map(id, sim.finished)) == set(map(id, seqs))
    assert sim.sched.preemptions > 0 and sim.moves > 0 and sim.settles_seen > 0
    assert sim.table.num_recent_free == RECENT_BLOCKS * 4


def test_recent_pages_bound_the_running_sequences():
    ps = 4
    sim = Sim(40, ps, recent_pages=RECENT_BLOCKS * 2, max_batch_size=4, max_chunk_size=64)
    for i in range(4):
        sim.add([i] * 9, generate=6)
    sim.step()
    assert len(sim.sched.running) == 2 == sim.sched.max_running
    sim.run()
    sim.check_done()
