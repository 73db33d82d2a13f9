"""Scatter new K/V rows into paged storage through the slot mapping. Torch reference."""

from __future__ import annotations

import torch


def cache_write_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, KV, D]; k_pages, v_pages: [P, S, KV, D]; slot_mapping: [T] (page * S + offset).

    Rows whose slot is negative are padding and are not written.
    """
    slots = slot_mapping.long()
    k_flat = k_pages.view(-1, *k_pages.shape[2:])
    v_flat = v_pages.view(-1, *v_pages.shape[2:])
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_flat.index_copy_(0, slots, k.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, v.to(v_flat.dtype))
