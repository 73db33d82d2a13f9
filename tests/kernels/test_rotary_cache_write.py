"""Fused rotary + paged K/V write kernel against its torch reference (simulator on tiny shapes
without CUDA; ``gpu`` tests at model sizes on a real device)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import rotary as rotary_mod
from engine.cuda.rotary import rotary_cache_write_cuda, rotary_cache_write_reference
from tests.kernels.common import DEVICE, DTYPES, TOL, assert_warmed_up, max_rel_err


def make_inputs(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: str = DEVICE,
    contiguous: bool = False,
):
    """q, k, v as the model makes them (split + reshape of one fused qkv output: strided
    views), cos/sin of random positions in q's dtype, and pages holding old random content."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.reshape(tokens, heads, head_dim)
    k = k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    if contiguous:  # what the model passes after Qwen3's q/k norm
        q, k = q.contiguous(), k.contiguous()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    positions = torch.randint(0, 4096, (tokens,), device=device)
    freqs = positions[:, None].float() * inv_freq[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = torch.randn(shape, device=device).to(dtype)
    v_pages = torch.randn(shape, device=device).to(dtype)
    return q, k, v, cos, sin, k_pages, v_pages


def run_both(q, k, v, cos, sin, k_pages, v_pages, slots, **kwargs):
    """(kernel q, k_pages, v_pages), (reference q, k_pages, v_pages) from the same inputs."""
    ref_k, ref_v = k_pages.clone(), v_pages.clone()
    ref_q = rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    out = rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots, **kwargs)
    return (out, k_pages, v_pages), (ref_q, ref_k, ref_v)


def assert_matches(got, ref, dtype):
    (q, k_pages, v_pages), (ref_q, ref_k, ref_v) = got, ref
    for out, want in ((q, ref_q), (k_pages, ref_k)):
        if dtype == torch.float32:
            # x*cos - y*sin can cancel to near zero, where a GPU's fused multiply-add rounds
            # differently from the reference's multiply then add: the error is a few ulps of
            # the pair's magnitude (<= the largest output), not of the result.
            bound = 4 * torch.finfo(dtype).eps * want.abs().max().item()
            assert (out - want).abs().max().item() <= bound
        else:
            assert max_rel_err(out, want) <= TOL[dtype]
    assert torch.equal(v_pages, ref_v)  # a copy: exact, and untouched slots kept


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(2, 2, 16), (4, 2, 16), (4, 1, 32)],
    ids=["gqa1", "gqa2", "gqa4"],
)
def test_ragged_batch_with_padding(dtype, heads, kv_heads, head_dim):
    """Two sequences (one crossing a page boundary) and padding rows (-1)."""
    torch.manual_seed(0)
    inputs = make_inputs(6, heads, kv_heads, head_dim, 3, 4, dtype)
    # seq A at page 0 offsets 2,3 then page 2 offset 0 (its next block); seq B at page 1
    # offset 1; two padding rows.
    slots = torch.tensor([2, 3, 8, 5, -1, -1], device=DEVICE)
    got, ref = run_both(*inputs, slots)
    assert_matches(got, ref, dtype)
    assert got[0].is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_contiguous_inputs_and_int32_slots(dtype):
    torch.manual_seed(1)
    inputs = make_inputs(3, 2, 1, 32, 2, 2, dtype, contiguous=True)
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE)
    got, ref = run_both(*inputs, slots)
    assert_matches(got, ref, dtype)


def test_in_place_into_q_view():
    """out=q rotates the strided q view in place (inside the fused qkv buffer)."""
    torch.manual_seed(2)
    dtype = torch.float16
    q, k, v, cos, sin, k_pages, v_pages = make_inputs(3, 4, 2, 16, 2, 4, dtype)
    k_before, v_before = k.clone(), v.clone()
    slots = torch.tensor([1, -1, 6], device=DEVICE)
    ref_k, ref_v = k_pages.clone(), v_pages.clone()
    ref_q = rotary_cache_write_reference(q, k, v, cos, sin, ref_k, ref_v, slots)
    out = rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots, out=q)
    assert out is q
    assert max_rel_err(q, ref_q) <= TOL[dtype]
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    assert max_rel_err(k_pages, ref_k) <= TOL[dtype]
    assert torch.equal(v_pages, ref_v)


def test_all_padding_and_out_of_range_slots_write_nothing():
    torch.manual_seed(3)
    dtype = torch.float32
    q, k, v, cos, sin, k_pages, v_pages = make_inputs(2, 2, 1, 16, 1, 2, dtype)
    k_before, v_before = k_pages.clone(), v_pages.clone()
    slots = torch.tensor([-1, 2], device=DEVICE)  # 2 == P * S: past the end
    out = rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots)
    no_writes = torch.full_like(slots, -1)
    ref_q = rotary_cache_write_reference(
        q, k, v, cos, sin, k_pages.clone(), v_pages.clone(), no_writes
    )
    assert max_rel_err(out, ref_q) <= TOL[dtype]
    assert torch.equal(k_pages, k_before) and torch.equal(v_pages, v_before)


def test_empty_batch():
    q, k, v, cos, sin, k_pages, v_pages = make_inputs(0, 2, 1, 16, 1, 2, torch.float32)
    slots = torch.empty(0, dtype=torch.long, device=DEVICE)
    assert rotary_cache_write_cuda(q, k, v, cos, sin, k_pages, v_pages, slots).shape == (0, 2, 16)


def test_validation_errors():
    q, k, v, cos, sin, k_pages, v_pages = make_inputs(2, 2, 1, 16, 1, 4, torch.float32)
    slots = torch.tensor([0, 1], device=DEVICE)
    args = [q, k, v, cos, sin, k_pages, v_pages, slots]
    bad = {
        "dtype": (0, q.double()),
        "k dtype": (1, k.half()),
        "slot_mapping dtype": (7, slots.float()),
        "q and k must be": (0, q[0]),
        "does not match q": (1, k[:1]),
        "v shape": (2, v[:, :, :8]),
        "cos/sin": (3, cos[:, :4]),
        "k_pages must be": (5, k_pages[..., :8]),
        "v_pages shape": (6, v_pages[:, :2]),
        "slot_mapping must be": (7, slots[:1]),
        "must be contiguous": (5, torch.zeros(1, 4, 1, 32, device=DEVICE)[..., :16]),
        "device": (0, q.to("meta")),
    }
    for message, (index, value) in bad.items():
        call = list(args)
        call[index] = value
        with pytest.raises(ValueError, match=message):
            rotary_cache_write_cuda(*call)
    with pytest.raises(ValueError, match="out must be"):
        rotary_cache_write_cuda(*args, out=q[:1])


def test_warm_up_compiles_the_kernel_for_the_dtype_and_slot_dtype():
    factory = rotary_mod._rotary_cache_write_kernel
    factory.cache_clear()
    rotary_mod.warm_up(torch.float16, DEVICE)  # int64 slots, as the model's slot mapping
    inputs = make_inputs(3, 4, 2, 16, 2, 4, torch.float16)
    slots = torch.tensor([1, 6, -1], device=DEVICE)
    assert_warmed_up(
        [(factory, (torch.float16, torch.int64))],
        lambda: rotary_cache_write_cuda(*inputs, slots),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 32), (32, 8)], ids=["mha", "gqa4"])
def test_gpu_model_sizes(dtype, heads, kv_heads):
    """1k tokens, D = 128, 16-token pages, shuffled slots with padding rows."""
    torch.manual_seed(10)
    tokens, page_size, num_pages = 1024, 16, 80
    inputs = make_inputs(tokens, heads, kv_heads, 128, num_pages, page_size, dtype, "cuda")
    slots = torch.randperm(num_pages * page_size, device="cuda")[:tokens]
    slots[::37] = -1
    got, ref = run_both(*inputs, slots)
    assert_matches(got, ref, dtype)
