"""Pure prefix-routing state and policy (no Ray): which replica holds which prompt pages, and
how replicas are ranked. ``deployments.routing`` adapts it to Ray Serve's ``RequestRouter``.

See ``deployments.routing`` for the routing rules; everything here is unit-testable.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deployments.load_report import ReportedLoad, parse_active_requests
from deployments.router_settings import RouterSettings

logger = logging.getLogger("ray.serve")

Clock = Callable[[], float]

# LLMServer reports at most this many hashes (deployments.llm_server.ROUTING_HASH_LIMIT). A
# report that long may be truncated, so pages missing from it are not proof of eviction.
# Duplicated rather than imported: importing llm_server pulls in torch and the engine.
REPORTED_HASH_LIMIT = 4096
# An in-flight record older than this is dropped (a completion that never matched must not
# inflate a replica's load forever); longer requests stay counted by the replica's own report.
FLIGHT_TTL_S = 600.0
# A replica chosen for a request that was never dispatched (cancelled while routing).
TENTATIVE_TTL_S = 30.0
EXPIRY_PERIOD_S = 5.0


# -- what each replica holds -------------------------------------------------------------------


class _ReplicaPages:
    """One replica's believed pages: routed (LRU, timestamped), reported, pinned (in flight)."""

    __slots__ = ("pinned", "reported", "routed", "truncated")

    def __init__(self) -> None:
        # INVARIANT: insertion order == time order (re-routing moves a hash to the end), so
        # pruning by age pops from the front.
        self.routed: OrderedDict[int, float] = OrderedDict()
        self.reported: frozenset[int] = frozenset()
        self.truncated = True  # no report yet: nothing is known to be evicted
        self.pinned: Counter[int] = Counter()

    def holds(self, page: int) -> bool:
        return page in self.reported or page in self.routed or page in self.pinned


class PrefixIndex:
    """Per replica (any hashable id), a bounded set of page hashes it is believed to hold."""

    def __init__(
        self,
        max_entries: int = 50_000,
        routed_grace_s: float = 3.0,
        clock: Clock = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.routed_grace_s = routed_grace_s
        self._clock = clock
        self._replicas: dict[Hashable, _ReplicaPages] = {}

    def __len__(self) -> int:
        return len(self._replicas)

    def replicas(self) -> list[Hashable]:
        return list(self._replicas)

    def _state(self, replica: Hashable) -> _ReplicaPages:
        state = self._replicas.get(replica)
        if state is None:
            state = self._replicas[replica] = _ReplicaPages()
        return state

    def record_routed(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """This router sent a prompt with ``hashes`` there (or it just finished there)."""
        state, now = self._state(replica), self._clock()
        # Tail first, root last: the root ends up most recent, so LRU eviction drops a
        # prefix's tail before its head and leading runs stay matchable.
        for page in reversed(hashes):
            state.routed[page] = now
            state.routed.move_to_end(page)
        while len(state.routed) > self.max_entries:
            state.routed.popitem(last=False)

    def pin(self, replica: Hashable, hashes: Sequence[int]) -> bool:
        """Believe ``hashes`` there until ``unpin``, whatever reports say: a request carrying
        them is on its way or queued there. False (nothing pinned) when the pin set is full."""
        state = self._state(replica)
        if len(state.pinned) + len(hashes) > self.max_entries:
            return False
        state.pinned.update(hashes)
        return True

    def unpin(self, replica: Hashable, hashes: Sequence[int]) -> None:
        state = self._replicas.get(replica)
        if state is None:
            return  # forgotten meanwhile
        for page in hashes:
            left = state.pinned[page] - 1
            if left > 0:
                state.pinned[page] = left
            else:
                state.pinned.pop(page, None)

    def update_reported(
        self, replica: Hashable, hashes: Sequence[int], truncated: bool = False
    ) -> None:
        """The replica's own report (most recent first) replaces the reported part; routed
        pages older than the grace period that it does not list are taken as evicted."""
        state, now = self._state(replica), self._clock()
        state.reported = frozenset(hashes[: self.max_entries])
        state.truncated = truncated or len(hashes) > self.max_entries
        if state.truncated:
            return  # an incomplete list proves nothing about missing pages
        cutoff = now - self.routed_grace_s
        while state.routed:
            oldest = next(iter(state.routed))
            if state.routed[oldest] >= cutoff:
                break
            state.routed.popitem(last=False)  # reported ones stay believed via ``reported``

    def matched_pages(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """Length of the leading run of ``hashes`` the replica is believed to hold."""
        state = self._replicas.get(replica)
        if state is None:
            return 0
        for i, page in enumerate(hashes):
            if not state.holds(page):
                return i
        return len(hashes)

    def size(self, replica: Hashable) -> int:
        """Entries kept for ``replica`` (for tests and debugging)."""
        state = self._replicas.get(replica)
        if state is None:
            return 0
        return len(state.routed) + len(state.reported) + len(state.pinned)

    def forget(self, replica: Hashable) -> None:
        self._replicas.pop(replica, None)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        """Drop every replica not in ``replicas`` (they were scaled down or died)."""
        keep = set(replicas)
        for replica in [r for r in self._replicas if r not in keep]:
            del self._replicas[replica]


# -- scoring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """What the score needs to know about one replica for one request."""

    replica: Hashable
    uncached_pages: int
    load: float
    queue_full: bool = False
    recent: float = 0.0  # decayed count of requests recently routed there (tie-breaker)


def score(candidate: Candidate, settings: RouterSettings) -> float:
    """Lower is better: prefill work the replica would redo plus the queue it would join."""
    return candidate.uncached_pages * settings.prefix_weight + candidate.load * settings.load_weight


def overloaded(candidate: Candidate, settings: RouterSettings) -> bool:
    return candidate.queue_full or candidate.load > settings.max_load


def is_fresh(candidates: Sequence[Candidate], settings: RouterSettings) -> bool:
    """No replica that can take the request holds more of its prompt than another: a new
    prefix (or one cached everywhere alike)."""
    usable = {c.uncached_pages for c in candidates if not overloaded(c, settings)}
    return len(usable) == 1


def rank_candidates(
    candidates: Sequence[Candidate],
    settings: RouterSettings,
    rng: random.Random | None = None,
    fresh: bool = False,
) -> list[Candidate]:
    """Best first. Overloaded replicas come after all others (spill-over); within each group
    by score, then load, then recent requests, then randomly.

    ``fresh``: the prompt is new to every replica. Where it lands decides where the requests
    that share its prefix will go, so rank by recent traffic first (then load): new prefixes
    alternate between replicas instead of following momentary queue noise, which at low
    concurrency would let a slightly faster replica collect most prefixes.
    """
    rng = rng or random

    def key(i: int, c: Candidate) -> tuple:
        if fresh:
            return (overloaded(c, settings), c.recent, c.load, rng.random(), i)
        return (overloaded(c, settings), score(c, settings), c.load, c.recent, rng.random(), i)

    keyed = sorted(key(i, c) for i, c in enumerate(candidates))
    return [candidates[k[-1]] for k in keyed]


# -- policy: the router's whole state, without Ray ---------------------------------------------


@dataclass
class _Placement:
    """A request placed on a replica: tentatively (chosen, not yet dispatched) or in flight."""

    replica: Hashable
    hashes: Sequence[int]
    pinned: bool
    at: float
    key: Hashable | None = None  # the request's id in the replica's reports
    choices: float = 1.0  # engine jobs it holds there (its ``n``)
    # Pages each ranked replica was believed to hold when the choice was made (a retry may
    # dispatch to a later rank): the prediction the routing audit compares with the outcome.
    matched: dict[Hashable, int] = field(default_factory=dict)


class _Decayed:
    """An exponentially decayed event count."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value, self.at = 0.0, 0.0

    def get(self, now: float, half_life: float) -> float:
        return self.value * 0.5 ** ((now - self.at) / half_life)

    def add(self, now: float, half_life: float) -> None:
        self.value, self.at = self.get(now, half_life) + 1.0, now


class PrefixPolicy:
    """Index + loads -> ranking. Replica ids, request ids and tokens are any hashables.

    Load of a replica, in jobs (a request's ``n`` choices are ``n`` jobs), = this router's
    requests there + other routers' requests in the replica's last report. This router's
    count covers requests in flight (``routed`` ..
    ``completed``) and requests it has just chosen a replica for but Serve has not dispatched
    yet (``choose`` .. ``routed``): concurrent routing decisions would otherwise all see the
    same idle replica. It is exact and fresh for this router's traffic; the report (up to
    ~1.5 s old when it arrives) lists the requests it counted by id, so other routers' (other
    ingress replicas, job drivers) are the list less this router's, and a request of ours
    that ends after the report was taken stops counting at once, whether its end comes before
    the report arrives or after (``load_report.ReportedLoad``): the replica that just served
    a short prompt does not look busy to the follow-up turn (CI saw a second request on a
    2-page prompt go to the other replica: load weighs 4 pages). A report without the list
    (truncated) gives max(this router's count, its load less our requests ended since).
    """

    def __init__(
        self,
        settings: RouterSettings | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings or RouterSettings()
        self._clock = clock
        self._rng = rng or random.Random()
        self.index = PrefixIndex(
            self.settings.max_index_entries, self.settings.routed_grace_s, clock
        )
        self._tentative: dict[Hashable, _Placement] = {}  # by token (one per pending request)
        # In flight, keyed by (replica, request id): Serve gives every handle call made while
        # serving one HTTP request the same internal id, so one key may hold several calls.
        self._in_flight: dict[tuple[Hashable, Hashable], list[_Placement]] = {}
        self._local_load: Counter[Hashable] = Counter()  # jobs of this router's requests
        # each replica's last reported load, less our requests it counted that have ended
        self._reported: dict[Hashable, ReportedLoad] = {}
        self._recent: dict[Hashable, _Decayed] = {}
        self._next_expiry = clock() + EXPIRY_PERIOD_S

    def load(self, replica: Hashable) -> float:
        local = float(self._local_load[replica])
        reported = self._reported.get(replica)
        if reported is None:
            return local
        others = reported.others()
        return local + others if others is not None else max(local, reported.load)

    def candidate(self, replica: Hashable, hashes: Sequence[int], full: bool) -> Candidate:
        recent = self._recent.get(replica)
        return Candidate(
            replica,
            uncached_pages=len(hashes) - self.index.matched_pages(replica, hashes),
            load=self.load(replica),
            queue_full=full,
            recent=recent.get(self._clock(), self.settings.recent_half_life_s) if recent else 0.0,
        )

    def rank(
        self,
        replicas: Sequence[Hashable],
        hashes: Sequence[int],
        full: Callable[[Hashable], bool] = lambda _: False,
    ) -> list[Hashable]:
        """Replica ids best first; requests without hashes rank by load alone."""
        return [c.replica for c in self._ranked(replicas, hashes, full)]

    def _ranked(
        self, replicas: Sequence[Hashable], hashes: Sequence[int], full: Callable[[Hashable], bool]
    ) -> list[Candidate]:
        candidates = [self.candidate(r, hashes, full(r)) for r in replicas]
        fresh = bool(hashes) and is_fresh(candidates, self.settings)
        return rank_candidates(candidates, self.settings, self._rng, fresh)

    def choose(
        self,
        token: Hashable,
        replicas: Sequence[Hashable],
        hashes: Sequence[int],
        full: Callable[[Hashable], bool] = lambda _: False,
        choices: float = 1.0,
    ) -> list[Hashable]:
        """``rank``, and count the request (its ``choices`` jobs) on the best replica until
        ``routed(token=...)``."""
        previous = self._tentative.pop(token, None)
        if previous is not None:  # a retry (the last choice was full): undo that one
            self._unplace(previous)
        ranked = self._ranked(replicas, hashes, full)
        if ranked:
            now = self._clock()
            best = ranked[0].replica
            placement = self._place(best, hashes, now, previous is None, choices)
            placement.matched = {c.replica: len(hashes) - c.uncached_pages for c in ranked}
            self._tentative[token] = placement
            self._maybe_expire(now)
        return [c.replica for c in ranked]

    def routed(
        self,
        replica: Hashable,
        request_id: Hashable,
        hashes: Sequence[int],
        token: Hashable = None,
        key: Hashable = None,
        choices: float = 1.0,
    ) -> int:
        """Serve dispatched the request there (``token`` as given to ``choose``, if any;
        ``key``: its id in the replica's reports, ``choices``: the jobs it holds there).
        Returns the pages of ``hashes`` the replica was believed to hold when it was chosen."""
        now = self._clock()
        tentative = self._tentative.pop(token, None) if token is not None else None
        if tentative is not None:
            self._unplace(tentative)
        if tentative is not None and replica in tentative.matched:
            predicted = tentative.matched[replica]
        else:
            predicted = self.index.matched_pages(replica, hashes)
        placement = self._place(replica, hashes, now, tentative is None, choices)
        placement.key = key
        self._reported.setdefault(replica, ReportedLoad()).dispatched(key, choices)
        self.index.record_routed(replica, hashes)
        self._in_flight.setdefault((replica, request_id), []).append(placement)
        self._maybe_expire(now)
        return predicted

    def completed(self, replica: Hashable, request_id: Hashable) -> None:
        """One request with this id finished there. Serve also reports requests the replica
        rejected (never routed): no record matches, nothing changes."""
        placements = self._in_flight.get((replica, request_id))
        if not placements:
            return
        self._finish(replica, request_id, placements.pop(0))

    def _place(
        self, replica: Hashable, hashes: Sequence[int], now: float, count: bool, choices: float
    ) -> _Placement:
        if count:  # one decision, however many tries it takes
            self._recent.setdefault(replica, _Decayed()).add(now, self.settings.recent_half_life_s)
        self._local_load[replica] += choices  # jobs, as the replicas' reports count them
        pinned = self.index.pin(replica, hashes)
        return _Placement(replica, hashes, pinned, now, choices=choices)

    def _unplace(self, placement: _Placement) -> None:
        self._local_load[placement.replica] -= placement.choices
        if self._local_load[placement.replica] <= 0:
            del self._local_load[placement.replica]
        if placement.pinned:
            self.index.unpin(placement.replica, placement.hashes)

    def _finish(
        self, replica: Hashable, request_id: Hashable, placement: _Placement, ended: bool = True
    ) -> None:
        """Stop counting ``placement``; ``ended``: its completion came (so reports that
        counted it stop counting it too), else it expired and the reports keep it."""
        if not self._in_flight.get((replica, request_id)):
            self._in_flight.pop((replica, request_id), None)
        self._unplace(placement)
        self.index.record_routed(replica, placement.hashes)  # fresh until the next reports
        reported = self._reported.setdefault(replica, ReportedLoad())
        reported.finished(placement.key, placement.choices, placement.at, self._clock(), ended)

    def _maybe_expire(self, now: float) -> None:
        """Drop placements whose end never came: tentative ones whose request was cancelled
        (or never reported as routed), in-flight ones whose completion did not match."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_PERIOD_S
        for token, placement in list(self._tentative.items()):
            if now - placement.at > TENTATIVE_TTL_S:
                self._unplace(self._tentative.pop(token))
        for (replica, request_id), placements in list(self._in_flight.items()):
            while placements and now - placements[0].at > FLIGHT_TTL_S:
                logger.warning("PrefixAwareRouter: no completion for %s on %s", request_id, replica)
                self._finish(replica, request_id, placements.pop(0), ended=False)

    def report(self, replica: Hashable, stats: Mapping[str, Any]) -> None:
        """Ingest one ``record_routing_stats`` dict (unknown or bad keys are ignored)."""
        hashes = stats.get("page_hashes")
        if isinstance(hashes, list):
            truncated = stats.get("page_hashes_truncated", len(hashes) >= REPORTED_HASH_LIMIT)
            self.index.update_reported(replica, hashes, truncated=bool(truncated))
        load = stats.get("load")
        if isinstance(load, int | float) and not isinstance(load, bool):
            reported = self._reported.setdefault(replica, ReportedLoad())
            reported.report(float(load), parse_active_requests(stats), self._clock())

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: drop its pages and loads (placements end on completion)."""
        self.index.forget(replica)
        self._reported.pop(replica, None)
        self._recent.pop(replica, None)

    def retain(self, replicas: Iterable[Hashable]) -> None:
        keep = set(replicas)
        for replica in set(self.index.replicas()) | set(self._reported) | set(self._recent):
            if replica not in keep:
                self.forget(replica)
