"""Prefix-aware request routing for ``LLMServer`` replicas (see DESIGN.md section 6).

The ingress sends each request (an ``engine.request.GenerationRequest``) with ``page_hashes``:
the chained hashes of its prompt's full pages (``engine.cache.prefix_hash``), the same keys the
replicas' page tables use. The router believes a replica holds a page when

* this router sent it a request with that page that is still in flight, or finished less than
  ``routed_grace_s`` before the replica's latest report (optimistic: the replica is computing
  it, and its scheduler makes concurrent requests on a shared prefix wait for it), or
* the replica said so in its last ``record_routing_stats`` report (exact, but up to ~1 s old).

A report's load lists the requests it counts, so this router's requests that have ended since
stop counting at once (``deployments.load_report``).

It ranks replicas by ``uncached pages * prefix_weight + load * load_weight`` and spills a
replica whose load exceeds ``max_load`` (or whose queue is full) to a later rank, so a hot
prefix is replicated instead of piling onto one replica. A prompt new to every replica is
placed by recent traffic (then load), so prefixes, and with them their followers, spread evenly.

Layers, so most of it is testable without Ray:

* ``deployments.prefix_index.PrefixIndex``: pure, bounded per-replica belief of cached pages.
* ``deployments.prefix_index.rank_candidates``: pure scoring.
* ``deployments.prefix_index.PrefixPolicy``: pure; index + in-flight + loads -> ranking.
* ``PrefixAwareRouter``: the thin Ray Serve ``RequestRouter`` adapter.

State is per router instance (one per handle per process). With one ingress replica that is
exact; with several ingress replicas each learns from its own traffic plus the shared reports.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments import routing_audit
from deployments.prefix_index import PrefixPolicy
from deployments.router_settings import RouterSettings
from engine.request import GenerationRequest

logger = logging.getLogger("ray.serve")


# -- the Ray Serve adapter ---------------------------------------------------------------------


def generation_request(pending_request: PendingRequest | None) -> GenerationRequest | None:
    """The request of an ``LLMServer.generate(request)`` call; None for any other call."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerationRequest) else None


def request_hashes(pending_request: PendingRequest | None) -> tuple[int, ...]:
    """``page_hashes`` of an ``LLMServer.generate(request)`` call; () for any other call."""
    request = generation_request(pending_request)
    return request.page_hashes if request is not None else ()


class PrefixAwareRouter(RequestRouter):
    """Ranks replicas by uncached prompt pages and load; see the module docstring.

    Every hook runs on the router's event loop (Serve schedules completion callbacks there),
    so the policy needs no locks, and ``choose_replicas`` never awaits.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup(RouterSettings())

    def _setup(self, settings: RouterSettings) -> None:
        self.policy = PrefixPolicy(settings)
        # Last routing_stats object ingested per replica: Serve replaces the dict when a new
        # report arrives, so an identity check skips re-reading an unchanged one.
        self._seen_stats: dict[ReplicaID, object] = {}

    def initialize_state(self, **kwargs: Any) -> None:
        try:
            settings = RouterSettings.from_kwargs(kwargs)
        except ValueError:
            # Raising here would leave Serve's handle waiting forever for a router; serve with
            # the defaults and say so loudly (build_app should validate presets up front).
            logger.exception("PrefixAwareRouter: bad request_router_kwargs; using defaults")
            settings = RouterSettings()
        self._setup(settings)
        logger.info("PrefixAwareRouter: %s", settings)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        for replica in candidate_replicas:
            self._refresh(replica)
        by_id = {r.replica_id: r for r in candidate_replicas}
        hashes = request_hashes(pending_request)
        if pending_request is None:
            order = self.policy.rank(list(by_id), hashes, self._queue_full)
        else:  # the same PendingRequest object comes back in on_request_routed
            token = id(pending_request)
            request = generation_request(pending_request)
            order = self.policy.choose(
                token, list(by_id), hashes, self._queue_full, request.n if request else 1.0
            )
        # One replica per rank: the order is the decision; Serve moves to the next rank only
        # when a replica rejects (its queue is full).
        return [[by_id[replica_id]] for replica_id in order]

    def _refresh(self, replica: RunningReplica) -> None:
        stats = replica.routing_stats
        if not stats or self._seen_stats.get(replica.replica_id) is stats:
            return
        self._seen_stats[replica.replica_id] = stats
        self.policy.report(replica.replica_id, stats)

    def _queue_full(self, replica_id: ReplicaID) -> bool:
        replica = self.curr_replicas.get(replica_id)
        queue_len = self.replica_queue_len_cache.get(replica_id)
        return (
            replica is not None
            and queue_len is not None
            and (queue_len >= replica.max_ongoing_requests)
        )

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        request_id = pending_request.metadata.internal_request_id
        hashes = request_hashes(pending_request)
        request = generation_request(pending_request)
        predicted = self.policy.routed(
            replica_id,
            request_id,
            hashes,
            token=id(pending_request),
            key=request.request_id if request else None,  # as the replica's reports list it
            choices=request.n if request else 1.0,
        )
        if hashes:  # explain the decision: /v1/stats compares it with the replica's cache use
            routing_audit.predict(request.request_id, replica_id.unique_id, len(hashes), predicted)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.policy.completed(replica_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.info("PrefixAwareRouter: %s died, forgetting it", replica_id)
        self.policy.forget(replica_id)
        self._seen_stats.pop(replica_id, None)

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        # Possibly gone (or restarting without its cache): stop believing it holds anything.
        # ``_seen_stats`` stays, so only a *new* report (the replica is fine) restores it.
        super().on_replica_actor_unavailable(replica_id)
        logger.info("PrefixAwareRouter: %s unavailable, forgetting its pages", replica_id)
        self.policy.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        self.policy.retain(live)
        for replica_id in [r for r in self._seen_stats if r not in live]:
            del self._seen_stats[replica_id]
