"""The load run's report: one JSON document, a printed table, and a PNG of TTFT and ITL over time.

The JSON keeps every request (start, outcome, TTFT, inter-chunk gaps, usage) so a plot or a
different percentile can be redone later without running the load again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .client import RequestResult
from .server_stats import REPLICA_KEYS
from .stats import Summary, first_errors

logger = logging.getLogger(__name__)

REPORT_KEYS = (
    "benchmark",
    "date",
    "machine",
    "target",
    "workload",
    "summary",
    "errors",
    "server",
    "requests",
)
DIGITS = 5  # per-request times are rounded to 10 µs in the JSON


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, DIGITS) for v in values]


def request_record(r: RequestResult) -> dict[str, Any]:
    ttft = r.ttft_s
    return {
        "index": r.index,
        "kind": r.kind,
        "shared": r.shared,
        "start_s": round(r.start_s, DIGITS),
        "end_s": round(r.end_s, DIGITS),
        "outcome": r.outcome,
        "error_kind": r.error_kind,
        "ttft_s": None if ttft is None else round(ttft, DIGITS),
        "itl_s": _rounded(r.itl_s),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
    }


def build_report(
    *,
    date: str,
    machine: dict[str, Any],
    target: dict[str, Any],
    workload: dict[str, Any],
    summary: Summary,
    results: Sequence[RequestResult],
    server: dict[str, Any],
) -> dict[str, Any]:
    """``server``: ``{"before": [...], "after": [...], "settled", "settle_wait_s", "held"}``."""
    return {
        "benchmark": "load",
        "date": date,
        "machine": machine,
        "target": target,
        "workload": workload,
        "summary": summary.to_dict(),
        "errors": first_errors(results),
        "server": server,
        "requests": [request_record(r) for r in results],
    }


def _ms(seconds: float | None) -> str:
    return "    -" if seconds is None else f"{seconds * 1000:5.0f} ms"


def _summary_lines(report: dict[str, Any]) -> list[str]:
    s, w = report["summary"], report["workload"]
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors_by_kind"].items()) or "none"
    cached = s["cached_fraction"]
    return [
        f"load run: {w['clients']} clients, {s['requests']} requests in {s['seconds']:.1f} s, "
        f"max_tokens {w['max_tokens']}, shared {w['shared_fraction']:.0%}, "
        f"disconnect {w['disconnect_fraction']:.0%}",
        f"requests      ok {s['ok']}   disconnected {s['disconnected']}   errors {s['errors']}",
        f"errors        {errors}",
        f"throughput    {s['requests_per_s']:.2f} ok req/s   "
        f"{s['tokens_per_s']:.1f} generated tok/s   ({s['generated_tokens']} tokens)",
        f"TTFT          p50 {_ms(s['ttft_p50_s'])}   p99 {_ms(s['ttft_p99_s'])}",
        f"ITL (chunks)  p50 {_ms(s['itl_p50_s'])}   p99 {_ms(s['itl_p99_s'])}"
        f"   ({s['itl_samples']} gaps)",
        f"TPOT          p50 {_ms(s['tpot_p50_s'])}   p99 {_ms(s['tpot_p99_s'])}",
        "prefix cache  " + ("-" if cached is None else f"{cached:.1%} of prompt tokens cached"),
    ]


def _server_lines(server: dict[str, Any]) -> list[str]:
    lines = ["replica " + " ".join(f"{k:>15s}" for k in REPLICA_KEYS) + "   (after the run)"]
    for i, replica in enumerate(server.get("after", [])):
        lines.append(f"{i:7d} " + " ".join(f"{replica.get(k, '-')!s:>15s}" for k in REPLICA_KEYS))
    waited = server.get("settle_wait_s", 0.0)
    if server.get("settled"):
        lines.append(f"leak check    clean: no job, no referenced page (after {waited:.1f} s)")
    else:
        held = ", ".join(f"{k}={v}" for k, v in server.get("held", {}).items())
        lines.append(f"leak check    NOT IDLE after {waited:.1f} s: {held}")
    return lines


def print_table(report: dict[str, Any]) -> None:
    """The run's figures on stdout (a bench script's table, not library logging)."""
    for line in _summary_lines(report) + _server_lines(report["server"]):
        print(line)


def write_json(report: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
