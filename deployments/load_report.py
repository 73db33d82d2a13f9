"""A replica's load as it reports it to the prefix-aware router, and the router's account of it.

The replica (``ActiveRequests``) reports its load as the choices of the ``generate`` calls it
holds, and lists those calls by request id. A report reaches the router up to about a second
after it was taken, so it may still count a request that has ended since: the router saw that
request complete first. ``ReportedLoad`` takes exactly such requests off, by id, whether their
completion came before the report (ids it remembers ending) or after it (ids the report lists).
Without the list, a finished request of one replica's traffic kept it looking busy until the
next report, and a follow-up on a short shared prompt went to another replica.

The list also tells this router's requests from other routers' (another ingress replica, a
batch driver): a replica's load is this router's own count, which is fresh, plus the others'
from the report, instead of the larger of the two, which undercounted whenever both had some.

Pure (no Ray, no torch): ``deployments.llm_server`` and ``deployments.prefix_index`` use it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Hashable, Mapping
from typing import Any

# At most this many request ids per report. A replica holds at most its
# ``max_ongoing_requests`` (64 in the presets), so the list is complete in practice; a
# truncated one falls back to the timing rule (``ReportedLoad.finished``).
ACTIVE_REQUEST_LIMIT = 1024
# How long the router remembers a request of its own that ended, to take it off a report that
# was taken before it ended but arrives after. Reports are at most ~1.5 s old when they arrive.
FINISHED_MEMORY_S = 10.0
FINISHED_MEMORY_ENTRIES = 4096


class ActiveRequests:
    """The replica's ledger: request id -> choices held, for its routing reports."""

    def __init__(self) -> None:
        self._choices: Counter[str] = Counter()

    def start(self, request_id: str, choices: int) -> None:
        self._choices[request_id] += choices

    def end(self, request_id: str, choices: int) -> None:
        left = self._choices.pop(request_id, 0) - choices
        if left > 0:
            self._choices[request_id] = left

    def load(self) -> int:
        """The choices (engine jobs) of every ``generate`` call held now."""
        return sum(self._choices.values())

    def report(self) -> dict[str, Any]:
        """``load``, ``active_requests`` (id -> choices) and ``active_requests_truncated``."""
        listed = dict(self._choices.most_common(ACTIVE_REQUEST_LIMIT))
        return {
            "load": self.load(),
            "active_requests": listed,
            "active_requests_truncated": len(listed) < len(self._choices),
        }


def parse_active_requests(stats: Mapping[str, Any]) -> dict[Hashable, float] | None:
    """A report's complete request list (id -> choices), or None when it has none, it is
    truncated or it is malformed (then the router falls back to the timing rule)."""
    listed = stats.get("active_requests")
    if not isinstance(listed, dict) or stats.get("active_requests_truncated", False):
        return None
    weights: dict[Hashable, float] = {}
    for key, weight in listed.items():
        if not _is_count(weight):
            return None
        weights[key] = float(weight)
    return weights


def _is_count(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


class ReportedLoad:
    """One replica's last reported load, as this router accounts for it.

    With the report's request list, the load splits exactly: this router's own requests
    there (which it counts itself, fresh) and everyone else's, which is the list less this
    router's requests in it, the ended ones included (``others``). Without one (a truncated
    or an older replica's report), the report's load less the requests it is taken to have
    counted that have ended since."""

    __slots__ = ("_counted", "_finished", "_mine", "at", "load")

    def __init__(self) -> None:
        self.load = 0.0  # the last report's load, less this router's requests ended since
        self.at = 0.0  # when the last report arrived (router clock)
        # The last report's request list, less what has been taken off it; None: no list.
        self._counted: dict[Hashable, float] | None = None
        # this router's requests there that have not ended, by id: choices
        self._mine: Counter[Hashable] = Counter()
        # (when, request id, choices) of this router's requests there that ended
        self._finished: deque[tuple[float, Hashable, float]] = deque(maxlen=FINISHED_MEMORY_ENTRIES)

    def report(self, load: float, counted: dict[Hashable, float] | None, now: float) -> None:
        """A new report: ``counted`` is its request list (``parse_active_requests``)."""
        self.at, self._counted = now, counted
        self.load = load
        if counted is None:
            return
        self._forget_before(now - FINISHED_MEMORY_S)
        for _, key, choices in self._finished:  # ended before this report arrived
            self._take_off(key, choices)

    def others(self) -> float | None:
        """The jobs of other routers' requests that the last report counted; None when it
        had no request list."""
        if self._counted is None:
            return None
        mine = sum(min(w, self._mine[k]) for k, w in self._counted.items() if k in self._mine)
        return max(self.load - mine, 0.0)

    def dispatched(self, key: Hashable | None, choices: float) -> None:
        """This router sent a request there (``key``: its id in the replica's list)."""
        if key is not None:
            self._mine[key] += choices

    def finished(
        self,
        key: Hashable | None,
        choices: float,
        dispatched_at: float,
        now: float,
        ended: bool = True,
    ) -> None:
        """A request this router sent there ended; ``ended`` False: it is no longer tracked
        (its completion never came), so the reports count it as anyone's."""
        if key is not None:
            left = self._mine.pop(key, 0.0) - choices
            if left > 0:
                self._mine[key] = left
        if not ended:
            return
        if key is not None:
            self._finished.append((now, key, choices))
        if self._counted is not None:
            if key is not None:
                self._take_off(key, choices)
            return
        # No request list: a report that arrived after the request was dispatched is taken to
        # have counted it (it may not have, if taken before the request arrived there).
        if self.load and dispatched_at <= self.at:
            self.load = max(self.load - 1.0, 0.0)

    def _take_off(self, key: Hashable, choices: float) -> None:
        counted = self._counted
        listed = counted.get(key, 0.0) if counted is not None else 0.0
        if listed <= 0.0:
            return
        taken = min(listed, choices)
        counted[key] = listed - taken
        self.load = max(self.load - taken, 0.0)

    def _forget_before(self, cutoff: float) -> None:
        while self._finished and self._finished[0][0] < cutoff:
            self._finished.popleft()
