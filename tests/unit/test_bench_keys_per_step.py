"""bench/attention_keys_per_step.py's page layouts (its timing needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from attention_keys_per_step import first_pages_first

from engine.cache.page_table import RECENT_BLOCKS


@pytest.mark.parametrize("recent", [False, True])
def test_unquantized_pages_come_first_as_the_page_table_lays_them_out(recent):
    blocks, batch = 5, 3
    table = torch.randperm(blocks * batch, generator=torch.Generator().manual_seed(0))
    table = table.reshape(batch, blocks).to(torch.int32)
    renamed = first_pages_first(table, blocks * batch + 2, recent)
    assert renamed.dtype == table.dtype
    assert renamed.unique().numel() == renamed.numel()  # still distinct pages
    assert renamed[:, 0].tolist() == list(range(batch))  # sink pages: sequence i's is page i
    tails = renamed[:, -RECENT_BLOCKS:]
    middle = renamed[:, 1:-RECENT_BLOCKS]
    exact = batch * (1 + RECENT_BLOCKS)
    if recent:
        assert tails.reshape(-1).tolist() == list(range(batch, exact))
        assert middle.min() >= exact
    else:
        assert renamed[:, 1:].min() >= batch
