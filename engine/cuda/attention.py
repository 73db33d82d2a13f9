"""Paged attention over a ragged batch (prefill, chunked prefill and decode in one call).

Torch reference: gathers each sequence's pages into a padded [B, max_kv] view and runs one
masked scaled-dot-product attention. It is the spec the CUDA kernels are checked against and
the CPU production path, so it avoids per-sequence Python loops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch


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
    layout = _padded_layout(batch)
    num_heads, head_dim = q.shape[1], q.shape[2]
    q_pad = torch.cat((q, q.new_zeros(1, num_heads, head_dim)))[layout["q_index"]]
    k = _gather_pages(k_pages, batch, layout["num_blocks"])
    v = _gather_pages(v_pages, batch, layout["num_blocks"])
    mask = _mask(batch, layout, sliding_window)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # [B, H, max_q, D]
        k.transpose(1, 2).to(q.dtype),  # [B, KV, max_kv, D]
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != k.shape[2],
    )
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B * max_q, H, D]
    return out[layout["out_rows"]]


def _gather_pages(pages: torch.Tensor, batch: ForwardBatch, num_blocks: int) -> torch.Tensor:
    """[P, S, KV, D] pages -> [B, num_blocks * S, KV, D] contiguous per-sequence context."""
    table = batch.block_tables[:, :num_blocks].long()
    gathered = pages[table]  # [B, num_blocks, S, KV, D]
    b, n, s, kv, d = gathered.shape
    return gathered.view(b, n * s, kv, d)


def _padded_layout(batch: ForwardBatch) -> dict:
    """Index tensors mapping flat rows <-> [B, max_q] padded rows; cached for all layers."""
    if "attn_layout" in batch.scratch:
        return batch.scratch["attn_layout"]
    device = batch.input_ids.device
    num_seqs, max_q = batch.num_seqs, batch.max_query_len
    q_lens = torch.tensor(batch.q_lens, device=device)
    seq_lens = torch.tensor(batch.seq_lens_host, device=device)
    starts = batch.query_start_loc[:-1].long()
    col = torch.arange(max_q, device=device)
    valid = col[None, :] < q_lens[:, None]  # [B, max_q]
    # padding rows point at the extra zero row appended to q (index T)
    q_index = torch.where(valid, starts[:, None] + col[None, :], batch.num_tokens)
    rows = (torch.arange(num_seqs, device=device)[:, None] * max_q + col[None, :])[valid]
    num_blocks = -(-batch.max_seq_len // batch.page_size)
    layout = {
        "q_index": q_index,
        "out_rows": rows,
        "valid": valid,
        # absolute position of each padded query row
        "q_pos": (seq_lens - q_lens)[:, None] + col[None, :],
        "num_blocks": num_blocks,
        "kv_pos": torch.arange(num_blocks * batch.page_size, device=device),
        "seq_lens": seq_lens,
    }
    batch.scratch["attn_layout"] = layout
    return layout


def _mask(batch: ForwardBatch, layout: dict, sliding_window: int | None) -> torch.Tensor:
    """Boolean [B, 1, max_q, max_kv] mask (True = attend), one per window size per forward."""
    key = ("attn_mask", sliding_window)
    if key in batch.scratch:
        return batch.scratch[key]
    q_pos = layout["q_pos"][:, :, None]  # [B, max_q, 1]
    kv_pos = layout["kv_pos"][None, None, :]  # [1, 1, max_kv]
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    # Padding query rows would see no key and turn into NaN; give them key 0 (rows are dropped).
    mask[:, :, 0] |= ~layout["valid"]
    mask = mask[:, None]
    batch.scratch[key] = mask
    return mask
