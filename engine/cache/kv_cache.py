"""Paged K/V storage: per layer, K and V of shape [num_pages, page_size, kv_heads, head_dim].

INVARIANT: this module is the one place that knows the layout; kernels and the attention
reference take the tensors it returns.
"""

from __future__ import annotations

import torch

from engine.cache.page_table import PageTable, whole_pages
from engine.config import ModelConfig

KVPages = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_pages, v_pages)


def allocate_kv_pages(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVPages:
    """Zeroed K/V page storage for every layer."""
    if num_pages <= 0:
        raise ValueError(f"num_pages must be positive, got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V storage one token takes across all layers."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


CACHE_QUANTS = ("fp16",)


class PagedCache:
    """The K/V page storage of one model plus the page table that manages it.

    ``quant="fp16"`` stores K/V unquantized in the model's dtype (float16 on GPU, float32 for
    CPU runs). Quantized storage (q8/q6/q4) is a later work item and raises for now.
    """

    def __init__(self, model, max_num_tokens: int, page_size: int = 16, quant: str = "fp16"):
        if quant not in CACHE_QUANTS:
            raise ValueError(
                f"cache quant {quant!r} is not supported yet; choose one of {CACHE_QUANTS}"
            )
        self.model = model
        self.page_size = page_size
        self.quant = quant
        self.num_pages = whole_pages(max_num_tokens, page_size)
        self.max_num_tokens = self.num_pages * page_size
        self.kv: KVPages = model.allocate_kv(self.num_pages, page_size)
        self.page_table = PageTable(self.num_pages, page_size)
