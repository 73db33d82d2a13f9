"""bench/chunk_mask_cpu.py: it times the engine's masked and split attention of later prompt
chunks (the same rows both ways), totals them per schedule, and records ragged cases and its
grid."""

from __future__ import annotations

import itertools
import json

import pytest

from bench import chunk_mask_cpu as bench
from engine.cuda import attention
from engine.cuda.attention import attention_groups


def test_schedule_lists_every_later_chunk():
    assert bench.Schedule(1, 1100, 512).later_chunks() == [(512, 512), (1024, 76)]
    assert bench.Schedule(1, 512, 512).later_chunks() == []


def test_thresholds_are_set_for_a_while_and_restored():
    before = attention.SPLIT_MIN_PREFIX, attention.SPLIT_MIN_CHUNK, attention.SPLIT_MIN_ROWS
    with bench.split_thresholds(*bench.MASK_ONLY):
        assert attention.SPLIT_MIN_PREFIX == attention.SPLIT_MIN_ROWS == bench.MASK_ONLY[0]
    with pytest.raises(RuntimeError), bench.split_thresholds(1, 2, 2):
        raise RuntimeError
    assert before == (
        attention.SPLIT_MIN_PREFIX,
        attention.SPLIT_MIN_CHUNK,
        attention.SPLIT_MIN_ROWS,
    )


@pytest.mark.parametrize("sequences", [[(32, 16)], [(32, 16), (40, 20)]])
def test_a_group_is_timed_both_ways_on_the_same_rows(sequences):
    timing = bench.time_group(sequences, repeats=1)
    assert timing.max_abs_diff < 1e-5  # the split, thresholds lifted, is the masked attention
    assert not timing.engine_splits and timing.engine_ms == timing.masked_ms  # under them
    assert list(zip(timing.prefixes, timing.chunks, strict=True)) == sequences


def test_cases_in_two_attention_groups_are_refused():
    with pytest.raises(ValueError, match="more than one attention group"):
        bench.time_group([(32, 16), (32, 8)], repeats=1)


def test_quick_run_writes_totals_ragged_cases_and_the_grid(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "GRID", {"batch": (1, 2), "chunk": (8,), "prefix": (16, 32)})
    monkeypatch.setattr(bench, "GRID_MAX_TOKENS", 60)  # leaves out 2 x (32 + 8)
    output = tmp_path / "chunk_mask_cpu.json"
    argv = ["--quick", "--grid", "--threads", "1", "--output", str(output)]
    assert bench.main(argv) == 0
    record = json.loads(output.read_text())
    assert record["benchmark"] == "chunk_mask_cpu"
    assert record["thresholds"] == {"prefix": 1024, "chunk": 64, "rows": 128}
    first = record["schedules"][0]
    assert [(g["prefixes"], g["chunks"]) for g in first["groups"]] == [([32], [32]), ([64], [32])]
    masked_ms = sum(g["masked_ms"] for g in first["groups"])
    assert first["masked_total_s"] == pytest.approx(masked_ms * 30 / 1e3)
    assert first["engine_total_s"] == pytest.approx(first["masked_total_s"])  # tiny: masked
    assert [(t["prefixes"], t["chunks"]) for t in record["ragged"]] == [([32, 40], [16, 20])]
    cells = [(len(t["chunks"]), t["chunks"][0], t["prefixes"][0]) for t in record["grid"]]
    assert cells == [(1, 8, 16), (1, 8, 32), (2, 8, 16)]
    out = capsys.readouterr().out
    assert "| 1 x 96 | 32 | 2 |" in out and "| (32, 16), (40, 20) |" in out
    assert "| 2 | 8 | " in out and " | - |" in out


def test_ragged_grid_cases_are_ragged_single_groups_spreading_from_their_base(monkeypatch):
    """Every ``--ragged-grid`` case is one attention group whose sequences differ in length
    (so the engine splits it one by one), its prefixes spreading upwards from the grid's base
    by the grid's fraction; tiny bases keep the check fast."""
    grid = {"prefix": (40, 80), "sequences": (2, 4), "spread": (0.1, 0.5), "chunk": (8,)}
    monkeypatch.setattr(bench, "RAGGED_GRID", grid)
    cases = bench.ragged_grid_cases()
    assert len(cases) == 2 * 2 * 2
    cells = itertools.product(*grid.values())
    for case, (base, n, spread, chunk) in zip(cases, cells, strict=True):
        prefixes, chunks = zip(*case, strict=True)
        assert len(case) == n and prefixes[0] == base and chunks[0] == chunk
        assert prefixes[-1] == round(base * (1 + spread)) and list(prefixes) == sorted(prefixes)
        batch, _ = bench.group_batch(case)
        (group,) = attention_groups(batch)
        assert not group.layout.same_lengths


def test_dtype_and_head_shape_are_recorded_and_used(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_RAGGED_CASES", ())
    output = tmp_path / "chunk_mask.json"
    argv = ["--quick", "--threads", "1", "--shape", "llama3-8b", "--dtype", "bfloat16"]
    assert bench.main([*argv, "--output", str(output)]) == 0
    record = json.loads(output.read_text())
    assert (record["device"], record["dtype"], record["chunk_split"]) == (
        "cpu",
        "bfloat16",
        ["cpu"],
    )
    assert record["shape"] == bench.SHAPES["llama3-8b"]
    first = record["schedules"][0]
    masked_ms = sum(g["masked_ms"] for g in first["groups"])
    assert first["masked_total_s"] == pytest.approx(masked_ms * 32 / 1e3)  # the 8B's layers
