"""``import engine`` bounds torch's OpenMP spinning (engine/cpu/spin.py) only where that still
takes effect (torch not loaded yet) and nobody chose a setting. Each case runs in a fresh
interpreter: this one loaded torch long ago."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu import spin

REPO = Path(__file__).resolve().parents[2]


def _spin_count_after(code: str, **settings: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in spin.SPIN_SETTINGS}
    env.update(settings)
    probe = f"{code}; import os; print(os.environ.get('GOMP_SPINCOUNT'))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("first", ["import engine", "import deployments"])
def test_importing_the_engine_first_sets_the_spin_count_before_torch_loads(first):
    assert _spin_count_after(f"{first}; import torch") == spin.SPIN_COUNT


def test_torch_loaded_first_keeps_libgomps_default():
    assert _spin_count_after("import torch; import engine") == "None"


@pytest.mark.parametrize(
    "setting, value", [("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "PASSIVE")]
)
def test_a_setting_the_user_chose_wins(setting, value):
    want = value if setting == "GOMP_SPINCOUNT" else "None"
    assert _spin_count_after("import engine", **{setting: value}) == want


def test_bound_spinning_reports_what_it_did():
    environ: dict[str, str] = {}
    assert spin.bound_spinning(environ, modules={})
    assert environ == {"GOMP_SPINCOUNT": spin.SPIN_COUNT}
    assert not spin.bound_spinning({}, modules={"torch": object()})
    assert not spin.bound_spinning({"OMP_WAIT_POLICY": "ACTIVE"}, modules={})
