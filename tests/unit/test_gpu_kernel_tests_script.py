"""bench/gpu_kernel_tests.sh: the device's kernel tests dealt to several pytest processes at
once, their logs gathered (also when the step's time cap ends them), and after a sticky CUDA
error each test file of that process again in a process of its own (here with stand-in test
files that print such an error; no GPU needed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_kernel_tests.sh"

PASSES = "def test_passes():\n    assert True\n"
STICKY = (
    "def test_faults():\n"
    "    raise RuntimeError('CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was "
    "encountered')\n"
)
PLAIN_FAILURE = "def test_fails():\n    assert 1 == 2\n"
SLOW = "import time\n\n\ndef test_waits():\n    time.sleep(60)\n"


def _files(tmp_path: Path, files: dict[str, str]) -> tuple[Path, dict[str, str]]:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in files.items():
        (tests / name).write_text(text)
    out = tmp_path / "out"
    env = {"OUT": str(out), "PY": sys.executable, "PATH": "/usr/bin:/bin", "JOBS": "2"}
    return tests, env


def _run(tmp_path: Path, files: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    tests, env = _files(tmp_path, files)
    result = subprocess.run(
        ["bash", str(SCRIPT), str(tests)], env=env, capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    return result, Path(env["OUT"])


def test_a_sticky_error_runs_each_file_of_its_process_again_alone(tmp_path: Path) -> None:
    # largest first, dealt to 2 processes: the faulting file and the smallest in part 0,
    # the middle one (two tests) in part 1
    larger = PASSES + "\n\ndef test_also_passes():\n    assert True\n"
    assert len(STICKY) > len(larger) > len(PASSES)
    result, out = _run(
        tmp_path, {"test_a_faults.py": STICKY, "test_b_passes.py": PASSES, "test_c.py": larger}
    )
    assert result.returncode != 0
    assert "part 0: a sticky CUDA error" in result.stdout
    assert "part 1: a sticky" not in result.stdout
    log = (out / "pytest.log").read_text()
    assert "=== part 0:" in log and "=== part 1:" in log and "2 passed" in log  # (test_c)
    alone = (out / "pytest_alone.log").read_text()
    assert "test_b_passes.py: rc=0" in alone and "1 passed" in alone
    assert "test_c.py" not in alone  # (its process had no sticky error)
    assert "test_b_passes.py: rc=0" in result.stdout
    assert "test_a_faults.py: rc=1" in result.stdout


def test_an_ordinary_failure_is_not_run_again(tmp_path: Path) -> None:
    result, out = _run(tmp_path, {"test_a_fails.py": PLAIN_FAILURE, "test_b.py": PASSES})
    assert result.returncode != 0
    assert "again" not in result.stdout
    assert not (out / "pytest_alone.log").exists()


def test_a_clean_run_exits_zero(tmp_path: Path) -> None:
    result, out = _run(tmp_path, {"test_b.py": PASSES, "test_c.py": PASSES})
    assert result.returncode == 0, result.stdout + result.stderr
    log = (out / "pytest.log").read_text()
    assert log.count("1 passed") == 2  # (both files, each in a process of its own)
    assert result.stdout.count("rc=0") == 2


def test_the_time_cap_keeps_what_finished(tmp_path: Path) -> None:
    """The session's cap ends the step with TERM (to the process group, as timeout does):
    the log of the finished part and the header of the unfinished one are in pytest.log."""
    tests, env = _files(tmp_path, {"test_a_waits.py": SLOW + "#" * 200, "test_b.py": PASSES})
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(tests)], env=env, cwd=tmp_path, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = tmp_path / "out" / "pytest.log"
    time.sleep(8)  # (part 1, test_b, finishes; part 0 waits)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 124
    text = log.read_text()
    assert "=== part 0:" in text and "test_a_waits.py" in text
    assert "=== part 1:" in text and "1 passed" in text
