"""On a GPU: each kernel gives bit-identical outputs through the fast launch path and through
Numba's own launch (``ENGINE_NUMBA_LAUNCH``, read per launch). The packing is checked directly
here, not only through the kernels' agreement with their references."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import _launch
from engine.cuda.activation import silu_mul_cuda
from engine.cuda.attention import paged_attention_cuda
from engine.cuda.fast_launch import LAUNCH_ENV
from engine.cuda.norm import add_rms_norm_cuda, rms_norm_cuda
from engine.cuda.rotary import rotary_cache_write_cuda
from engine.cuda.sampling import greedy_cuda
from tests.kernels.test_attention import make_case
from tests.kernels.test_rotary_cache_write import make_inputs

pytestmark = pytest.mark.gpu


def _both_ways(monkeypatch, call):
    """``call()``'s outputs with Numba's launch, then twice through the fast path (the first
    launch of a signature is Numba's; the second is packed)."""
    monkeypatch.setenv(LAUNCH_ENV, "numba")
    numba_out = call()
    monkeypatch.setenv(LAUNCH_ENV, "fast")
    call()
    fast_out = call()
    assert _launch._LAUNCHERS, "the fast path launched nothing"
    return numba_out, fast_out


def _assert_identical(a, b) -> None:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_norms_and_activation(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(37, 2048, device="cuda", dtype=torch.float16)
    w = torch.randn(2048, device="cuda", dtype=torch.float16)
    res = torch.randn_like(x)
    gate_up = torch.randn(37, 2 * 2048, device="cuda", dtype=torch.float16)
    _assert_identical(*_both_ways(monkeypatch, lambda: rms_norm_cuda(x[:, ::1], w, 1e-5)))
    _assert_identical(*_both_ways(monkeypatch, lambda: rms_norm_cuda(x[::2], w, 1e-5)))  # view
    _assert_identical(*_both_ways(monkeypatch, lambda: add_rms_norm_cuda(x, res.clone(), w, 1e-5)))
    _assert_identical(*_both_ways(monkeypatch, lambda: silu_mul_cuda(gate_up)))


def test_rotary_cache_write(monkeypatch):
    torch.manual_seed(1)
    q, k, v, cos, sin, k_pages, v_pages = make_inputs(64, 32, 8, 64, 16, 16, torch.float16, "cuda")
    slots = torch.randperm(16 * 16, device="cuda")[:64]

    def call():
        kp, vp = k_pages.clone(), v_pages.clone()
        out = rotary_cache_write_cuda(q, k, v, cos, sin, kp, vp, slots)
        return out, kp, vp

    _assert_identical(*_both_ways(monkeypatch, call))


@pytest.mark.parametrize("splits", [1, 3])
def test_attention(monkeypatch, splits):
    q, k, v, batch = make_case(
        [(300, 1), (17, 1), (0, 9)], 32, 8, 128, torch.float16, page_size=16, device="cuda"
    )
    call = lambda: paged_attention_cuda(q, k, v, batch, 0.1, num_splits=splits)  # noqa: E731
    _assert_identical(*_both_ways(monkeypatch, call))


def test_greedy_sampling(monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(64, 128256, device="cuda")
    _assert_identical(*_both_ways(monkeypatch, lambda: greedy_cuda(x, 128000)))
