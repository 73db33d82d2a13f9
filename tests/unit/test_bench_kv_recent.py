"""bench/kv_recent.py (an emulated cache whose recent tokens read exactly): its attention reads
every row exactly with a window past the sequence, every row through its codes with none, and
mixes the two per query in between."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench import kv_recent

TOKENS, HEADS, KV_HEADS, DIM = 12, 4, 2, 8


def _rows(seed: int = 0) -> tuple[torch.Tensor, kv_recent.LayerRows]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, DIM, generator=gen)
    exact_k, exact_v = torch.randn(2, TOKENS, KV_HEADS, DIM, generator=gen)
    noise_k, noise_v = torch.randn(2, TOKENS, KV_HEADS, DIM, generator=gen) * 0.3
    return q, kv_recent.LayerRows(exact_k, exact_v, exact_k + noise_k, exact_v + noise_v)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)


def test_window_past_the_sequence_reads_exactly_and_none_reads_codes():
    q, rows = _rows()
    positions, scale = torch.arange(TOKENS), DIM**-0.5
    exact = kv_recent.attend(q, rows, positions, scale, window=TOKENS, page=None)
    codes = kv_recent.attend(q, rows, positions, scale, window=0, page=None)
    torch.testing.assert_close(exact, _causal(q, rows.exact_k, rows.exact_v))
    torch.testing.assert_close(codes, _causal(q, rows.code_k, rows.code_v))


def test_a_query_reads_its_recent_rows_exactly():
    q, rows = _rows(1)
    positions, scale = torch.arange(TOKENS), DIM**-0.5
    out = kv_recent.attend(q, rows, positions, scale, window=3, page=None)
    last = TOKENS - 1  # reads rows last-2..last exactly, the rest through their codes
    k, v = rows.code_k.clone(), rows.code_v.clone()
    k[last - 2 :], v[last - 2 :] = rows.exact_k[last - 2 :], rows.exact_v[last - 2 :]
    torch.testing.assert_close(out[last], _causal(q, k, v)[last])
    paged = kv_recent.attend(q, rows, positions, scale, window=0, page=4)
    k, v = rows.code_k.clone(), rows.code_v.clone()
    k[8:], v[8:] = rows.exact_k[8:], rows.exact_v[8:]  # the last query's page: positions 8..11
    torch.testing.assert_close(paged[last], _causal(q, k, v)[last])
