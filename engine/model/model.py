"""``Model``: load a Hugging Face Llama-family folder or a GGUF file; run ragged, paged forwards."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.batch import ForwardBatch, SequenceInput, build_forward_batch
from engine.cache.key_centers import key_centers
from engine.cache.kv_cache import KVPages, allocate_kv_pages
from engine.cache.quant import check_center, check_exact_chunks, check_quant
from engine.config import ModelConfig
from engine.gguf_file import find_gguf_file, open_gguf
from engine.model.llama import LlamaForCausalLM
from engine.model.weights import load_weights
from engine.ops import OpSet, select_ops

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """float16 on CUDA and float32 on CPU unless asked otherwise."""
    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class Model:
    """A loaded decoder: config, weights on a device, and the op set that runs it by default.

    ``forward`` / ``logits`` are direct forwards (tests, benchmarks); the generator runs the
    model through an ``engine.model.runner.ModelRunner``, which also warms the kernels up.
    """

    def __init__(self, config: ModelConfig, network: LlamaForCausalLM, path: Path | None = None):
        self.config = config
        self.network = network
        self.path = path
        self.device = network.embed.device
        self.dtype = network.embed.dtype
        self.ops: OpSet = select_ops(self.device)
        self._key_centers: list[torch.Tensor] | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> Model:
        """Load an HF folder (``config.json`` + safetensors: bf16/fp16/fp32 on disk) or a GGUF
        file (a ``.gguf`` path, or a folder holding one and no ``config.json``), dequantized
        at load; any run dtype."""
        folder = Path(path)
        gguf_file = find_gguf_file(folder)
        if gguf_file is not None:
            reader = open_gguf(gguf_file)
            config = ModelConfig.from_gguf(reader)
        else:
            config = ModelConfig.from_pretrained(folder)
        dev = resolve_device(device)
        run_dtype = resolve_dtype(dtype, dev)
        ops = select_ops(dev)
        if not ops.supports_dtype(run_dtype):
            # The Numba kernels take fp16/fp32 (the simulator has no bf16); bf16 weights are
            # converted tensor by tensor at load, which fp16's range covers for LLM weights.
            logger.warning("%s requested with the %s ops: running in float16", run_dtype, ops.name)
            run_dtype = torch.float16
        network = LlamaForCausalLM(config, run_dtype, dev)
        if gguf_file is not None:
            from engine.model.gguf import load_gguf_weights

            load_gguf_weights(network, reader)
            del reader  # drops the file mapping
        else:
            ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
            load_weights(network.weight_targets(), folder, ignore=ignore)
        network.eval()
        model = cls(config, network, folder)
        logger.info(
            "loaded %s model from %s (%.1fM parameters, %s on %s)",
            config.architecture,
            folder,
            sum(p.numel() for p in network.parameters()) / 1e6,
            run_dtype,
            dev,
        )
        return model

    def allocate_kv(
        self,
        num_pages: int,
        page_size: int = 16,
        quant: str = "fp16",
        rotate: bool | None = None,
        center_keys: bool | None = None,
        num_sink_pages: int = 0,
        exact_chunks: bool | None = None,
    ) -> KVPages:
        """Paged K/V storage for this model on its device, in its dtype (or quantized: see
        ``PagedCache``; quantized keys are centered by default, ``key_centers``)."""
        check_quant(quant, rotate)
        exact_chunks = check_exact_chunks(quant, exact_chunks)
        centers = self.key_centers() if check_center(quant, center_keys) else None
        return allocate_kv_pages(
            self.config,
            num_pages,
            page_size,
            self.dtype,
            self.device,
            quant,
            rotate,
            centers,
            num_sink_pages,
            exact_chunks,
        )

    def key_centers(self) -> list[torch.Tensor]:
        """Per layer, the vector a quantized cache subtracts from every key before storing it
        (engine/cache/key_centers.py): one calibration forward, on first use."""
        if self._key_centers is None:
            self._key_centers = key_centers(self)
        return self._key_centers

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_pages: KVPages) -> torch.Tensor:
        """Run one ragged batch; writes its K/V into ``kv_pages``; returns float32 logits
        [len(batch.logits_indices), vocab]."""
        return self.network(batch, kv_pages, self.ops)

    def logits(self, input_ids: torch.Tensor | Sequence[int], page_size: int = 16) -> torch.Tensor:
        """Float32 logits [n, vocab] of every position of one sequence (no cache kept)."""
        ids = _flat_ids(input_ids)
        num_pages = -(-len(ids) // page_size)
        kv = self.allocate_kv(num_pages, page_size)
        row = SequenceInput(ids, num_cached=0, pages=range(num_pages), logits_rows=len(ids))
        return self.forward(build_forward_batch([row], page_size, self.device), kv)


def _flat_ids(input_ids: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"logits() takes one sequence, got shape {tuple(input_ids.shape)}")
        ids = input_ids.reshape(-1).tolist()
    else:
        ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("logits() needs at least one token")
    return ids
