"""bench/step_gap.py: the CPU dry run measures both modes with the same greedy tokens; without a
GPU it refuses to run."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import torch

from tests.bench_scripts import run_bench


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("step_gap.py", *args, timeout=300)


def test_dry_run_measures_both_modes(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "step_gap.json"
    proc = _run(
        "--dry-run", "--batches", "3", "--steps", "3", "--output", str(output),
        "--cache-dir", str(tmp_path / "cache"), "--trace", str(tmp_path / "trace"),
        "--log-level", "WARNING",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["dry_run"] is True and report["greedy_mismatches"] == []
    rows = {r["async_scheduling"]: r for r in report["results"]}
    assert set(rows) == {False, True}
    assert rows[False]["async_steps"] == 0 and rows[True]["async_steps"] >= 3
    for row in rows.values():
        assert row["batch"] == 3 and row["steps"] == 3
        assert row["forward_ms"] > 0 and row["gap_ms"] >= 0
    assert report["goal"]["measured"] is None  # the goal's batch and model are not in a dry run
    assert len(list((tmp_path / "trace").glob("*.json"))) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses() -> None:
    proc = _run("--log-level", "WARNING")
    assert proc.returncode == 2 and "--dry-run" in proc.stdout
