"""The CPU kernels on a CPU without AVX or F16C (Numba told to compile for plain x86-64): the
vector code lowers to what that CPU has, and float16 rounding goes on the bits instead of an
instruction whose runtime helper Numba's JIT lacks (the process crashed with a segmentation
fault). Runs the kernels' own tests in a child process: the target is fixed when Numba loads."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")
def test_cpu_kernels_pass_their_tests_compiled_for_plain_x86_64(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": "x86-64",
        "NUMBA_CPU_FEATURES": "",
        "NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"),  # (not the host-tuned cache)
    }
    tests = [f"tests/unit/test_cpu_{name}.py" for name in ("simd", "kernels", "kv_gather")]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "skipped" in result.stdout  # the conversion's own test: not on this target
