"""Greedy tokens and top-k candidates of a batch of logit rows without sorting (or reading
more than once) the vocabulary.

Both start from *block maxima*: the row's ids below ``limit`` are split into blocks of
``BLOCK`` ids (the ``limit % BLOCK`` last ids, the tail, stand apart) and each block's
maximum is taken with one vectorised ``amax`` pass. Then:

- the greedy token is the first id holding the row's maximum: the first block whose maximum
  equals it, then the first id inside that block (the tail comes last). The same id as
  ``max(-1).indices`` (the first maximum), which on a CPU is not vectorised and costs
  several times the ``amax`` pass.
- the ``n`` largest values of a row all lie in its ``n`` blocks with the largest maxima or
  in the tail (the n-th largest block maximum is at or below the row's n-th largest value,
  and any value above it sits in a block whose maximum is above it too). So ``topk`` runs
  over those ``n * BLOCK`` (+ tail) values only. The values (and so the kept set, whatever
  the ties) are those a ``topk`` over the whole row returns; which of several ids tied on
  the n-th value comes out may differ, and the sampler never depends on that.

Rows holding NaN are not handled here (``amax`` propagates it): callers check ``row_max``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 64  # ids per block: a vectorised amax over 64 floats, ~500 blocks for 32k ids


@dataclass(slots=True)
class Blocks:
    """Block maxima [B, full] of ``x[:, :full * BLOCK]`` and the row maxima [B, 1] (the
    tail ``x[:, full * BLOCK : limit]`` included)."""

    x: torch.Tensor
    limit: int
    full: int  # whole blocks
    maxima: torch.Tensor
    row_max: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, limit: int) -> Blocks:
        full = limit // BLOCK
        maxima = x[:, : full * BLOCK].unflatten(1, (full, BLOCK)).amax(-1)
        row_max = maxima.amax(-1, keepdim=True) if full else None
        if full * BLOCK < limit:
            tail = x[:, full * BLOCK : limit].amax(-1, keepdim=True)
            row_max = tail if row_max is None else torch.maximum(row_max, tail)
        return cls(x, limit, full, maxima, row_max)

    @property
    def tail(self) -> torch.Tensor:
        return self.x[:, self.full * BLOCK : self.limit]

    def block_view(self) -> torch.Tensor:
        return self.x[:, : self.full * BLOCK].unflatten(1, (self.full, BLOCK))

    def greedy(self) -> torch.Tensor:
        """[B] long: the first id of each row's maximum. Exactly
        ``x[:, :limit].max(-1).indices`` for rows without NaN."""
        width = self.full * BLOCK
        if not self.full:
            return (self.tail == self.row_max).to(torch.uint8).argmax(-1)
        # argmax returns the first maximum: on bools, the first True
        hit = (self.maxima == self.row_max).to(torch.uint8)
        in_blocks = hit.amax(-1).bool()
        first = hit.argmax(-1, keepdim=True)
        block = self.block_view().gather(1, first[..., None].expand(-1, -1, BLOCK)).squeeze(1)
        inside = (block == self.row_max).to(torch.uint8).argmax(-1)
        ids = first.squeeze(1) * BLOCK + inside
        if width < self.limit:  # rows whose maximum is only in the tail
            in_tail = width + (self.tail == self.row_max).to(torch.uint8).argmax(-1)
            ids = torch.where(in_blocks, ids, in_tail)
        return ids

    def top(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [B, n]: the ``n`` largest values of each row's first ``limit`` ids,
        descending, as ``x[:, :limit].topk(n)`` (ids among equal values may differ)."""
        if self.full <= n:  # blocks would not narrow anything
            return self.x[:, : self.limit].topk(n, dim=-1)
        chosen = self.maxima.topk(n, dim=-1).indices
        # gather whole blocks through an expanded (never materialised) index
        values = self.block_view().gather(1, chosen[..., None].expand(-1, -1, BLOCK))
        values = values.flatten(1)
        tail_width = self.limit - self.full * BLOCK
        if tail_width:
            values = torch.cat([values, self.tail], dim=1)
        top, where = values.topk(n, dim=-1)
        block = chosen.gather(1, (where // BLOCK).clamp(max=n - 1))
        ids = block * BLOCK + where % BLOCK
        if tail_width:
            in_tail = where >= n * BLOCK
            ids = torch.where(in_tail, where - n * BLOCK + self.full * BLOCK, ids)
        return top, ids
