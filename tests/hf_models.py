"""Small random-weight Hugging Face models written to disk for numerics tests.

Each builder returns the folder; ``reference_model(folder)`` loads it back with transformers
in float32 and eager attention (the exact reference, sliding windows included).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    # Larger than HF's 0.02 so attention is peaked and masking mistakes show in the logits.
    "initializer_range": 0.1,
}

VARIANTS = {
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 10000.0}),
    "llama_mha_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
    ),
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2_window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": False},
    ),
    "llama_gqa8": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 1},
    ),
}


def build_model(
    folder: Path,
    variant: str,
    seed: int = 0,
    torch_dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a random-weight model of ``variant`` (a key of VARIANTS) into ``folder``."""
    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch_dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def build_llama3_old_style(folder: Path, seed: int = 0) -> Path:
    """A llama with ``llama3`` rope scaling whose config.json uses the older keys
    (top-level ``rope_theta`` and ``rope_scaling`` with ``type``), as Llama 3.1 ships."""
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    build_model(
        folder,
        "llama_gqa",
        seed,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling},
    )
    config_file = folder / "config.json"
    raw = json.loads(config_file.read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 5e5
    raw["rope_scaling"] = {"type": "llama3", **scaling}
    config_file.write_text(json.dumps(raw, indent=2))
    return folder


def reference_model(folder: Path) -> torch.nn.Module:
    """The transformers model from ``folder`` in float32 with eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (the acceptance metric)."""
    return float((got - ref).abs().max() / ref.abs().max())
