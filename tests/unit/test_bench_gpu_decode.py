"""bench/gpu_decode.py: the CPU dry run covers every section; without a GPU it refuses to run."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from bench import kv_quant_decode
from tests.bench_scripts import run_bench

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "gpu_decode.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_bench(SCRIPT.name, *args, timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    tmp = tmp_path_factory.mktemp("gpu-decode")
    output = tmp / "gpu_decode.json"
    proc = _run(
        "--dry-run", "--output", str(output), "--cache-dir", str(tmp / "cache"),
        "--log-level", "WARNING", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(output.read_text()), proc.stdout


def test_dry_run_report_has_every_section(dry_run: tuple[dict, str]) -> None:
    report, _ = dry_run
    for key in ("benchmark", "date", "dry_run", "device", "versions", "workload",
                "copy_bandwidth", "methods", "models", "goals"):  # fmt: skip
        assert key in report, key
    assert report["dry_run"] is True
    assert report["device"]["name"]
    assert {"torch", "transformers", "numba_cuda"} <= set(report["versions"])
    assert report["copy_bandwidth"]["bytes_per_s"] > 0
    model = report["models"]["tiny"]
    assert set(model["ops"]) == {"default", "eager", "torch"}
    workload = report["workload"]
    for name, ops in model["ops"].items():
        assert ops["ops_name"] == "torch"  # the dry run forces ENGINE_OPS=torch
        assert all(r["cuda_graphs"] == "off" for r in ops["decode_generator"])
        if name == "eager":  # graphs change only the generator's decode rows
            assert set(ops) == {"ops_name", "decode_generator"}
            continue
        for key in ("decode_generator", "decode_forward"):
            rows = ops[key]
            assert [r["batch"] for r in rows] == list(workload["decode_batches"])
            for row in rows:
                assert row["tokens"] == row["batch"] * workload["decode_steps"]
                assert row["tokens_per_s"] > 0
                assert row["roofline_fraction"] > 0
        prefill = ops["prefill"]
        assert [r["batch"] for r in prefill] == list(workload["prefill_batches"])
        assert all(r["tokens_per_s"] > 0 and r["cached_prompt_tokens"] == 0 for r in prefill)


def workload_batch(report: dict) -> int:
    return report["workload"]["quant_batch"]


def test_dry_run_measures_every_kv_cache_mode(dry_run: tuple[dict, str]) -> None:
    report, stdout = dry_run
    rows = report["models"]["tiny"]["kv_quant"]
    assert list(rows) == ["fp16", "q8", "q6", "q4", "q4+sinks", "q4+sinks+recent"]
    assert (
        rows["q4+sinks"]["sink_pages"] == workload_batch(report) and rows["q4"]["sink_pages"] == 0
    )
    assert rows["q4+sinks+recent"]["recent_pages"] == 2 * workload_batch(report)
    workload = report["workload"]
    for row in rows.values():
        assert (row["batch"], row["context"]) == (
            workload["quant_batch"],
            workload["quant_context"],
        )
        assert row["decode_forward_tokens_per_s"] > 0 and row["decode_attention_tokens_per_s"] > 0
        # a prompt chunk through the op set's route (no kernel route without CUDA)
        chunk = min(workload["chunk_size"], workload["prefill_len"])
        assert row["prefill_chunk_tokens"] == chunk
        assert list(row["prefill_chunk_ms"]) == ["reference"]
        assert row["prefill_chunk_ms"]["reference"] > 0
        # a step of decode rows and a prompt chunk: the op set's route only without CUDA
        assert list(row["mixed_step_ms"]) == ["op_set"] and row["mixed_step_ms"]["op_set"] > 0
        # a step verifying drafts: as shipped, through the prompt chunks' route, and as
        # decode rows on the kernel
        assert row["verify_tokens_per_sequence"] == 1 + kv_quant_decode.VERIFY_DRAFTS
        assert list(row["verify_step_ms"]) == ["op_set", "gather", "kernel_rows"]
        assert all(ms > 0 for ms in row["verify_step_ms"].values())
    sizes = [rows[q]["bytes_per_token"] for q in ("fp16", "q8", "q6", "q4")]
    assert sizes == sorted(sizes, reverse=True)
    assert rows["q4"]["tokens_vs_fp16"] >= 3.5  # fp32 on CPU: 7.1x
    goal = report["goals"]["q4_tokens_in_fp16_bytes"]
    assert goal["measured"] == rows["q4"]["tokens_vs_fp16"] and goal["met"] is True
    assert "kv q4" in stdout


def test_dry_run_compares_with_transformers_on_the_same_weights(dry_run: tuple[dict, str]) -> None:
    report, _ = dry_run
    hf = report["models"]["tiny"]["transformers"]
    # float32 on CPU: the copied weights give the same logits and the same greedy tokens
    assert hf["logits_check"]["top1_agreement"] == 1.0
    assert hf["logits_check"]["max_abs_diff"] < 1e-3
    assert hf["greedy_agreement"]["identical"] == hf["greedy_agreement"]["requests"]
    for side in ("ours", "transformers"):
        assert hf[side]["tokens"] == hf[side]["batch"] * hf[side]["new_tokens"]
        assert hf[side]["decode_phase"]["tokens_per_s"] > 0
    assert hf["decode_phase_ratio"] > 0
    goals = report["goals"]
    assert goals["batch1_decode_roofline_fraction"]["target"] == 0.8
    assert goals["batch32_decode_vs_transformers"]["target"] == 3.0
    assert goals["batch32_decode_vs_transformers"]["measured"] == hf["decode_phase_ratio"]


def test_dry_run_prints_the_table(dry_run: tuple[dict, str]) -> None:
    _, stdout = dry_run
    for label in ("decode-gen", "decode-fwd", "prefill", "decode-phase", "goal "):
        assert label in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_gpu_exits_nonzero_with_a_message(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "never.json"
    proc = _run("--output", str(output), timeout=120)
    assert proc.returncode != 0
    assert "no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr
    assert not output.exists()


def _load_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_decode_phase_uses_the_window_where_every_request_decodes() -> None:
    bench = _load_module()
    # request 0 starts at t=0, request 1 at t=2 (prefill done for all); request 1 ends first at 5
    stamps = [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2.0, 3.0, 4.0, 5.0]]
    phase = bench.decode_phase(stamps)
    assert phase["all_active"] is True
    assert phase["seconds"] == 3.0
    assert phase["tokens"] == 6  # t in (2, 5]: 3, 4, 5 from each request
    assert phase["tokens_per_s"] == 2.0


def test_merge_keeps_models_and_op_sets_not_measured_now() -> None:
    bench = _load_module()
    previous = {
        "a": {"ops": {"default": 1, "torch": 2}, "transformers": 3},
        "b": {"ops": {"default": 4}},
    }
    current = {"a": {"ops": {"default": 5}}}
    merged = bench.merge_models(previous, current)
    assert merged["a"] == {"ops": {"default": 5, "torch": 2}, "transformers": 3}
    assert merged["b"] == previous["b"]


def test_kv_quant_page_lists_lay_out_sink_and_recent_pages_as_the_table_does() -> None:
    from bench.kv_quant_decode import page_lists
    from engine.cache.page_table import RECENT_BLOCKS

    batch, per_seq = 3, 5
    lists = page_lists(batch, per_seq, sinks=batch, recent=RECENT_BLOCKS * batch)
    flat = [p for pages in lists for p in pages]
    assert len(flat) == len(set(flat)) == batch * per_seq
    for b, pages in enumerate(lists):
        assert pages[0] == b
        assert all(batch <= p < batch * (1 + RECENT_BLOCKS) for p in pages[-RECENT_BLOCKS:])
        assert all(p >= batch * (1 + RECENT_BLOCKS) for p in pages[1:-RECENT_BLOCKS])
