"""bench/host_overhead.py: the quick run covers every mode, the breakdown and the goals."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "host_overhead.py"


def test_quick_run_reports_every_mode_and_part(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "host_overhead.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(output),
         "--cache-dir", str(tmp_path / "cache"), "--text-stages", "inline", "deferred"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["benchmark"] == "host_overhead" and report["quick"] is True
    assert report["model"]["logits_width"] > report["model"]["tokenizer_vocab"]
    results = report["results"]
    modes = {"greedy", "topk_topp", "topp", "temperature", "penalties", "greedy_stop"}
    stages = ("inline", "deferred")
    assert {(r["mode"], r["batch"], r["text_stage"]) for r in results} == {
        (m, b, s) for m in modes for b in (1, 4) for s in stages
    }
    for r in results:
        assert r["tokens_per_step"] == r["batch"]  # every job decodes one token per step
        assert r["us_per_step"] > 0
        assert r["us_per_token"] == r["us_per_step"] / r["batch"]
        parts = r["breakdown_us"]
        assert set(parts) == {"schedule", "batch", "sample", "receive", "text", "other"}
        assert all(parts[k] > 0 for k in ("schedule", "batch", "sample", "receive"))
        assert 0 < r["sample_tensor_us"] <= parts["sample"]
        # deferred: every job's token is rendered by the next step's text stage; inline: none
        late = r["batch"] if r["text_stage"] == "deferred" else 0
        assert r["text_results_per_step"] == late
        assert r["critical_us_per_step"] < r["us_per_step_instrumented"]
    # only batch-1 goals at quick sizes, and only for the inline stage
    assert [g["batch"] for g in report["goals"]] == [1]
    for label in ("us/step", "greedy_stop", "deferred", "critical", "goal greedy batch 1"):
        assert label in proc.stdout


def test_baseline_runs_the_same_cases_with_another_engine(tmp_path: pathlib.Path) -> None:
    """--baseline REF: the cases again with the engine of a temporary worktree at REF."""
    output = tmp_path / "host_overhead.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(output),
         "--cache-dir", str(tmp_path / "cache"), "--modes", "greedy", "topk_topp",
         "--batches", "2", "--baseline", "HEAD"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    baseline = report["baseline"]
    assert baseline["ref"] == "HEAD" and len(baseline["commit"]) == 40
    cases = {(r["mode"], r["batch"], r["text_stage"]) for r in report["results"]}
    assert {(r["mode"], r["batch"], r["text_stage"]) for r in baseline["results"]} == cases
    assert baseline["engine"] != report["engine"]  # the worktree's engine package
    assert {(c["mode"], c["batch"]) for c in report["comparison"]} == {
        ("greedy", 2),
        ("topk_topp", 2),
    }
    for c in report["comparison"]:
        assert c["speedup"] == c["baseline_us_per_step"] / c["us_per_step"]
    worktrees = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "host-overhead-baseline" not in worktrees  # removed again


def test_both_batch_paths_build_the_same_batches_and_are_compared(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "host_overhead.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output", str(output), "--modes", "greedy",
         "--cache-dir", str(tmp_path / "cache"), "--batch-paths", "reference", "persistent"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    # (the run fails if the builders ever disagree on a batch)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["workload"]["batch_paths"] == ["reference", "persistent"]
    assert [r["batch_path"] for r in report["results"]] == ["reference+persistent"] * 2
    rows = report["batch_paths"]
    assert [(c["mode"], c["batch"]) for c in rows] == [("greedy", 1), ("greedy", 4)]
    for c in rows:
        for path in ("reference", "persistent"):
            assert c[path]["schedule_plus_batch_build_us"] > c[path]["batch_build_us"] > 0
    assert "batch paths greedy inline batch 4" in proc.stdout
