"""Model configuration parsed from a Hugging Face ``config.json`` or a GGUF file's metadata.

Only the Llama family is supported (llama, mistral, qwen2, qwen3). Anything we cannot run
exactly fails here, at load, with a ``ValueError`` that names it: a model that loads must
produce the same numbers as the reference implementation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.gguf_file import find_gguf_file, hf_config_dict, open_gguf

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either HF config style."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 frequency-dependent scaling
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and options of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (qwen2, some llamas)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (qwen3)
    # One entry per layer: the sliding-window size in tokens (key j is visible to query i when
    # i - window < j <= i), or None for full attention.
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a positive multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even, got {self.head_dim}")
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries for "
                f"{self.num_layers} layers"
            )
        for window in self.sliding_windows:
            if window is not None and window <= 0:
                raise ValueError(f"sliding_window must be positive, got {window}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """From an HF folder's ``config.json``, or a ``.gguf`` file (or a folder holding one and
        no ``config.json``)."""
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return cls.from_gguf(open_gguf(gguf_file))
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ValueError(f"no config.json in model folder {str(path)!r}")
        with open(config_file, encoding="utf-8") as f:
            raw = json.load(f)
        return cls.from_dict(raw, generation_config=_read_generation_config(Path(path)))

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> ModelConfig:
        """From an open GGUF file's metadata, through the same checks as ``config.json``."""
        return cls.from_dict(hf_config_dict(reader))

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Parse an HF config dict (older and newer key styles)."""
        arch = raw.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _check_unsupported_options(raw)
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        head_dim = raw.get("head_dim") or hidden // num_heads
        qkv_bias, o_bias = _attention_biases(raw, arch)
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=arch == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_windows=parse_sliding_windows(raw, arch, num_layers),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw, generation_config or {}),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )


def _read_generation_config(path: Path) -> dict[str, Any]:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _eos_ids(raw: dict[str, Any], generation_config: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (raw.get("eos_token_id"), generation_config.get("eos_token_id")):
        values = source if isinstance(source, list) else [source]
        ids.extend(int(v) for v in values if v is not None and int(v) not in ids)
    return tuple(ids)


def _attention_biases(raw: dict[str, Any], arch: str) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as each architecture's reference code builds them."""
    if arch == "qwen2":
        return True, False  # qwen2 always has q/k/v biases, whatever attention_bias says
    if arch == "mistral":
        return False, False
    bias = bool(raw.get("attention_bias", False))
    return bias, bias


def _check_unsupported_options(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; only silu is implemented")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"unsupported pretraining_tp {raw['pretraining_tp']!r}")
    partial = raw.get(
        "partial_rotary_factor",
        (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0),
    )
    if partial not in (1, 1.0, None):
        raise ValueError(f"unsupported partial_rotary_factor {partial!r}")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ValueError(f"unsupported quantization_config (quant_method {method!r})")


def parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Normalise ``rope_theta`` + ``rope_scaling`` (older) or ``rope_parameters`` (newer)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    if not params:
        params = dict(scaling)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get(
                "original_max_position_embeddings",
                raw.get("max_position_embeddings", defaults.original_max_position_embeddings),
            )
        ),
    )


def parse_sliding_windows(
    raw: dict[str, Any], arch: str, num_layers: int
) -> tuple[int | None, ...]:
    """Per-layer window sizes, honouring ``layer_types`` when the config lists them."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}")
        if window is None and "sliding_attention" in layer_types:
            raise ValueError("layer_types has sliding_attention but sliding_window is null")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * num_layers
    if arch == "mistral":
        return (int(window),) * num_layers
    if arch in ("qwen2", "qwen3"):
        if not raw.get("use_sliding_window", False):
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    # llama configs do not define a window; a stray value is ignored by transformers too.
    return (None,) * num_layers
