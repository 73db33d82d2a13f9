"""bench/kv_gather_kernel.py's cases (its timing needs a GPU): the page layout each mode
gathers, the bytes it counts, and its kernel-vs-torch check, run in the simulator at a small
head shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from kv_gather_kernel import PAGE, check_equal, gather_case

KV, D = 2, 32


@pytest.mark.parametrize("mode", ["q4+rows+rot", "q8"])
def test_a_case_gathers_the_same_through_kernel_and_torch(mode):
    pages, index, unrotate, moved = gather_case(mode, 2, 4 * PAGE, "cpu", KV, D)
    assert index.shape == (2, 4) and unrotate == ("rot" in mode)
    assert sorted(index.flatten().tolist()) == list(range(8))  # every page once
    if "rows" in mode:  # first and last two blocks on rows pages (ids below 6)
        assert index[:, [0, 2, 3]].max() < 6 <= index[:, 1].min()
        assert pages.sinks.shape[0] == 6
    codes = D // (2 if mode.startswith("q4") else 1) + 2  # bytes per head and row: codes, scale
    rows_tokens = 6 * PAGE if "rows" in mode else 0
    out = 8 * PAGE * KV * D * 2
    assert moved == (8 * PAGE - rows_tokens) * KV * codes + rows_tokens * KV * D * 2 + out
    check_equal(pages, index, unrotate)


def test_the_check_catches_a_different_gather(monkeypatch):
    from engine.cuda import kv_gather

    pages, index, unrotate, _ = gather_case("q8", 1, 3 * PAGE, "cpu", KV, D)
    wrong = kv_gather.gather_context

    def off_by_one_page(pages, index, dtype, **kwargs):
        return wrong(pages, index.roll(1, dims=1), dtype, **kwargs)

    monkeypatch.setattr(kv_gather, "gather_context", off_by_one_page)
    with pytest.raises(AssertionError):
        check_equal(pages, index, unrotate)
