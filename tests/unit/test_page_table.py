"""Page table: exact behaviour on small cases and a hypothesis state machine for invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.cache.page_table import PageTable, pages_for_rows
from engine.cache.prefix_hash import PageHash, page_hash, prefix_hashes


def test_prefix_hash_is_chained_and_deterministic():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], page_size=4)
    assert len(a) == 2  # the partial third page has no hash
    assert a == prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], page_size=4)
    # same second page after a different first page -> different hash
    b = prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], page_size=4)
    assert a[0] != b[0] and a[1] != b[1]
    assert page_hash(None, [1, 2, 3, 4]) == a[0]
    assert page_hash(None, [1, 2, 3, 4], extra=b"img") != a[0]
    with pytest.raises(ValueError, match="page_size"):
        prefix_hashes([1], 0)


def test_allocate_release_and_reuse_by_hash():
    table = PageTable(4, page_size=2)
    pages = table.allocate(3)
    assert pages == [0, 1, 2] and table.num_referenced == 3
    hashes = prefix_hashes([1, 2, 3, 4], 2)
    for index, h in zip(pages, hashes, strict=False):
        assert table.register(index, h) == index
    table.release(reversed(pages))  # tail first
    assert (table.num_free, table.num_cached) == (2, 2)
    assert table.match_prefix(hashes) == [0, 1]
    table.acquire([0, 1])
    assert table.num_cached == 0 and table.pages[0].ref_count == 1
    table.release([1, 0])
    table.check_invariants()


def test_eviction_is_lru_and_tail_first():
    table = PageTable(3, page_size=1)
    chain = prefix_hashes([7, 8, 9], 1)
    pages = table.allocate(3)
    for index, h in zip(pages, chain, strict=True):
        table.register(index, h)
    table.release(reversed(pages))
    (fresh,) = table.allocate(1)
    assert fresh == pages[2]  # the chain's tail goes first
    assert table.match_prefix(chain) == pages[:2]
    assert table.evictions == 1
    table.check_invariants()


def test_allocate_is_all_or_nothing():
    table = PageTable(2, page_size=4)
    assert table.allocate(3) is None
    assert table.num_free == 2
    assert table.allocate(2) == [0, 1]
    assert table.allocate(1) is None


def test_register_dedups_identical_content():
    table = PageTable(4, page_size=2)
    h = prefix_hashes([5, 6], 2)[0]
    first, second = table.allocate(2)
    assert table.register(first, h) == first
    assert table.register(second, h) == first  # converges on the first page
    assert table.pages[first].ref_count == 2 and table.num_free == 3
    table.check_invariants()


def test_misuse_raises():
    table = PageTable(2, page_size=2)
    with pytest.raises(ValueError, match="released more often"):
        table.release([0])
    with pytest.raises(ValueError, match="only hashed pages"):
        table.acquire([0])
    with pytest.raises(ValueError, match="not referenced"):
        table.register(0, PageHash(1))
    with pytest.raises(ValueError, match="num_pages"):
        PageTable(0, 16)


class PageTableMachine(RuleBasedStateMachine):
    """Random interleavings of sequences growing, sharing prefixes, finishing and evicting."""

    SINKS = 0  # num_sink_pages

    def __init__(self):
        super().__init__()
        self.table = PageTable(12, page_size=2, num_sink_pages=self.SINKS)
        self.seqs: list[list[int]] = []  # page ids each live sequence holds, in order
        self.seq_tokens: list[list[int]] = []

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=12))
    def start_sequence(self, tokens):
        hashes = prefix_hashes(tokens, 2)
        hit = self.table.match_prefix(hashes)
        self.table.acquire(hit)
        need = -(-len(tokens) // 2) - len(hit)
        fresh = self.table.allocate(need, first_block=not hit)
        if fresh is None:
            self.table.release(reversed(hit))
            return
        pages = hit + fresh
        for i, h in enumerate(hashes):
            pages[i] = self.table.register(pages[i], h)
        self.seqs.append(pages)
        self.seq_tokens.append(tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_sequence(self, data):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        self.table.release(reversed(self.seqs.pop(i)))
        self.seq_tokens.pop(i)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def grow_sequence(self, data):
        i = data.draw(st.integers(0, len(self.seqs) - 1))
        fresh = self.table.allocate(1)
        if fresh is not None:
            self.seqs[i].extend(fresh)

    @rule()
    def clear_cache(self):
        self.table.clear_cache()

    @invariant()
    def bookkeeping_is_consistent(self):
        self.table.check_invariants()
        t = self.table
        assert t.num_free + t.num_referenced + t.num_cached == t.num_pages
        held = {}
        for pages in self.seqs:
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for page in t.pages:
            assert page.ref_count == held.get(page.index, 0)
        if self.SINKS:  # first blocks on sink pages, nothing else on them
            assert all(pages[0] < self.SINKS for pages in self.seqs)
            assert all(p >= self.SINKS for pages in self.seqs for p in pages[1:])


class SinkPageTableMachine(PageTableMachine):
    SINKS = 3


TestPageTableMachine = PageTableMachine.TestCase
TestPageTableMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestSinkPageTableMachine = SinkPageTableMachine.TestCase
TestSinkPageTableMachine.settings = TestPageTableMachine.settings


def test_sink_pages_are_a_pool_of_their_own():
    table = PageTable(5, page_size=1, num_sink_pages=2)
    assert (table.num_available, table.num_sink_available) == (3, 2)
    first = table.allocate(2, first_block=True)
    assert first[0] in (0, 1) and first[1] >= 2
    second = table.allocate(1, first_block=True)
    assert second[0] in (0, 1)
    assert table.allocate(1, first_block=True) is None  # both sink pages held: it waits
    assert table.allocate(2) == [3, 4]  # ordinary pages never come from the sink pool
    assert table.allocate(1) is None
    table.release(second)
    table.register(first[0], page_hash(None, [7]))
    table.release(first[:1])  # cached: evicted for the next first block, least recent first
    assert table.allocate(1, first_block=True) == second
    assert table.allocate(1, first_block=True) == first[:1] and table.evictions == 1
    table.check_invariants()
    with pytest.raises(ValueError, match="num_sink_pages"):
        PageTable(2, 1, num_sink_pages=3)


def test_recent_pages_are_a_pool_that_is_never_hashed():
    table = PageTable(8, page_size=1, num_sink_pages=2, num_recent_pages=3)
    assert (table.num_available, table.num_sink_available, table.num_recent_free) == (3, 2, 3)
    assert table.allocate(1, first_block=True)[0] in (0, 1)
    assert table.allocate(3) == [5, 6, 7]  # ordinary pages never come from the recent pool
    assert table.allocate(1) is None
    recent = [table.take_recent() for _ in range(3)]
    assert sorted(recent) == [2, 3, 4] and table.take_recent() is None
    assert all(table.is_recent(p) for p in recent) and not table.is_recent(5)
    with pytest.raises(ValueError, match="recent page"):
        table.register(recent[0], page_hash(None, [1]))
    table.release(recent)
    assert table.num_recent_free == 3 and table.num_cached == 0
    table.check_invariants()
    with pytest.raises(ValueError, match="num_recent_pages"):
        PageTable(4, 1, num_sink_pages=2, num_recent_pages=3)
    assert pages_for_rows(8, 2, 1, 3) == 4 and pages_for_rows(8, 2, 5, 3) == 5
