"""Paged attention over a ragged batch (prefill, chunked prefill and decode in one call).

Torch reference: gathers each sequence's pages into a padded [B, max_kv] view and runs one
masked scaled-dot-product attention. It is the spec the CUDA kernels are checked against and
the CPU production path, so it avoids per-sequence Python loops.

Numba CUDA kernel (``paged_attention_cuda``, below the reference): one kernel for decode and
(chunked) prefill rows, GQA-grouped, online softmax over the pages, optional flash-decoding
split of the key range with a small merge kernel. See the comment block above the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.batch import AttentionPlan, ForwardBatch
from engine.cache.gather import take_pages
from engine.cache.page_table import RECENT_BLOCKS
from engine.cache.quant import rotate_groups
from engine.cuda import attention_mma  # (it imports this module only inside functions)
from engine.cuda._launch import (
    SIMULATOR,
    check_dtype,
    cuda,
    device_function,
    kernels_available,
    launch,
)
from engine.cuda.bits import odd_parity
from engine.cuda.kv_load import (
    GROUP,
    flat_pages,
    kv_step_reader,
    reads_words,
    word_affine,
    word_dtype,
)

float32 = cuda.float32  # bound here: inside a simulated kernel ``cuda`` is the fake module
int32 = cuda.int32
uint32 = cuda.uint32
uint64 = cuda.uint64


def paged_attention_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached and new tokens.

    q: [T, H, D]; k_pages, v_pages: [num_pages, page_size, KV, D] (already holding this pass's
    K/V); returns [T, H, D]. Query at position p sees keys j with j <= p and, with a sliding
    window w, p - w < j.
    """

    def attend(group: AttentionGroup, q_group: torch.Tensor) -> torch.Tensor:
        k = _gather_pages(k_pages, group.block_tables)
        v = _gather_pages(v_pages, group.block_tables)
        return padded_attention(q_group, k, v, group, scale, sliding_window)

    return by_group(q, batch, attend)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """The reference's attention of one group's queries q [T_g, H, D] over its gathered
    context k, v [B_g, num_blocks * S, KV, D]; returns [T_g, H, D]."""
    layout = group.layout
    if _splits_at_prefix(layout, sliding_window, q):
        return prefix_then_chunk(q, k, v, layout, scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    q_pad = q[layout.q_index]
    max_q = q_pad.shape[1]
    causal = layout.from_start and (sliding_window is None or sliding_window >= max_q)
    if causal:
        # Every query row's position is its padded row: SDPA's own causal rule (row i sees
        # keys 0..i) is ours, a real row never reaching its sequence's padding keys, and
        # its kernels skip the blocks above the diagonal, which a mask makes them compute
        # (a fresh 8 x 1024-token prompt chunk on 2 CPU threads: 50 against 82 ms a layer).
        k, v, mask = k[:, :max_q], v[:, :max_q], None
    else:
        mask = _mask(group, sliding_window, q.dtype)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H, max_q, D]
        k.transpose(1, 2).to(q.dtype),  # [B, KV, max_kv, D]
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        is_causal=causal,
        enable_gqa=num_heads != k.shape[2],
    )
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * max_q, H, D]
    return out[layout.out_rows]


# torch's flash-attention op per device: it returns the log-sum-exp that SDPA's public call
# keeps to itself (private ops: where this torch lacks one, the mask stays)
_FLASH_OPS = {
    "cpu": "_scaled_dot_product_flash_attention_for_cpu",
    "cuda": "_scaled_dot_product_flash_attention",
}
CHUNK_SPLIT_ENV = "ENGINE_CHUNK_SPLIT"
# auto: on the CPU, where its thresholds say (measured); a GPU keeps the mask (untimed there).
# on: a GPU too, with the same thresholds (fp16/bf16, head_dim a multiple of 8 up to 256:
# what CUDA's flash op takes), to time it (bench/chunk_mask_cpu.py --device cuda). off: the
# mask everywhere.
CHUNK_SPLIT_DEVICES = {"auto": ("cpu",), "on": ("cpu", "cuda"), "off": ()}


@functools.cache
def chunk_split_devices() -> tuple[str, ...]:
    """The device types whose later prompt chunks may split (``ENGINE_CHUNK_SPLIT``; a
    ValueError names a bad value). Read once per process (the op sets ask when built)."""
    choice = os.environ.get(CHUNK_SPLIT_ENV, "auto").strip().lower() or "auto"
    if choice not in CHUNK_SPLIT_DEVICES:
        raise ValueError(
            f"{CHUNK_SPLIT_ENV}={choice!r} is not one of {', '.join(CHUNK_SPLIT_DEVICES)}"
        )
    return CHUNK_SPLIT_DEVICES[choice]


def flash_attention_op(device_type: str, dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The flash op the split runs on for queries of this device, dtype and head size, or
    None where it may not split (``chunk_split_devices``) or the op would refuse them."""
    if device_type not in chunk_split_devices():
        return None
    if device_type == "cuda" and (
        dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256
    ):
        return None
    return _flash_op(device_type)


@functools.cache
def _flash_op(device_type: str) -> Callable | None:
    """The op itself, looked up once (asked by every layer of a later chunk)."""
    return getattr(torch.ops.aten, _FLASH_OPS[device_type], None)


# Where the split beats the mask (``bench/chunk_mask_cpu.py --grid``, 2 CPU threads, SmolLM2's
# heads, batches of 1 to 8, masked / split time, two runs): 1.03-1.35x from 1024 cached tokens
# on with chunks of 64 or more and 128 or more query rows in all; 0.63-1.06x at 512 cached
# tokens, 0.62-0.99x with 16-token chunks under 2048, 0.93-0.97x for one 64-token chunk after
# 1024: there its extra ops (the merge, the chunk's K/V repeated per head) outweigh the mask's.
# Sequences of other lengths in one group, split one by one, mostly gain more (the mask pads
# each to the longest context and chunk): 1.31-2.51x in 5 of the bench's 6 ragged cases, 0.94x
# for two 200-token chunks after 1024 and 1100 cached tokens.
# (Near-equal lengths around 1024 cached tokens, split one by one, measured 0.89-1.04x: four
# 64-token chunks 0.89, hence rows per call rather than per group. ``--ragged-grid``: 48
# ragged groups of 2 or 4, 0.92-1.18x at 1024 cached tokens, 1.00-1.48x from 1536 on; a rule
# on the mask's padding would gain under 1% there, within the noise, so none is made.)
SPLIT_MIN_PREFIX = 1024  # cached tokens before every sequence's chunk
SPLIT_MIN_CHUNK = 64  # every sequence's chunk
SPLIT_MIN_ROWS = 128  # query rows of each split call: the group's, or each sequence's


def _splits_at_prefix(layout: PaddedLayout, sliding_window: int | None, q: torch.Tensor) -> bool:
    """Whether ``prefix_then_chunk`` takes the group: on a device that splits
    (``flash_attention_op``), every sequence's chunk and cached prefix long enough for the
    split to pay, and no window hiding a key. (Asked by every layer, decode groups included:
    the layout's host facts, made once per forward, answer it in a few comparisons.)"""
    if not layout.q_lens or layout.min_chunk < SPLIT_MIN_CHUNK:
        return False
    rows_per_call = (
        len(layout.q_lens) * layout.min_chunk if layout.same_lengths else layout.min_chunk
    )
    return (
        rows_per_call >= SPLIT_MIN_ROWS
        and layout.min_prefix >= SPLIT_MIN_PREFIX
        and (sliding_window is None or sliding_window >= max(layout.seq_lens))
        and flash_attention_op(q.device.type, q.dtype, q.shape[-1]) is not None
    )


def prefix_then_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: PaddedLayout,
    scale: float,
) -> torch.Tensor:
    """``padded_attention`` of later prompt chunks without a mask: the group's query rows q
    [T_g, H, D] (each sequence's chunk in turn, at the positions after its cached prefix)
    over the gathered context k, v [B, num_blocks * S, KV, D]; returns [T_g, H, D]. One
    batched ``split_attention`` when every sequence brings the same chunk after the same
    prefix, else one per sequence, on its own context (no padding)."""
    heads, dim = q.shape[1], q.shape[2]
    if layout.same_lengths:
        b, chunk = len(layout.q_lens), layout.q_lens[0]
        q_seq = q.reshape(b, chunk, heads, dim)
        return split_attention(q_seq, k, v, layout.seq_lens[0] - chunk, scale)
    out, row = [], 0
    for i, (chunk, seq_len) in enumerate(zip(layout.q_lens, layout.seq_lens, strict=True)):
        q_seq = q[row : row + chunk].unsqueeze(0)
        out.append(split_attention(q_seq, k[i : i + 1], v[i : i + 1], seq_len - chunk, scale))
        row += chunk
    return torch.cat(out)


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float
) -> torch.Tensor:
    """Causal attention of queries q [B, C, H, D] at positions [prefix, prefix + C) over
    keys k, v [B, >= prefix + C, KV, D], as two attentions merged by their log-sum-exps:
    over the prefix, which every query sees (no mask; a KV head's query heads folded into
    one row range), and over the chunk's own keys by the causal rule. An additive mask
    makes SDPA read and add a mask value per score, and score the keys above the diagonal
    too: on 2 CPU threads a 512-token chunk after 3072 cached tokens, SmolLM2's heads, takes
    1.2-1.3x as long masked (``bench/chunk_mask_cpu.py``). Returns [B * C, H, D]."""
    b, chunk, heads, dim = q.shape
    flash = flash_attention_op(q.device.type, q.dtype, dim)
    kv = k.shape[2]
    group_size = heads // kv
    k = k[:, : prefix + chunk].transpose(1, 2).to(q.dtype)  # [B, KV, P + C, D]
    v = v[:, : prefix + chunk].transpose(1, 2).to(q.dtype)
    q = q.transpose(1, 2)  # [B, H, C, D]
    folded = q.reshape(b, kv, group_size * chunk, dim)  # head h -> KV head h // group_size
    out_p, lse_p = flash(folded, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    # (a log-sum-exp per query row; sliced in case an op pads its row count)
    lse_p = lse_p[..., : group_size * chunk]
    out_p, lse_p = out_p.reshape(b, heads, chunk, dim), lse_p.reshape(b, heads, chunk, 1)
    k_chunk = k[:, :, prefix:].repeat_interleave(group_size, 1)
    v_chunk = v[:, :, prefix:].repeat_interleave(group_size, 1)
    out_c, lse_c = flash(q, k_chunk, v_chunk, is_causal=True, scale=scale)[:2]
    lse_c = lse_c[..., :chunk].unsqueeze(-1)
    lse = torch.logaddexp(lse_p, lse_c)  # (float32, as the op gives them)
    out = out_p.float() * (lse_p - lse).exp() + out_c.float() * (lse_c - lse).exp()
    return out.to(q.dtype).transpose(1, 2).reshape(-1, heads, dim)


def _gather_pages(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[P, S, KV, D] pages -> [B, num_blocks * S, KV, D] contiguous per-sequence context."""
    gathered = take_pages(pages, table)  # [B, num_blocks, S, KV, D]
    b, n, s, kv, d = gathered.shape
    return gathered.view(b, n * s, kv, d)


@dataclass(frozen=True, slots=True)
class PaddedLayout:
    """The torch reference's map between a group's flat rows and [B, max_q] padded rows."""

    # [B, max_q] flat row of each padded row (padding: row 0, whose copy there is attended
    # and dropped, as rows are independent in the attention: no zero row to append per call)
    q_index: torch.Tensor
    out_rows: torch.Tensor  # [T] padded row of each flat row
    valid: torch.Tensor  # [B, max_q] bool: the padded row is a real query
    q_pos: torch.Tensor  # [B, max_q] absolute position of each padded query row
    num_blocks: int  # pages gathered per sequence
    kv_pos: torch.Tensor  # [num_blocks * page_size] key positions
    # every sequence's queries start at position 0 (a prompt's first chunk, no cached
    # prefix): a query's padded row is its position
    from_start: bool
    q_lens: tuple[int, ...] = ()  # host: each sequence's queries
    seq_lens: tuple[int, ...] = ()  # host: each sequence's context after this pass
    # host facts for the later-chunk split, from the two above: one chunk after one prefix
    # for every sequence; the shortest chunk; the shortest cached prefix
    same_lengths: bool = False
    min_chunk: int = 0
    min_prefix: int = 0


@dataclass(slots=True)
class AttentionGroup:
    """Sequences of one forward that the torch reference pads and attends together.

    Padding makes a group cost (sequences x longest query x longest context): one prefill
    chunk of 448 tokens in a step with 63 decode rows would pad every decode row to 448
    queries (~56x the real work). So a forward's sequences are grouped by query length (see
    ``attention_groups``) and each group runs one padded attention of its own.
    """

    rows: torch.Tensor | None  # [T_g] the group's flat query rows (None: all, in order)
    block_tables: torch.Tensor  # [B_g, num_blocks] long: the pages each sequence reads
    layout: PaddedLayout
    # additive masks per (window, dtype)
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)


def by_group(
    q: torch.Tensor,
    batch: ForwardBatch,
    attend: Callable[[AttentionGroup, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``attend(group, q rows of the group)`` for each of the batch's groups, the outputs put
    back in flat row order: [T, H, D]."""
    groups = attention_groups(batch)
    if len(groups) == 1 and groups[0].rows is None:
        return attend(groups[0], q)
    out = None
    # (a batch's groups cover its rows; those of a DecodeSplit's ``rest`` leave out its decode
    # rows, which stay zero here)
    partial = sum(group.rows.numel() for group in groups) < q.shape[0]
    for group in groups:
        part = attend(group, q[group.rows])
        if out is None:
            shape = (q.shape[0], *part.shape[1:])
            out = part.new_zeros(shape) if partial else part.new_empty(shape)
        out[group.rows] = part
    return out


@dataclass(frozen=True, slots=True)
class DecodeSplit:
    """A batch cut in two for an op set with a decode kernel: its decode rows attended by the
    kernel as one-token rows of their own, the rest by the torch reference. The decode rows
    are the one-token sequences' and, with ``short`` > 1, every query token of the sequences
    of at most ``short`` tokens that are not prompt chunks (drafts to verify): token j of n,
    in a sequence whose context ends at L, is a row whose context ends at L - n + 1 + j (its
    causal limit), over the sequence's pages."""

    rows: torch.Tensor  # [N] long: the decode rows' flat indices in the batch, ascending
    decode: ForwardBatch  # those rows as a decode batch
    # the batch itself (same tensors, so a quantized cache's exact_chunks stash still finds
    # its rows) with a plan whose groups leave the decode rows out; None: no row is left
    rest: ForwardBatch | None
    short: int = 1


def decode_split(batch: ForwardBatch, short: int = 1) -> DecodeSplit | None:
    """The batch's ``DecodeSplit`` (decode rows: see there), made once per forward (every
    layer reuses it); None when no row is a decode row, or every sequence is one token (a
    decode batch: the kernel's as it is)."""
    split = batch.attention.decode_split
    if split is not None and split.short == short:
        return split
    if max(batch.q_lens) == 1:
        return None
    prompt = batch.prompt_chunks or (False,) * len(batch.q_lens)
    taken = [
        i
        for i, q_len in enumerate(batch.q_lens)
        if q_len == 1 or (q_len <= short and not prompt[i])
    ]
    if not taken:
        return None
    chosen = set(taken)
    left = [i for i in range(len(batch.q_lens)) if i not in chosen]
    rows, decode = _decode_batch(batch, taken)
    rest = None
    if left:
        groups = [_group(batch, seqs) for seqs in _length_buckets(batch, left)]
        rest = dataclasses.replace(batch, attention=AttentionPlan(groups=groups))
    batch.attention.decode_split = DecodeSplit(rows, decode, rest, short)
    return batch.attention.decode_split


def _decode_batch(batch: ForwardBatch, seqs: list[int]) -> tuple[torch.Tensor, ForwardBatch]:
    """(flat rows, decode batch) of every query token of the sequences ``seqs`` (batch
    indices, ascending), each a one-token row with its own causal limit."""
    starts = _row_offsets(batch.q_lens)
    flat, index, seq_lens = [], [], []
    for i in seqs:
        n, end = batch.q_lens[i], batch.seq_lens_host[i]
        for j in range(n):
            flat.append(starts[i] + j)
            index.append(i)
            seq_lens.append(end - n + 1 + j)
    device = batch.input_ids.device
    rows = _to_device(flat, device)
    width = -(-max(seq_lens) // batch.page_size)
    decode = ForwardBatch(
        input_ids=batch.input_ids[rows],
        positions=batch.positions[rows],
        slot_mapping=batch.slot_mapping[rows],
        query_start_loc=torch.arange(len(flat) + 1, dtype=torch.int32, device=device),
        seq_lens=_to_device(seq_lens, device).to(batch.seq_lens.dtype),
        block_tables=batch.block_tables[_to_device(index, device), :width].contiguous(),
        logits_indices=rows.new_empty(0),
        q_lens=(1,) * len(flat),
        seq_lens_host=tuple(seq_lens),
        page_size=batch.page_size,
        prompt_chunks=(False,) * len(flat),
    )
    return rows, decode


def attention_groups(batch: ForwardBatch) -> list[AttentionGroup]:
    """The batch's groups, built once per forward (every layer reuses them): sequences whose
    query lengths fall in one power-of-two bucket (1, 2-3, 4-7, ...) share a group, so padding
    at most doubles a group's query rows and a step has at most ~log2(chunk) groups."""
    if batch.attention.groups is not None:
        return batch.attention.groups
    buckets = _length_buckets(batch, range(len(batch.q_lens)))
    if len(buckets) == 1:
        groups = [_whole_batch_group(batch)]
    else:
        groups = [_group(batch, seqs) for seqs in buckets]
    batch.attention.groups = groups
    return groups


def _length_buckets(batch: ForwardBatch, seqs) -> list[list[int]]:
    """The sequences ``seqs`` (batch indices) by power-of-two bucket of their query length,
    shortest first."""
    buckets: dict[int, list[int]] = {}
    for i in seqs:
        buckets.setdefault(batch.q_lens[i].bit_length(), []).append(i)
    return [buckets[key] for key in sorted(buckets)]


def _row_offsets(q_lens: tuple[int, ...]) -> list[int]:
    """Each sequence's first flat row, and the total (B + 1 values)."""
    offsets = [0]
    for q_len in q_lens:
        offsets.append(offsets[-1] + q_len)
    return offsets


def _whole_batch_group(batch: ForwardBatch) -> AttentionGroup:
    """Every sequence in one group, with the batch's own row offsets (no row gather)."""
    starts = batch.query_start_loc[:-1].long()
    layout = _padded_layout(batch, batch.q_lens, batch.seq_lens_host, starts)
    table = batch.block_tables[:, : layout.num_blocks].long()
    return AttentionGroup(None, table, layout)


def _group(batch: ForwardBatch, seqs: list[int]) -> AttentionGroup:
    """The sequences ``seqs`` (batch indices) as one group: their rows gathered in order."""
    device = batch.input_ids.device
    offsets = _row_offsets(batch.q_lens)
    rows = [r for i in seqs for r in range(offsets[i], offsets[i + 1])]
    q_lens = tuple(batch.q_lens[i] for i in seqs)
    seq_lens = tuple(batch.seq_lens_host[i] for i in seqs)
    starts = _to_device(_row_offsets(q_lens)[:-1], device)
    layout = _padded_layout(batch, q_lens, seq_lens, starts)
    index = _to_device(seqs, device)
    table = batch.block_tables[index, : layout.num_blocks].long()
    return AttentionGroup(_to_device(rows, device), table, layout)


def _to_device(values, device) -> torch.Tensor:
    """Host ints as a long tensor on ``device``, copied without waiting for the device (the
    plain ``torch.tensor(..., device=cuda)`` synchronizes the stream: with async scheduling
    the host would wait there for the forward queued before)."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _padded_layout(
    batch: ForwardBatch,
    q_lens: tuple[int, ...],
    seq_lens: tuple[int, ...],
    starts: torch.Tensor,
) -> PaddedLayout:
    """Index tensors mapping a group's flat rows (starting at ``starts`` per sequence) <->
    [B, max_q] padded rows."""
    device = batch.input_ids.device
    num_seqs, max_q = len(q_lens), max(q_lens)
    q_lens_t = _to_device(q_lens, device)
    seq_lens_t = _to_device(seq_lens, device)
    col = torch.arange(max_q, device=device)
    valid = col[None, :] < q_lens_t[:, None]  # [B, max_q]
    num_blocks = -(-max(seq_lens) // batch.page_size)
    return PaddedLayout(
        q_index=torch.where(valid, starts[:, None] + col[None, :], 0),
        out_rows=(torch.arange(num_seqs, device=device)[:, None] * max_q + col[None, :])[valid],
        valid=valid,
        q_pos=(seq_lens_t - q_lens_t)[:, None] + col[None, :],
        num_blocks=num_blocks,
        kv_pos=torch.arange(num_blocks * batch.page_size, device=device),
        from_start=tuple(q_lens) == tuple(seq_lens),
        q_lens=tuple(q_lens),
        seq_lens=tuple(seq_lens),
        same_lengths=len(set(q_lens)) == 1 and len(set(seq_lens)) == 1,
        min_chunk=min(q_lens),
        min_prefix=min(s - c for s, c in zip(seq_lens, q_lens, strict=True)),
    )


def _mask(group: AttentionGroup, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, max_q, max_kv] mask of ``dtype`` (0: attend, -inf: not), one per
    window size and dtype per group. (SDPA turns a boolean mask into this one on every call:
    three more ops per layer.)"""
    mask = group.masks.get((sliding_window, dtype))
    if mask is not None:
        return mask
    layout = group.layout
    q_pos = layout.q_pos[:, :, None]  # [B, max_q, 1]
    kv_pos = layout.kv_pos[None, None, :]  # [1, 1, max_kv]
    attend = kv_pos <= q_pos
    if sliding_window is not None:
        attend &= kv_pos > q_pos - sliding_window
    # Padding query rows would see no key and turn into NaN; give them key 0 (rows are dropped).
    attend[:, :, 0] |= ~layout.valid
    mask = torch.zeros(attend.shape, dtype=dtype, device=attend.device)
    mask = mask.masked_fill_(~attend, float("-inf"))[:, None]
    group.masks[(sliding_window, dtype)] = mask
    return mask


# --------------------------------------------------------------------------------------------
# Numba CUDA kernel
#
# Work mapping: one block per (work item, KV head, split). A work item is a tile of up to QT
# consecutive query tokens of one sequence (QT = 1 when every sequence brings one token, i.e.
# a decode step). The block computes all G = H / KV query heads of its KV group for every
# token of the tile -- R = QT * G query rows -- so each K/V byte of the group is read once per
# tile, once per sequence in a decode step. Splits (flash-decoding) cut the tile's key range
# into chunks of ``chunk`` keys; with more than one split the blocks write unnormalised
# partials (row max, row sum, row output) to a scratch buffer and a second kernel merges them.
#
# Inside a block: NT threads form NG = NT / LT groups of LT lanes (LT = 16 or 32: a half or a
# whole warp). Per step each group owns KU consecutive keys (keys per step: start + (step * NG +
# group) * KU + u, the start aligned down to KU; the sink prologue takes one); each lane owns
# DPL = D / LT head dims strided by LT (lane, lane + LT, ...), so a group's K or V row load is
# one contiguous coalesced run; on quantized pages a lane owns DPL consecutive dims instead and
# reads them as one 4- or 8-byte word with one scale (engine/cuda/kv_load.py). Each group
# keeps an online softmax (max m, sum l, output acc) per query row in registers; the LT
# partial dot products of a row are summed by an xor butterfly of warp shuffles (a
# shared-memory sum in the simulator, which has no shuffles).
# At the end the NG group states are merged through shared memory, RB rows per round.
#
# All per-forward metadata (the work list, split count, chunk length, partial buffers) comes
# from ``_plan``: computed once per forward with device-side torch ops, sized from the host
# ints the batch carries, kept in ``batch.attention.kernel`` and shared by every layer.
# --------------------------------------------------------------------------------------------

_NUM_WARPS = 2 if SIMULATOR else 4  # threads per attention block / 32
_MERGE_THREADS = 32 if SIMULATOR else 128
_ROWS_TARGET = 8  # query rows (tile tokens x group heads) per block for prefill tiles
_MIN_SPLIT_KEYS = 256  # a split never gets fewer keys than this (unless asked explicitly)
_MAX_SPLITS = 32
_BLOCKS_PER_SM = 2  # automatic splitting stops once the grid has this many blocks per SM
_FORCE_LANES: int | None = None  # tests: force lanes per key (16 or 32)
# Keys per group per step for decode tiles (prefill tiles take 1): their loads are all issued
# before any is used. H200, Llama-3-8B shape, batch 32 x 4k, one key -> two, per layer (run 3 of
# bench/results/attention_keys_per_step_h200_2026-11-26_*): fp16 0.55 -> 0.49 ms, q8 0.49 ->
# 0.38, q4 0.44 -> 0.38; 16 keys or 32 lanes per key were slower for every mode. Since page
# arrays are indexed as unsigned rows, 4 keys fit the 128-register cap (8-12 spilled bytes for
# q6 and sink pages): quantized word pages 2 -> 4 keys in
# attention_keys_per_step_h200_2026-11-27_rows.json (q8 0.306 -> 0.276 ms, q4 0.318 -> 0.282);
# float pages since the leaner step loop of stops 34-35, in two runs, 2 -> 4 keys: fp16 0.207
# -> 0.184 ms (_2026-11-27_pipeline.json) and 0.207 -> 0.185 (_2026-11-30.json); before that
# loop fp16 had gone 0.277 -> 0.336 with 4 keys. Float pages of groups over 4 query heads per
# KV head (32 lanes per key) spill 84-112 bytes with 4 keys at sm_90, none with 2: they keep 2.
_DECODE_KEYS_PER_STEP = 4
_WIDE_GROUP_KEYS_PER_STEP = 2
_WIDE_GROUP = 4  # float pages of larger groups take _WIDE_GROUP_KEYS_PER_STEP
_FORCE_KEYS_PER_STEP: int | None = None  # tests and bench/attention_keys_per_step.py
_MIN_BLOCKS = 4  # resident blocks per SM the register cap is set for (launch_bounds)
_FORCE_MIN_BLOCKS: int | None = None  # bench/attention_keys_per_step.py
_SHUFFLES = not SIMULATOR  # row sums by warp shuffles (tests emulate them in the simulator)
# Transposed row sums (``_transposed_row_sum``) for quantized word pages only: with them and the
# code unpack, q4/q8 decode went 0.41/0.43 -> 0.38/0.38 ms on the H200 (8B shape, batch 32 x
# 4k, 2 keys per step), while fp16 pages went 0.46 -> 0.49 ms (run 1 vs run 3 of
# bench/results/attention_keys_per_step_h200_2026-11-26_*: other machines, and the sum and the
# unpack changed together). None: that rule; True/False forces it (tests, the sweep).
_FORCE_TRANSPOSED_SUMS: bool | None = None
# 4-bit word codes unpacked to 0.5 + nibble / 256 (kv_load.word_affine), which saves an add per
# code: SASS per key on sm_90 (bench/kernel_sass.py) q4 219.8 -> 209.2 with the live-row test
# gone too (then 202 with the half-warp shuffles of _transposed_row_sum); not timed on a GPU.
# False: the integer codes (permute and add), for bench/attention_keys_per_step.py's
# comparison and the tests.
_FORCE_WORD_AFFINE: bool | None = None
_NEG = float32(-1e30)  # stands for -inf: exp(a - b) never sees inf - inf
_MAX_HEAD_DIM = 256
_MAX_ROWS = 2**32 - 1  # page slots x KV heads of one layer's pages: 32-bit row arithmetic
_MERGE_SMEM_BYTES = 16384  # shared memory for the end-of-block merge of the group outputs


def _row_sum_impl(rows: int, lanes: int, threads: int, shuffles: bool, transposed: bool):
    """Device function summing ``part[r]`` over the ``lanes`` lanes of each key group, for
    every row r, in place (every lane gets the sum): warp shuffles when ``shuffles`` (a
    transposed reduction when ``transposed`` and rows is a power of two up to ``lanes``, else
    a butterfly per row), else through shared memory (the simulator has no shuffles)."""
    if not shuffles:

        def row_sum(part, sm_red, tid, parity):
            # Two buffers alternating per step: one barrier per call. A thread can only come
            # back to a buffer after the next call's barrier, which every reader has passed.
            buf = parity * rows * threads
            for r in range(rows):
                sm_red[buf + r * threads + tid] = part[r]
            cuda.syncthreads()
            base = buf + tid - tid % lanes
            for r in range(rows):
                total = float32(0.0)
                for k in range(lanes):
                    total += sm_red[base + r * threads + k]
                part[r] = total

        return device_function(row_sum)
    if transposed and rows & (rows - 1) == 0 and rows <= lanes:
        return _transposed_row_sum(rows, lanes)

    def row_sum(part, sm_red, tid, parity):
        for r in range(rows):
            v = part[r]
            offset = lanes // 2
            while offset > 0:
                v += cuda.shfl_xor_sync(0xFFFFFFFF, v, offset)
                offset //= 2
            part[r] = v

    return device_function(row_sum)


def _transposed_row_sum(rows: int, lanes: int):
    """The row sums in ``rows - 1 + log2(lanes / rows) + rows`` shuffles instead of
    ``rows * log2(lanes)`` (rows a power of two, at most ``lanes``).

    Halving levels: at offset o = lanes / 2, lanes / 4, ... (log2(rows) of them) a lane keeps
    one half of its values (the upper half if its bit o is set), sends the other half to its
    partner and adds what it receives: each level halves the values a lane holds and doubles
    the lanes each is summed over. Then plain butterflies over the remaining offsets: every
    lane holds the whole sum of one row, the row whose index is the lane's bits at the halving
    offsets. Last, each row's sum is fetched from a lane that holds it.
    """
    levels = rows.bit_length() - 1
    halving = [lanes >> (t + 1) for t in range(levels)]
    plain = []
    o = lanes >> (levels + 1)
    while o > 0:
        plain.append(o)
        o //= 2
    held = sum(halving)  # the lane bits that say which row a lane ends up holding
    full = 0xFFFFFFFF
    halve_all = _chain_levels([_halving_level(o, rows >> (t + 1)) for t, o in enumerate(halving)])
    butterflies = _chain_values([_butterfly_level(o) for o in plain])
    segment16 = rows == lanes == 16 and not SIMULATOR

    if segment16:
        # rows == lanes == 16: lane r of each half-warp holds row r, and a constant lane in a
        # 16-lane segment needs no per-lane xor mask (a GPU intrinsic: not in the simulator)
        from engine.cuda.bits import shfl_segment16_sync

        def row_sum(part, sm_red, tid, parity):
            halve_all(part, tid)
            x = butterflies(part[0])
            for r in range(rows):
                part[r] = shfl_segment16_sync(full, x, r)

        return device_function(row_sum)

    def row_sum(part, sm_red, tid, parity):
        halve_all(part, tid)
        x = butterflies(part[0])
        for r in range(rows):
            # a lane with r's bits at the halving offsets (and this lane's other bits)
            bits = 0
            for t in range(levels):
                if (r >> (levels - 1 - t)) & 1:
                    bits |= lanes >> (t + 1)
            part[r] = cuda.shfl_xor_sync(full, x, (tid & held) ^ bits)

    return device_function(row_sum)


def _halving_level(offset: int, keep: int):
    def level(part, tid):
        upper = (tid & offset) != 0
        for i in range(keep):
            a = part[i]
            b = part[i + keep]
            send = a if upper else b
            part[i] = (b if upper else a) + cuda.shfl_xor_sync(0xFFFFFFFF, send, offset)

    return device_function(level)


def _butterfly_level(offset: int):
    def level(x):
        return x + cuda.shfl_xor_sync(0xFFFFFFFF, x, offset)

    return device_function(level)


def _chain_levels(fns):
    """Device function ``(part, tid)`` running the halving levels ``fns`` in order. Built
    from closures so that every level's offset and count are compile-time constants."""
    if not fns:

        def none(part, tid):
            pass

        return device_function(none)
    head, rest = fns[0], _chain_levels(fns[1:])

    def both(part, tid):
        head(part, tid)
        rest(part, tid)

    return device_function(both)


def _chain_values(fns):
    """Device function ``x -> fns[-1](... fns[0](x))`` (the identity for none)."""
    if not fns:

        def identity(x):
            return x

        return device_function(identity)
    head, rest = fns[0], _chain_values(fns[1:])

    def both(x):
        return rest(head(x))

    return device_function(both)


@functools.cache
def _rescaler(dims_per_lane: int, q_tile: int, weight_sums: bool):
    """``rescale(m, l, acc, wsum, r, mx)``: row r's running max becomes ``mx``, its sum and
    accumulator (and with ``weight_sums`` its ``wsum``) scaled to match (online softmax).
    Decode tiles skip it when the max holds (most steps once a row has seen its largest
    scores); prefill tiles always take it (no registers to spare for the test)."""
    DPL, QT, WSUM = dims_per_lane, q_tile, weight_sums

    def rescale(m, l, acc, wsum, r, mx):  # noqa: E741
        if QT > 1 or mx > m[r]:
            c = math.exp2(m[r] - mx)  # (scores in log2 units: the kernel's q carries log2(e))
            l[r] *= c
            if WSUM:
                wsum[r] *= c
            for i in range(DPL):
                acc[r * DPL + i] *= c
            m[r] = mx

    return device_function(rescale, fastmath=True)  # (the kernel's fast exp)


@device_function
def _seen(j, lo, hi, p, window):
    """``_visible`` for a key of the main steps, which may start below the chunk's ``lo``."""
    return j >= lo and _visible(j, hi, p, window)


@device_function
def _visible(j, hi, p, window):
    """Whether key ``j`` counts for the query at position ``p``: inside this split's chunk
    (``j < hi``), causal, and inside the sliding window (0: none)."""
    return j < hi and j <= p and (window == 0 or j > p - window)


@functools.cache
def _attention_kernel(  # noqa: C901, PLR0915
    head_dim: int,
    page_size: int,
    group: int,
    q_tile: int,
    lanes: int,
    k_bits: int,
    v_bits: int,
    keys_per_step: int = 1,
    min_blocks: int = _MIN_BLOCKS,
    shuffles: bool = not SIMULATOR,
    transposed_sums: bool = False,
    sinks: bool = False,
    rotate: bool = False,
    affine: bool = True,
):
    """The attention kernel specialised on its compile-time constants. ``sinks``: quantized
    pages with unquantized ones (sink and recent pages, engine/cache/page_table.py): a tile
    whose first block is a sink page, or whose last blocks are recent pages, reads those
    blocks' keys from the unquantized rows, the rest as usual.
    ``k_bits``/``v_bits``:
    the page formats (0: unquantized; 8 or 4: engine/cache/quant.py), read through
    ``kv_step_reader``; the scale arrays are not read for unquantized pages. Each key group
    takes ``keys_per_step`` keys per step (their loads are all issued before any is used);
    ``min_blocks``: the resident blocks per SM the register cap is set for (0: no cap);
    ``shuffles``: row sums by warp shuffles (a GPU; the simulator only with emulated ones),
    ``transposed_sums``: by ``_transposed_row_sum`` where it applies; ``affine``: 4-bit word
    codes unpack through ``kv_load.word_affine`` (else to the integer codes)."""
    D, PS, G, QT, LT, KU = head_dim, page_size, group, q_tile, lanes, keys_per_step
    DPL = D // LT
    NT = _NUM_WARPS * 32
    NG = NT // LT
    R = G * QT
    QV = R * DPL
    SM_ROWS = NG * R
    # Rows merged per round: the largest divisor of R whose NG partial outputs fit the budget.
    RB = max(d for d in range(1, R + 1) if R % d == 0 and d * NG * D * 4 <= _MERGE_SMEM_BYTES)
    SM_ACC = RB * NG * D
    SM_RED = 1 if shuffles else 2 * R * KU * NT
    NEG = _NEG
    row_sum = _row_sum_impl(R * KU, LT, NT, shuffles, transposed_sums)
    RAW_T, RAW_W, SCALED, read_kv, unpack_k, unpack_v = kv_step_reader(
        k_bits, v_bits, D, LT, affine
    )
    RAW = KU * RAW_W
    SR = R * KU  # scores, then weights, of a step: [u * R + r]
    # Quantized pages: each lane owns DPL consecutive dims and reads them as one word (kv_load)
    words = reads_words(k_bits, v_bits, DPL)
    # Word reads of 4-bit codes unpack to x with code = factor * (x - offset) (kv_load's
    # word_affine), so that no code costs an add. Keys: q is taken times the factor and each
    # row's dot products start from -offset * sum(q) (per lane and row, once per tile). Values:
    # the accumulators sum weight * scale * x, and the weights times their scales are summed on
    # the side (``wsum``); at the end acc = factor * (acc - offset * wsum). The sink pages'
    # exact rows (the prologue) enter both in those units.
    K_FACTOR, K_OFFSET = (float32(x) for x in word_affine(k_bits if words else 0, affine))
    V_FACTOR, V_OFFSET = (float32(x) for x in word_affine(v_bits if words else 0, affine))
    K_AFFINE, V_AFFINE = K_OFFSET != 0.0, V_OFFSET != 0.0
    INV_K_FACTOR, INV_V_FACTOR = float32(1.0 / K_FACTOR), float32(1.0 / V_FACTOR)
    rescale = _rescaler(DPL, QT, V_AFFINE)
    DSTRIDE = 1 if words else LT  # the lane's i-th dim: lane * DPL + i, or lane + LT * i
    LSTRIDE = DPL if words else 1
    SINKS = sinks
    # Rotated pages (engine/cache/quant.py): q is rotated per group of 32 on entry and the
    # output on the way out, here rather than by two torch launches around the kernel. Only
    # for word reads, whose lane dims make H_32 = H_LPG (across lanes) x H_DPL (in a lane).
    ROTATE = rotate
    if ROTATE and not words:
        raise ValueError("the attention kernel rotates q and the output for word reads only")
    # q's rotation goes through sm_acc (free until the merge) where its rows fit
    ROT_SIZE = R * D if ROTATE and R * D > SM_ACC else 1
    rotate_q = _q_rotator(R, DPL, D) if ROTATE else None
    rotate_lane = _lane_rotator(R, DPL) if ROTATE else None
    LPG = GROUP // DPL  # lanes per group of 32 (word reads)
    inv_sqrt = float32(1.0 / math.sqrt(GROUP))
    LOG2E, LN2 = float32(1.0 / math.log(2.0)), float32(math.log(2.0))
    PS_U = np.uint32(PS)  # (unsigned constants: unsigned row arithmetic stays unsigned)
    KU_U = np.uint32(KU)
    SHARED_PAGE = PS % KU == 0  # a group's KU consecutive keys, aligned to KU: one page
    SINK_W = np.uint64(D)  # an unquantized row's values
    TAIL_BLOCKS = RECENT_BLOCKS  # a sequence's last blocks that may be on recent pages
    options = {}
    if not SIMULATOR and QV <= 32 and min_blocks > 0:
        # 4 resident blocks per SM: caps registers at 128 (ptxas for sm_90 reports no spills
        # for D=128 with G=4/QT=1/LT=16, G=8/LT=32 and G=1/QT=8/LT=32; 133-167 without).
        # Quantized pages too since they are read as words (element loads spilled 292 bytes
        # for 8-bit K/V and 480 for 8/4 under this cap).
        options["launch_bounds"] = (NT, min_blocks)

    @cuda.jit(fastmath=True, **options)
    def attention(  # noqa: C901, PLR0915
        q, k_pages, v_pages, k_scales, v_scales, out, part_ml, part_o, block_tables, seq_lens,
        query_start_loc, work, scale, window, min_chunk, num_splits, k_sinks, v_sinks,
    ):  # fmt: skip
        sm_m = cuda.shared.array(SM_ROWS, float32)
        sm_l = cuda.shared.array(SM_ROWS, float32)
        sm_acc = cuda.shared.array(SM_ACC, float32)
        sm_red = cuda.shared.array(SM_RED, float32)
        sm_rot = cuda.shared.array(ROT_SIZE, float32)
        qv = cuda.local.array(QV, float32)
        acc = cuda.local.array(QV, float32)
        m = cuda.local.array(R, float32)
        l = cuda.local.array(R, float32)  # noqa: E741
        s = cuda.local.array(SR, float32)
        kf = cuda.local.array(DPL, float32)
        vf = cuda.local.array(DPL, float32)
        kr = cuda.local.array(RAW, RAW_T)
        vr = cuda.local.array(RAW, RAW_T)
        ks = cuda.local.array(KU, float32)
        vs = cuda.local.array(KU, float32)
        key_seen = cuda.local.array(KU, int32)  # decode tiles: whether the step's key u counts
        kbias = cuda.local.array(R, float32)  # K_AFFINE: each row's dot products start here
        wsum = cuda.local.array(R, float32)  # V_AFFINE: each row's sum of weight * scale

        # Scores in log2 units (q times log2(e) with the scale): every weight is one exp2, no
        # multiply before it; the partial maxima go out in natural units for the merge kernel.
        scale_log2 = float32(scale) * LOG2E
        item = cuda.blockIdx.x
        h = cuda.blockIdx.y
        z = cuda.blockIdx.z
        # Page arrays come flat (kv_load.flat_pages): row (page * PS + slot) * KV + h, in 32
        # unsigned bits (launch_attention checks the rows fit), times the row's width.
        row_head = uint32(h)
        row_heads = uint32(cuda.gridDim.y)
        tid = cuda.threadIdx.x
        grp = tid // LT
        lane = tid % LT

        # The tile: sequence b, query tokens [row0, row0 + n_q) at positions pos0 + i.
        b = work[item, 0]
        off = work[item, 1]
        seq_start = query_start_loc[b]
        q_len = query_start_loc[b + 1] - seq_start
        row0 = seq_start + off
        n_q = min(QT, q_len - off)
        pos0 = seq_lens[b] - q_len + off
        # Keys of the whole tile: [k_lo, pos0 + n_q); this split's chunk: [lo, hi). Each tile
        # splits its own key range (same formula as ``_chunk_keys``), so the split count can be
        # fixed for a CUDA graph while context lengths change from step to step.
        k_lo = 0
        if window > 0:
            k_lo = max(0, pos0 - window + 1)
        span = max(0, pos0 + n_q - k_lo)
        chunk = max((span + num_splits - 1) // num_splits, min_chunk)
        chunk = (chunk + NG - 1) // NG * NG
        lo = k_lo + z * chunk
        hi = min(pos0 + n_q, lo + chunk)

        for r in range(R):
            m[r] = NEG
            l[r] = 0.0
            for i in range(DPL):
                acc[r * DPL + i] = 0.0
                x = float32(0.0)
                if r // G < n_q:
                    x = float32(q[row0 + r // G, h * G + r % G, lane * LSTRIDE + DSTRIDE * i])
                    x *= scale_log2
                qv[r * DPL + i] = x
        if ROTATE:
            rotate_q(qv, kf, sm_rot if ROT_SIZE > 1 else sm_acc, grp, lane)
        for r in range(R):
            wsum[r] = 0.0
            if K_AFFINE:
                total = float32(0.0)
                for i in range(DPL):
                    qv[r * DPL + i] *= K_FACTOR
                    total += qv[r * DPL + i]
                kbias[r] = -K_OFFSET * total

        # Unquantized pages (engine/cache/page_table.py): this chunk's keys in the first block
        # [lo, min(hi, PS)) when it is a sink page, and in its last blocks [tail_lo, hi) that
        # are recent pages (up to TAIL_BLOCKS, never block 0), read from their rows one key
        # per group per step; the code steps below take [main_lo, main_hi) between them.
        # (Uniform per block: every thread takes the same branches.)
        main_lo = lo
        main_hi = hi
        parity = 0
        if SINKS:
            exact_rows = k_sinks.shape[0]  # (flat: pages 0..R+T-1 x PS x KV x D values)
            first = block_tables[b, 0]
            if first >= 0 and first * PS * D * cuda.gridDim.y < exact_rows and lo < min(hi, PS):
                main_lo = min(hi, PS)
            if hi > main_lo:
                blk = (hi - 1) // PS
                for _ in range(TAIL_BLOCKS):
                    if blk < 1 or (blk + 1) * PS <= main_lo:
                        break
                    page = block_tables[b, blk]
                    if page < 0 or page * PS * D * cuda.gridDim.y >= exact_rows:
                        break
                    main_hi = max(main_lo, blk * PS)
                    blk -= 1
            for part in range(2):
                x_lo = lo if part == 0 else main_hi
                x_hi = main_lo if part == 0 else hi
                n_exact_steps = 0
                if x_hi > x_lo:
                    n_exact_steps = (x_hi - x_lo + NG - 1) // NG
                for step in range(n_exact_steps):
                    jb = x_lo + step * NG + grp
                    jc = min(jb, x_hi - 1)
                    page = uint32(block_tables[b, jc // PS])
                    row = uint32(page * PS_U + uint32(jc % PS)) * row_heads + row_head
                    at = uint64(uint32(row)) * SINK_W
                    for i in range(DPL):
                        d = uint64(lane * LSTRIDE + DSTRIDE * i)
                        kf[i] = float32(k_sinks[at + d]) * INV_K_FACTOR  # (1 but 4-bit)
                        vf[i] = float32(v_sinks[at + d]) * INV_V_FACTOR
                    for r in range(R):
                        dot = float32(0.0)
                        if r // G < n_q:
                            for i in range(DPL):
                                dot += qv[r * DPL + i] * kf[i]
                        s[r] = dot
                        for u in range(1, KU):
                            s[u * R + r] = 0.0
                    row_sum(s, sm_red, tid, parity)
                    parity = 1 - parity
                    for r in range(R):
                        seen = r // G < n_q and _visible(jb, x_hi, pos0 + r // G, window)
                        mx = m[r]
                        if seen:
                            mx = max(mx, s[r])
                        rescale(m, l, acc, wsum, r, mx)
                        if seen:
                            e = math.exp2(s[r] - mx)
                            l[r] += e
                            for i in range(DPL):
                                acc[r * DPL + i] += e * vf[i]

        # Step: keys base + u for u < KU, base = start + step * NG * KU + grp * KU (group grp
        # takes KU consecutive keys; start is main_lo rounded down to a multiple of KU, the keys
        # below main_lo masked). All KU keys' K and V are read before any is used, so their
        # loads are in flight together. When KU divides the page size, a group's KU keys lie in
        # one page: one block-table read per step, rows one KV-row stride apart.
        # Decode tiles: key j is visible iff main_lo <= j < main_hi and, with a window, j >
        # pos0 - window (j <= pos0 holds for every j < main_hi <= pos0 + 1), in 32 bits.
        hi32 = int32(main_hi)
        lo32 = int32(main_lo)
        win_lo32 = int32(-1)
        if window > 0:
            win_lo32 = int32(pos0 - window)
        n_steps = 0
        last = uint32(main_hi - 1)
        start = main_lo - main_lo % KU
        if main_hi > main_lo:
            n_steps = (main_hi - start + NG * KU - 1) // (NG * KU)
        for step in range(n_steps):
            base = start + step * NG * KU + grp * KU
            if SHARED_PAGE:
                # Every lane runs every step (the shuffles need the whole warp): keys past the
                # end read the chunk's last keys' page and are masked below.
                jc = min(uint32(base), last - last % KU_U)  # (>= 0: hi > main_lo >= 0)
                page = uint32(block_tables[b, jc // PS_U])
                row = uint32(uint32(page * PS_U + jc % PS_U) * row_heads + row_head)
                for u in range(KU):
                    # Word reads in 64 bits: no 32-bit wrap to honour, so the compiler turns
                    # each key's addresses into the first key's plus a constant stride (SASS
                    # per key: q4 196.8 -> 188.2; fp16 element reads 214 -> 216, so not there)
                    if words:
                        at = uint64(row) + uint64(u) * uint64(row_heads)
                    else:
                        at = uint64(uint32(row + uint32(u) * row_heads))
                    read_kv(k_pages, k_scales, v_pages, v_scales, at, lane, u, kr, ks, vr, vs)
            else:
                for u in range(KU):
                    jc = min(uint32(base + u), last)  # (a key past the end: the last key)
                    page = uint32(block_tables[b, jc // PS_U])
                    row = uint32(uint32(page * PS_U + jc % PS_U) * row_heads + row_head)
                    read_kv(k_pages, k_scales, v_pages, v_scales, row, lane, u, kr, ks, vr, vs)
            for u in range(KU):
                unpack_k(kr, u, lane, kf)  # codes (word_affine) times ks[u] when SCALED
                for r in range(R):
                    dot = float32(0.0)
                    if QT == 1 or r // G < n_q:  # (a decode tile's one query is always live)
                        if K_AFFINE:
                            dot = kbias[r]
                        for i in range(DPL):
                            dot += qv[r * DPL + i] * kf[i]
                    if SCALED:
                        dot *= ks[u]
                    s[u * R + r] = dot
            row_sum(s, sm_red, tid, (step + parity) & 1)
            if QT == 1:  # one query position: one 32-bit test per key, shared by the rows
                for u in range(KU):
                    j = int32(base + u)
                    key_seen[u] = j < hi32 and j > win_lo32 and j >= lo32
            # Online softmax over the step's keys: one rescale per row, then s holds the weights
            # (0 for a masked key).
            for r in range(R):
                p = pos0 + r // G
                live = r // G < n_q
                mx = m[r]
                for u in range(KU):
                    ok = key_seen[u]
                    if QT != 1:
                        ok = live and _seen(base + u, main_lo, main_hi, p, window)
                    if ok:
                        mx = max(mx, s[u * R + r])
                rescale(m, l, acc, wsum, r, mx)
                for u in range(KU):
                    e = float32(0.0)
                    ok = key_seen[u]
                    if QT != 1:
                        ok = live and _seen(base + u, main_lo, main_hi, p, window)
                    if ok:
                        e = math.exp2(s[u * R + r] - mx)
                    s[u * R + r] = e
                    l[r] += e
            for u in range(KU):
                unpack_v(vr, u, lane, vf)
                for r in range(R):
                    e = s[u * R + r]
                    if SCALED:
                        e *= vs[u]
                    if V_AFFINE:
                        wsum[r] += e
                    for i in range(DPL):
                        acc[r * DPL + i] += e * vf[i]
        if V_AFFINE:  # the codes' offset and factor, for every weight at once
            for r in range(R):
                for i in range(DPL):
                    acc[r * DPL + i] = V_FACTOR * (acc[r * DPL + i] - V_OFFSET * wsum[r])

        # Rotated pages: the output is H_32 acc per group of 32 = H_LPG (x) H_DPL; the lane's
        # part here, the part across lanes (linear, so over the summed groups) below.
        if ROTATE:
            rotate_lane(acc, kf)
        # Merge the NG group states through shared memory, RB rows per round.
        if lane == 0:
            for r in range(R):
                sm_m[grp * R + r] = m[r]
                sm_l[grp * R + r] = l[r]
        cuda.syncthreads()
        for rb in range(0, R, RB):
            for rr in range(RB):
                mx = NEG
                for g in range(NG):
                    mx = max(mx, sm_m[g * R + rb + rr])
                w = math.exp2(m[rb + rr] - mx)
                for i in range(DPL):
                    d = lane * LSTRIDE + DSTRIDE * i
                    sm_acc[(rr * NG + grp) * D + d] = acc[(rb + rr) * DPL + i] * w
            cuda.syncthreads()
            for idx in range(tid, RB * D, NT):
                r = rb + idx // D
                d = idx % D
                if r // G < n_q:
                    mx = NEG
                    for g in range(NG):
                        mx = max(mx, sm_m[g * R + r])
                    total = float32(0.0)
                    o = float32(0.0)
                    la = (d // DPL) % LPG  # rotated: d mixes dim d % DPL of its group's lanes
                    for g in range(NG):
                        total += sm_l[g * R + r] * math.exp2(sm_m[g * R + r] - mx)
                        at = ((idx // D) * NG + g) * D
                        if ROTATE:
                            src = at + d - la * DPL
                            for lb in range(LPG):
                                x = sm_acc[src + lb * DPL]
                                o += -x if odd_parity(la & lb) else x
                        else:
                            o += sm_acc[at + d]
                    if ROTATE:
                        o *= inv_sqrt
                    row = row0 + r // G
                    head = h * G + r % G
                    if num_splits == 1:
                        if total > 0.0:
                            o = o / total
                        out[row, head, d] = o
                    else:
                        part_o[z, row, head, d] = o
                        if d == 0:
                            part_ml[z, row, head, 0] = mx * LN2  # (natural units again)
                            part_ml[z, row, head, 1] = total
            cuda.syncthreads()

    return attention


@functools.cache
def _q_rotator(rows: int, dims_per_lane: int, head_dim: int):
    """``rotate_q(qv, tmp, buf, grp, lane)``: each row's q (this lane's ``dims_per_lane``
    consecutive dims of every row, as word reads own them) multiplied per group of 32 by the
    normalised Hadamard matrix H_32, in float32. A group's index a = (lane % LPG) * DPL + i
    splits into lane bits and dim bits, so H_32 = H_LPG (x) H_DPL: the lane's own part first
    (``_lane_rotator``; tmp: its DPL scratch floats), then the group's LPG lanes through
    ``buf`` [rows * head_dim] (key group 0 writes; every group holds the same q). All threads
    must call it."""
    R, DPL, D = rows, dims_per_lane, head_dim
    LPG = GROUP // DPL
    inv_sqrt = float32(1.0 / math.sqrt(GROUP))
    rotate_lane = _lane_rotator(R, DPL)

    def rotate_q(qv, tmp, buf, grp, lane):
        rotate_lane(qv, tmp)
        if grp == 0:
            for r in range(R):
                for i in range(DPL):
                    buf[r * D + lane * DPL + i] = qv[r * DPL + i]
        cuda.syncthreads()
        first = lane - lane % LPG
        la = lane % LPG
        for r in range(R):
            for i in range(DPL):
                y = float32(0.0)
                for lb in range(LPG):
                    zb = buf[r * D + (first + lb) * DPL + i]
                    y += -zb if odd_parity(la & lb) else zb
                qv[r * DPL + i] = y * inv_sqrt
        cuda.syncthreads()  # (buf is reused at the end)

    return device_function(rotate_q)


@functools.cache
def _lane_rotator(rows: int, dims_per_lane: int):
    """``rotate_lane(x, tmp)``: each row's ``dims_per_lane`` values of this lane (x[r * DPL +
    i]) multiplied by the unnormalised H_DPL (constant signs); tmp: DPL scratch floats."""
    R, DPL = rows, dims_per_lane

    def rotate_lane(x, tmp):
        for r in range(R):
            for i in range(DPL):
                z = float32(0.0)
                for j in range(DPL):
                    v = x[r * DPL + j]
                    z += -v if odd_parity(i & j) else v
                tmp[i] = z
            for i in range(DPL):
                x[r * DPL + i] = tmp[i]

    return device_function(rotate_lane)


@functools.cache
def _merge_kernel(head_dim: int):
    """out[t, h] = sum_z part_o[z, t, h] * exp(m_z - M) / sum_z l_z * exp(m_z - M), one block
    per (t, h). (One block per token, its threads walking every head's dims, was latency-bound:
    29 us per call at batch 32 on the H200, 6% of an 8B decode forward: profile of
    bench/results/forward_profile_h200_2026-11-27.txt.)"""
    D = head_dim
    NT = min(_MERGE_THREADS, D)
    NEG = _NEG

    @cuda.jit(fastmath=True)
    def merge(part_ml, part_o, out, num_splits):
        t = cuda.blockIdx.x
        for h in range(cuda.blockIdx.y, out.shape[1], cuda.gridDim.y):  # (see merge_splits)
            mx = NEG  # (every thread of the block reads the same few maxima and sums)
            for z in range(num_splits):
                mx = max(mx, part_ml[z, t, h, 0])
            total = float32(0.0)
            for z in range(num_splits):
                total += part_ml[z, t, h, 1] * math.exp(part_ml[z, t, h, 0] - mx)
            inv = float32(1.0) / total if total > 0.0 else float32(0.0)  # (no keys: zeros)
            for d in range(cuda.threadIdx.x, D, NT):
                o = float32(0.0)
                for z in range(num_splits):
                    o += part_o[z, t, h, d] * math.exp(part_ml[z, t, h, 0] - mx)
                out[t, h, d] = o * inv

    return merge


def merge_splits(part_ml, part_o, out: torch.Tensor, num_splits: int) -> None:
    """Combine a split decode's partials (part_ml [Z, T, H, 2]: max and sum per split,
    part_o [Z, T, H, D] unnormalised) into out [T, H, D]."""
    tokens, heads, head_dim = out.shape
    threads = min(_MERGE_THREADS, head_dim)
    # one block per (token, head) on a GPU; the simulator, which starts a Python thread per
    # simulated thread of every block, takes one block per token walking the heads
    head_blocks = 1 if SIMULATOR else heads
    launch(_merge_kernel(head_dim), (tokens, head_blocks), threads, part_ml, part_o, out,
           num_splits)  # fmt: skip


# (num_heads, num_kv_heads, head_dim, sliding_window, forced num_splits)
KernelPlanKey = tuple[int, int, int, int | None, int | None]


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """Per-forward launch data of the CUDA attention, shared by every layer."""

    q_tile: int  # query tokens per work item
    lanes: int  # lanes per key group
    num_items: int  # work items (grid x)
    num_splits: int  # key-range splits (grid z)
    min_chunk: int  # fewest keys a split of a tile gets (each tile splits its own key range)
    chunk: int  # keys per split of the longest tile
    work: torch.Tensor  # [num_items, 2] int32: (sequence, first query token within it)
    part_ml: torch.Tensor  # [S, T, H, 2] float32 partial (max, sum); dummy when S == 1
    part_o: torch.Tensor  # [S, T, H, D] float32 partial outputs; dummy when S == 1


def _tile_config(head_dim: int, group: int, max_query_len: int) -> tuple[int, int]:
    """(query tokens per work item, lanes per key group)."""
    q_tile = 1 if max_query_len == 1 else max(1, _ROWS_TARGET // group)
    rows = group * q_tile
    # Half-warp groups (2 keys per warp step) when each lane's registers allow it: per lane
    # 2 * rows * head_dim / lanes floats of query + accumulator.
    lanes = 32 if head_dim % 32 == 0 and rows * head_dim > 512 else 16
    if _FORCE_LANES is not None:
        lanes = _FORCE_LANES
    return q_tile, lanes


def _transposed_sums(k_bits: int, v_bits: int, dims_per_lane: int) -> bool:
    if _FORCE_TRANSPOSED_SUMS is not None:
        return _FORCE_TRANSPOSED_SUMS
    return reads_words(k_bits, v_bits, dims_per_lane)


def _keys_per_step(q_tile: int, group: int, words: bool) -> int:
    """Keys per group per step of a tile of ``q_tile`` query tokens for ``group`` query heads
    per KV head; ``words``: quantized pages read as words (kv_load)."""
    if _FORCE_KEYS_PER_STEP is not None:
        return _FORCE_KEYS_PER_STEP
    if q_tile > 1:
        return 1
    if words or group <= _WIDE_GROUP:
        return _DECODE_KEYS_PER_STEP
    return _WIDE_GROUP_KEYS_PER_STEP


def num_sms(device: torch.device) -> int:
    """The SMs of a CUDA ``device`` (the current one when it names no index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_splits(blocks: int, max_span: int, device: torch.device) -> int:
    if SIMULATOR:
        return 1
    want = -(-_BLOCKS_PER_SM * num_sms(device) // blocks)
    return max(1, min(want, max_span // _MIN_SPLIT_KEYS, _MAX_SPLITS))


def _chunk_keys(span: int, splits: int, min_chunk: int, groups: int) -> int:
    """Keys per split of a tile whose key range is ``span`` long (the kernel's formula):
    an even share, at least ``min_chunk``, rounded up to whole key groups."""
    chunk = max(-(-span // splits), min_chunk)
    return -(-chunk // groups) * groups


def _plan(
    batch: ForwardBatch,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sliding_window: int | None,
    num_splits: int | None,
    device: torch.device,
) -> KernelPlan:
    key = (num_heads, num_kv_heads, head_dim, sliding_window, num_splits)
    plan = batch.attention.kernel.get(key)
    if plan is not None:
        return plan
    group = num_heads // num_kv_heads
    q_tile, lanes = _tile_config(head_dim, group, batch.max_query_len)
    num_items = sum(-(-n // q_tile) for n in batch.q_lens)  # host ints, once per forward

    # Work list on the device from query_start_loc: no host copy, capturable.
    qsl = batch.query_start_loc.to(device)
    tiles = (qsl[1:] - qsl[:-1] + (q_tile - 1)) // q_tile  # [B]
    seq = torch.repeat_interleave(
        torch.arange(batch.num_seqs, device=device, dtype=torch.int32),
        tiles,
        output_size=num_items,
    )
    first_tile = torch.cumsum(tiles, 0) - tiles
    item = torch.arange(num_items, device=device, dtype=torch.int32)
    offset = (item - first_tile[seq.long()]) * q_tile
    work = torch.stack((seq, offset.to(torch.int32)), dim=1).contiguous()

    # Longest key range of any tile, then the split of it.
    max_span = batch.max_seq_len
    if sliding_window is not None:
        max_span = min(max_span, sliding_window + q_tile - 1)
    groups_per_block = _NUM_WARPS * 32 // lanes
    if num_splits is None:
        splits = _auto_splits(num_items * num_kv_heads, max_span, device)
        min_chunk = _MIN_SPLIT_KEYS
    else:
        splits = min(num_splits, max_span)
        min_chunk = 1
    chunk = _chunk_keys(max_span, splits, min_chunk, groups_per_block)
    splits = -(-max_span // chunk)  # no grid slice that even the longest tile leaves empty
    if splits > 1:
        shape = (splits, batch.num_tokens, num_heads)
        part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=device)
        part_o = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
    else:
        part_ml = torch.empty((1, 1, 1, 2), dtype=torch.float32, device=device)
        part_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=device)
    plan = KernelPlan(q_tile, lanes, num_items, splits, min_chunk, chunk, work, part_ml, part_o)
    batch.attention.kernel[key] = plan
    return plan


def _check_inputs(  # noqa: C901
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: ForwardBatch,
    sliding_window: int | None,
    num_splits: int | None,
) -> None:
    name = "paged_attention_cuda"
    if not kernels_available():
        raise ValueError(f"{name}: no CUDA device (and NUMBA_ENABLE_CUDASIM is not set)")
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [T, H, D], got shape {tuple(q.shape)}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"{name}: k_pages and v_pages must both be [num_pages, page_size, KV, D], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    check_dtype(name, q, k_pages, v_pages)
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(
            f"{name}: q, k_pages and v_pages must share a dtype, got {q.dtype}, "
            f"{k_pages.dtype} and {v_pages.dtype}"
        )
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"{name}: q head_dim {head_dim} != K/V head_dim {kv_dim}")
    if head_dim % 16 or not 16 <= head_dim <= _MAX_HEAD_DIM:
        raise ValueError(
            f"{name}: head_dim must be a multiple of 16 in [16, {_MAX_HEAD_DIM}], got {head_dim}"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{name}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    if page_size != batch.page_size:
        raise ValueError(f"{name}: pages hold {page_size} tokens, batch says {batch.page_size}")
    if tokens != batch.num_tokens:
        raise ValueError(f"{name}: q has {tokens} rows, batch has {batch.num_tokens} tokens")
    for field_name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(batch, field_name)
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: batch.{field_name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: batch.{field_name} is on {t.device}, q on {q.device}")
    if k_pages.device != q.device or v_pages.device != q.device:
        raise ValueError(f"{name}: q, k_pages and v_pages must be on one device")
    if (q.device.type == "cuda") == SIMULATOR:
        where = "CPU tensors in the simulator" if SIMULATOR else "CUDA tensors"
        raise ValueError(f"{name}: needs {where}, got tensors on {q.device}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"{name}: sliding_window must be positive, got {sliding_window}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{name}: num_splits must be >= 1, got {num_splits}")


def paged_attention_cuda(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``paged_attention_reference`` as Numba CUDA kernels; returns a new [T, H, D] tensor.

    ``num_splits`` forces the flash-decoding split count (tests, benchmarks); by default it is
    chosen per forward from the grid size and the longest context. Launches on torch's current
    stream without a host sync.
    """
    _check_inputs(q, k_pages, v_pages, batch, sliding_window, num_splits)
    if attention_mma.routes_decode(q) and attention_mma.supports_fp16(
        k_pages.dtype, q.shape[2], q.shape[1] // k_pages.shape[2], batch.page_size,
        batch.max_query_len,
    ):  # fmt: skip
        return attention_mma.decode_attention_mma_fp16(
            q, k_pages, v_pages, batch, scale, sliding_window=sliding_window, num_splits=num_splits
        )
    pages = KVArgs(k_pages, v_pages, k_pages, v_pages, 0, 0, k_pages.shape[2])
    return launch_attention(q, pages, batch, scale, sliding_window, num_splits)


@dataclass(frozen=True, slots=True)
class KVArgs:
    """The page storage one attention launch reads: values, scales (unquantized pages pass
    their values again: never read) and each one's format (kv_load.kv_loader)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor
    v_scales: torch.Tensor
    k_bits: int
    v_bits: int
    kv_heads: int
    # the sink pages' unquantized rows [R, S, KV, D] (QuantPages.sinks); None: no sink pages
    k_sinks: torch.Tensor | None = None
    v_sinks: torch.Tensor | None = None
    # pages stored rotated per group of 32 (QuantPages.rotate): q goes in rotated and the
    # output comes out rotated back (in the kernel for word reads, else by torch around it)
    rotate: bool = False


def launch_attention(
    q: torch.Tensor,
    pages: KVArgs,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None,
    num_splits: int | None,
) -> torch.Tensor:
    """The attention (+ merge) launches over checked inputs; returns a new [T, H, D]."""
    tokens, heads, head_dim = q.shape
    kv_heads = pages.kv_heads
    rows = pages.k.shape[0] * batch.page_size * kv_heads
    if rows > _MAX_ROWS:  # the kernel's row arithmetic is 32-bit (kv_load)
        raise ValueError(
            f"paged attention: {pages.k.shape[0]} pages x {batch.page_size} slots x {kv_heads} "
            f"KV heads = {rows} rows, over the kernel's {_MAX_ROWS}"
        )
    plan = _plan(batch, heads, kv_heads, head_dim, sliding_window, num_splits, q.device)
    dpl = head_dim // plan.lanes
    words = reads_words(pages.k_bits, pages.v_bits, dpl)
    rotate_around = pages.rotate and not words  # (the kernel rotates for word reads only)
    if rotate_around:
        q = rotate_groups(q)
    kernel = _attention_kernel(
        head_dim,
        batch.page_size,
        heads // kv_heads,
        plan.q_tile,
        plan.lanes,
        pages.k_bits,
        pages.v_bits,
        _keys_per_step(plan.q_tile, heads // kv_heads, words),
        _MIN_BLOCKS if _FORCE_MIN_BLOCKS is None else _FORCE_MIN_BLOCKS,
        _SHUFFLES,
        _transposed_sums(pages.k_bits, pages.v_bits, dpl),
        pages.k_sinks is not None,
        pages.rotate and words,
        _FORCE_WORD_AFFINE is not False,
    )
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if SIMULATOR and not q.is_contiguous():
        q = q.contiguous()  # the simulator copies arrays in as single buffers; a GPU takes views
    k_pages, v_pages = pages.k, pages.v
    if words:
        k_pages, v_pages = k_pages.view(word_dtype(dpl)), v_pages.view(word_dtype(dpl))
    # (without sink pages the kernel never reads them: the scales stand in for the arguments)
    k_sinks = pages.k_scales if pages.k_sinks is None else pages.k_sinks
    v_sinks = pages.v_scales if pages.v_sinks is None else pages.v_sinks
    k_pages, v_pages, k_sinks, v_sinks = map(flat_pages, (k_pages, v_pages, k_sinks, v_sinks))
    launch(
        kernel,
        (plan.num_items, kv_heads, plan.num_splits),
        _NUM_WARPS * 32,
        q,
        k_pages,
        v_pages,
        flat_pages(pages.k_scales),
        flat_pages(pages.v_scales),
        out,
        plan.part_ml,
        plan.part_o,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        plan.work,
        np.float32(scale),
        sliding_window or 0,
        plan.min_chunk,
        plan.num_splits,
        k_sinks,
        v_sinks,
    )
    if plan.num_splits > 1:
        merge_splits(plan.part_ml, plan.part_o, out, plan.num_splits)
    return rotate_groups(out) if rotate_around else out


def warm_up_split_merge(
    dtype: torch.dtype,
    device: torch.device | str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    """Launch a 2-way split once so the merge kernel is compiled at load: a warm-up forward's
    short contexts never split, and the first long-context decode would compile it mid-request.
    """
    from engine.batch import SequenceInput, build_forward_batch

    # Long enough that a 2-way split survives rounding each split to whole key groups (up to
    # a block's threads): a context of one page did not split on a GPU, so nothing compiled.
    cached = 2 * _NUM_WARPS * 32
    num_pages = cached // page_size + 1
    seq = SequenceInput([0], num_cached=cached, pages=list(range(num_pages)))
    batch = build_forward_batch([seq], page_size, device)
    q = torch.zeros((1, num_heads, head_dim), dtype=dtype, device=device)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    pages = torch.zeros(shape, dtype=dtype, device=device)
    paged_attention_cuda(q, pages, pages, batch, 1.0, num_splits=2)
