"""Prefix-aware routing without a Ray cluster: the index, the scoring, the policy, the Serve
adapter with fake replicas, and a simulation of 2 replicas with LRU page caches against an ideal
single cache and against power-of-two choices."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from deployments.prefix_index import (
    EXPIRY_PERIOD_S,
    FLIGHT_TTL_S,
    TENTATIVE_TTL_S,
    Candidate,
    PrefixIndex,
    PrefixPolicy,
    RouterSettings,
    is_fresh,
    rank_candidates,
    score,
)
from deployments.routing import PrefixAwareRouter, request_hashes
from engine.cache.prefix_hash import prefix_hashes
from engine.request import GenerationRequest

PAGE = 16


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pages(seed: int, n: int) -> list[int]:
    """``n`` chained page hashes of random tokens (distinct seeds share nothing)."""
    rng = random.Random(seed)
    return prefix_hashes([rng.randrange(4, 4096) for _ in range(n * PAGE)], PAGE)


# -- PrefixIndex -------------------------------------------------------------------------------


def test_matched_pages_counts_the_leading_run() -> None:
    index = PrefixIndex()
    prompt = pages(1, 10)
    assert index.matched_pages("a", prompt) == 0
    index.record_routed("a", prompt[:6])
    assert index.matched_pages("a", prompt) == 6
    assert index.matched_pages("a", prompt[:3]) == 3
    assert index.matched_pages("b", prompt) == 0
    assert index.matched_pages("a", pages(2, 10)) == 0
    # A hole stops the run even if later pages are known.
    index.update_reported("c", [prompt[0], prompt[2], prompt[3]])
    assert index.matched_pages("c", prompt) == 1
    assert index.matched_pages("a", []) == 0


def test_lru_bound_keeps_recent_prefix_heads() -> None:
    clock = FakeClock()
    index = PrefixIndex(max_entries=20, clock=clock)
    old, new = pages(1, 15), pages(2, 15)
    index.record_routed("a", old)
    clock.now += 1
    index.record_routed("a", new)
    assert index.size("a") == 20
    assert index.matched_pages("a", new) == 15
    # The old prompt lost its tail first: its head (5 pages) is still matchable.
    assert index.matched_pages("a", old) == 5
    for seed in range(3, 50):
        index.record_routed("a", pages(seed, 15))
    assert index.size("a") == 20


def test_forget_and_retain_bound_memory_across_replicas() -> None:
    index = PrefixIndex()
    prompt = pages(1, 4)
    for replica in range(100):  # replicas come and go
        index.record_routed(replica, prompt)
        index.retain([replica, "kept"])
    index.record_routed("kept", prompt)
    index.retain([99, "kept"])
    assert sorted(map(str, index.replicas())) == ["99", "kept"]
    index.forget(99)
    assert index.matched_pages(99, prompt) == 0
    assert index.replicas() == ["kept"]
    index.forget("never-seen")  # no error


def test_reported_replaces_and_routed_counts_for_a_grace_period() -> None:
    clock = FakeClock()
    index = PrefixIndex(routed_grace_s=2.0, clock=clock)
    a, b, c = pages(1, 4), pages(2, 4), pages(3, 4)
    index.update_reported("r", a)
    assert index.matched_pages("r", a) == 4
    index.update_reported("r", b)  # replaces: ``a`` was evicted
    assert (index.matched_pages("r", a), index.matched_pages("r", b)) == (0, 4)
    index.record_routed("r", c)
    clock.now += 0.5
    index.update_reported("r", b)  # a report that cannot have seen ``c`` yet
    assert index.matched_pages("r", c) == 4
    clock.now += 3.0
    index.update_reported("r", b)  # newer than the grace period and still no ``c``: gone
    assert index.matched_pages("r", c) == 0


def test_truncated_reports_and_pins_do_not_drop_routed_pages() -> None:
    clock = FakeClock()
    index = PrefixIndex(routed_grace_s=1.0, clock=clock)
    a, b = pages(1, 4), pages(2, 4)
    index.record_routed("r", a)
    index.record_routed("r", b)
    assert index.pin("r", b)  # in flight, queued for a long time
    clock.now += 10
    index.update_reported("r", [], truncated=True)
    assert index.matched_pages("r", a) == 4
    index.update_reported("r", [])
    assert index.matched_pages("r", a) == 0
    assert index.matched_pages("r", b) == 4  # pinned
    index.unpin("r", b)
    index.record_routed("r", b)  # finished: counts as freshly routed
    clock.now += 0.5
    index.update_reported("r", [])
    assert index.matched_pages("r", b) == 4
    clock.now += 2
    index.update_reported("r", [])
    assert index.matched_pages("r", b) == 0
    assert not PrefixIndex(max_entries=3).pin("r", b)  # the pin set is bounded too


# -- scoring -----------------------------------------------------------------------------------


def test_score_weights_uncached_pages_and_load() -> None:
    settings = RouterSettings(prefix_weight=2.0, load_weight=3.0)
    assert score(Candidate("a", uncached_pages=5, load=1), settings) == 13.0
    cached = Candidate("cached", uncached_pages=1, load=3)
    cold = Candidate("cold", uncached_pages=18, load=0)
    ranked = rank_candidates([cold, cached], RouterSettings(load_weight=4.0))
    assert [c.replica for c in ranked] == ["cached", "cold"]  # 13 < 18
    ranked = rank_candidates([cold, cached], RouterSettings(load_weight=6.0))
    assert [c.replica for c in ranked] == ["cold", "cached"]  # 19 > 18: the queue costs more


def test_spill_over_when_the_best_replica_is_saturated() -> None:
    settings = RouterSettings(max_load=4)
    hot = Candidate("hot", uncached_pages=0, load=5)  # best score, but above max_load
    other = Candidate("other", uncached_pages=30, load=1)
    assert [c.replica for c in rank_candidates([hot, other], settings)] == ["other", "hot"]
    full = Candidate("full", uncached_pages=0, load=0, queue_full=True)
    assert [c.replica for c in rank_candidates([full, other], settings)] == ["other", "full"]
    # Everyone saturated: back to plain score order.
    both = [Candidate("x", 10, 9), Candidate("y", 0, 9)]
    assert [c.replica for c in rank_candidates(both, settings)] == ["y", "x"]


def test_a_report_that_counted_a_finished_request_stops_counting_it() -> None:
    """A short request ends before the replica's next report: the report taken while it ran
    must not keep that replica busy for the follow-up, which shares its 2 pages (load weighs
    4 pages, so a stale load of 1 sent it to the other replica)."""
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock, rng=random.Random(0))
    prompt = pages(7, 2)
    first = policy.rank(["a", "b"], prompt)[0]
    other = "b" if first == "a" else "a"
    policy.routed(first, "r1", prompt)
    clock.now += 0.1
    policy.report(first, {"load": 1})  # taken while r1 ran
    clock.now += 0.1
    policy.completed(first, "r1")
    assert policy.load(first) == 0.0
    assert policy.rank([other, first], prompt)[0] == first
    # a report received before a request was dispatched never counted it: nothing drops
    policy.report(first, {"load": 2})  # another router's two requests
    clock.now += 0.1
    policy.routed(first, "r2", prompt)
    policy.completed(first, "r2")
    assert policy.load(first) == 2.0


def test_ties_break_by_load_then_recent_then_randomly() -> None:
    settings = RouterSettings(prefix_weight=1.0, load_weight=1.0)
    # Equal scores (uncached + load): the less loaded one wins.
    busy, idle = Candidate("busy", 0, 2), Candidate("idle", 2, 0)
    assert [c.replica for c in rank_candidates([busy, idle], settings)] == ["idle", "busy"]
    fresh, used = Candidate("fresh", 3, 1, recent=0.0), Candidate("used", 3, 1, recent=2.5)
    assert [c.replica for c in rank_candidates([used, fresh], settings)] == ["fresh", "used"]
    firsts = {
        rank_candidates([Candidate("p", 3, 1), Candidate("q", 3, 1)], settings, random.Random(s))[
            0
        ].replica
        for s in range(20)
    }
    assert firsts == {"p", "q"}


def test_fresh_prefixes_rank_by_recent_traffic_then_load() -> None:
    settings = RouterSettings()
    busy_quiet = Candidate("busy-but-quiet", 18, load=2, recent=1.0)
    idle_popular = Candidate("idle-but-popular", 18, load=0, recent=3.0)
    pair = [idle_popular, busy_quiet]
    assert is_fresh(pair, settings)
    assert rank_candidates(pair, settings)[0].replica == "idle-but-popular"
    assert rank_candidates(pair, settings, fresh=True)[0].replica == "busy-but-quiet"
    # Not fresh once one replica holds part of the prompt; overloaded ones do not count.
    assert not is_fresh([Candidate("a", 18, 0), Candidate("b", 10, 0)], settings)
    assert is_fresh([Candidate("a", 18, 0), Candidate("b", 10, 99)], settings)


def test_new_prefixes_spread_evenly_when_one_replica_is_always_busier() -> None:
    """At low concurrency the momentary queue is noise: a replica that is a little slower
    must not end up with fewer prefixes (and so fewer requests) for good."""
    policy = PrefixPolicy(rng=random.Random(0))
    policy.report("slow", {"load": 1})  # always one request behind
    placed = []
    for i in range(8):
        replica = policy.rank(["fast", "slow"], pages(i, 17))[0]
        policy.routed(replica, i, pages(i, 17))
        policy.completed(replica, i)
        placed.append(replica)
    assert sorted(placed.count(r) for r in ("fast", "slow")) == [4, 4]


def test_settings_from_kwargs_validate() -> None:
    assert RouterSettings.from_kwargs({"max_load": 8}).max_load == 8
    with pytest.raises(ValueError, match="unknown router kwarg"):
        RouterSettings.from_kwargs({"prefix_wieght": 1})
    with pytest.raises(ValueError, match="load_weight"):
        RouterSettings(load_weight=-1)
    with pytest.raises(ValueError, match="max_index_entries"):
        RouterSettings(max_index_entries=0)
    with pytest.raises(ValueError, match="prefix_weight"):
        RouterSettings(prefix_weight=float("nan"))


# -- policy ------------------------------------------------------------------------------------


def test_policy_prefers_the_replica_it_routed_the_prefix_to() -> None:
    policy = PrefixPolicy(rng=random.Random(0))
    shared = pages(1, 17)
    first = policy.rank(["a", "b"], shared)[0]
    policy.routed(first, "r1", shared)
    # Still in flight (load 1): 0 uncached + 4 beats 17 uncached + 0.
    assert policy.rank(["a", "b"], shared)[0] == first
    policy.completed(first, "r1")
    assert policy.rank(["a", "b"], shared)[0] == first
    # A different cold prefix goes to the other replica (recent-requests tie-break).
    assert policy.rank(["a", "b"], pages(2, 17))[0] != first


def test_hot_prefix_replicates_once_its_queue_outweighs_the_prefix() -> None:
    """All requests share 17 pages and none completes: the first replica takes them until its
    queue costs more than recomputing the prefix, then both take turns; max_load caps both."""
    policy = PrefixPolicy(RouterSettings(load_weight=4.0, max_load=6), rng=random.Random(0))
    hot = pages(1, 17)
    chosen = []
    for i in range(12):
        replica = policy.rank(["a", "b"], hot)[0]
        policy.routed(replica, i, hot)
        chosen.append(replica)
    first = chosen[0]
    assert chosen[:5] == [first] * 5  # 4 in flight * 4 = 16 < 17 uncached pages elsewhere
    assert chosen[5] != first
    assert sorted(chosen.count(r) for r in "ab") == [6, 6]


def test_concurrent_choices_see_each_other_before_dispatch() -> None:
    """Serve runs several routing tasks at once and reports dispatch only after a round trip
    to the replica: choices made meanwhile must count the ones before them."""
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock, rng=random.Random(1))
    chosen = [policy.choose(f"t{i}", ["a", "b"], pages(i, 17))[0] for i in range(4)]
    assert sorted(chosen.count(r) for r in "ab") == [2, 2]  # four new prefixes, 2 and 2
    sibling = policy.choose("t-sibling", ["a", "b"], pages(0, 17))[0]
    assert sibling == chosen[0]  # follows its prefix even before that one was dispatched
    assert policy.load(chosen[0]) == 3
    # Dispatch elsewhere (the chosen replica was full) moves the count.
    other = "b" if chosen[0] == "a" else "a"
    policy.routed(other, "req0", pages(0, 17), token="t0")
    assert (policy.load(chosen[0]), policy.load(other)) == (2, 3)
    # A retry replaces the earlier choice; a choice never dispatched expires.
    policy.choose("t1", ["a", "b"], pages(1, 17))
    assert policy.load("a") + policy.load("b") == 5
    clock.now += TENTATIVE_TTL_S + EXPIRY_PERIOD_S + 1
    policy.choose("late", ["a", "b"], [])  # triggers expiry: t1, t2, t3, t-sibling, late
    assert policy.load("a") + policy.load("b") == 2  # req0 in flight and the new "late"


def test_policy_load_is_in_flight_or_reported_whichever_is_higher() -> None:
    policy = PrefixPolicy()
    policy.routed("a", 1, [])
    policy.routed("a", 2, [])
    assert policy.load("a") == 2
    policy.report("a", {"load": 5, "page_hashes": []})
    assert policy.load("a") == 5
    policy.report("a", {"load": 0})
    assert policy.load("a") == 2
    policy.completed("a", 1)
    policy.completed("a", 2)
    assert policy.load("a") == 0
    # Requests without hashes (e.g. stats calls) rank by load alone.
    policy.routed("b", 3, [])
    assert policy.rank(["b", "a"], []) == ["a", "b"]


def test_policy_counts_calls_sharing_a_request_id_and_ignores_rejections() -> None:
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock)
    policy.completed("a", "rejected")  # on_request_completed without on_request_routed
    assert policy.load("a") == 0
    for _ in range(3):  # n=3 choices: three handle calls, one internal request id
        policy.routed("a", "same", pages(1, 2))
    assert policy.load("a") == 3
    policy.completed("a", "same")
    policy.completed("b", "same")  # not routed there: no effect
    assert (policy.load("a"), policy.load("b")) == (2, 0)
    # A record whose completion never comes expires instead of inflating the load forever.
    clock.now += FLIGHT_TTL_S + 1
    policy.routed("b", "later", [])
    assert (policy.load("a"), policy.load("b")) == (0, 1)
    policy.completed("a", "same")  # too late: ignored, no negative load
    assert policy.load("a") == 0


def test_policy_forget_and_retain() -> None:
    policy = PrefixPolicy()
    policy.report("gone", {"load": 3, "page_hashes": pages(1, 3)})
    policy.report("live", {"load": 1, "page_hashes": pages(1, 3)})
    policy.retain(["live"])
    assert policy.load("gone") == 0
    assert policy.index.matched_pages("gone", pages(1, 3)) == 0
    assert policy.index.matched_pages("live", pages(1, 3)) == 3


# -- the Serve adapter, with fake replicas (no cluster) ----------------------------------------


def _replica_id(name: str) -> Any:
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    return ReplicaID(unique_id=name, deployment_id=DeploymentID(name="LLMServer", app_name="t"))


class FakeReplica:
    """What the router reads from a RunningReplica."""

    def __init__(self, name: str, routing_stats: dict[str, Any] | None = None) -> None:
        self.replica_id = _replica_id(name)
        self.routing_stats = routing_stats or {}
        self.max_ongoing_requests = 64

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0  # Serve probes new replicas


@dataclass
class FakeMetadata:
    internal_request_id: str


@dataclass
class FakeRequest:
    args: list[Any]
    metadata: FakeMetadata


def generation(hashes: list[int]) -> GenerationRequest:
    return GenerationRequest(prompt_ids=(1,), max_new_tokens=1, page_hashes=tuple(hashes))


def _router() -> PrefixAwareRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = PrefixAwareRouter(
        deployment_id=DeploymentID(name="LLMServer", app_name="t"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(max_load=8)
    return router


def _ids(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


async def _adapter_scenario() -> None:
    router = _router()
    shared = pages(1, 10)
    a = FakeReplica("a", {"load": 0, "page_hashes": shared[:8]})
    b = FakeReplica("b", {"load": 0, "page_hashes": []})
    router.update_replicas([a, b])
    await asyncio.sleep(0)  # let Serve's probes of the new replicas land
    request = FakeRequest([generation(shared)], FakeMetadata("r1"))
    assert _ids(await router.choose_replicas([b, a], request)) == [["a"], ["b"]]
    router.on_request_routed(request, b.replica_id, None)
    assert router.policy.load(b.replica_id) == 1
    assert router.policy.index.matched_pages(b.replica_id, shared) == 10
    router.on_request_completed(b.replica_id, "r1")
    assert router.policy.load(b.replica_id) == 0
    # A new report (a new stats object) replaces what ``a`` is believed to hold.
    a.routing_stats = {"load": 0, "page_hashes": []}
    assert _ids(await router.choose_replicas([a, b], request)) == [["b"], ["a"]]
    # A stats call (no dict argument) ranks by load; a full queue spills to the last rank.
    router.replica_queue_len_cache.update(b.replica_id, 64)
    stats_call = FakeRequest([], FakeMetadata("s"))
    assert _ids(await router.choose_replicas([b, a], stats_call)) == [["a"], ["b"]]
    router.update_replicas([b])
    assert router.policy.index.replicas() == [b.replica_id]
    router.on_replica_actor_died(b.replica_id)
    assert router.policy.index.replicas() == []
    assert await router.choose_replicas([], None) == []
    router.initialize_state(max_load=0)  # invalid: logged, defaults used (never hang Serve)
    assert router.policy.settings == RouterSettings()


def test_router_adapter_ranks_by_reported_pages_and_tracks_requests() -> None:
    """The RequestRouter subclass on fake replicas: Serve's base class runs, no cluster."""
    asyncio.run(_adapter_scenario())


async def _finished_request_scenario() -> None:
    router = _router()
    prompt = pages(2, 2)
    a = FakeReplica("a", {"load": 0, "page_hashes": []})
    router.update_replicas([a])
    await asyncio.sleep(0)
    generate = GenerationRequest(prompt_ids=(1,), max_new_tokens=1, n=2, page_hashes=tuple(prompt))
    request = FakeRequest([generate], FakeMetadata("internal"))
    await router.choose_replicas([a], request)
    assert router.policy.load(a.replica_id) == 2  # its two choices, before dispatch
    router.on_request_routed(request, a.replica_id, None)
    assert router.policy.load(a.replica_id) == 2
    router.on_request_completed(a.replica_id, "internal")
    # a report taken while it ran (its 2 choices) arrives after its completion
    a.routing_stats = {"load": 2, "active_requests": {generate.request_id: 2}, "page_hashes": []}
    await router.choose_replicas([a], None)  # reads the new report, places nothing
    assert router.policy.load(a.replica_id) == 0


def test_router_adapter_takes_its_finished_requests_off_late_reports() -> None:
    """The adapter hands the policy each request's id and choices as the replica lists them."""
    asyncio.run(_finished_request_scenario())


def test_request_hashes_reads_the_first_argument() -> None:
    meta = FakeMetadata("x")
    assert request_hashes(None) == ()
    assert request_hashes(FakeRequest([generation([1, 2])], meta)) == (1, 2)  # type: ignore[arg-type]
    assert request_hashes(FakeRequest(["text"], meta)) == ()  # type: ignore[arg-type]
    assert request_hashes(FakeRequest([{"page_hashes": [1]}], meta)) == ()  # type: ignore[arg-type]


# -- simulation: 2 replicas with LRU page caches -----------------------------------------------


class SimReplica:
    """A replica's page cache: LRU of fixed size, tail-first eviction like the engine's."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.requests = 0

    def serve(self, hashes: Sequence[int]) -> int:
        hits = 0
        while hits < len(hashes) and hashes[hits] in self.cache:
            hits += 1
        for page in reversed(hashes):  # the root ends up most recent
            self.cache[page] = None
            self.cache.move_to_end(page)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        self.requests += 1
        return hits

    def report(self) -> list[int]:
        return list(reversed(self.cache))  # most recent first, as LLMServer reports


class PowerOfTwo:
    """Ray's default: two random replicas, the less loaded one (ties random)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.loads: dict[Hashable, int] = {}

    def choose(
        self, token: Hashable, replicas: Sequence[Hashable], hashes: Sequence[int]
    ) -> list[Hashable]:
        two = self.rng.sample(list(replicas), 2)
        return sorted(two, key=lambda r: (self.loads.get(r, 0), self.rng.random()))

    def routed(
        self, replica: Hashable, request_id: Hashable, hashes: Sequence[int], token: Any = None
    ) -> None:
        self.loads[replica] = self.loads.get(replica, 0) + 1

    def completed(self, replica: Hashable, request_id: Hashable) -> None:
        self.loads[replica] -= 1

    def report(self, replica: Hashable, stats: dict[str, Any]) -> None:
        pass


def shared_prefix_workload(
    groups: int = 8, per_group: int = 8, prefix_pages: int = 32, tail_pages: int = 2
) -> list[list[int]]:
    """Interleaved requests sharing a long prefix per group: rounds of one request per group,
    in a shuffled order (a strictly periodic order would let pow2's alternation pin groups)."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(4, 4096) for _ in range(prefix_pages * PAGE)] for _ in range(groups)]
    prompts = []
    for _ in range(per_group):
        for prefix in rng.sample(prefixes, len(prefixes)):
            tail = [rng.randrange(4, 4096) for _ in range(tail_pages * PAGE + 5)]
            prompts.append(prefix_hashes(prefix + tail, PAGE))
    return prompts


def ideal_cached_pages(prompts: Sequence[Sequence[int]]) -> int:
    """One unbounded cache: each request reuses its longest prefix seen before."""
    seen: set[int] = set()
    total = 0
    for hashes in prompts:
        run = 0
        while run < len(hashes) and hashes[run] in seen:
            run += 1
        total += run
        seen.update(hashes)
    return total


def simulate(
    router: Any,
    prompts: Sequence[Sequence[int]],
    clock: FakeClock,
    capacity: int = 160,
    concurrency: int = 4,
    report_every: int = 5,
    burst: int = 2,
) -> tuple[int, list[int]]:
    """Route every prompt; at most ``concurrency`` in flight (the oldest completes first);
    replicas report their hashes and load every ``report_every`` requests. Requests arrive in
    bursts of ``burst``, all chosen before any is dispatched (as Serve's concurrent routing
    tasks do)."""
    replicas = {name: SimReplica(capacity) for name in ("r0", "r1")}
    in_flight: list[tuple[str, int]] = []
    cached = 0
    for first in range(0, len(prompts), burst):
        chosen = []
        for i in range(first, min(first + burst, len(prompts))):
            clock.now += 0.1
            if len(in_flight) >= concurrency:
                router.completed(*in_flight.pop(0))
            if i % report_every == 0:
                for name, replica in replicas.items():
                    load = sum(1 for r, _ in in_flight if r == name)
                    router.report(name, {"load": load, "page_hashes": replica.report()})
            chosen.append((i, router.choose(i, list(replicas), prompts[i])[0]))
        for i, replica in chosen:
            router.routed(replica, i, prompts[i], token=i)
            in_flight.append((replica, i))
            cached += replicas[replica].serve(prompts[i])
    return cached, [r.requests for r in replicas.values()]


def test_simulation_prefix_routing_is_near_ideal_and_balanced(
    record_property: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = shared_prefix_workload()
    ideal = ideal_cached_pages(prompts)
    clock = FakeClock()
    prefix_cached, prefix_counts = simulate(
        PrefixPolicy(clock=clock, rng=random.Random(0)), prompts, clock
    )
    pow2_cached, pow2_counts = simulate(PowerOfTwo(random.Random(0)), prompts, FakeClock())
    record_property("ideal_cached_pages", ideal)
    record_property("prefix_cached_pages", prefix_cached)
    record_property("pow2_cached_pages", pow2_cached)
    with capsys.disabled():
        print(
            f"\nsimulation: ideal {ideal} pages; prefix {prefix_cached} "
            f"({prefix_cached / ideal:.0%}) requests {prefix_counts}; "
            f"pow2 {pow2_cached} ({pow2_cached / ideal:.0%}) requests {pow2_counts}"
        )
    assert prefix_cached >= 0.8 * ideal
    assert max(prefix_counts) <= 1.5 * min(prefix_counts)
    # Each pow2 replica sees all 8 prefixes, more than its cache holds: LRU thrashes.
    assert pow2_cached <= 0.6 * prefix_cached
