"""A ragged batch for one forward pass, as device tensors.

Each sequence in the batch brings some new tokens (a whole prompt, a prefill chunk, or one
decode token) and some tokens already in paged KV storage. All new tokens are concatenated
into one flat row dimension ``T``; the per-sequence metadata says where each sequence's rows
start, how long its context is and which pages hold it.

    sequence b: [ cached tokens (num_cached[b]) | new tokens (q_len[b]) ]  -> seq_len[b]
    token t of sequence b sits at position num_cached[b] + i and is written to slot
    block_table[b][pos // page_size] * page_size + pos % page_size.

A sequence asks for the logits of its last ``logits_rows`` new tokens: 1 for a decode token
or a prompt's last chunk, 0 for a chunk mid-prompt, 1 + k to verify k draft tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.embeddings import EmbeddingTable, EmbeddingTableBuilder, MMEmbedding

if TYPE_CHECKING:
    from engine.cuda.attention import AttentionGroup, DecodeSplit, KernelPlan, KernelPlanKey


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """One sequence's part of a forward pass (host values)."""

    token_ids: Sequence[int]  # the new tokens computed in this pass
    num_cached: int  # tokens of this sequence already in KV storage (their positions come first)
    pages: Sequence[int]  # page ids holding positions [0, num_cached + len(token_ids))
    logits_rows: int = 1  # logits wanted for this many trailing new tokens (0: none)
    # the job's embedding containers, when its placeholder ids may be among token_ids
    embeddings: Sequence[MMEmbedding] = ()
    # every one of token_ids is a prompt token (no generated token, no draft): a quantized
    # cache's ``exact_chunks`` lets such a chunk read its own K/V exactly
    prompt_chunk: bool = False

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a sequence in a forward batch needs at least one new token")
        if self.num_cached < 0:
            raise ValueError(f"num_cached must be >= 0, got {self.num_cached}")
        if self.logits_rows != 1 and not 0 <= self.logits_rows <= n:  # 1: always valid
            raise ValueError(
                f"logits_rows must be in [0, {n}] (the new tokens), got {self.logits_rows}"
            )


@dataclass(slots=True)
class AttentionPlan:
    """Attention metadata of one forward, shared by every layer: the first layer that needs a
    part builds it from the batch, the later layers reuse it. Each op set fills its own fields.
    A batch reused for another forward with other values needs a fresh plan (decode-graph
    buckets keep theirs: it is sized for the longest context they allow)."""

    # CUDA kernel: launch plan (work list, split count, partial buffers) per shape and window
    kernel: dict[KernelPlanKey, KernelPlan] = field(default_factory=dict)
    # torch reference: the sequences padded together (row maps, pages, masks per window)
    groups: list[AttentionGroup] | None = None
    # quantized pages with exact_chunks: the slots (ascending) and flat rows of the prompt
    # chunks of more than one token, which read their own K/V exactly; () when there are none
    own_order: tuple[torch.Tensor, ...] | None = None
    # CUDA op set, a batch of decode rows and longer queries: the decode rows for the kernel,
    # the rest for the reference (engine/cuda/attention.py ``decode_split``)
    decode_split: DecodeSplit | None = None


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors for one forward over a ragged batch.

    Shapes: T = total new tokens, B = sequences, P = max pages per sequence.
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [B + 1] int32: row offsets of each sequence
    seq_lens: torch.Tensor  # [B] int32: context length after this pass (cached + new)
    block_tables: torch.Tensor  # [B, P] int32, padded with 0 (masked by seq_lens)
    logits_indices: torch.Tensor  # [N] long: rows whose logits the caller wants, in order
    # Host copies: the attention paths need these sizes without a device sync.
    q_lens: tuple[int, ...] = ()
    seq_lens_host: tuple[int, ...] = ()
    page_size: int = 16
    attention: AttentionPlan = field(default_factory=AttentionPlan)
    # rows that replace placeholder tokens in the embedding step (None: plain tokens only)
    embeddings: EmbeddingTable | None = None
    # per sequence: its new tokens are all prompt tokens (``SequenceInput.prompt_chunk``);
    # () for none
    prompt_chunks: tuple[bool, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.q_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)


def build_forward_batch(
    seqs: Sequence[SequenceInput], page_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """Flatten sequences into one ragged batch; validates that the pages cover every position."""
    if not seqs:
        raise ValueError("a forward batch needs at least one sequence")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    wanted: list[int] = []
    embeds = EmbeddingTableBuilder() if any(s.embeddings for s in seqs) else None
    for seq in seqs:
        _check_pages(seq, page_size)
        if seq.embeddings:
            embeds.add(seq.token_ids, len(input_ids), seq.embeddings)
        for i, token in enumerate(seq.token_ids):
            pos = seq.num_cached + i
            input_ids.append(int(token))
            positions.append(pos)
            slots.append(seq.pages[pos // page_size] * page_size + pos % page_size)
        starts.append(len(input_ids))
        wanted.extend(range(len(input_ids) - seq.logits_rows, len(input_ids)))
    q_lens = tuple(len(s.token_ids) for s in seqs)
    seq_lens = tuple(s.num_cached + len(s.token_ids) for s in seqs)
    max_pages = max(len(s.pages) for s in seqs)
    table = [list(s.pages) + [0] * (max_pages - len(s.pages)) for s in seqs]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.long),
        positions=tensor(positions, torch.long),
        slot_mapping=tensor(slots, torch.long),
        query_start_loc=tensor(starts, torch.int32),
        seq_lens=tensor(list(seq_lens), torch.int32),
        block_tables=tensor(table, torch.int32),
        logits_indices=tensor(wanted, torch.long),
        q_lens=q_lens,
        seq_lens_host=seq_lens,
        page_size=page_size,
        embeddings=None if embeds is None else embeds.build(device),
        prompt_chunks=tuple(s.prompt_chunk for s in seqs),
    )


def _check_pages(seq: SequenceInput, page_size: int) -> None:
    needed = -(-(seq.num_cached + len(seq.token_ids)) // page_size)
    if len(seq.pages) < needed:
        raise ValueError(
            f"sequence of {seq.num_cached + len(seq.token_ids)} tokens needs {needed} pages "
            f"of {page_size}, got {len(seq.pages)}"
        )
