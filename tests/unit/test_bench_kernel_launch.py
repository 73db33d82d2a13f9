"""bench/kernel_launch.py: the CPU dry run (CUDA simulator) times every kernel launch function
of the engine, its torch reference, and the sampling paths."""

from __future__ import annotations

import json
import math
import pathlib

import pytest

from bench.kernel_launch import kernel_functions
from tests.bench_scripts import run_bench


def test_dry_run_times_every_kernel_launch_function(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # (run_bench passes the environment on)
    output = tmp_path / "x.json"
    proc = run_bench(
        "kernel_launch.py", "--dry-run", "--output", str(output), "--log-level", "WARNING",
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["dry_run"] is True and report["device"]["name"] == "cpu (simulator)"
    assert set(report["versions"]) >= {"torch", "numba", "numba_cuda"}
    assert report["errors"] == [] and report["unbenchmarked"] == []
    (mode,) = report["modes"].values()  # one child in the simulator
    assert mode["returncode"] == 0 and mode["skipped"] == []
    rows = report["rows"]
    for row in rows:
        for key in ("first_call_ms", "host_us", "wall_us"):
            assert math.isfinite(row[key]) and row[key] > 0, (row["function"], key)
        assert row["iters"] >= 1 and row["wall_us"] >= row["host_us"]

    kernels = set(kernel_functions())
    assert {"rms_norm_cuda", "paged_attention_cuda", "greedy_cuda", "sample_cuda"} <= kernels
    assert kernels <= {r["function"] for r in rows if r["mode"] != "torch"}
    # every kernel row has its torch reference row for the same op and case
    references = {(r["op"], r["case"]) for r in rows if r["mode"] == "torch"}
    assert {(r["op"], r["case"]) for r in rows if r["group"] == "kernel"} <= references

    (batch,) = report["sampling"]["batches"]
    sampling = {(r["function"], r["mode"], r["case"]): r for r in rows if r["synced_ms"]}
    assert set(sampling) == {
        ("greedy_cuda", "fast", f"greedy b{batch}"),
        ("sampling_fast._choose", "torch", f"greedy b{batch}"),
        ("sample_cuda", "fast", f"top-k/top-p b{batch}"),
        ("SamplerState.sample_on_device", "fast", f"top-k/top-p b{batch}"),
        ("sampling_fast._choose", "torch", f"top-k/top-p b{batch}"),
    }
    assert all(math.isfinite(r["synced_ms"]) and r["synced_ms"] > 0 for r in sampling.values())
    assert "sampling: wall ms per call" in proc.stdout and str(output) in proc.stdout
