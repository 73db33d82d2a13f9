"""bench/gpu_kernel_tests.sh: the device's kernel tests in one pytest process, and after a
sticky CUDA error each test file again in a process of its own (here with stand-in test files
that print such an error; no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernel_tests.sh"

PASSES = "def test_passes():\n    assert True\n"
STICKY = (
    "def test_faults():\n"
    "    raise RuntimeError('CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was "
    "encountered')\n"
)
PLAIN_FAILURE = "def test_fails():\n    assert 1 == 2\n"


def _run(tmp_path: Path, files: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in files.items():
        (tests / name).write_text(text)
    out = tmp_path / "out"
    env = {"OUT": str(out), "PY": sys.executable, "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tests)], env=env, capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    return result, out


def test_a_sticky_error_runs_each_file_again_alone(tmp_path: Path) -> None:
    result, out = _run(tmp_path, {"test_a_faults.py": STICKY, "test_b_passes.py": PASSES})
    assert result.returncode != 0
    assert "each test file again" in result.stdout
    assert (out / "pytest.log").exists()
    alone = (out / "pytest_test_b_passes.log").read_text()
    assert "1 passed" in alone
    assert "test_b_passes.py: rc=0" in result.stdout
    assert "test_a_faults.py: rc=1" in result.stdout


def test_an_ordinary_failure_is_not_run_again(tmp_path: Path) -> None:
    result, out = _run(tmp_path, {"test_a_fails.py": PLAIN_FAILURE, "test_b.py": PASSES})
    assert result.returncode != 0
    assert "again" not in result.stdout
    assert not list(out.glob("pytest_*.log"))


def test_a_clean_run_exits_zero(tmp_path: Path) -> None:
    result, out = _run(tmp_path, {"test_b.py": PASSES})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in (out / "pytest.log").read_text()
