"""bench/cache_write_kernel.py's block sizes (its timing needs a GPU): which sizes it takes
and that each quantized row is timed with the kernel forced to that size, fp16 once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import cache_write_kernel as bench

from engine.cuda import quant_kernels


def test_threads_take_auto_and_powers_of_two():
    assert bench.parse_threads("auto, 64,128") == ["auto", "64", "128"]
    for bad in ("48", "2048", "many", ""):
        with pytest.raises(ValueError, match="--threads"):
            bench.parse_threads(bad)


def test_each_quantized_row_runs_at_its_block_size(monkeypatch):
    forced_at_call = []

    def fake_case(mode, tokens):
        forced_at_call.append((mode, quant_kernels._FORCE_WRITE_THREADS))
        return (lambda: None), 1000

    monkeypatch.setattr(bench, "write_case", fake_case)
    monkeypatch.setattr(bench, "time_ms", lambda write, iters: (0.01, "graph"))
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    rows = bench.measure(["fp16", "q4"], [32], 3, ["auto", "64"])
    assert forced_at_call == [("fp16", None), ("q4", None), ("q4", 64)]
    assert [(r.mode, r.threads) for r in rows] == [("fp16", "auto"), ("q4", "auto"), ("q4", "64")]
    assert rows[2].vs_fp16 == 1.0 and rows[2].time_us == 10.0
    assert quant_kernels._FORCE_WRITE_THREADS is None  # (reset after the rows)
