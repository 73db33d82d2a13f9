"""Predicted vs actual prefix-cache hits, per replica: every routing decision explained.

The prefix-aware router runs in the ingress's process (it belongs to the ingress's handle), so
both write to one process-wide audit (``predict``, ``observe``, ``summary``): the router
records, when Serve dispatches a request, how many of its prompt pages it believed the chosen
replica held; the ingress records, when the request's first choice finishes, how many the
replica really had cached. ``/v1/stats`` shows the totals per replica, so a router whose
beliefs drift from the replicas' caches shows up as predicted > actual (stale beliefs) or
predicted < actual (missed sharing).

Pure and bounded: at most ``max_pending`` predictions wait for their outcome (the oldest are
dropped, e.g. for requests that failed), and totals are kept for at most ``max_replicas``
replicas (the least recently used go).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass


@dataclass
class ReplicaAudit:
    """Totals for one replica over the requests whose outcome was seen."""

    requests: int = 0
    prompt_pages: int = 0  # full prompt pages of those requests
    predicted_pages: int = 0  # pages the router believed cached there
    actual_pages: int = 0  # pages the replica's cache really supplied
    predicted_hits: int = 0  # requests predicted to reuse at least one page
    actual_hits: int = 0

    def as_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = asdict(self)
        pages = max(self.prompt_pages, 1)
        out["predicted_hit_rate"] = self.predicted_pages / pages
        out["actual_hit_rate"] = self.actual_pages / pages
        return out


@dataclass(frozen=True)
class _Prediction:
    replica: str
    prompt_pages: int
    predicted_pages: int


class RoutingAudit:
    """Thread-safe: the router's loop and the ingress's loop both write."""

    def __init__(self, max_pending: int = 10_000, max_replicas: int = 256) -> None:
        self.max_pending = max_pending
        self.max_replicas = max_replicas
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, _Prediction] = OrderedDict()
        self._replicas: OrderedDict[str, ReplicaAudit] = OrderedDict()

    def predict(self, request_id: str, replica: str, prompt_pages: int, predicted: int) -> None:
        """The router sent ``request_id`` to ``replica`` expecting ``predicted`` cached pages.
        A request routed twice (a retry) keeps its last placement."""
        with self._lock:
            self._pending[request_id] = _Prediction(replica, prompt_pages, predicted)
            self._pending.move_to_end(request_id)
            while len(self._pending) > self.max_pending:
                self._pending.popitem(last=False)

    def observe(self, request_id: str, actual_pages: int) -> None:
        """The request finished with ``actual_pages`` prompt pages read from the cache. A
        request the router did not place (another router, or none) is not counted."""
        with self._lock:
            prediction = self._pending.pop(request_id, None)
            if prediction is None:
                return
            totals = self._replicas.pop(prediction.replica, None) or ReplicaAudit()
            self._replicas[prediction.replica] = totals  # most recent last
            while len(self._replicas) > self.max_replicas:
                self._replicas.popitem(last=False)
            totals.requests += 1
            totals.prompt_pages += prediction.prompt_pages
            totals.predicted_pages += prediction.predicted_pages
            totals.actual_pages += actual_pages
            totals.predicted_hits += prediction.predicted_pages > 0
            totals.actual_hits += actual_pages > 0

    def summary(self) -> dict[str, dict[str, float | int]]:
        with self._lock:
            return {replica: totals.as_dict() for replica, totals in self._replicas.items()}

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)


# The process-wide audit, reached only through the functions below: the ingress class is
# pickled by value when Serve deploys it, and a module function is pickled by reference (a lock
# held in a global its code names would not pickle).
_AUDIT = RoutingAudit()


def predict(request_id: str, replica: str, prompt_pages: int, predicted: int) -> None:
    _AUDIT.predict(request_id, replica, prompt_pages, predicted)


def observe(request_id: str, actual_pages: int) -> None:
    _AUDIT.observe(request_id, actual_pages)


def summary() -> dict[str, dict[str, float | int]]:
    return _AUDIT.summary()
