"""The demo model: a small Llama with deterministic random weights, built offline on first use.

The server must start on a fresh machine with no network, so instead of downloading a model we
write one in Hugging Face format: ``config.json``, ``generation_config.json``,
``model.safetensors`` and a real byte-level BPE tokenizer trained on an embedded English corpus
(``demo_corpus.txt``). Its text is noise, but every code path (tokenizer, chat template, paged
attention, sampling, stop tokens) runs exactly as it would with a real model.

Public API:
    DemoModelSpec        -- the knobs (seed and shapes); frozen and validated.
    ensure_demo_model()  -- build (once, atomically) and return the model folder.
    resolve_model_path() -- turn a config ``model:`` section into a model folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.resources
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from engine.gguf_file import find_gguf_file

logger = logging.getLogger(__name__)

# Bump when the on-disk layout or the generation recipe changes, so old caches are not reused.
FORMAT_VERSION = 1

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: the trainer assigns special tokens first, so these get ids 0..3.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Byte-level BPE needs all 256 byte symbols plus our special tokens before any merge.
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
_INIT_STD = 0.02
_STALE_TMP_SECONDS = 3600.0
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape and seed of the demo model.

    With the defaults the model has 12,587,904 parameters (~12.6M, ~50 MB in float32):
    embeddings 4096*384 = 1,572,864; lm_head another 1,572,864 (untied); each of the 6 layers
    has q/o 2*384*384, k/v 2*384*128 (2 KV heads of dim 64), MLP 3*384*1024 and two norms of
    384 = 1,573,632 per layer, 9,441,792 in all; plus the final norm (384).
    """

    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        self._check_shapes()

    def _check_types(self) -> None:
        # YAML overrides arrive untyped. field.type is a string here (postponed annotations).
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"DemoModelSpec.{field.name} must be a bool, got {value!r}")
            elif field.type == "int":
                # bool is an int subclass; `layers: true` in YAML is a mistake, not 1.
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"DemoModelSpec.{field.name} must be an int, got {value!r}")
            elif field.type == "float":
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"DemoModelSpec.{field.name} must be a number, got {value!r}")
                # Normalise so `rope_theta: 500000` and `500000.0` hash to the same folder.
                object.__setattr__(self, field.name, float(value))

    def _check_shapes(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"DemoModelSpec.seed must be in [0, 2**63), got {self.seed}")
        if self.vocab_size < _MIN_VOCAB:
            raise ValueError(
                f"DemoModelSpec.vocab_size={self.vocab_size} is below {_MIN_VOCAB} "
                "(256 byte tokens + special tokens)"
            )
        for name in _POSITIVE_INTS:
            if getattr(self, name) <= 0:
                raise ValueError(f"DemoModelSpec.{name} must be > 0, got {getattr(self, name)}")
        self._check_heads()
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            # `not value > 0` also rejects NaN; inf would make config.json invalid JSON.
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"DemoModelSpec.{name} must be finite and > 0, got {value}")

    def _check_heads(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"DemoModelSpec.num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DemoModelSpec.num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2:
            # RoPE rotates pairs of channels.
            raise ValueError(f"DemoModelSpec head_dim={self.head_dim} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameter count of the LlamaForCausalLM this spec describes."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_hidden_layers * per_layer + h


# ---------------------------------------------------------------------------------------------
# Cache location


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get("PAGEDSERVE_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "pagedserve"


def _corpus_text() -> str:
    return importlib.resources.files("engine").joinpath("demo_corpus.txt").read_text("utf-8")


def spec_digest(spec: DemoModelSpec) -> str:
    """Short hash naming the cache folder: spec, format version and corpus all change it."""
    payload = {
        "spec": dataclasses.asdict(spec),
        "format_version": FORMAT_VERSION,
        "corpus_sha256": hashlib.sha256(_corpus_text().encode("utf-8")).hexdigest(),
    }
    blob = json.dumps(payload, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_complete(folder: pathlib.Path) -> bool:
    return folder.is_dir() and all((folder / name).is_file() for name in REQUIRED_FILES)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on the embedded corpus; deterministic for a given corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=specials,
        # The full byte alphabet makes every string encodable, not only the corpus' characters.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = _corpus_text().splitlines()
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, "special token ids moved"
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Weights


def _tensor_shapes(spec: DemoModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """HF LlamaForCausalLM tensor names and shapes, in the fixed order the RNG consumes them."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    yield "model.embed_tokens.weight", (spec.vocab_size, h)
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "mlp.gate_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, spec.intermediate_size)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not spec.tie_word_embeddings:
        # Tied checkpoints omit lm_head, as HF's save_pretrained does.
        yield "lm_head.weight", (spec.vocab_size, h)


def build_weights(spec: DemoModelSpec) -> dict[str, torch.Tensor]:
    """float32 weights: norms are ones, everything else N(0, 0.02) from one seeded generator."""
    generator = torch.Generator(device="cpu").manual_seed(spec.seed)
    shapes = list(_tensor_shapes(spec))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes, desc="demo model weights", unit="tensor", disable=None):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = torch.empty(shape, dtype=torch.float32).normal_(
                0.0, _INIT_STD, generator=generator
            )
    return tensors


# ---------------------------------------------------------------------------------------------
# Config files


def hf_config(spec: DemoModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` of a demo model (also used by the GPU benchmark's in-memory
    models, so both describe a spec the same way)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "use_cache": True,
        # Older readers look at torch_dtype, transformers >= 4.56 at dtype.
        "torch_dtype": "float32",
        "dtype": "float32",
        "demo_model": {"format_version": FORMAT_VERSION, **dataclasses.asdict(spec)},
    }


def _generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        # Chat replies end with <|im_end|>; raw completions with <|end_of_text|>.
        "eos_token_id": [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END_TOKEN)],
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        # The chat template frames every message itself; no implicit BOS.
        "add_bos_token": False,
        "add_eos_token": False,
        # Keep decode(encode(x)) == x: no space clean-up heuristics.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
    }


# ---------------------------------------------------------------------------------------------
# Building and publishing


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _finish_tree(folder: pathlib.Path) -> None:
    """Make the build readable by other users and durable before it is renamed into place."""
    # mkdtemp (and safetensors) create owner-only modes; the cache may be shared.
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)
        # Without fsync a power loss right after the rename could expose empty files.
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _write_model(spec: DemoModelSpec, folder: pathlib.Path) -> None:
    """Write every file of the model into `folder` (an empty temp directory)."""
    tokenizer = build_tokenizer(spec.vocab_size)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} > {spec.vocab_size} ids")
    logger.info(
        "demo tokenizer: %d trained ids, model vocab padded to %d",
        tokenizer.get_vocab_size(),
        spec.vocab_size,
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", _tokenizer_config())
    _write_json(folder / "special_tokens_map.json", _special_tokens_map())
    _write_json(folder / "config.json", hf_config(spec))
    _write_json(folder / "generation_config.json", _generation_config())
    save_file(build_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    _finish_tree(folder)


def _publish(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
    """Atomically move a finished build into place; if another process won, keep theirs."""
    if final.exists() and not _is_complete(final):
        # A damaged folder (not ours: our renames are atomic). Move it aside, then replace it.
        stale = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=final.parent))
        with contextlib.suppress(FileNotFoundError):  # someone else already moved it
            os.rename(final, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        # A concurrent build renamed first (EEXIST/ENOTEMPTY). Identical content: use theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete(final):
            raise
        logger.info("demo model: another process finished first, using %s", final)
    return final


def _remove_stale_temps(cache_dir: pathlib.Path, name: str) -> None:
    # Leftovers of crashed builds; young ones may belong to a build still running elsewhere.
    now = time.time()
    for path in cache_dir.glob(f".{name}.*"):
        try:
            if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            continue


def ensure_demo_model(
    spec: DemoModelSpec | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Return the folder of the demo model for `spec`, building it once if it is missing.

    The folder is ``<cache_dir>/demo-<hash>``; cache_dir defaults to ``$PAGEDSERVE_CACHE`` or
    ``~/.cache/pagedserve``. Builds go to a temp sibling that is renamed into place, so a
    folder with the final name is always complete.
    """
    spec = spec or DemoModelSpec()
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / f"demo-{spec_digest(spec)}"
    if _is_complete(final):
        logger.debug("demo model: using cached %s", final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root, final.name)
    logger.info("demo model: building %s (%d parameters)", final, spec.num_parameters())
    started = time.perf_counter()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _write_model(spec, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result = _publish(tmp, final)
    logger.info("demo model: ready in %.1f s at %s", time.perf_counter() - started, result)
    return result


# ---------------------------------------------------------------------------------------------
# Config presets


def _spec_from_overrides(overrides: Any) -> DemoModelSpec:
    if overrides is None or overrides is True:
        return DemoModelSpec()  # `demo:` or `demo: true` means the defaults
    if not isinstance(overrides, dict):
        raise ValueError(f"model.demo must be a mapping of DemoModelSpec fields, got {overrides!r}")
    known = {field.name for field in dataclasses.fields(DemoModelSpec)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown model.demo keys: {', '.join(map(str, unknown))} "
            f"(known: {', '.join(sorted(known))})"
        )
    return DemoModelSpec(**overrides)


def resolve_model_path(
    model_section: dict[str, Any], cache_dir: str | os.PathLike[str] | None = None
) -> pathlib.Path:
    """Model folder (or GGUF file) for a config's ``model:`` section: ``path:`` wins, else
    ``demo:``."""
    if not isinstance(model_section, dict):
        raise ValueError(f"model section must be a mapping, got {model_section!r}")
    path = model_section.get("path")
    if path is not None:
        folder = pathlib.Path(str(path)).expanduser()
        if not ((folder / "config.json").is_file() or find_gguf_file(folder)):
            raise ValueError(
                f"model.path {str(path)!r} is not a folder with a config.json, a .gguf file, "
                "or a folder holding one .gguf"
            )
        if "demo" in model_section:
            logger.warning("model.path is set; ignoring model.demo")
        return folder
    if "demo" in model_section:
        spec = _spec_from_overrides(model_section["demo"])
        return ensure_demo_model(spec, cache_dir=cache_dir)
    raise ValueError("model section needs either `path:` (an HF model folder) or `demo:`")
