"""GGUF weights: dequantized at load, tensor by tensor, into the preallocated parameters.

Each tensor is dequantized by the ``gguf`` package (float32 numpy), its rows are put back in
Hugging Face order where llama.cpp's converter permuted them, and it is copied into its
parameter (or a slice of a fused q/k/v or gate/up one) through the same ``WeightTarget``s the
safetensors path uses. Peak memory is the model plus a few copies of one tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES
from gguf.quants import dequantize
from tqdm import tqdm

from engine.config import ModelConfig
from engine.gguf_file import PERMUTED_QK_ARCHITECTURES, architecture
from engine.model.llama import LlamaForCausalLM
from engine.model.weights import WeightTarget, copy_into

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)
# Per-frequency rotary divisors (llama 3 scaling as llama.cpp stores it).
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True, slots=True)
class GGUFTarget:
    """Where one GGUF tensor goes, and whether its rows need llama.cpp's q/k permutation
    undone (``unpermute_heads`` is then the head count the converter permuted with)."""

    hf_name: str
    target: WeightTarget
    unpermute_heads: int | None = None


def gguf_targets(
    targets: dict[str, WeightTarget], config: ModelConfig, arch: str
) -> dict[str, GGUFTarget]:
    """The network's HF-named targets keyed by their GGUF tensor names (gguf's own name map)."""
    arch_enum = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    name_map = get_tensor_name_map(arch_enum, config.num_layers)
    permuted = arch in PERMUTED_QK_ARCHITECTURES
    result: dict[str, GGUFTarget] = {}
    for hf_name, target in targets.items():
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF tensor name for parameter {hf_name!r} ({arch})")
        heads = None
        if permuted and ".self_attn.q_proj." in hf_name:
            heads = config.num_heads
        elif permuted and ".self_attn.k_proj." in hf_name:
            heads = config.num_kv_heads
        result[gguf_name] = GGUFTarget(hf_name, target, heads)
    return result


def check_tensor_types(tensors: list[ReaderTensor]) -> None:
    """Refuse tensors stored in types the loader does not dequantize, naming each."""
    bad = [
        f"{t.name!r} ({t.tensor_type.name})"
        for t in tensors
        if t.tensor_type not in SUPPORTED_TYPES
    ]
    if bad:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"GGUF tensors of unsupported types: {', '.join(bad[:5])}{more}; supported: {supported}"
        )


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 in PyTorch layout (rows = ggml's last dimension)."""
    check_tensor_types([tensor])
    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists the fastest dim first
    values = values.reshape(shape).astype(np.float32, copy=False)
    # F32 tensors come back as views of the read-only file mapping; torch wants writable memory
    return values if values.flags.writeable else values.copy()


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's q/k permutation: per head, llama.cpp interleaves the two
    rotary halves (rows x0 y0 x1 y1 ...); HF keeps them apart (x0 x1 ... y0 y1 ...).
    Works for weights [rows, in] and biases [rows]."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows over {num_heads} heads")
    half = rows // num_heads // 2
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def load_gguf_weights(network: LlamaForCausalLM, reader: GGUFReader) -> None:
    """Copy every tensor of ``reader`` into ``network``; fail listing missing/unexpected ones."""
    check_tensor_types(reader.tensors)  # before any work
    config = network.cfg
    targets = gguf_targets(network.weight_targets(), config, architecture(reader))
    loaded: set[str] = set()
    unexpected: list[str] = []
    progress = tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=None)
    for tensor in progress:
        if tensor.name == ROPE_FREQS:
            apply_rope_freqs(network, torch.from_numpy(dequantize_tensor(tensor)))
        elif tensor.name in targets:
            _load_one(tensor, targets[tensor.name])
            loaded.add(tensor.name)
        else:
            unexpected.append(tensor.name)
    missing = sorted(targets[name].hf_name for name in set(targets) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"GGUF tensors do not match the model: missing {missing[:20]}, "
            f"unexpected {sorted(unexpected)[:20]}"
        )
    logger.info("loaded %d GGUF tensors", len(loaded))


def _load_one(tensor: ReaderTensor, spec: GGUFTarget) -> None:
    weight = torch.from_numpy(dequantize_tensor(tensor))
    if spec.unpermute_heads is not None:
        weight = unpermute_rows(weight, spec.unpermute_heads)
    copy_into(f"{tensor.name} ({spec.hf_name})", weight, spec.target)


def apply_rope_freqs(network: LlamaForCausalLM, factors: torch.Tensor) -> None:
    """llama.cpp divides each rotary frequency by its factor (how it stores llama 3 scaling)."""
    inv_freq = network.inv_freq
    if factors.reshape(-1).shape != inv_freq.shape:
        raise ValueError(
            f"GGUF tensor {ROPE_FREQS!r} has {factors.numel()} factors, the model has "
            f"{inv_freq.numel()} rotary frequencies"
        )
    inv_freq.div_(factors.reshape(-1).to(inv_freq))
