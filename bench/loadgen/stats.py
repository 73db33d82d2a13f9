"""Percentiles and the summary of one load run (pure functions over ``RequestResult``s)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .client import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """One run in numbers. Throughput counts requests that finished ``ok`` (a disconnected
    request never gets its usage chunk, so its tokens are unknown); latencies count every
    request that saw content (``ok`` and ``disconnected``)."""

    requests: int
    ok: int
    disconnected: int
    errors: int
    errors_by_kind: dict[str, int]
    seconds: float
    requests_per_s: float
    generated_tokens: int
    tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    cached_fraction: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_samples: int
    tpot_p50_s: float | None  # per request: (last chunk - first chunk) / (tokens - 1)
    tpot_p99_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first (an ``ok`` request with >= 2 tokens)."""
    tokens = result.completion_tokens or 0
    if result.outcome != "ok" or tokens < 2 or len(result.chunk_s) < 2:
        return None
    return (result.chunk_s[-1] - result.chunk_s[0]) / (tokens - 1)


def summarize(results: Sequence[RequestResult], seconds: float) -> Summary:
    if seconds <= 0:
        raise ValueError(f"run seconds must be > 0, got {seconds}")
    ok = [r for r in results if r.outcome == "ok"]
    seen = [r for r in results if r.outcome in ("ok", "disconnected")]
    errors = Counter(r.error_kind for r in results if r.outcome == "error")
    generated = sum(r.completion_tokens or 0 for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttfts = [r.ttft_s for r in seen if r.ttft_s is not None]
    itls = [gap for r in seen for gap in r.itl_s]
    tpots = [t for t in map(tpot, ok) if t is not None]
    return Summary(
        requests=len(results),
        ok=len(ok),
        disconnected=sum(r.outcome == "disconnected" for r in results),
        errors=sum(errors.values()),
        errors_by_kind=dict(sorted(errors.items())),
        seconds=seconds,
        requests_per_s=len(ok) / seconds,
        generated_tokens=generated,
        tokens_per_s=generated / seconds,
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_fraction=cached / prompt if prompt else None,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p99_s=percentile(itls, 99),
        itl_samples=len(itls),
        tpot_p50_s=percentile(tpots, 50),
        tpot_p99_s=percentile(tpots, 99),
    )


def first_errors(results: Sequence[RequestResult]) -> dict[str, str]:
    """One example message per error kind (the first request that had it)."""
    examples: dict[str, str] = {}
    for r in results:
        if r.outcome == "error" and r.error_kind not in examples:
            examples[str(r.error_kind)] = r.error_detail or ""
    return examples
