"""RMSNorm kernels against their torch references.

Without CUDA these run in the Numba CUDA simulator on tiny shapes (the root conftest turns it
on); the ``gpu`` tests run the same checks at model sizes on a real device.
"""

from __future__ import annotations

import pytest
import torch

from engine.cuda import _launch
from engine.cuda import norm as norm_mod
from engine.cuda.norm import (
    add_rms_norm_cuda,
    add_rms_norm_reference,
    rms_norm_cuda,
    rms_norm_reference,
)
from tests.kernels.common import (
    DEVICE,
    DTYPES,
    TOL,
    assert_warmed_up,
    emulate_warp_shuffles,
    max_rel_err,
)

EPS = 1e-6


def _randn(*shape: int, dtype: torch.dtype, device: str = DEVICE, scale: float = 1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _qk_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device=DEVICE):
    """q, k as the model makes them: split + reshape of one fused qkv output (strided views)."""
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 32), (2, 1, 2, 16), (32,)])
def test_rms_norm_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = _randn(*shape, dtype=dtype, scale=3.0)
    w = _randn(shape[-1], dtype=dtype)
    out = rms_norm_cuda(x, w, EPS)
    ref = rms_norm_reference(x, w, EPS)
    assert out.shape == x.shape and out.is_contiguous()
    assert max_rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_qk_views(dtype):
    """Qwen3's q/k norm: per-head norm of split views of the fused qkv output, no copy."""
    torch.manual_seed(1)
    q, k = _qk_views(3, 2, 1, 16, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    w = _randn(16, dtype=dtype)
    for t in (q, k):
        before = t.clone()
        out = rms_norm_cuda(t, w, EPS)
        assert max_rel_err(out, rms_norm_reference(t, w, EPS)) <= TOL[dtype]
        assert torch.equal(t, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference_in_place(dtype):
    torch.manual_seed(2)
    x = _randn(4, 32, dtype=dtype, scale=2.0)
    residual = _randn(4, 32, dtype=dtype, scale=2.0)
    w = _randn(32, dtype=dtype)
    x_before, res_before = x.clone(), residual.clone()
    normed, new_residual = add_rms_norm_cuda(x, residual, w, EPS)
    ref_normed, ref_residual = add_rms_norm_reference(x_before, res_before, w, EPS)
    assert new_residual is residual  # updated in place, as documented
    assert torch.equal(x, x_before)
    # The sum is one rounding of an exact fp32 add: identical to torch's.
    assert torch.equal(new_residual, ref_residual)
    assert max_rel_err(normed, ref_normed) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided_and_3d(dtype):
    torch.manual_seed(3)
    base = _randn(3, 2, 40, dtype=dtype)
    x = base[:, :, 4:36]  # strided [3, 2, 32]
    residual = _randn(3, 2, 32, dtype=dtype)
    w = _randn(32, dtype=dtype)
    ref_normed, ref_residual = add_rms_norm_reference(x.clone(), residual.clone(), w, EPS)
    normed, new_residual = add_rms_norm_cuda(x, residual, w, EPS)
    assert new_residual is residual
    assert torch.equal(new_residual, ref_residual)
    assert max_rel_err(normed, ref_normed) <= TOL[dtype]


def test_decoder_layer_residual_chain_matches_reference():
    """The model's use: rms_norm, then add_rms_norm twice on the returned residual."""
    torch.manual_seed(4)
    dtype = torch.float16
    h = _randn(2, 16, dtype=dtype)
    w1, w2 = _randn(16, dtype=dtype), _randn(16, dtype=dtype)
    attn, mlp = _randn(2, 16, dtype=dtype), _randn(2, 16, dtype=dtype)

    ref_res = h.clone()
    ref_h = rms_norm_reference(ref_res, w1, EPS)
    ref_h, ref_res = add_rms_norm_reference(attn + ref_h, ref_res, w2, EPS)
    ref_h, ref_res = add_rms_norm_reference(mlp * ref_h, ref_res, w1, EPS)

    res = h
    out = rms_norm_cuda(res, w1, EPS)
    out, res = add_rms_norm_cuda(attn + out, res, w2, EPS)
    out, res = add_rms_norm_cuda(mlp * out, res, w1, EPS)
    assert max_rel_err(out, ref_h) <= TOL[dtype]
    assert max_rel_err(res, ref_res) <= TOL[dtype]


@pytest.mark.skipif(not _launch.SIMULATOR, reason="emulates warp shuffles in the simulator")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_warp_shuffle_reduction_in_simulator(monkeypatch, dtype):
    """Runs the GPU reduction (``_block_sum_warp_shuffle``) in the simulator with emulated
    shuffles and a 2-warp block, so the code path real GPUs take is checked here too."""
    emulate_warp_shuffles(monkeypatch)
    monkeypatch.setattr(norm_mod, "_block_sum", norm_mod._block_sum_warp_shuffle)
    monkeypatch.setattr(norm_mod, "_row_threads", lambda d: 64)
    torch.manual_seed(5)
    x = _randn(2, 80, dtype=dtype, scale=2.0)  # 80 elements over 64 threads: ragged
    residual = _randn(2, 80, dtype=dtype)
    w = _randn(80, dtype=dtype)
    assert max_rel_err(rms_norm_cuda(x, w, EPS), rms_norm_reference(x, w, EPS)) <= TOL[dtype]
    ref_normed, ref_residual = add_rms_norm_reference(x, residual.clone(), w, EPS)
    normed, new_residual = add_rms_norm_cuda(x, residual, w, EPS)
    assert torch.equal(new_residual, ref_residual)
    assert max_rel_err(normed, ref_normed) <= TOL[dtype]


def test_row_threads_are_whole_warps():
    assert norm_mod._row_threads(16) == 32
    assert norm_mod._row_threads(128) == 32
    assert norm_mod._row_threads(4096) == 512
    assert norm_mod._row_threads(1 << 20) == 1024


def test_empty_rows():
    x = torch.empty(0, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    assert rms_norm_cuda(x, w, EPS).shape == (0, 16)
    normed, residual = add_rms_norm_cuda(x, x.clone(), w, EPS)
    assert normed.shape == residual.shape == (0, 16)


def test_validation_errors():
    x = torch.zeros(2, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm_cuda(x.double(), w.double(), EPS)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_cuda(x, torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="weight dtype"):
        rms_norm_cuda(x, w.half(), EPS)
    with pytest.raises(ValueError, match="residual shape"):
        add_rms_norm_cuda(x, torch.zeros(3, 16, device=DEVICE), w, EPS)
    with pytest.raises(ValueError, match="residual dtype"):
        add_rms_norm_cuda(x, x.half(), w, EPS)
    other = "meta"
    with pytest.raises(ValueError, match="device"):
        rms_norm_cuda(x.to(other), w, EPS)


def test_warm_up_compiles_both_kernels_for_the_dtype():
    factories = (norm_mod._rms_norm_kernel, norm_mod._add_rms_norm_kernel)
    for factory in factories:
        factory.cache_clear()
    norm_mod.warm_up(torch.float16, DEVICE)
    x, w = _randn(3, 48, dtype=torch.float16), _randn(48, dtype=torch.float16)
    assert_warmed_up(
        [(factory, (torch.float16,)) for factory in factories],
        lambda: rms_norm_cuda(x, w, EPS),
        lambda: add_rms_norm_cuda(x, x.clone(), w, EPS),
    )


# --------------------------------------------------------------------------------------------
# Real sizes on a GPU (skipped without CUDA)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rms_norm_model_sizes(dtype):
    torch.manual_seed(10)
    x = _randn(1024, 4096, dtype=dtype, device="cuda", scale=3.0)
    w = _randn(4096, dtype=dtype, device="cuda")
    out = rms_norm_cuda(x, w, 1e-5)
    assert max_rel_err(out, rms_norm_reference(x, w, 1e-5)) <= TOL[dtype]
    # Per-head q/k norm on strided views, D = 128 (32 query heads, 8 KV heads).
    q, k = _qk_views(1024, 32, 8, 128, dtype, device="cuda")
    wq = _randn(128, dtype=dtype, device="cuda")
    for t in (q, k):
        assert (
            max_rel_err(rms_norm_cuda(t, wq, 1e-6), rms_norm_reference(t, wq, 1e-6)) <= (TOL[dtype])
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_add_rms_norm_model_sizes(dtype):
    torch.manual_seed(11)
    x = _randn(1024, 4096, dtype=dtype, device="cuda", scale=2.0)
    residual = _randn(1024, 4096, dtype=dtype, device="cuda", scale=2.0)
    w = _randn(4096, dtype=dtype, device="cuda")
    ref_normed, ref_residual = add_rms_norm_reference(x, residual.clone(), w, 1e-5)
    normed, new_residual = add_rms_norm_cuda(x, residual, w, 1e-5)
    assert new_residual is residual
    assert torch.equal(new_residual, ref_residual)
    assert max_rel_err(normed, ref_normed) <= TOL[dtype]
