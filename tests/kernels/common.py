"""Shared by the kernel tests: where kernels run, which dtypes, and the one tolerance table.

Tolerances (max relative error): fp32 kernels do the reference's math in the same order, so
they agree to rounding; fp16 rounds inputs and outputs to 11 bits, so 2e-3 (the issue's bar).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.cuda import _launch

DEVICE = "cpu" if _launch.SIMULATOR else "cuda"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
REPO = Path(__file__).resolve().parents[2]


def run_without_simulator(
    script: str, timeout: float = 300, args: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``python -c script *args`` in the repository with the CUDA simulator off (the GPU
    build of the kernels: typing, lowering, compiling need no GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_without_simulator_in_parts(
    script: str, parts: int, timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    """``run_without_simulator`` of ``script PART PARTS`` for each part at once: a script
    that takes every PARTS-th case from PART keeps more than one core busy."""
    with ThreadPoolExecutor(parts) as pool:
        runs = [
            pool.submit(run_without_simulator, script, timeout, (str(i), str(parts)))
            for i in range(parts)
        ]
        return [run.result() for run in runs]


def assert_warmed_up(specialisations: list[tuple[Callable, tuple]], *launches: Callable) -> None:
    """Checks after a warm-up (its kernel factories' caches cleared before it): each
    ``functools.cache``'d factory holds exactly the one specialisation (factory, args) it was
    meant to make -- on a GPU a dispatcher with one overload, compiled from the explicit
    signature -- and ``launches`` (calls as the model makes them) compile nothing more."""
    factories = [factory for factory, _ in specialisations]
    assert [f.cache_info().currsize for f in factories] == [1] * len(factories)
    misses = [f.cache_info().misses for f in factories]
    for factory, args in specialisations:
        kernel = factory(*args)
        if not _launch.SIMULATOR:
            assert len(kernel.overloads) == 1
    for launch in launches:
        launch()
    assert [f.cache_info().misses for f in factories] == misses, "compiled after the warm-up"


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise |out - ref| / |ref| (|ref| floored at 1e-3 against near-zeros)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).abs() / ref64.abs().clamp_min(1e-3)).max().item()


def _fake_shfl_xor_sync(self, mask, value, lane_mask):
    """A butterfly shuffle for the simulator, built on block barriers: valid when every thread
    of the block makes the same sequence of shuffle calls (the lane mask may differ per thread:
    each gets the value of thread ``tid ^ lane_mask``)."""
    import numpy as np

    buf = self.shared.array(1024, np.float32)
    tid = self.threadIdx.x
    buf[tid] = value
    self.syncthreads()
    out = buf[tid ^ lane_mask]
    self.syncthreads()
    return np.float32(out)


def emulate_warp_shuffles(monkeypatch) -> None:
    """Give the simulator's fake ``cuda`` module ``shfl_xor_sync`` (``_fake_shfl_xor_sync``)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    monkeypatch.setattr(FakeCUDAModule, "shfl_xor_sync", _fake_shfl_xor_sync, raising=False)
