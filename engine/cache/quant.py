"""Quantized K/V page layout (q8, q6, q4) and its torch reference quantize / dequantize.

INVARIANT: this module is the one place that knows how a quantized page is laid out; the
cache allocates through it, the torch reference attention dequantizes through it and the
Numba kernels (engine/cuda/quant_attention.py) follow the same rules, checked against it.

Layout, per layer and for K and V separately (``QuantPages``):

- Groups of ``GROUP`` = 32 consecutive elements along head_dim, symmetric (no zero point):
  one float16 scale per group, value = q * scale, and
  ``q = clamp(floor(x / scale + 0.5), -2^(bits-1), qmax)`` (qmax = 2^(bits-1) - 1).
- 8 bits: ``scale = absmax / 127``, so ``|x - q * scale| <= scale / 2``; ``data`` int8
  ``[P, S, KV, D]``, one value per byte.
- 4 bits, rotated groups: the scale is searched (``search_scales``): the group's
  largest-magnitude element m is mapped towards the code -8 (the 16th level absmax / 7 leaves
  unused) by a signed scale ``-m / d`` for each divisor d in ``SEARCH_DIVISORS`` (d > 8 clips
  the group's largest values to buy a finer step for the rest), and the candidate whose
  stored scale reconstructs the group with the least squared error is kept. d = 7 is the
  absmax / 7 scheme (up to the codes' sign), so a group's error never exceeds that scheme's:
  L2 <= sqrt(32) s7 / 2. On SmolLM2's rotated keys and values it cuts the squared error by
  ~29% and q4+rot's perplexity increase over the 4096-token bench text from +8.4% to +4.7%
  (bench/results/kv_quant_quality.json). Unrotated
  groups keep absmax / 7: there clipping a key's outlier channel costs more than the finer
  step buys (the same search measured +15.2% against +12.6% over 1024 tokens).
  ``data`` uint8 ``[P, S, KV, D // 2]``: a group of 32 is 16 bytes (one 128-bit load) plus its
  scale. Byte j of a group holds element j in its low nibble and element j + 16 in its high
  nibble, each stored as q + 8 (0..15). This "split halves" packing lets the attention
  kernel's lanes, which own head dims lane, lane + LT, ..., read contiguous bytes.
- ``scales``: float16 ``[P, S, KV, D // 32]``.
- ``sinks`` (optional): ``[R, S, KV, D]`` in the model's dtype. Pages 0..R-1 keep their rows
  here too, after the center is taken off and the rotation applied (what the codes encode),
  and attention reads those pages from here: the unquantized first page of each sequence
  (the page table gives every first block a page below R and no other block one).

Modes: q8 = K 8 bits, V 8 bits; q6 = K 8 bits, V 4 bits (as ExLlamaV2's Q6: keys are the more
sensitive half, so the bits go there; 6 bits per element on average); q4 = 4 and 4.

Optional rotation (``rotate``): each group is multiplied by the normalised 32-point Hadamard
matrix H (orthonormal and symmetric, so H^-1 = H) before quantizing. It spreads an outlier's
energy over its group, shrinking the absmax and so the step. Attention never undoes it per key:
q . k = (q H) . (k H), and sum_j p_j v_j = (sum_j p_j (v_j H)) H, so the query is rotated once
and the output once (``rotate_groups`` here; the Numba kernel does both itself), and attention
works in the rotated space throughout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from engine.cache.gather import take_pages

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
# 4-bit scale candidates: |m| / |scale| (exact in float32; the kernel takes the same list).
SEARCH_DIVISORS = (7.0, 7.5, 8.0, 8.25, 8.5, 8.75, 9.0, 9.5)
SEARCH_BITS = 4  # width whose rotated groups' scales are searched (8 bits: a ~7% gain only)


def qmax(bits: int) -> int:
    """Largest quantized magnitude of a symmetric ``bits``-bit code."""
    return (1 << (bits - 1)) - 1


def qmin(bits: int) -> int:
    """Smallest code of a ``bits``-bit group (the 4-bit search uses it; absmax never does)."""
    return -(1 << (bits - 1))


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


def check_center(quant: str, center: bool | None) -> bool:
    """Validate key centering for a cache mode; returns whether keys are centered (default:
    yes when quantized; bench/results/kv_quant_quality.json has the measurement)."""
    if QUANT_BITS.get(quant) is None:
        if center:
            raise ValueError(f"center_keys=True needs a quantized cache, not {quant!r}")
        return False
    return True if center is None else bool(center)


def check_exact_chunks(quant: str, exact_chunks: bool | None) -> bool:
    """Validate ``exact_chunks`` for a cache mode; returns whether a forward's multi-token
    rows read the K/V they wrote exactly (default: yes when quantized;
    engine/cuda/quant_reference.py has why and what it costs)."""
    if QUANT_BITS.get(quant) is None:
        if exact_chunks:
            raise ValueError(f"exact_chunks=True needs a quantized cache, not {quant!r}")
        return False
    return True if exact_chunks is None else bool(exact_chunks)


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
class WrittenRows:
    """The K/V rows one forward's cache write took, as they came (before rotary, centering,
    rotation and quantization), so that the same forward's attention can read them exactly
    instead of through their codes (as ExLlamaV2 does: a prompt's tokens attend to each other
    unquantized). ``slot_mapping`` is the write's own argument, the batch's tensor: attention
    uses the rows only with the batch that holds this very tensor, so rows never reach
    another forward."""

    slot_mapping: torch.Tensor  # [T] long (negative: padding, not written)
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor  # [T, KV, D]
    cos: torch.Tensor  # [T, D / 2]
    sin: torch.Tensor  # [T, D / 2]


class RowStash:
    """Where a layer's cache write leaves its ``WrittenRows`` for that layer's attention,
    which takes them (one forward, one layer: write, then attention)."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: WrittenRows | None = None

    def put(self, rows: WrittenRows) -> None:
        self.rows = rows

    def take(self, slot_mapping: torch.Tensor) -> WrittenRows | None:
        """The rows written with this very ``slot_mapping`` (None: none, or another
        forward's, which are dropped); the stash is empty afterwards either way."""
        rows, self.rows = self.rows, None
        return rows if rows is not None and rows.slot_mapping is slot_mapping else None


@dataclass(frozen=True, slots=True)
class QuantPages:
    """One layer's K (or V) pages, quantized. ``shape`` is the logical [P, S, KV, D]."""

    data: torch.Tensor  # int8 [P, S, KV, D] (8 bits) or uint8 [P, S, KV, D // 2] (4 bits)
    scales: torch.Tensor  # float16 [P, S, KV, D // GROUP]
    bits: int
    rotate: bool
    # float32 [KV, D] subtracted from every row before it is quantized (key centering, see
    # the module docstring); None: rows are stored as they come
    center: torch.Tensor | None = None
    # [R, S, KV, D] in the model's dtype: pages 0..R-1 ("sink pages", which hold sequences'
    # first blocks: engine/cache/page_table.py) keep their rows unquantized here, centered
    # and rotated like the codes, and are read from here; None: every page is quantized
    sinks: torch.Tensor | None = None
    # K pages with ``exact_chunks``: the current forward's written rows, for its attention;
    # None: attention reads every row through its code
    written: RowStash | None = field(default=None, compare=False, repr=False)

    @property
    def num_sink_pages(self) -> int:
        return 0 if self.sinks is None else self.sinks.shape[0]

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
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    bits: int,
    rotate: bool,
    device,
    center: torch.Tensor | None = None,
    num_sink_pages: int = 0,
    sink_dtype: torch.dtype = torch.float16,
    exact_chunks: bool = False,
) -> QuantPages:
    return allocate_quant_layers(
        [center],
        num_pages,
        page_size,
        kv_heads,
        head_dim,
        bits,
        rotate,
        device,
        num_sink_pages,
        sink_dtype,
        exact_chunks,
    )[0]


def allocate_quant_layers(
    centers: list[torch.Tensor | None],
    num_pages: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    bits: int,
    rotate: bool,
    device,
    num_sink_pages: int = 0,
    sink_dtype: torch.dtype = torch.float16,
    exact_chunks: bool = False,
) -> list[QuantPages]:
    """``allocate_quant_pages`` for one layer per center: each layer's codes, scales and
    unquantized rows are views of one tensor over all layers ([L, P, ...], a layer's part
    contiguous), so a page copy is one operation for every layer (``stacked_storage``)."""
    check_head_dim(head_dim)
    if not 0 <= num_sink_pages <= num_pages:
        raise ValueError(f"num_sink_pages must be in [0, {num_pages}], got {num_sink_pages}")
    shape = (len(centers), num_pages, page_size, kv_heads)
    width = data_width(head_dim, bits)
    data = torch.zeros((*shape, width), dtype=data_dtype(bits), device=device)
    scales = torch.zeros((*shape, head_dim // GROUP), dtype=SCALE_DTYPE, device=device)
    rows = None
    if num_sink_pages:
        rows_shape = (len(centers), num_sink_pages, *shape[2:], head_dim)
        rows = torch.zeros(rows_shape, dtype=sink_dtype, device=device)
    return [
        QuantPages(
            data=data[layer],
            scales=scales[layer],
            bits=bits,
            rotate=rotate,
            center=_checked_center(center, kv_heads, head_dim, device),
            sinks=None if rows is None else rows[layer],
            written=RowStash() if exact_chunks else None,
        )
        for layer, center in enumerate(centers)
    ]


def _checked_center(center: torch.Tensor | None, kv_heads: int, head_dim: int, device):
    if center is None:
        return None
    if tuple(center.shape) != (kv_heads, head_dim):
        raise ValueError(
            f"a key center must be [kv_heads, head_dim] = [{kv_heads}, {head_dim}], "
            f"got {tuple(center.shape)}"
        )
    return center.to(device=device, dtype=torch.float32).contiguous()


def stacked_storage(per_layer: list[torch.Tensor]) -> torch.Tensor | None:
    """The [L, ...] tensor whose layer views ``per_layer`` are (``allocate_quant_layers``,
    ``kv_cache.allocate_kv_pages``), or None if they are not one tensor's layers in order."""
    base = per_layer[0]._base
    if base is None or base.dim() != per_layer[0].dim() + 1 or base.shape[0] != len(per_layer):
        return None
    if base.stride(0) != per_layer[0].numel() or not base.is_contiguous():
        return None
    step = base.stride(0) * base.element_size()
    first = base.data_ptr()
    for layer, t in enumerate(per_layer):
        if t._base is not base or t.data_ptr() != first + layer * step:
            return None
    return base


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


def quantize(
    x: torch.Tensor, bits: int, rotate: bool, search: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., data_width], float16 scales [..., D // 32]); math in float32.
    ``search`` (default: rotated 4-bit groups, ``searches``) picks each group's scale by
    ``search_scales``, otherwise absmax / qmax."""
    groups = rotated_groups(x, rotate)
    if searches(bits, rotate) if search is None else search:
        scales = search_scales(groups, bits)
    else:
        absmax = groups.abs().amax(dim=-1)
        scales = (absmax / qmax(bits)).clamp_max(FP16_MAX).to(SCALE_DTYPE)
    return _pack(_codes(groups, scales, bits), bits), scales


def rotated_groups(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    """x [..., D] -> the groups ``quantize`` quantizes: float32 [..., D // 32, 32], each times
    H when ``rotate`` (by ``hadamard_butterflies``: the write kernels' arithmetic)."""
    head_dim = x.shape[-1]
    check_head_dim(head_dim)
    groups = x.float().reshape(*x.shape[:-1], head_dim // GROUP, GROUP)
    return hadamard_butterflies(groups) if rotate else groups


# The last butterfly stage's factor, 1 / sqrt(32) rounded to float32 (the kernels' constant)
BUTTERFLY_NORM = 1.0 / GROUP**0.5


def hadamard_butterflies(groups: torch.Tensor) -> torch.Tensor:
    """float32 groups [..., 32] times H (``hadamard``'s matrix) in five butterfly stages,
    (x_i, x_i+h) -> (x_i + x_i+h, x_i - x_i+h) for h = 1, 2, 4, 8, 16, the last one times
    1 / sqrt(32): the same float32 operations in the same order as the cache-write kernels
    (engine/cuda/quant_kernels.py, engine/cpu/quant_write.py), so the codes they write are
    this reference's bit for bit. (A matmul by H gives the same transform, rounded in an
    order of the BLAS's choosing.)"""
    h = 1
    while h < GROUP:
        pairs = groups.unflatten(-1, (GROUP // (2 * h), 2, h))  # i with bit h clear, i + h
        a, b = pairs.select(-2, 0), pairs.select(-2, 1)
        plus, minus = a + b, a - b
        if 2 * h == GROUP:  # (a float32 tensor times a Python float: the float32 product)
            plus, minus = plus * BUTTERFLY_NORM, minus * BUTTERFLY_NORM
        groups = torch.stack((plus, minus), dim=-2).flatten(-3)
        h *= 2
    return groups


def searches(bits: int, rotate: bool) -> bool:
    """Whether groups of this width and rotation get a searched scale (see the layout)."""
    return bits == SEARCH_BITS and rotate


def _codes(groups: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of groups [..., G, 32] under float16 scales [..., G], as integral floats.
    Quantize with the stored (fp16-rounded) scale: dequantization uses that one. A zero
    scale means an all-zero group (or one below fp16's range): dividing by 1 gives q = 0."""
    step = scales.float()
    step = torch.where(step != 0, step, torch.ones_like(step))
    return torch.floor(groups / step[..., None] + 0.5).clamp(qmin(bits), qmax(bits))


def search_scales(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """Per group of [..., G, 32], the float16 scale -m / d (m: the group's first element of
    largest magnitude; d in SEARCH_DIVISORS) whose codes reconstruct the group with the least
    squared error (the first such d on a tie). The errors are summed in float64 from float32
    residuals (q * scale is exact: a small integer times an fp16), so the choice does not
    depend on the summation order the Numba kernel takes. All candidates at once, for up to
    ``_SEARCH_SLICE`` groups at a time (a decode step's cache write on the CPU was ~100 small
    ops per call; a prompt chunk's stays in the CPU's caches)."""
    flat = groups.reshape(-1, GROUP)
    if flat.shape[0] <= _SEARCH_SLICE:
        return _search_slice(groups, bits)
    parts = [_search_slice(part, bits) for part in flat.split(_SEARCH_SLICE)]
    return torch.cat(parts).reshape(groups.shape[:-1])


_SEARCH_SLICE = 1024  # groups per pass: 8 candidates' float64 errors, ~2 MiB


def _search_slice(groups: torch.Tensor, bits: int) -> torch.Tensor:
    first = groups.abs().argmax(dim=-1, keepdim=True)
    m = groups.gather(-1, first)  # [..., G, 1]
    candidates = (m / _negated_divisors(groups.device)).clamp(-FP16_MAX, FP16_MAX)
    candidates = candidates.to(SCALE_DTYPE)  # [..., G, K]
    each = groups.unsqueeze(-2)  # [..., G, 1, 32]
    residual = each - _codes(each, candidates, bits) * candidates.float()[..., None]
    error = residual.double().square().sum(dim=-1)
    return candidates.gather(-1, error.argmin(dim=-1, keepdim=True))[..., 0]  # (first on a tie)


def _negated_divisors(device: torch.device) -> torch.Tensor:
    return _divisors_on(device.type, device.index)


@functools.cache
def _divisors_on(device_type: str, device_index: int | None) -> torch.Tensor:
    """-SEARCH_DIVISORS in float32 (exact), once per device (made outside inference mode, so
    that a first call under it does not cache an inference tensor)."""
    with torch.inference_mode(False):
        device = torch.device(device_type, device_index)
        return -torch.tensor(SEARCH_DIVISORS, dtype=torch.float32, device=device)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [..., G, 32] integral floats -> data [..., G * 32 * bits / 8]."""
    lead = q.shape[:-2]
    if bits == 8:
        return q.to(torch.int8).reshape(*lead, -1)
    u = (q + 8).to(torch.uint8)
    return (u[..., : GROUP // 2] | (u[..., GROUP // 2 :] << 4)).reshape(*lead, -1)


def _unpack(data: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data [..., W] -> q [..., G, 32] in ``dtype`` (exact: at most 8-bit integers)."""
    lead = data.shape[:-1]
    if bits == 8:
        return data.to(dtype).reshape(*lead, -1, GROUP)
    b = data.reshape(*lead, -1, 1, GROUP // 2)  # a group's low nibbles, then its high ones
    # (less 8 in bytes, wrapping, read back as int8: one pass over the floats fewer)
    q = torch.cat(((b & 15) - 8, (b >> 4) - 8), dim=-2).view(torch.int8)
    return q.to(dtype).reshape(*lead, -1, GROUP)


def dequantize(
    data: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """data, scales -> values [..., D] in ``dtype`` (still rotated if they were stored so).
    A code times an fp16 scale is exact in float32 (at most 8 + 11 significant bits), so an
    fp16 or float32 result is that product rounded once, which taking it in the result's own
    dtype gives too (without a float32 copy of every gathered page; bf16 rounds the scale
    first, so it goes through float32)."""
    work = dtype if dtype in (SCALE_DTYPE, torch.float32) else torch.float32
    # (in place on _unpack's new tensor: on the CPU a new context-sized tensor per op took
    # longer than the arithmetic; a q4 decode step of SmolLM2 at 8 x 1k went 234 -> 190 ms)
    q = _unpack(data, bits, work).mul_(scales.to(work)[..., None])
    return q.reshape(*q.shape[:-2], -1).to(dtype)


def dequantize_pages(pages: QuantPages, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages ``index`` ([...] page ids) dequantized: [..., S, KV, D]. Only those pages;
    sink pages come from their unquantized rows."""
    data, scales = take_pages(pages.data, index), take_pages(pages.scales, index)
    values = dequantize(data, scales, pages.bits, dtype)
    if pages.sinks is None:
        return values
    sink = (index >= 0) & (index < pages.num_sink_pages)
    return put_rows(values, sink, pages.sinks, index.clamp(0, pages.num_sink_pages - 1))


def put_rows(
    out: torch.Tensor,
    hit: torch.Tensor,
    source: torch.Tensor,
    at: torch.Tensor,
    in_place: bool | None = None,
) -> torch.Tensor:
    """``out`` with ``source[at]`` (in out's dtype) wherever ``hit``; ``hit`` and ``at``
    index out's leading dims. ``in_place`` (default: on the CPU): written into ``out`` (a new
    tensor of the caller's), reading only the hits' rows (a few sink pages among a context);
    otherwise by ``torch.where`` over every row, since on a device a boolean-mask assignment
    would wait for it to count the hits."""
    if out.device.type == "cpu" if in_place is None else in_place:
        where = hit.nonzero(as_tuple=True)
        out[where] = source[at[where]].to(out.dtype)
        return out
    mask = hit.reshape(*hit.shape, *(1,) * (out.dim() - hit.dim()))
    return torch.where(mask, source[at].to(out.dtype), out)


def write_slots(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize rows x [T, KV, D] (less the pages' center, in float32) into ``slots``
    ([T] page * S + slot in page, all valid); rows of sink pages are also kept as they are
    (centered, rotated)."""
    x = centered(pages, x)
    data, scales = quantize(x, pages.bits, pages.rotate)
    pages.data.view(-1, *pages.data.shape[2:]).index_copy_(0, slots, data)
    pages.scales.view(-1, *pages.scales.shape[2:]).index_copy_(0, slots, scales)
    if pages.sinks is not None:
        write_sink_rows(pages, x, slots)


def centered(pages: QuantPages, x: torch.Tensor) -> torch.Tensor:
    """Rows x less the pages' center (in float32), as they are quantized; x without one."""
    return x if pages.center is None else x.float() - pages.center


def write_sink_rows(pages: QuantPages, x: torch.Tensor, slots: torch.Tensor) -> None:
    """The unquantized copy of centered rows x whose ``slots`` lie in sink or recent pages,
    rotated by the same butterflies as the codes (so the write kernels store these values bit
    for bit before rounding to the pages' dtype)."""
    sink = slots < pages.num_sink_pages * pages.sinks.shape[1]
    if not bool(sink.any()):
        return
    rows = rotated_groups(x[sink], pages.rotate).flatten(-2)  # the write kernels' butterflies
    flat = pages.sinks.view(-1, *pages.sinks.shape[2:])
    flat.index_copy_(0, slots[sink], rows.to(flat.dtype))
