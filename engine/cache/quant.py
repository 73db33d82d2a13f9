"""Quantized K/V page layout (q8, q6, q4) and its torch reference quantize / dequantize.

INVARIANT: this module is the one place that knows how a quantized page is laid out; the
cache allocates through it, the torch reference attention dequantizes through it and the
Numba kernels (engine/cuda/quant_attention.py) follow the same rules, checked against it.

Layout, per layer and for K and V separately (``QuantPages``):

- Groups of ``GROUP`` = 32 consecutive elements along head_dim, symmetric: one float16 scale
  per group, ``scale = absmax / qmax`` (qmax = 2^(bits-1) - 1: 127 for 8 bits, 7 for 4) and
  ``q = clamp(floor(x / scale + 0.5), -qmax, qmax)``, so ``|x - q * scale| <= scale / 2``.
- 8 bits: ``data`` int8 ``[P, S, KV, D]``, one value per byte.
- 4 bits: ``data`` uint8 ``[P, S, KV, D // 2]``: a group of 32 is 16 bytes (one 128-bit load)
  plus its scale. Byte j of a group holds element j in its low nibble and element j + 16 in
  its high nibble, each stored as q + 8 (1..15). This "split halves" packing lets the attention
  kernel's lanes, which own head dims lane, lane + LT, ..., read contiguous bytes.
- ``scales``: float16 ``[P, S, KV, D // 32]``.

Modes: q8 = K 8 bits, V 8 bits; q6 = K 8 bits, V 4 bits (as ExLlamaV2's Q6: keys are the more
sensitive half, so the bits go there; 6 bits per element on average); q4 = 4 and 4.

Optional rotation (``rotate``): each group is multiplied by the normalised 32-point Hadamard
matrix H (orthonormal and symmetric, so H^-1 = H) before quantizing. It spreads an outlier's
energy over its group, shrinking the absmax and so the step. Attention never undoes it per key:
q . k = (q H) . (k H), and sum_j p_j v_j = (sum_j p_j (v_j H)) H, so the query is rotated once
and the output once (``rotate_groups``), and the kernel works in the rotated space throughout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

GROUP = 32
SCALE_DTYPE = torch.float16
FP16_MAX = 65504.0
# mode -> (K bits, V bits); "fp16" is the unquantized cache (the model's own dtype).
QUANT_BITS: dict[str, tuple[int, int] | None] = {
    "fp16": None,
    "q8": (8, 8),
    "q6": (8, 4),
    "q4": (4, 4),
}
CACHE_QUANTS = tuple(QUANT_BITS)


def qmax(bits: int) -> int:
    """Largest quantized magnitude of a symmetric ``bits``-bit code."""
    return (1 << (bits - 1)) - 1


def check_quant(quant: str, rotate: bool | None) -> bool:
    """Validate a cache mode; returns whether groups are rotated (default: yes when quantized,
    as ExLlamaV2 does; see bench/results/kv_quant_quality.json for the measurement)."""
    if quant not in QUANT_BITS:
        raise ValueError(f"cache quant {quant!r} is not one of {', '.join(CACHE_QUANTS)}")
    if QUANT_BITS[quant] is None:
        if rotate:
            raise ValueError(f"rotate=True needs a quantized cache, not {quant!r}")
        return False
    return True if rotate is None else bool(rotate)


def check_head_dim(head_dim: int) -> None:
    if head_dim % GROUP:
        raise ValueError(f"a quantized cache needs head_dim divisible by {GROUP}, got {head_dim}")


def data_width(head_dim: int, bits: int) -> int:
    """Bytes of one token-head's values (the last dim of ``QuantPages.data``)."""
    return head_dim * bits // 8


def data_dtype(bits: int) -> torch.dtype:
    if bits == 8:
        return torch.int8
    if bits == 4:
        return torch.uint8
    raise ValueError(f"unsupported bit width {bits} (8 or 4)")


@dataclass(frozen=True, slots=True)
class QuantPages:
    """One layer's K (or V) pages, quantized. ``shape`` is the logical [P, S, KV, D]."""

    data: torch.Tensor  # int8 [P, S, KV, D] (8 bits) or uint8 [P, S, KV, D // 2] (4 bits)
    scales: torch.Tensor  # float16 [P, S, KV, D // GROUP]
    bits: int
    rotate: bool

    @property
    def shape(self) -> tuple[int, int, int, int]:
        p, s, kv, groups = self.scales.shape
        return (p, s, kv, groups * GROUP)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def bytes_per_slot(self) -> int:
        """Bytes one token takes in these pages (all KV heads): values plus scales."""
        per = self.data[0, 0].numel() * self.data.element_size()
        return per + self.scales[0, 0].numel() * self.scales.element_size()


def allocate_quant_pages(
    num_pages: int, page_size: int, kv_heads: int, head_dim: int, bits: int, rotate: bool, device
) -> QuantPages:
    check_head_dim(head_dim)
    shape = (num_pages, page_size, kv_heads)
    width = data_width(head_dim, bits)
    return QuantPages(
        data=torch.zeros((*shape, width), dtype=data_dtype(bits), device=device),
        scales=torch.zeros((*shape, head_dim // GROUP), dtype=SCALE_DTYPE, device=device),
        bits=bits,
        rotate=rotate,
    )


@functools.cache
def _hadamard(device_type: str, device_index: int | None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of order GROUP (float32, symmetric)."""
    h = torch.ones(1, 1)
    while h.shape[0] < GROUP:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / GROUP**0.5).to(torch.device(device_type, device_index))


def hadamard(device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    return _hadamard(device.type, device.index)


def rotate_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] with every group of 32 multiplied by H (its own inverse), in x's dtype."""
    shape = x.shape
    groups = x.float().reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    return (groups @ hadamard(x.device)).reshape(shape).to(x.dtype)


def quantize(x: torch.Tensor, bits: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., data_width], float16 scales [..., D // 32]); math in float32."""
    head_dim = x.shape[-1]
    check_head_dim(head_dim)
    groups = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)
    if rotate:
        groups = groups @ hadamard(x.device)
    top = qmax(bits)
    absmax = groups.abs().amax(dim=-1)
    scales = (absmax / top).clamp_max(FP16_MAX).to(SCALE_DTYPE)
    # Quantize with the stored (fp16-rounded) scale: the bound |x - q s| <= s/2 holds for the
    # scale dequantization uses. A zero scale means an all-zero group (or one below fp16's
    # range): dividing by 1 instead gives q = 0.
    step = scales.float()
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.floor(groups / step[..., None] + 0.5).clamp(-top, top)
    return _pack(q, bits), scales


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [..., G, 32] integral floats -> data [..., G * 32 * bits / 8]."""
    lead = q.shape[:-2]
    if bits == 8:
        return q.to(torch.int8).reshape(*lead, -1)
    u = (q + 8).to(torch.uint8)
    return (u[..., : GROUP // 2] | (u[..., GROUP // 2 :] << 4)).reshape(*lead, -1)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """data [..., W] -> float32 q [..., G, 32]."""
    lead = data.shape[:-1]
    if bits == 8:
        return data.float().reshape(*lead, -1, GROUP)
    b = data.reshape(*lead, -1, GROUP // 2)
    low = (b & 15).float() - 8
    high = (b >> 4).float() - 8
    return torch.cat((low, high), dim=-1)


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data, scales -> values [..., D] in ``dtype`` (still rotated if they were stored so)."""
    q = _unpack(data, bits) * scales.float()[..., None]
    return q.reshape(*q.shape[:-2], -1).to(dtype)


def dequantize_pages(pages: QuantPages, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages ``index`` ([...] page ids) dequantized: [..., S, KV, D]. Only those pages."""
    return dequantize(pages.data[index], pages.scales[index], pages.bits, dtype)


def write_slots(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize rows x [T, KV, D] into ``slots`` ([T] page * S + offset, all valid)."""
    data, scales = quantize(x, pages.bits, pages.rotate)
    pages.data.view(-1, *pages.data.shape[2:]).index_copy_(0, slots, data)
    pages.scales.view(-1, *pages.scales.shape[2:]).index_copy_(0, slots, scales)
