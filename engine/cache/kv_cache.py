"""Paged K/V storage: per layer, K and V of shape [num_pages, page_size, kv_heads, head_dim],
unquantized tensors in the model's dtype ("fp16") or ``QuantPages`` (q8/q6/q4, layout in
engine/cache/quant.py).

INVARIANT: this module (with quant.py) is the one place that knows the layout; kernels and
the attention reference take the storage it returns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.page_table import (
    RECENT_BLOCKS,
    PageTable,
    budget_pages,
    pages_for_rows,
    whole_pages,
)
from engine.cache.quant import (
    CACHE_QUANTS,
    GROUP,
    QUANT_BITS,
    SCALE_DTYPE,
    QuantPages,
    allocate_quant_layers,
    check_center,
    check_exact_chunks,
    check_head_dim,
    check_quant,
    data_width,
    stacked_storage,
)
from engine.config import ModelConfig

__all__ = [
    "CACHE_QUANTS",
    "KVPages",
    "PagedCache",
    "allocate_kv_pages",
    "kv_bytes_per_token",
    "kv_format",
]

Pages = torch.Tensor | QuantPages
KVPages = list[tuple[Pages, Pages]]  # per layer: (k_pages, v_pages)


def allocate_kv_pages(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    quant: str = "fp16",
    rotate: bool | None = None,
    key_centers: Sequence[torch.Tensor] | None = None,
    num_sink_pages: int = 0,
    exact_chunks: bool = False,
) -> KVPages:
    """Zeroed K/V page storage for every layer (``quant``/``rotate``: see ``PagedCache``).
    ``key_centers``: per layer, the [KV, D] vector the quantized K pages subtract from every
    key (``QuantPages.center``); None: keys stored as they come. ``num_sink_pages``: pages
    0..R-1 also keep their rows unquantized (``QuantPages.sinks``). ``exact_chunks``: the K
    pages keep each forward's written rows for its attention (``QuantPages.written``)."""
    if num_pages <= 0:
        raise ValueError(f"num_pages must be positive, got {num_pages}")
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    rotate = check_quant(quant, rotate)
    bits = QUANT_BITS[quant]
    shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
    layers = config.num_layers
    if bits is None:
        if key_centers is not None:
            raise ValueError(f"key centers need a quantized cache, not {quant!r}")
        if num_sink_pages:
            raise ValueError(f"sink pages need a quantized cache, not {quant!r}")
        if exact_chunks:
            raise ValueError(f"exact_chunks needs a quantized cache, not {quant!r}")
        # (each of K and V one [L, P, S, KV, D] tensor: a page copy is one op, move_kv_pages)
        k, v = (torch.zeros((layers, *shape), dtype=dtype, device=device) for _ in range(2))
        return [(k[layer], v[layer]) for layer in range(layers)]
    if key_centers is not None and len(key_centers) != layers:
        raise ValueError(f"{len(key_centers)} key centers for {layers} layers")
    centers = list(key_centers) if key_centers is not None else [None] * layers
    k_bits, v_bits = bits
    sinks = {"num_sink_pages": num_sink_pages, "sink_dtype": dtype}
    k_pages = allocate_quant_layers(
        centers, *shape, k_bits, rotate, device, **sinks, exact_chunks=exact_chunks
    )
    v_pages = allocate_quant_layers([None] * layers, *shape, v_bits, rotate, device, **sinks)
    return list(zip(k_pages, v_pages, strict=True))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, quant: str = "fp16") -> int:
    """Bytes of K and V storage one token takes across all layers (values plus scales)."""
    check_quant(quant, None)
    bits = QUANT_BITS[quant]
    per_head = config.num_layers * config.num_kv_heads
    if bits is None:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * per_head * config.head_dim * element
    check_head_dim(config.head_dim)
    scale_bytes = config.head_dim // GROUP * torch.empty((), dtype=SCALE_DTYPE).element_size()
    return per_head * sum(data_width(config.head_dim, b) + scale_bytes for b in bits)


class PagedCache:
    """The K/V page storage of one model plus the page table that manages it.

    ``quant``: "fp16" stores K/V unquantized in the model's dtype (float16 on GPU, float32 for
    CPU runs); "q8", "q6" (K 8 bits, V 4 bits) and "q4" store packed integers plus a float16
    scale per 32 elements, read in place by the attention. ``rotate`` (quantized modes only;
    default on) applies a 32-point Hadamard rotation per group before quantizing.
    ``center_keys`` (quantized modes only; default on) subtracts the model's per-layer key
    centers (``Model.key_centers``) from every key before quantizing: exact for attention,
    smaller stored keys (engine/cache/quant.py). ``sink_pages`` (quantized modes only; default
    0) keeps that many pages unquantized as well, for sequences' first blocks ("attention
    sinks": engine/cache/page_table.py). ``recent_pages`` (quantized modes only; default 0):
    that many more unquantized pages hold sequences' last RECENT_BLOCKS blocks, so decoded
    tokens read their most recent keys exactly (engine/cache/page_table.py); RECENT_BLOCKS
    per running sequence serve every one (``recent_pages_for``). ``exact_chunks`` (quantized
    modes only; default on): a sequence with several tokens in a forward (a prompt chunk, a
    draft to verify) attends to the K/V those tokens wrote exactly, and only to earlier
    tokens through their codes,
    as ExLlamaV2 does; off, every read goes through the codes, so a token's numerics never
    depend on how its prompt was chunked (engine/cuda/quant_reference.py).
    """

    def __init__(
        self,
        model,
        max_num_tokens: int,
        page_size: int = 16,
        quant: str = "fp16",
        rotate: bool | None = None,
        center_keys: bool | None = None,
        sink_pages: int = 0,
        exact_chunks: bool | None = None,
        recent_pages: int = 0,
    ):
        self.rotate = check_quant(quant, rotate)
        self.center_keys = check_center(quant, center_keys)
        self.exact_chunks = check_exact_chunks(quant, exact_chunks)
        self.model = model
        self.page_size = page_size
        self.quant = quant
        self.num_pages = whole_pages(max_num_tokens, page_size)
        self.max_num_tokens = self.num_pages * page_size
        self.sink_pages = check_sink_pages(quant, sink_pages, self.num_pages)
        self.recent_pages = check_recent_pages(quant, recent_pages, self.num_pages - sink_pages)
        self.kv: KVPages = model.allocate_kv(
            self.num_pages,
            page_size,
            quant,
            self.rotate,
            self.center_keys,
            sink_pages + recent_pages,  # (both keep unquantized rows: pages 0..R+T-1)
            self.exact_chunks,
        )
        self.page_table = PageTable(self.num_pages, page_size, sink_pages, recent_pages)

    @classmethod
    def from_budget(
        cls,
        model,
        num_bytes: int,
        page_size: int = 16,
        quant: str = "fp16",
        rotate: bool | None = None,
        center_keys: bool | None = None,
        sink_pages: int = 0,
        exact_chunks: bool | None = None,
        recent_pages: int = 0,
    ) -> PagedCache:
        """The largest cache of whole pages whose K/V storage (key centers, sink and recent
        pages included) fits ``num_bytes``: a quantized mode holds proportionally more tokens
        in the same bytes."""
        per_token = kv_bytes_per_token(model.config, model.dtype, quant)
        num_bytes -= reserved_budget_bytes(
            model.config, model.dtype, quant, center_keys, sink_pages + recent_pages, page_size
        )
        try:
            pages = budget_pages(num_bytes, per_token, page_size)
        except ValueError as e:
            raise ValueError(f"{e} in a {quant} cache") from None
        layout = (quant, rotate, center_keys, sink_pages, exact_chunks, recent_pages)
        return cls(model, pages * page_size, page_size, *layout)

    def pages_for_rows(self, rows: int) -> int:
        """The most pages ``rows`` sequences may hold at once (``page_table.pages_for_rows``)."""
        return pages_for_rows(self.num_pages, self.sink_pages, rows, self.recent_pages)

    def move_pages(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (source, destination) page's stored rows (codes and scales; the rows of
        an unquantized cache) in every layer: the scheduler's ``take_page_moves``, settling
        recent pages. Stream-ordered after the forwards already launched, before the next."""
        if moves:
            move_kv_pages(self.kv, moves)

    def bytes_per_token(self) -> int:
        """Bytes one token really takes in this cache's storage, all layers, K and V."""
        return sum(_slot_bytes(k) + _slot_bytes(v) for k, v in self.kv)

    def num_bytes(self) -> int:
        """Bytes of the whole storage: the pages, the key centers of a centered cache and
        the unquantized rows of its sink pages."""
        extras = [
            t
            for pages in self.kv
            for p in pages
            if isinstance(p, QuantPages)
            for t in (p.center, p.sinks)
            if t is not None
        ]
        extra_bytes = sum(t.numel() * t.element_size() for t in extras)
        return self.bytes_per_token() * self.max_num_tokens + extra_bytes


def move_kv_pages(kv: KVPages, moves: Sequence[tuple[int, int]]) -> None:
    """``PagedCache.move_pages`` on storage: one gather and one scatter per stored tensor
    (a draft model's cache shares the table, so it moves the same pages)."""
    device = _storage(kv[0][0]).device
    index = torch.tensor(moves, dtype=torch.int64).T.contiguous()  # [2, n]: sources, targets
    if device.type == "cuda":  # (a pageable copy would wait for the device)
        index = index.pin_memory().to(device, non_blocking=True)
    sources, targets = index
    for per_layer in _stored_tensors(kv):
        stacked = stacked_storage(per_layer)
        if stacked is not None:  # every layer at once
            stacked.index_copy_(1, targets, stacked.index_select(1, sources))
            continue
        for t in per_layer:
            t.index_copy_(0, targets, t.index_select(0, sources))


def _stored_tensors(kv: KVPages) -> list[list[torch.Tensor]]:
    """Per stored tensor kind (K codes, K scales, V codes, ...; K and V rows), its layers."""
    names = ("data", "scales") if isinstance(kv[0][0], QuantPages) else (None,)
    return [
        [getattr(layer[side], name) if name else layer[side] for layer in kv]
        for side in (0, 1)
        for name in names
    ]


def _storage(pages: Pages) -> torch.Tensor:
    return pages.data if isinstance(pages, QuantPages) else pages


def recent_pages_for(rows: int) -> int:
    """Recent pages that let ``rows`` running sequences each keep RECENT_BLOCKS blocks."""
    return RECENT_BLOCKS * rows


def check_recent_pages(quant: str, recent_pages: int, room: int) -> int:
    if recent_pages and QUANT_BITS.get(quant) is None:
        raise ValueError(f"recent_pages needs a quantized cache, not {quant!r}")
    if not 0 <= recent_pages <= room:
        raise ValueError(
            f"recent_pages must be in [0, {room}] (the cache's pages less its sink pages), "
            f"got {recent_pages}"
        )
    if 0 < recent_pages < RECENT_BLOCKS:
        raise ValueError(
            f"recent_pages must be 0 or at least {RECENT_BLOCKS} (a sequence's last "
            f"{RECENT_BLOCKS} blocks), got {recent_pages}"
        )
    return recent_pages


def check_sink_pages(quant: str, sink_pages: int, num_pages: int) -> int:
    if sink_pages and QUANT_BITS.get(quant) is None:
        raise ValueError(f"sink_pages needs a quantized cache, not {quant!r}")
    if not 0 <= sink_pages <= num_pages:
        raise ValueError(
            f"sink_pages must be in [0, {num_pages}] (the cache's pages), got {sink_pages}"
        )
    return sink_pages


def kv_format(kv: KVPages) -> tuple[str, bool, bool, bool]:
    """(quant mode, rotate, center_keys, has sink pages) of existing storage, to allocate
    scratch pages like it (the same kernel specialisations)."""
    k, v = kv[0]
    if not isinstance(k, QuantPages):
        return "fp16", False, False, False
    bits = (k.bits, v.bits)
    quant = next(q for q, b in QUANT_BITS.items() if b == bits)
    return quant, k.rotate, k.center is not None, k.sinks is not None


def reserved_budget_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    quant: str,
    center_keys: bool | None,
    unquantized_pages: int,
    page_size: int,
) -> int:
    """What a byte budget holds besides its pages: the key centers of a centered cache and
    the unquantized rows of its sink and recent pages (``PagedCache.from_budget`` and the
    serving preset)."""
    reserved = unquantized_pages * page_size * kv_bytes_per_token(config, dtype)
    if check_center(quant, center_keys):
        reserved += center_bytes(config)
    return reserved


def center_bytes(config) -> int:
    """Bytes of a centered cache's key centers: float32 [KV, D] per layer."""
    return config.num_layers * config.num_kv_heads * config.head_dim * 4


def _slot_bytes(pages: Pages) -> int:
    if isinstance(pages, QuantPages):
        return pages.bytes_per_slot()
    return pages[0, 0].numel() * pages.element_size()
