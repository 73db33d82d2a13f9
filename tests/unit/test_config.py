"""ModelConfig parsing: both HF key styles, per-layer windows, and clear errors."""

from __future__ import annotations

import json

import pytest

from engine.config import ModelConfig, RopeConfig

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def parse(**changes) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **changes})


def test_defaults_and_derived_head_dim():
    cfg = parse()
    assert cfg.head_dim == 16 and cfg.q_size == 64 and cfg.kv_size == 32
    assert cfg.rope == RopeConfig()
    assert cfg.sliding_windows == (None, None, None)
    assert not cfg.attention_bias and not cfg.qk_norm


def test_explicit_head_dim_and_qwen3_norm():
    cfg = parse(model_type="qwen3", head_dim=32)
    assert cfg.head_dim == 32 and cfg.q_size == 128 and cfg.qk_norm


def test_old_and_new_rope_styles_agree():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    old = parse(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling})
    new = parse(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling})
    assert old.rope == new.rope
    assert old.rope.rope_type == "llama3" and old.rope.theta == 5e5


def test_linear_rope():
    cfg = parse(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_scaling_names_it(kind):
    with pytest.raises(ValueError, match=kind):
        parse(rope_scaling={"rope_type": kind, "factor": 4.0})


def test_unknown_architecture_names_it():
    with pytest.raises(ValueError, match="'gpt2'"):
        parse(model_type="gpt2")


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("hidden_act", "gelu", "hidden_act"),
        ("quantization_config", {"quant_method": "gptq"}, "gptq"),
        ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
    ],
)
def test_unsupported_options_fail_at_load(key, value, needle):
    with pytest.raises(ValueError, match=needle):
        parse(**{key: value})


def test_biases_per_architecture():
    assert parse(model_type="qwen2").attention_bias
    assert not parse(model_type="qwen2").o_proj_bias
    llama = parse(attention_bias=True, mlp_bias=True)
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    assert not parse(model_type="mistral", attention_bias=True).attention_bias


def test_sliding_windows():
    assert parse(model_type="mistral", sliding_window=4096).sliding_windows == (4096,) * 3
    # qwen2 ignores the window unless use_sliding_window, then from max_window_layers on
    assert parse(model_type="qwen2", sliding_window=64).sliding_windows == (None,) * 3
    qwen = parse(
        model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=1
    )
    assert qwen.sliding_windows == (None, 64, 64)
    typed = parse(
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    assert typed.sliding_windows == (8, None, 8)
    with pytest.raises(ValueError, match="layer_types"):
        parse(layer_types=["full_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        parse(sliding_window=8, layer_types=["chunked_attention"] * 3)


def test_eos_ids_union_of_config_and_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 7, 9)


def test_missing_config_names_folder(tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        ModelConfig.from_pretrained(tmp_path)
