"""Reading the pages a batch names out of a cache tensor, for the torch references.

``take_pages`` is ``pages[index]`` by ``torch.index_select``: one contiguous copy per page
where advanced indexing copies element by element, about twice as fast on the CPU (SmolLM2's
fp16 pages, a decode batch of 8 x 1040 tokens: 0.41 -> 0.21 ms per K or V per layer on this
project's 2-core CPU), where the references run every decode step.
"""

from __future__ import annotations

import torch


def take_pages(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``pages[index]``: page ids ``index`` [...] of ``pages`` [P, ...] -> [..., *pages[0].shape].
    A negative id (block-table padding, which the attention masks) reads page 0, where
    advanced indexing would read from the end."""
    flat = index.reshape(-1).clamp(min=0)
    return torch.index_select(pages, 0, flat).view(*index.shape, *pages.shape[1:])
