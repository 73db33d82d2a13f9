"""bench/kv_balance.py (bench-only K/V experiments of bench/kv_quant_quality.py): the scales'
RoPE pairing, exactness of the transforms without quantization, and that each one shrinks the
quantized attention error in the case it is built for."""

from __future__ import annotations

import pytest
import torch

from bench.kv_balance import (
    STATS,
    Activations,
    LayerScales,
    adjusted_ops,
    calibrated,
    calibrated_scales,
    centered,
    channel_stat,
    identity_scales,
    key_means,
    model_scales,
    random_ids,
    record_qk,
)
from engine import Model
from engine.batch import SequenceInput, build_forward_batch
from engine.cache.quant import allocate_quant_pages
from engine.ops import TORCH_OPS
from tests.hf_models import build_model


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    # head_dim 32 (one quantization group), two q heads per KV head.
    folder = tmp_path_factory.mktemp("kv_balance")
    build_model(folder, "llama_gqa", num_attention_heads=2, num_key_value_heads=1)
    return Model.from_pretrained(folder, device="cpu", dtype=torch.float32)


def test_scales_share_rope_pairs_and_have_unit_geometric_mean(model):
    half = model.config.head_dim // 2
    for layer in model_scales(model, 0.5, 0.5):
        assert torch.equal(layer.s[:, :half], layer.s[:, half:])
        for x in (layer.s, layer.t):
            assert x.log().mean(dim=-1).abs().max() < 1e-5
            assert not torch.allclose(x, torch.ones_like(x))  # random weights: not flat


def _logits(model: Model, ids: list[int], ops) -> torch.Tensor:
    pages = -(-len(ids) // 4)
    kv = model.allocate_kv(pages, 4)
    # Two chunks: the second one's attention reads keys the first wrote.
    out = []
    for start, end in ((0, 7), (7, len(ids))):
        row = SequenceInput(ids[start:end], start, range(pages), logits_rows=end - start)
        with torch.inference_mode():
            out.append(model.network(build_forward_batch([row], 4, "cpu"), kv, ops))
    return torch.cat(out)


def test_transforms_are_exact_without_quantization(model):
    ids = [3, 17, 250, 9, 41, 41, 7, 300, 12, 5, 88, 2, 64]
    plain = _logits(model, ids, TORCH_OPS)
    layers = centered(model_scales(model, 0.5, 0.5), key_means(model, tokens=24))
    adjusted = _logits(model, ids, adjusted_ops(TORCH_OPS, layers))
    assert (adjusted - plain).abs().max() < 1e-4 * plain.abs().max()
    assert not torch.equal(layers[0].key_mean, torch.zeros_like(layers[0].key_mean))


def _quantized_error(q, k, v, layer: LayerScales, bits: int = 4, rotate: bool = True) -> float:
    """max |attention over quantized pages - exact| / max |exact| for one sequence, with the
    K/V written and read through ``adjusted_ops`` with ``layer``."""
    tokens, kv_heads, dim = k.shape
    batch = build_forward_batch([SequenceInput([1] * tokens, 0, range(tokens // 4))], 4)
    slots = torch.arange(tokens)
    cos, sin = torch.ones(tokens, dim // 2), torch.zeros(tokens, dim // 2)
    scale = dim**-0.5
    exact_k = torch.zeros(tokens // 4, 4, kv_heads, dim)
    exact_v = torch.zeros_like(exact_k)
    q_rot = TORCH_OPS.rotary_cache_write(q, k, v, cos, sin, exact_k, exact_v, slots)
    exact = TORCH_OPS.paged_attention(q_rot, exact_k, exact_v, batch, scale)
    pages = [allocate_quant_pages(tokens // 4, 4, kv_heads, dim, bits, rotate, "cpu") for _ in "kv"]
    ops = adjusted_ops(TORCH_OPS, [layer])
    q_rot = ops.rotary_cache_write(q, k, v, cos, sin, *pages, slots)
    out = ops.paged_attention(q_rot, *pages, batch, scale)
    return ((out - exact).abs().max() / exact.abs().max()).item()


def _case(seed: int = 0, tokens: int = 64, heads: int = 2, dim: int = 32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, 1, dim, generator=gen)
    v = torch.randn(tokens, 1, dim, generator=gen)
    return q, k, v


def test_centering_shrinks_the_error_of_keys_with_a_common_offset():
    q, k, v = _case()
    offset = 4 * torch.randn(1, 32, generator=torch.Generator().manual_seed(1))
    k = k + offset
    plain = LayerScales(torch.ones(1, 32), torch.ones(1, 32))
    with_mean = LayerScales(plain.s, plain.t, key_mean=offset)
    assert _quantized_error(q, k, v, with_mean) < 0.6 * _quantized_error(q, k, v, plain)


def test_rebalancing_shrinks_the_error_of_skewed_channels():
    # Keys large where queries are small and the other way round: s^2 = |k| / |q|.
    q, k, v = _case()
    skew = torch.ones(32)
    skew[[0, 16, 5, 21]] = 8.0  # two RoPE pairs
    q, k = q / skew, k * skew
    plain = LayerScales(torch.ones(1, 32), torch.ones(1, 32))
    balanced = LayerScales(skew[None, :], torch.ones(1, 32))
    assert _quantized_error(q, k, v, balanced) < 0.6 * _quantized_error(q, k, v, plain)


@pytest.mark.parametrize(("stat", "pairs"), [(stat, False) for stat in STATS] + [("rms", True)])
def test_calibrated_equalization_is_exact_without_quantization(model, stat, pairs):
    ids = [3, 17, 250, 9, 41, 41, 7, 300, 12, 5, 88, 2, 64]
    plain = _logits(model, ids, TORCH_OPS)
    acts = record_qk(model, random_ids(model, 24, seed=1))  # not the scored ids
    means = key_means(model, tokens=24)
    scales = calibrated_scales(acts, stat, alpha=1.0, query_alpha=0.5, means=means, pairs=pairs)
    layers = calibrated(centered(identity_scales(model), means), scales)
    adjusted = _logits(model, ids, adjusted_ops(TORCH_OPS, layers))
    assert (adjusted - plain).abs().max() < 1e-4 * plain.abs().max()
    for s in scales:
        assert s.shape == (model.config.num_kv_heads, model.config.head_dim)
        assert s.log().mean(dim=-1).abs().max() < 1e-5
        assert not torch.allclose(s, torch.ones_like(s))  # random weights: not flat
        half = s.shape[-1] // 2
        assert torch.equal(s[:, :half], s[:, half:]) == pairs


def _skewed_keys(seed: int = 0):
    """A case whose keys have a few channels 8x larger than the rest (queries flat): not RoPE
    pairs, the calibrated scales act after the rotary."""
    q, k, v = _case(seed)
    skew = torch.ones(32)
    skew[[0, 5, 11, 30]] = 8.0
    return q, k * skew, v


@pytest.mark.parametrize(
    ("stat", "alpha", "query_alpha", "bits", "rotate"),
    [
        ("rms", 0.5, 0.5, 4, True),
        ("p99", 0.5, 0.5, 4, True),
        ("absmax", 1.0, 0.0, 8, False),
        ("rms", 1.0, 0.5, 8, False),
    ],
)
def test_calibration_shrinks_the_error_of_keys_with_skewed_channels(
    stat, alpha, query_alpha, bits, rotate
):
    q, k, v = _skewed_keys()
    # Calibrated on another draw of the same distribution, not on the keys it is scored on.
    cq, ck, _ = _skewed_keys(seed=5)
    acts = Activations([cq], [ck])
    (s,) = calibrated_scales(acts, stat, alpha, query_alpha)
    plain = LayerScales(torch.ones(1, 32), torch.ones(1, 32))
    equalized = LayerScales(s, torch.ones(1, 32))
    before = _quantized_error(q, k, v, plain, bits, rotate)
    after = _quantized_error(q, k, v, equalized, bits, rotate)
    assert after < 0.75 * before


def test_channel_stats_and_their_bad_input():
    x = torch.tensor([[[1.0, -4.0]], [[-3.0, 0.0]]])  # [T=2, 1, D=2]
    assert torch.allclose(channel_stat(x, "rms"), torch.tensor([[5**0.5, 8**0.5]]))
    assert torch.equal(channel_stat(x, "absmax"), torch.tensor([[3.0, 4.0]]))
    assert torch.allclose(channel_stat(x, "p99"), torch.tensor([[2.98, 3.96]]))
    with pytest.raises(ValueError, match="'median'"):
        channel_stat(x, "median")
    with pytest.raises(ValueError, match="at least one token"):
        record_qk(None, [])


def test_identity_scales_change_nothing(model):
    ids = [3, 17, 250, 9, 41, 41, 7, 300, 12, 5]
    plain = _logits(model, ids, TORCH_OPS)
    same = _logits(model, ids, adjusted_ops(TORCH_OPS, identity_scales(model)))
    assert torch.equal(same, plain)


def test_experiments_are_named_modes_outside_the_default_run():
    from bench.kv_quant_quality import MODES, parse_modes

    assert not any(mode.adjust for mode in MODES.values())
    modes = parse_modes("q4+rot+ctr,q8+bal,q8+rot+ctr+bal,q8+cal,q4+rot+ctr+cal")
    assert [m.adjust for m in modes] == [
        (),
        ("ctr",),
        ("bal",),
        ("ctr", "bal"),
        ("cal",),
        ("ctr", "cal"),
    ]
    assert modes[1].quant == "q4" and modes[1].rotate
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("fp16+bal")


def test_sweep_scores_compare_distributions_with_the_reference():
    from bench.kv_cal_sweep import scores

    ref = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]).log()
    targets = torch.tensor([0, 2])
    same = scores(ref, ref, targets)
    assert same == {"kl": 0.0, "top1": 1.0, "ppl_vs_fp32": 0.0}
    other = torch.tensor([[0.2, 0.7, 0.1], [0.1, 0.1, 0.8]]).log()
    moved = scores(ref, other, targets)
    assert moved["kl"] > 0 and moved["top1"] == 0.5
    assert moved["ppl_vs_fp32"] == pytest.approx((0.7 / 0.2) ** 0.5 - 1)
