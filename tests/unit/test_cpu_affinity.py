"""``deployments.cpu_affinity``: core lists from presets, exclusive per-core claims between
processes, and pinning every thread of a process (the replica, the ingress).

Whatever pins runs in a child process: pinning pytest itself would slow every later test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deployments import cpu_affinity
from deployments.cpu_affinity import parse_cpu_list, pin_process

REPO_ROOT = Path(__file__).resolve().parents[2]
# the first core this process may use (a container's cpuset need not hold core 0)
CORE = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="core affinity is Linux-only"
)


@pytest.mark.parametrize(
    ("value", "cores"),
    [(None, None), ([1], (1,)), ([3, 0], (0, 3)), ("0", (0,)), ("1-3,5", (1, 2, 3, 5))],
)
def test_core_lists_parse(value, cores) -> None:
    assert parse_cpu_list(value, "serving.engine_cpus") == cores


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], r"serving.engine_cpus must name at least one core, got \[\]"),
        ([-1], r"core numbers must be >= 0, got \[-1\]"),
        ([1, 1], r"names a core twice: \[1, 1\]"),
        ([True], r"must hold core numbers \(integers\), got \[True\]"),
        ([1.0], r"must hold core numbers \(integers\), got \[1.0\]"),
        ("1-x", "'1-x' is not a cpulist such as '1-3,5'"),
        ("", "'' is not a cpulist"),
        ("3-1", "'3-1': range '3-1' runs backwards"),
        (2, "must be a list of core numbers or a cpulist string, got 2"),
    ],
)
def test_bad_core_lists_name_key_and_value(value, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        parse_cpu_list(value, "serving.engine_cpus")
    assert str(raised.value).startswith("serving.engine_cpus")


def test_claims_are_exclusive_between_processes(tmp_path: Path, monkeypatch) -> None:
    """A core claimed by a live process is skipped by the next claimant; the claim goes away
    with its process."""
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path))
    holder = _child(
        """
        print(json.dumps(cpu_affinity.claim_cores([0, 1, 2], 1)), flush=True)
        sys.stdin.read()  # hold the claim until the parent closes stdin
        """,
        wait=False,
    )
    try:
        assert json.loads(holder.stdout.readline()) == [0]
        assert _run_child("print(json.dumps(cpu_affinity.claim_cores([0, 1, 2], 2)))") == [1, 2]
        assert _run_child("print(json.dumps(cpu_affinity.claim_cores([0], 1)))") is None
    finally:
        holder.communicate("", timeout=30)
    assert _run_child("print(json.dumps(cpu_affinity.claim_cores([0], 1)))") == [0]


def test_a_claim_short_of_cores_takes_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path))
    code = """
        first = cpu_affinity.claim_cores([4, 5], 1)
        short = cpu_affinity.claim_cores([4, 5], 2)  # only 5 is free: nothing is kept
        last = cpu_affinity.claim_cores([5], 1)  # so 5 is still free
        print(json.dumps([first, short, last]))
    """
    assert _run_child(code) == [[4], None, [5]]


@linux_only
def test_pin_engine_moves_every_thread_to_its_claimed_cores(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path))
    code = """
        import threading
        started = threading.Event()
        stop = threading.Event()
        worker = threading.Thread(target=lambda: (started.set(), stop.wait()))
        worker.start()  # a thread that exists before pinning moves too
        started.wait()
        cores = cpu_affinity.pin_engine((__CORE__,), 1)
        tids = [int(t) for t in os.listdir("/proc/self/task")]
        masks = sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tids})
        stop.set()
        worker.join()
        print(json.dumps([cores, len(tids), masks]))
    """
    cores, threads, masks = _run_child(code)
    assert cores == [CORE] and threads >= 2 and masks == [[CORE]]


@linux_only
def test_pin_engine_shares_the_set_when_no_core_is_free(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path))
    code = """
        import logging
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
        taken = cpu_affinity.claim_cores([__CORE__], 1)  # as another replica would hold it
        cores = cpu_affinity.pin_engine((__CORE__,), 1)
        print(json.dumps([taken, cores, sorted(os.sched_getaffinity(0))]))
    """
    out = _child(code).stdout.splitlines()
    assert f"fewer than 1 of [{CORE}] are free of other replicas" in out[0]
    assert json.loads(out[-1]) == [[CORE], [CORE], [CORE]]


@linux_only
def test_cores_this_machine_lacks_are_refused_before_anything_moves() -> None:
    before = os.sched_getaffinity(0)
    count = os.cpu_count() or 1
    message = rf"serving.engine_cpus: this machine has cores 0-{count - 1}, not \[{count + 7}\]"
    with pytest.raises(ValueError, match=message):
        pin_process([0, count + 7], "serving.engine_cpus")
    assert os.sched_getaffinity(0) == before


@linux_only
def test_build_generator_runs_the_engine_on_its_core(tmp_path: Path, monkeypatch) -> None:
    """The wiring: a replica's engine (and the bare benchmark's) pins before the model loads."""
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path / "claims"))
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "models"))
    code = """
        from deployments.llm_server import build_generator
        from deployments.preset import Preset
        from engine.demo import DemoModelSpec

        spec = dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        preset = Preset.parse({
            "model": {"demo": {"seed": 1, **spec}, "dtype": "float32", "device": "cpu"},
            "engine": {"max_num_tokens": 256, "page_size": 16, "max_chunk_size": 64},
            "serving": {"torch_threads": 1, "engine_cpus": [__CORE__]},
        })
        build_generator(preset)
        print(json.dumps(sorted(os.sched_getaffinity(0))))
    """
    assert _run_child(code) == [CORE]


def test_claim_dir_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_affinity.CLAIM_DIR_ENV, str(tmp_path))
    assert cpu_affinity.claim_dir() == tmp_path
    monkeypatch.delenv(cpu_affinity.CLAIM_DIR_ENV)
    assert cpu_affinity.claim_dir().name == "pagedserve-cpu-claims"


def _child(code: str, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (json, os, sys and cpu_affinity imported;
    ``__CORE__`` replaced by ``CORE``)."""
    prelude = "import json, os, sys\nfrom deployments import cpu_affinity\n"
    code = textwrap.dedent(code).replace("__CORE__", str(CORE))
    argv = [sys.executable, "-c", prelude + code]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    if not wait:
        return subprocess.Popen(
            argv, env=env, cwd=REPO_ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
    done = subprocess.run(argv, env=env, cwd=REPO_ROOT, text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def _run_child(code: str):
    return json.loads(_child(code).stdout.splitlines()[-1])


@linux_only
def test_the_ingress_runs_on_its_cores(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "models"))
    code = """
        import copy
        import yaml
        from deployments import ingress as ingress_module
        from deployments.preset import Preset

        class UnusedLLM:
            def options(self, **_):
                return self

        raw = yaml.safe_load(open("configs/demo.yaml"))
        raw["serving"]["ingress_cpus"] = [__CORE__]
        wrapped = ingress_module.Ingress.func_or_class  # without Serve's ASGI wrapper
        cls = next(c for c in wrapped.__mro__[1:] if c.__name__ == "Ingress")
        cls(UnusedLLM(), Preset.parse(raw))
        print(json.dumps(sorted(os.sched_getaffinity(0))))
    """
    assert _run_child(code) == [CORE]
