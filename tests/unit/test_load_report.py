"""A replica's routing-report load and the router's account of it (``deployments.load_report``),
alone and through ``PrefixPolicy``: a request of this router that ends after a report was
taken stops counting at once, by its id, whichever of its end and the report comes first."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from deployments import load_report
from deployments.load_report import (
    FINISHED_MEMORY_S,
    ActiveRequests,
    ReportedLoad,
    parse_active_requests,
)
from deployments.prefix_index import FLIGHT_TTL_S, PrefixPolicy
from tests.serve.test_routing import FakeClock, pages

# -- the replica's ledger ----------------------------------------------------------------------


def test_ledger_counts_choices_by_request_id() -> None:
    ledger = ActiveRequests()
    assert ledger.report() == {
        "load": 0,
        "active_requests": {},
        "active_requests_truncated": False,
    }
    ledger.start("a", 1)
    ledger.start("b", 3)  # n = 3 choices: three engine jobs
    ledger.start("a", 1)  # the same id twice (two calls)
    assert ledger.report()["load"] == 5
    assert ledger.report()["active_requests"] == {"a": 2, "b": 3}
    ledger.end("a", 1)
    ledger.end("b", 3)
    assert ledger.report()["active_requests"] == {"a": 1}
    ledger.end("a", 1)
    ledger.end("never started", 1)  # no error, nothing negative
    assert ledger.report() == {
        "load": 0,
        "active_requests": {},
        "active_requests_truncated": False,
    }


def test_ledger_truncates_its_list_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_report, "ACTIVE_REQUEST_LIMIT", 2)
    ledger = ActiveRequests()
    for name in "abc":
        ledger.start(name, 1)
    report = ledger.report()
    assert report["load"] == 3  # the load still counts every request
    assert len(report["active_requests"]) == 2 and report["active_requests_truncated"]
    assert parse_active_requests(report) is None  # the router falls back to timing


@pytest.mark.parametrize(
    "stats",
    [
        {"load": 1},
        {"load": 1, "active_requests": ["a"]},
        {"load": 1, "active_requests": {"a": -1}},
        {"load": 1, "active_requests": {"a": True}},
        {"load": 1, "active_requests": {"a": float("nan")}},
        {"load": 1, "active_requests": {"a": "1"}},
        {"load": 1, "active_requests": {"a": 1}, "active_requests_truncated": True},
    ],
)
def test_a_missing_truncated_or_malformed_list_is_no_list(stats: dict) -> None:
    assert parse_active_requests(stats) is None


def test_a_well_formed_list_parses_to_weights() -> None:
    stats = {"active_requests": {"a": 1, "b": 2.0}, "active_requests_truncated": False}
    assert parse_active_requests(stats) == {"a": 1.0, "b": 2.0}


# -- the router's account ----------------------------------------------------------------------


def test_a_request_that_ended_before_the_report_arrived_is_taken_off_it() -> None:
    reported = ReportedLoad()
    reported.finished("mine", 1.0, dispatched_at=0.0, now=1.0)  # no report yet
    reported.report(3.0, {"mine": 1.0, "other": 2.0}, now=1.5)  # taken while "mine" ran
    assert reported.load == 2.0  # only the other router's two jobs
    reported.report(3.0, {"mine": 1.0, "other": 2.0}, now=2.0)  # an even older one
    assert reported.load == 2.0


def test_a_request_that_ends_after_the_report_arrived_is_taken_off_once() -> None:
    reported = ReportedLoad()
    reported.report(4.0, {"mine": 3.0, "other": 1.0}, now=1.0)
    reported.finished("mine", 3.0, dispatched_at=0.5, now=1.2)
    assert reported.load == 1.0
    reported.finished("mine", 3.0, dispatched_at=0.6, now=1.3)  # listed once: nothing more
    assert reported.load == 1.0


def test_a_request_the_report_did_not_list_is_not_taken_off() -> None:
    """Dispatched before the report arrived, but it reached the replica after the report was
    taken: the timing rule subtracted it, undercounting another router's request."""
    reported = ReportedLoad()
    reported.report(1.0, {"other": 1.0}, now=1.0)
    reported.finished("mine", 1.0, dispatched_at=0.9, now=1.1)
    assert reported.load == 1.0


def test_without_a_list_the_timing_rule_applies() -> None:
    reported = ReportedLoad()
    reported.report(2.0, None, now=1.0)
    reported.finished("late", 1.0, dispatched_at=1.5, now=1.6)  # dispatched after it came
    assert reported.load == 2.0
    reported.finished("early", 1.0, dispatched_at=0.5, now=1.7)
    assert reported.load == 1.0


def test_ended_requests_are_remembered_for_a_bounded_time() -> None:
    reported = ReportedLoad()
    reported.finished("mine", 1.0, dispatched_at=0.0, now=1.0)
    reported.report(1.0, {"mine": 1.0}, now=1.0 + FINISHED_MEMORY_S + 0.1)
    assert reported.load == 1.0  # forgotten: counted until the replica's next report
    for i in range(load_report.FINISHED_MEMORY_ENTRIES + 10):
        reported.finished(i, 1.0, dispatched_at=0.0, now=20.0)
    assert len(reported._finished) == load_report.FINISHED_MEMORY_ENTRIES


# -- through the policy ------------------------------------------------------------------------


def test_a_follow_up_goes_back_to_the_replica_of_its_short_prefix() -> None:
    """The race: a 2-page request ends, then a report taken while it ran arrives. Load weighs
    4 pages, so a stale load of 1 sent the follow-up to the replica without its prefix."""
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock, rng=random.Random(0))
    prompt = pages(7, 2)
    first = policy.rank(["a", "b"], prompt)[0]
    other = "b" if first == "a" else "a"
    policy.routed(first, "internal-1", prompt, key="turn-1")
    clock.now += 0.2
    policy.completed(first, "internal-1")
    clock.now += 0.3
    policy.report(first, {"load": 1, "active_requests": {"turn-1": 1}})
    assert policy.load(first) == 0.0
    assert policy.rank([other, first], prompt)[0] == first


def test_another_routers_requests_stay_counted() -> None:
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock)
    policy.routed("a", "internal-1", [], key="mine")
    policy.report("a", {"load": 3, "active_requests": {"mine": 1, "theirs": 2}})
    policy.completed("a", "internal-1")
    assert policy.load("a") == 2.0
    # a request routed after that report, not in it, ending: the report is unchanged
    policy.routed("a", "internal-2", [], key="new")
    clock.now += 0.1
    policy.completed("a", "internal-2")
    assert policy.load("a") == 2.0


def test_this_routers_requests_and_anothers_add_up() -> None:
    """Two ingress replicas (two routers) on one replica: the larger of the two counts
    undercounted the replica whenever both had requests there."""
    policy = PrefixPolicy(clock=FakeClock())
    for i in range(3):
        policy.routed("a", f"internal-{i}", [], key=f"mine-{i}")
    report = {f"mine-{i}": 1 for i in range(3)} | {"theirs-0": 2, "theirs-1": 1}
    policy.report("a", {"load": 6, "active_requests": report})
    assert policy.load("a") == 6.0  # our three once, not twice
    for i in range(3, 5):
        policy.routed("a", f"internal-{i}", [], key=f"mine-{i}")
    assert policy.load("a") == 8.0  # max(5, 6) said 6


def test_a_requests_choices_count_as_jobs_from_choice_to_completion() -> None:
    """The reports count a request's n choices as n jobs; this router does too, from the
    moment it chooses a replica (before Serve dispatches) to the completion."""
    policy = PrefixPolicy(clock=FakeClock())
    assert policy.choose("token", ["a"], [], choices=3) == ["a"]
    assert policy.load("a") == 3.0
    policy.routed("a", "internal", [], token="token", key="req", choices=3)
    assert policy.load("a") == 3.0
    policy.report("a", {"load": 3, "active_requests": {"req": 3}})
    assert policy.load("a") == 3.0  # ours, once
    policy.completed("a", "internal")
    assert policy.load("a") == 0.0


def test_an_expired_record_leaves_the_report_counting_its_request() -> None:
    """No completion within FLIGHT_TTL_S: the request may still run, and the replica's report
    keeps counting it (a completion would have taken it off)."""
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock)
    policy.routed("a", "internal-1", [], key="long")
    policy.report("a", {"load": 1, "active_requests": {"long": 1}})
    clock.now += FLIGHT_TTL_S + 10
    policy.routed("b", "internal-2", [])  # any routing call runs the expiry
    assert policy.load("a") == 1.0


# -- a replica, this router and another, with reports delivered late, at random -------------


@dataclass
class Trace:
    """This router's requests on one replica (dispatched, run, ended, completion seen) and
    another router's, which this one never sees but in the replica's reports."""

    rng: random.Random
    ledger: ActiveRequests = field(default_factory=ActiveRequests)
    in_transit: list[tuple[str, int]] = field(default_factory=list)  # dispatched, not arrived
    running: list[tuple[str, int]] = field(default_factory=list)
    ended: list[tuple[str, int]] = field(default_factory=list)  # completion not yet seen
    theirs: list[tuple[str, int]] = field(default_factory=list)  # the other router's, running
    reports: list[dict] = field(default_factory=list)  # taken, not yet delivered
    in_flight: int = 0  # this router's jobs: dispatched, completion not yet seen


def _step(trace: Trace, policy: PrefixPolicy, clock: FakeClock, i: int) -> dict | None:
    """One random event; returns the report delivered, if that was the event."""
    clock.now += 0.02 * trace.rng.random()  # 400 events: reports stay within memory
    event, rng = trace.rng.randrange(8), trace.rng
    if event == 0:  # this router dispatches a request (1 to 3 choices)
        key, n = f"mine-{i}", rng.randint(1, 3)
        policy.routed("r", f"internal-{i}", [], key=key, choices=n)
        trace.in_transit.append((key, n))
        trace.in_flight += n
    elif event == 1 and trace.in_transit:  # it arrives at the replica
        key, n = trace.in_transit.pop(0)
        trace.ledger.start(key, n)
        trace.running.append((key, n))
    elif event == 2 and trace.running:  # it ends there
        key, n = trace.running.pop(rng.randrange(len(trace.running)))
        trace.ledger.end(key, n)
        trace.ended.append((key, n))
    elif event == 3 and trace.ended:  # this router sees the completion
        key, n = trace.ended.pop(0)
        policy.completed("r", key.replace("mine", "internal"))
        trace.in_flight -= n
    elif event == 4:  # the other router's request starts there
        key, n = f"theirs-{i}", rng.randint(1, 3)
        trace.ledger.start(key, n)
        trace.theirs.append((key, n))
    elif event == 5 and trace.theirs:  # and ends
        trace.ledger.end(*trace.theirs.pop(rng.randrange(len(trace.theirs))))
    elif event == 6:  # the replica takes a report
        trace.reports.append(trace.ledger.report())
    elif event == 7 and trace.reports:  # the oldest report reaches the router
        report = trace.reports.pop(0)
        policy.report("r", report)
        return report
    return None


@pytest.mark.parametrize("seed", range(20))
def test_load_is_this_routers_requests_plus_the_others_in_the_last_report(seed: int) -> None:
    """After every event: the jobs of this router's requests whose completion it has not
    seen, plus the other router's jobs that the last delivered report listed. Nothing stale, nothing
    counted twice, nothing of the other router's lost while this one's come and go."""
    clock = FakeClock()
    policy = PrefixPolicy(clock=clock)
    trace = Trace(random.Random(seed))
    last: dict | None = None
    for i in range(400):
        last = _step(trace, policy, clock, i) or last
        listed = last["active_requests"] if last else {}
        theirs = sum(n for key, n in listed.items() if key.startswith("theirs"))
        assert policy.load("r") == trace.in_flight + theirs, (seed, i)
