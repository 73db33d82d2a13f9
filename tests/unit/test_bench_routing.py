"""bench/routing.py without a cluster: a baseline run gets this run's workload, and the table
and the JSON take every run and each router's medians. (The live app runs in
tests/serve/test_routing_live.py; the bench's own run takes minutes.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from bench import routing


def _args(monkeypatch: pytest.MonkeyPatch, *flags: str):
    monkeypatch.setattr(sys, "argv", ["routing.py", *flags])
    return routing.parse_args()


def test_a_baseline_run_gets_this_runs_workload(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(
        monkeypatch,
        *("--groups", "3", "--per-group", "5", "--shared-tokens", "32", "--tail-tokens", "8"),
        *("--max-tokens", "4", "--concurrency", "1", "--max-num-tokens", "4096", "--seed", "7"),
        *("--repeats", "2", "--routers", "prefix", "--baseline", "HEAD"),
    )
    again = _args(monkeypatch, *routing.workload_flags(args))
    assert routing.workload(again) == routing.workload(args)  # the same prompts
    for name in ("groups", "per_group", "shared_tokens", "tail_tokens", "max_tokens"):
        assert getattr(again, name) == getattr(args, name)
    for name in ("concurrency", "max_num_tokens", "seed"):
        assert getattr(again, name) == getattr(args, name)
    assert again.baseline is None and again.routers == list(routing.ROUTERS)


def test_routers_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        _args(monkeypatch, "--routers", "random")


def _run(router: str, hit_rate: float) -> dict:
    row = dict.fromkeys(routing.NUMERIC, 1.0)
    return {**row, "router": router, "hit_rate": hit_rate, "replica_requests": [1, 2]}


def test_rows_and_results_take_every_run_and_the_medians() -> None:
    runs = {
        "prefix": [_run("prefix", h) for h in (0.5, 0.7, 0.6)],
        "prefix@old": [_run("prefix@old", h) for h in (0.4, 0.2, 0.3)],
        "pow2": [],  # not run: left out
    }
    rows = routing.table_rows(runs)
    assert [r["router"] for r in rows] == ["prefix"] * 3 + ["prefix@old"] * 3 + [
        "prefix med",
        "prefix@old med",
    ]
    assert rows[-2]["hit_rate"] == 0.6 and rows[-1]["hit_rate"] == 0.3
    results = routing.results_of(runs)
    assert set(results) == {"prefix", "prefix@old"}
    assert results["prefix"]["median"]["hit_rate"] == 0.6
    assert results["prefix"]["runs"] == runs["prefix"]


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[2] / ".git").exists(), reason="needs a git checkout"
)
def test_the_record_names_the_commit_it_ran() -> None:
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", routing.source_commit() or "")
