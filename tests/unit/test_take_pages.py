"""engine/cache/gather.py: take_pages is pages[index] (any page layout and index shape), with
negative ids (block-table padding) reading page 0."""

from __future__ import annotations

import torch

from engine.cache.gather import take_pages


def test_take_pages_is_advanced_indexing():
    gen = torch.Generator().manual_seed(0)
    for pages in (torch.randn(9, 4, 2, 8, generator=gen), torch.randint(0, 255, (9, 4, 3, 16))):
        index = torch.randint(0, 9, (3, 5), generator=gen)
        assert torch.equal(take_pages(pages, index), pages[index])
        assert torch.equal(take_pages(pages, index[0]), pages[index[0]])
        assert take_pages(pages, index).is_contiguous()


def test_negative_ids_read_page_zero():
    pages = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)
    index = torch.tensor([[3, -1], [-2, 4]])
    assert take_pages(pages, index).tolist() == [[[6, 7], [0, 1]], [[0, 1], [8, 9]]]
