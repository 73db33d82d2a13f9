"""bench/chunk_mask_cpu.py: it times the engine's masked and split attention of later prompt
chunks (the same rows both ways), totals them per schedule, and records its grid."""

from __future__ import annotations

import json

import pytest

from bench import chunk_mask_cpu as bench
from engine.cuda import attention


def test_schedule_lists_every_later_chunk():
    assert bench.Schedule(1, 1100, 512).later_chunks() == [(512, 512), (1024, 76)]
    assert bench.Schedule(1, 512, 512).later_chunks() == []


def test_masked_batch_keeps_the_mask_and_leaves_the_engines_batch_alone():
    batch, _ = bench.chunk_batch(bench.Schedule(2, 1200, 100), 1100, 100)
    (group,) = attention.attention_groups(batch)
    (masked,) = attention.attention_groups(bench.masked_batch(batch))
    assert group.layout.chunk_after_prefix and not masked.layout.chunk_after_prefix
    assert masked.block_tables is group.block_tables


def test_a_chunk_is_timed_both_ways_on_the_same_rows():
    timing = bench.time_chunk(bench.Schedule(1, 48, 16), 32, 16, repeats=1)
    assert timing.max_abs_diff < 1e-5  # the split, thresholds lifted, is the masked attention
    assert not timing.engine_splits and timing.engine_ms == timing.masked_ms  # under them
    assert attention.SPLIT_MIN_PREFIX > 32  # (restored after timing)


def test_quick_run_writes_totals_and_the_grid(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "GRID", {"batch": (1, 2), "chunk": (8,), "prefix": (16, 32)})
    monkeypatch.setattr(bench, "GRID_MAX_TOKENS", 60)  # leaves out 2 x (32 + 8)
    output = tmp_path / "chunk_mask_cpu.json"
    argv = ["--quick", "--grid", "--threads", "1", "--output", str(output)]
    assert bench.main(argv) == 0
    record = json.loads(output.read_text())
    assert record["benchmark"] == "chunk_mask_cpu"
    assert record["thresholds"] == {"prefix": 1024, "chunk": 64, "rows": 128}
    first = record["schedules"][0]
    assert [(c["prefix"], c["chunk"]) for c in first["chunks"]] == [(32, 32), (64, 32)]
    masked_ms = sum(c["masked_ms"] for c in first["chunks"])
    assert first["masked_total_s"] == pytest.approx(masked_ms * 30 / 1e3)
    assert first["engine_total_s"] == pytest.approx(first["masked_total_s"])  # tiny: masked
    cells = [(t["batch"], t["chunk"], t["prefix"]) for t in record["grid"]]
    assert cells == [(1, 8, 16), (1, 8, 32), (2, 8, 16)]
    out = capsys.readouterr().out
    assert "| 1 x 96 | 32 | 2 |" in out and "| 2 | 8 | " in out and " | - |" in out
