"""Running a ``bench/`` script as a user would, for the benches' CPU dry-run tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python bench/<script> args`` from the repository root, without the test session's
    ``ENGINE_OPS`` (the script picks its own op set)."""
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_OPS"}
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
