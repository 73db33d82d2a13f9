"""SiLU-and-multiply kernel against its torch reference (simulator on tiny shapes without CUDA;
``gpu`` tests at model sizes on a real device)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import activation as act_mod
from engine.cuda.activation import silu_mul_cuda, silu_mul_reference
from tests.kernels.common import DEVICE, DTYPES, TOL, assert_warmed_up, max_rel_err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (5, 48), (3, 2)])
def test_silu_mul_matches_reference(dtype, shape):
    torch.manual_seed(0)
    gate_up = (torch.randn(*shape) * 4).to(dtype).to(DEVICE)
    out = silu_mul_cuda(gate_up)
    assert out.shape == (shape[0], shape[1] // 2) and out.is_contiguous()
    assert max_rel_err(out, silu_mul_reference(gate_up)) <= TOL[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulator casts
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_extremes(dtype):
    """Large |gate|: exp(-g) overflows to inf for very negative g (silu -> -0, as torch)."""
    big = 60000.0 if dtype == torch.float16 else 1e30
    gate = torch.tensor([[-big, -1000.0, -89.0, -88.0, -20.0, 0.0, 20.0, big]], dtype=dtype)
    gate_up = torch.cat((gate, torch.ones_like(gate)), dim=-1).to(DEVICE)
    out = silu_mul_cuda(gate_up)
    ref = silu_mul_reference(gate_up)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert max_rel_err(out, ref) <= TOL[dtype]
    assert torch.equal(out[:, :2], ref[:, :2])  # -0.0 where exp(-g) overflowed


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_grid_stride_and_strided_input(monkeypatch, dtype):
    """Fewer blocks than work (every thread loops) and a non-contiguous gate_up view."""
    monkeypatch.setattr(act_mod, "_MAX_BLOCKS", 1)
    torch.manual_seed(1)
    wide = (torch.randn(6, 100) * 3).to(dtype).to(DEVICE)
    gate_up = wide[:, 10:90]  # [6, 80], row stride 100: 6 * 40 = 240 outputs > 1 block
    assert not gate_up.is_contiguous()
    out = silu_mul_cuda(gate_up)
    assert max_rel_err(out, silu_mul_reference(gate_up)) <= TOL[dtype]


def test_silu_mul_empty():
    assert silu_mul_cuda(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


def test_validation_errors():
    with pytest.raises(ValueError, match="dtype"):
        silu_mul_cuda(torch.zeros(2, 8, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul_cuda(torch.zeros(2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="even"):
        silu_mul_cuda(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="device"):
        silu_mul_cuda(torch.zeros(2, 8, device="meta"))


def test_warm_up_compiles_the_kernel_for_the_dtype():
    act_mod._silu_mul_kernel.cache_clear()
    act_mod.warm_up(torch.float16, DEVICE)
    gate_up = torch.randn(3, 40).to(torch.float16).to(DEVICE)
    assert_warmed_up([(act_mod._silu_mul_kernel, (torch.float16,))], lambda: silu_mul_cuda(gate_up))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_silu_mul_model_sizes(dtype):
    """Llama-3-8B MLP: 1k tokens, intermediate 14336."""
    torch.manual_seed(10)
    gate_up = (torch.randn(1024, 2 * 14336, device="cuda") * 4).to(dtype)
    out = silu_mul_cuda(gate_up)
    assert max_rel_err(out, silu_mul_reference(gate_up)) <= TOL[dtype]
