"""Write small GGUF files for tests with ``gguf.GGUFWriter``: a tiny HF model's weights (as
llama.cpp's converter lays them out: GGUF names, q/k rows permuted for llama, 2-D weights in
the chosen type, norms in F32) and an HF tokenizer folder's vocabulary as ``tokenizer.ggml.*``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFWriter,
    TokenType,
    get_tensor_name_map,
)
from gguf.constants import MODEL_ARCH_NAMES
from gguf.quants import quantize
from safetensors.torch import load_file

Q = GGMLQuantizationType
# gguf-py has no quantizer for the K types: tests write random blocks of them instead.
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Byte offsets of the float16 scale fields inside one block of each K type.
_K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TensorHook = Callable[[str, np.ndarray], np.ndarray]


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k permutation: per head, interleave the two rotary halves."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, 2, half, *rest).swapaxes(1, 2).reshape(rows, *rest)


def encode_tensor(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The bytes (or values, for F32/F16) ``GGUFWriter.add_tensor`` stores for ``qtype``."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return quantize(values.astype(np.float32), qtype)


def random_k_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random, valid bytes of a ``rows x cols`` K-quant tensor (scales small and finite)."""
    block, size = GGML_QUANT_SIZES[qtype]
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scale = gen.uniform(0.001, 0.01, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def write_model_gguf(
    hf_folder: Path,
    out: Path,
    qtype: GGMLQuantizationType = Q.F32,
    tokenizer_folder: Path | None = None,
    tensor_hook: TensorHook | None = None,
    metadata_hook: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """Convert an HF folder (config.json + model.safetensors) into a GGUF file.

    ``tensor_hook(gguf_name, float32 values)`` may replace a tensor's values before encoding
    (it returns values, raw block bytes of ``qtype``, or None to leave the tensor out).
    ``metadata_hook(writer)`` runs after the metadata is written. K types get random blocks.
    """
    config = json.loads((hf_folder / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = GGUFWriter(out, arch)
    _write_model_metadata(writer, config)
    if tokenizer_folder is not None:
        write_tokenizer_metadata(writer, tokenizer_folder)
    if metadata_hook is not None:
        metadata_hook(writer)
    tensors = load_file(hf_folder / "model.safetensors")
    for index, (gguf_name, values) in enumerate(_gguf_tensors(tensors, config, arch)):
        tensor_type = qtype if values.ndim == 2 else Q.F32
        if tensor_hook is not None:
            values = tensor_hook(gguf_name, values)
        if values is None:  # the hook dropped it
            continue
        if values.dtype == np.uint8:  # raw blocks from the hook
            writer.add_tensor(gguf_name, values, raw_dtype=qtype)
        elif tensor_type in K_QUANTS:
            blocks = random_k_blocks(*values.shape, tensor_type, seed=index)
            writer.add_tensor(gguf_name, blocks, raw_dtype=tensor_type)
        else:
            data = encode_tensor(values, tensor_type)
            raw = tensor_type if data.dtype == np.uint8 else None
            writer.add_tensor(gguf_name, data, raw_dtype=raw)
    _finish(writer)
    return out


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_model_metadata(writer: GGUFWriter, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config["model_type"] == "mistral" and config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _gguf_tensors(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], arch: str
) -> list[tuple[str, np.ndarray]]:
    arch_enum = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    name_map = get_tensor_name_map(arch_enum, config["num_hidden_layers"])
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    result = []
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        values = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            values = permute_rows(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = permute_rows(values, kv_heads)
        result.append((name_map.get_name(name, try_suffixes=(".weight", ".bias")), values))
    return result


# -- tokenizers -------------------------------------------------------------------------------


def write_tokenizer_metadata(
    writer: GGUFWriter,
    folder: Path,
    pre: str = "gpt2",
    with_merges: bool = True,
    add_bos: bool | None = None,
) -> None:
    """``tokenizer.ggml.*`` from an HF tokenizer folder built by tests/tokenizer_builders.py:
    ``gpt2`` for byte-level vocabularies, ``llama`` for byte-fallback ('▁') ones."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens, types = _tokens_by_id(spec)
    ids = {token: i for i, token in enumerate(tokens)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    sentencepiece = bool(spec["model"].get("byte_fallback"))
    writer.add_tokenizer_model("llama" if sentencepiece else "gpt2")
    if not sentencepiece:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if sentencepiece:
        writer.add_token_scores(_scores_from_merges(tokens, merges))
        writer.add_unk_token_id(ids["<unk>"])
    if with_merges:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(ids[config["bos_token"]])
    writer.add_eos_token_id(ids[config["eos_token"]])
    if config.get("pad_token"):
        writer.add_pad_token_id(ids[config["pad_token"]])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(config["chat_template"])


def _tokens_by_id(spec: dict[str, Any]) -> tuple[list[str], list[int]]:
    by_id = {i: (t, TokenType.NORMAL) for t, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        kind = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
        if added["content"] == spec["model"].get("unk_token"):
            kind = TokenType.UNKNOWN
        by_id[added["id"]] = (added["content"], kind)
    tokens, types = [], []
    for i in range(len(by_id)):
        token, kind = by_id[i]
        if token.startswith("<0x") and len(token) == 6 and kind == TokenType.NORMAL:
            kind = TokenType.BYTE
        tokens.append(token)
        types.append(int(kind))
    return tokens, types


def _scores_from_merges(tokens: list[str], merges: list[str]) -> list[float]:
    """SentencePiece-style scores: a piece made by an earlier merge scores higher."""
    rank = {"".join(m.split(" ")): -float(i) for i, m in reversed(list(enumerate(merges)))}
    return [rank.get(t, 0.0) for t in tokens]


def write_tokenizer_gguf(folder: Path, out: Path, arch: str = "llama", **kwargs: Any) -> Path:
    """A GGUF holding only model-free tokenizer metadata (enough for ``Tokenizer``)."""
    writer = GGUFWriter(out, arch)
    write_tokenizer_metadata(writer, folder, **kwargs)
    _finish(writer)
    return out
