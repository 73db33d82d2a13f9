"""The page table: which KV pages are free, referenced by running jobs, or cached for reuse.

Pure Python (no torch): the scheduler and the tests drive it without a device.

Every page is in exactly one state:

    free        ref_count == 0, no hash              (ready to hand out)
    referenced  ref_count >= 1, hash or not          (a running job reads or writes it)
    cached      ref_count == 0, hash                 (content kept for prefix reuse, LRU order)

    allocate():  free -> referenced, else evict the least recently used cached page
    acquire():   cached/referenced -> referenced (a prefix hit)
    release():   referenced -> cached (hashed) or free (unhashed) when the last ref goes
    register():  a referenced full page gets its chained hash, so later jobs can find it

INVARIANT: free + referenced + cached == num_pages, and a hash maps to at most one page.
Only full, hashed pages are ever shared, and a job only writes to pages it holds alone, so no
copy-on-write is needed.

Sink pages (``num_sink_pages`` = R > 0): page ids 0..R-1 are stored unquantized in a quantized
cache (engine/cache/quant.py: the layout follows the page id). They form a pool of their own:
every sequence's first page (``allocate(first_block=True)``) is a sink page, and no other page
ever is, so a token's numerics never depend on which pages happened to be free. A first block
takes a free sink page, else evicts the least recently used cached one (an old prefix whose
chain that ends), else waits. ``num_available`` counts the ordinary pool.

Recent pages (``num_recent_pages`` = T > 0): page ids R..R+T-1 are stored unquantized too. A
sequence's last ``RECENT_BLOCKS`` blocks (not a sink block) live on them while it grows, so a
decoded token reads its most recent 16-31 keys (page size 16) exactly, not through 4-bit
codes (engine/scheduler.py places and settles them). A recent page is never hashed or
cached: when its block leaves the sequence's last RECENT_BLOCKS, the scheduler has its codes
(which the cache write stores for every page) copied to an ordinary page the sequence holds
in reserve for that block, and only that page is registered. So the ordinary pool is used
exactly as without recent pages, and the recent pool only needs RECENT_BLOCKS pages per
running sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.cache.prefix_hash import PageHash

# Blocks per sequence kept on recent pages. SmolLM2, q4 + rotation, a decode-time read of
# every earlier token through its codes (bench/results/kv_recent_window*.json, emulated):
# perplexity +4.40% over fp32; the query's own page exact (0-15 earlier keys) +2.31%; the
# last 16 keys +1.53%, 64 +1.38%. Two blocks keep 16-31 keys exact.
RECENT_BLOCKS = 2
ORDINARY, SINK, RECENT = 0, 1, 2  # the pools (indices into ``_free``/``_cached``)


@dataclass(slots=True)
class Page:
    index: int
    ref_count: int = 0
    hash: PageHash | None = None


class PageTable:
    """Reference-counted pages with a hash index and LRU eviction of unreferenced ones."""

    def __init__(
        self, num_pages: int, page_size: int, num_sink_pages: int = 0, num_recent_pages: int = 0
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if not 0 <= num_sink_pages <= num_pages:
            raise ValueError(f"num_sink_pages must be in [0, {num_pages}], got {num_sink_pages}")
        if not 0 <= num_recent_pages <= num_pages - num_sink_pages:
            raise ValueError(
                f"num_recent_pages must be in [0, {num_pages - num_sink_pages}] (the pages "
                f"less the sink pages), got {num_recent_pages}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_sink_pages = num_sink_pages
        self.num_recent_pages = num_recent_pages
        self.pages = [Page(i) for i in range(num_pages)]
        unquantized = num_sink_pages + num_recent_pages
        # free and cached (unreferenced, hashed; least recently used first) pages, per pool
        # (ORDINARY, SINK, RECENT; recent pages are never cached)
        self._free: tuple[deque[int], ...] = (
            deque(range(unquantized, num_pages)),
            deque(range(num_sink_pages)),
            deque(range(num_sink_pages, unquantized)),
        )
        self._cached: tuple[OrderedDict[int, None], ...] = (
            OrderedDict(),
            OrderedDict(),
            OrderedDict(),
        )
        self._by_hash: dict[PageHash, int] = {}
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return sum(map(len, self._free))

    @property
    def num_cached(self) -> int:
        return sum(map(len, self._cached))

    @property
    def num_referenced(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Ordinary pages ``allocate`` can hand out now (free ones plus evictable cached
        ones): every page of a cache without sink pages."""
        return len(self._free[0]) + len(self._cached[0])

    @property
    def num_sink_available(self) -> int:
        """Sink pages (first blocks) ``allocate`` can hand out now."""
        return len(self._free[SINK]) + len(self._cached[SINK])

    @property
    def num_recent_free(self) -> int:
        """Recent pages ``take_recent`` can hand out now."""
        return len(self._free[RECENT])

    def is_recent(self, index: int) -> bool:
        return self._kind(index) == RECENT

    def match_prefix(self, hashes: Sequence[PageHash]) -> list[int]:
        """Page ids holding the longest leading run of ``hashes`` (no references taken)."""
        found: list[int] = []
        for h in hashes:
            index = self._by_hash.get(h)
            if index is None:
                break
            found.append(index)
        return found

    def recent_hashes(self, limit: int) -> list[PageHash]:
        """Up to ``limit`` hashes the table can serve now, most recently registered first
        (a bounded summary for the router)."""
        hashes = []
        for h in reversed(self._by_hash):
            if len(hashes) >= limit:
                break
            hashes.append(h)
        return hashes

    # -- state changes ---------------------------------------------------------------------

    def allocate(self, n: int, first_block: bool = False) -> list[int] | None:
        """``n`` fresh, unhashed pages with one reference each, or None (and no change) if
        fewer are free or evictable. ``first_block``: the first page is a sequence's block 0
        (a sink page, when the table has them)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        sink = first_block and n > 0 and self.num_sink_pages > 0
        if n - sink > self.num_available or (sink and not self.num_sink_available):
            return None
        taken = [self._take(kind=int(sink and i == 0)) for i in range(n)]
        for index in taken:
            self.pages[index].ref_count = 1
        return taken

    def take_recent(self) -> int | None:
        """A free recent page with one reference, or None if there is none."""
        if not self._free[RECENT]:
            return None
        index = self._free[RECENT].popleft()
        self.pages[index].ref_count = 1
        return index

    def _take(self, kind: int) -> int:
        """A free page of the pool, else its least recently used cached page."""
        if self._free[kind]:
            return self._free[kind].popleft()
        return self._evict_one(kind)

    def acquire(self, indices: Iterable[int]) -> None:
        """Take one more reference on each page (prefix hits on cached or shared pages)."""
        for index in indices:
            page = self.pages[index]
            if page.ref_count == 0:
                if page.hash is None:
                    raise ValueError(f"page {index} is free; only hashed pages can be acquired")
                del self._cached[self._kind(index)][index]
            page.ref_count += 1

    def release(self, indices: Iterable[int]) -> None:
        """Drop one reference on each page. Pass a sequence's pages tail first: the tail then
        sits nearer the LRU end and is evicted before the prefix that other jobs may share."""
        for index in indices:
            page = self.pages[index]
            if page.ref_count <= 0:
                raise ValueError(f"page {index} released more often than referenced")
            page.ref_count -= 1
            if page.ref_count == 0:
                if page.hash is None:
                    self._free[self._kind(index)].append(index)
                else:
                    self._cached[self._kind(index)][index] = None

    def register(self, index: int, page_hash: PageHash) -> int:
        """Give a full, referenced page its hash; returns the page the caller should keep.

        If another page already holds this hash (two jobs computed the same content), the
        caller's reference moves to that page and ``index`` is released, so identical
        prefixes converge on one page.
        """
        page = self.pages[index]
        if page.ref_count <= 0:
            raise ValueError(f"page {index} is not referenced; only held pages are registered")
        if page.hash == page_hash:
            return index
        if page.hash is not None:
            raise ValueError(f"page {index} already has a different hash")
        if self._kind(index) == RECENT:
            raise ValueError(f"page {index} is a recent page: only its codes' copy is registered")
        existing = self._by_hash.get(page_hash)
        if existing is not None:
            self.acquire([existing])
            self.release([index])
            return existing
        page.hash = page_hash
        self._by_hash[page_hash] = index
        return index

    def clear_cache(self) -> int:
        """Forget every unreferenced cached page; returns how many were freed."""
        count = 0
        for kind, cached in enumerate(self._cached):
            while cached:
                self._free[kind].append(self._evict_one(kind))
                count += 1
        return count

    def _kind(self, index: int) -> int:
        """The page's pool: SINK, RECENT or ORDINARY (the index into ``_free``/``_cached``)."""
        if index < self.num_sink_pages:
            return SINK
        return RECENT if index < self.num_sink_pages + self.num_recent_pages else ORDINARY

    def _evict_one(self, kind: int) -> int:
        index, _ = self._cached[kind].popitem(last=False)
        page = self.pages[index]
        del self._by_hash[page.hash]
        page.hash = None
        self.evictions += 1
        return index

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests, debugging)."""
        free = set().union(*self._free)
        cached = set().union(*self._cached)
        assert len(free) == self.num_free, "a page is free twice"
        assert not free & cached, "a page is both free and cached"
        assert not self._cached[RECENT], "a recent page is cached"
        for kind in (ORDINARY, SINK, RECENT):
            listed = [*self._free[kind], *self._cached[kind]]
            assert all(self._kind(i) == kind for i in listed), "a page is listed as the other kind"
        for page in self.pages:
            assert page.ref_count >= 0, f"page {page.index} has ref_count {page.ref_count}"
            in_use = page.ref_count > 0
            assert in_use + (page.index in free) + (page.index in cached) == 1, (
                f"page {page.index} is in more or fewer than one state"
            )
            assert page.index not in cached or page.hash is not None
            assert page.index not in free or page.hash is None
            if page.hash is not None:
                assert self._by_hash.get(page.hash) == page.index, "hash index out of sync"
        assert len(self._by_hash) == sum(p.hash is not None for p in self.pages)


def whole_pages(max_num_tokens: int, page_size: int) -> int:
    """Pages in a cache of ``max_num_tokens``: whole pages only, so a cache of 1000 tokens in
    pages of 16 holds 62 pages (992 tokens). The one place a cache size is rounded."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if max_num_tokens < page_size:
        raise ValueError(
            f"max_num_tokens ({max_num_tokens}) must hold at least one page of {page_size}"
        )
    return max_num_tokens // page_size


def budget_pages(num_bytes: int, bytes_per_token: int, page_size: int) -> int:
    """Whole pages whose K/V storage fits ``num_bytes`` (the one rule for a byte budget: the
    cache and the serving preset both size with it)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    pages = num_bytes // (bytes_per_token * page_size)
    if pages < 1:
        raise ValueError(
            f"a budget of {num_bytes} bytes holds no page of {page_size} tokens "
            f"({bytes_per_token} bytes per token)"
        )
    return pages


def pages_for_rows(
    num_pages: int, num_sink_pages: int, rows: int, num_recent_pages: int = 0
) -> int:
    """The most pages ``rows`` sequences may hold for their blocks at once in a table of
    ``num_pages``: all of them, or with sink pages one sink page each (first blocks) and every
    ordinary page. Recent pages hold no block of their own (each stands in for an ordinary
    page the sequence keeps in reserve). The one rule: the cache, the generator and the
    serving preset all size with it."""
    ordinary = num_pages - num_sink_pages - num_recent_pages
    return ordinary + min(num_sink_pages, rows)
