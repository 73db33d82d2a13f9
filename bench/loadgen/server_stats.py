"""The server's ``GET /v1/stats`` (one entry per replica) and the after-run leak check.

After the last request the replicas should hold no job and reference no KV page: cancelled
streams free their pages at once, finished ones at their end. Cached pages (unreferenced,
kept for prefix reuse) are not a leak. Cancellation travels asynchronously (client -> proxy ->
ingress -> replica), so the check polls for a while before calling what it sees a leak.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

# Keys of a replica's stats shown in the report (others are kept in the JSON as they come).
REPLICA_KEYS = (
    "pages_in_use",
    "pages_cached",
    "pages_free",
    "pages_total",
    "jobs_running",
    "jobs_waiting",
    "requests_active",
    "requests_served",
    "preemptions",
    "evictions",
)
BUSY_KEYS = ("pages_in_use", "jobs_running", "jobs_waiting", "requests_active")
STATS_TIMEOUT_S = 30.0


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    timeout = aiohttp.ClientTimeout(total=STATS_TIMEOUT_S)
    async with session.get(url, timeout=timeout) as response:
        response.raise_for_status()
        return await response.json()


async def replica_stats(session: aiohttp.ClientSession, base_url: str) -> list[dict[str, Any]]:
    """Each replica's stats (the order Serve returns them in; sorted by nothing stable)."""
    body = await get_json(session, f"{base_url}/v1/stats")
    return list(body.get("replicas", []))


def busy(replicas: list[dict[str, Any]]) -> dict[str, int]:
    """What is still held, summed over replicas: only keys with a non-zero value."""
    totals = {key: sum(int(r.get(key, 0) or 0) for r in replicas) for key in BUSY_KEYS}
    return {key: value for key, value in totals.items() if value}


@dataclass
class SettleResult:
    """The last stats seen, whether the replicas were idle then, and how long that took."""

    replicas: list[dict[str, Any]]
    settled: bool
    waited_s: float
    held: dict[str, int]


async def settle(base_url: str, timeout_s: float, poll_s: float = 0.5) -> SettleResult:
    """Poll ``/v1/stats`` until no replica holds a job or a referenced page, or ``timeout_s``."""
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while True:
            replicas = await replica_stats(session, base_url)
            held = busy(replicas)
            waited = time.perf_counter() - start
            if not held or waited >= timeout_s:
                return SettleResult(replicas, not held, waited, held)
            await asyncio.sleep(poll_s)
