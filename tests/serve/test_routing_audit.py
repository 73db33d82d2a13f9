"""Predicted vs actual cache hits: the router's beliefs recorded per decision and compared with
what the replica's cache supplied (pure parts and the Serve adapter, no cluster)."""

from __future__ import annotations

import asyncio
import random

from deployments import routing_audit
from deployments.prefix_index import PrefixPolicy
from deployments.routing_audit import RoutingAudit
from tests.serve.test_routing import FakeMetadata, FakeReplica, FakeRequest, _router, generation


def pages(prefix: int, n: int) -> list[int]:
    return [prefix * 1000 + i for i in range(n)]


def test_audit_totals_and_rates_per_replica() -> None:
    audit = RoutingAudit()
    audit.predict("r1", "a", prompt_pages=10, predicted=8)
    audit.predict("r2", "a", prompt_pages=10, predicted=0)
    audit.predict("r3", "b", prompt_pages=4, predicted=4)
    audit.observe("r1", 8)
    audit.observe("r2", 2)  # the router missed sharing it could have had
    audit.observe("r3", 0)  # the router believed a page that was gone (stale)
    audit.observe("unknown", 5)  # placed by another router: not counted
    summary = audit.summary()
    assert summary["a"]["requests"] == 2
    assert (summary["a"]["predicted_pages"], summary["a"]["actual_pages"]) == (8, 10)
    assert (summary["a"]["predicted_hits"], summary["a"]["actual_hits"]) == (1, 2)
    assert summary["a"]["predicted_hit_rate"] == 0.4 and summary["a"]["actual_hit_rate"] == 0.5
    assert (summary["b"]["predicted_pages"], summary["b"]["actual_pages"]) == (4, 0)
    assert audit.pending() == 0


def test_audit_is_bounded_in_pending_predictions_and_replicas() -> None:
    audit = RoutingAudit(max_pending=3, max_replicas=2)
    for i in range(10):
        audit.predict(f"r{i}", f"replica{i % 4}", 2, 1)
    assert audit.pending() == 3  # the oldest (never observed: failed requests) were dropped
    audit.observe("r0", 1)  # dropped: ignored
    for i in (7, 8, 9):
        audit.observe(f"r{i}", 1)
    assert set(audit.summary()) == {"replica0", "replica1"}  # the two most recently seen


def test_policy_reports_the_prediction_for_the_replica_it_dispatched_to() -> None:
    policy = PrefixPolicy(rng=random.Random(0))
    hot = pages(1, 6)
    first = policy.choose("t1", ["a", "b"], hot)[0]
    assert policy.routed(first, "r1", hot, token="t1") == 0  # nobody held it
    policy.completed(first, "r1")
    ranked = policy.choose("t2", ["a", "b"], hot)
    assert ranked[0] == first
    # Serve found the first rank full and dispatched to the second: its own belief counts.
    assert policy.routed(ranked[1], "r2", hot, token="t2") == 0
    assert policy.routed(first, "r3", hot) == 6  # no token: the index's belief at dispatch


async def _adapter_records_predictions() -> None:
    router = _router()
    shared = pages(7, 10)
    a = FakeReplica("audit-a", {"load": 0, "page_hashes": shared[:8]})
    b = FakeReplica("audit-b", {"load": 0, "page_hashes": []})
    router.update_replicas([a, b])
    await asyncio.sleep(0)
    request = FakeRequest([generation(shared)], FakeMetadata("x1"))
    await router.choose_replicas([a, b], request)
    router.on_request_routed(request, a.replica_id, None)
    routing_audit.observe(request.args[0].request_id, 7)
    totals = routing_audit.summary()["audit-a"]
    assert (totals["prompt_pages"], totals["predicted_pages"], totals["actual_pages"]) == (10, 8, 7)
    no_pages = FakeRequest([generation([])], FakeMetadata("x2"))
    await router.choose_replicas([a, b], no_pages)
    router.on_request_routed(no_pages, b.replica_id, None)
    assert "audit-b" not in routing_audit.summary()  # nothing to predict, nothing recorded


def test_router_adapter_records_its_prediction_per_request() -> None:
    asyncio.run(_adapter_records_predictions())
