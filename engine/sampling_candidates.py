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

A row holding a NaN gets its first NaN as the greedy token (as ``max`` gives it) and a NaN
``row_max``; ``top`` does not handle such rows: callers check ``row_max``.

The block maxima always come from torch (``amax`` is vectorised and propagates NaN). What
follows them runs as compiled loops for float32 rows on the CPU (``engine.sampling_cpu``, the
same tokens and values; ``ENGINE_SAMPLING_JIT=0``: the torch ops below everywhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BLOCK = 64  # ids per block: a vectorised amax over 64 floats, ~500 blocks for 32k ids
SUB = 8  # ids per sub-block, the second narrowing of the top-k candidates
JIT_ENV = "ENGINE_SAMPLING_JIT"  # "0": the torch ops on the CPU too (no engine.sampling_cpu)


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
        maxima = _block_maxima(x, full)
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
        """[B] long: the first id of each row's maximum, or of its first NaN: exactly
        ``x[:, :limit].max(-1).indices`` (a NaN is the maximum there)."""
        width = self.full * BLOCK
        if not self.full:
            return _first_hit(self.tail, self.row_max)
        if compiled_rows(self.x):
            from engine import sampling_cpu

            return sampling_cpu.greedy(self.x, self.limit, self.maxima, self.row_max)
        # a block holding a NaN has a NaN maximum (amax propagates it), equal to nothing
        hit = ((self.maxima == self.row_max) | self.maxima.isnan()).to(torch.uint8)
        in_blocks = hit.amax(-1).bool()
        first = hit.argmax(-1, keepdim=True)
        block = self.block_view().gather(1, first[..., None].expand(-1, -1, BLOCK)).squeeze(1)
        ids = first.squeeze(1) * BLOCK + _first_hit(block, self.row_max)
        if width < self.limit:  # rows whose maximum is only in the tail
            ids = torch.where(in_blocks, ids, width + _first_hit(self.tail, self.row_max))
        return ids

    def top(self, n: int, floors=None, needs=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, ids) [B, n]: the ``n`` largest values of each row's first ``limit`` ids,
        descending, as ``x[:, :limit].topk(n)`` (ids among equal values may differ).

        Two narrowings: the ``n`` blocks with the largest maxima, then, inside them, the
        ``n`` sub-blocks of ``SUB`` ids with the largest maxima (the same argument one level
        down); the final ``topk`` sees ``n * SUB`` values and the tail.

        ``floors``, ``needs``: per row a value with at least ``needs[r]`` (default ``n``)
        values at or above it, or -inf (``engine.sampling_cpu.MassHistogram.bounds``): the
        compiled loops then narrow an ``n`` past the blocks' reach too, and a row whose
        ``needs[r]`` is below ``n`` may end in pads (value -inf, id -1) past its floor."""
        compiled = compiled_rows(self.x)
        if compiled and (self.full > n or floors is not None):
            from engine import sampling_cpu

            return sampling_cpu.top(self.x, self.limit, self.maxima, n, floors, needs)
        if self.full <= n:  # blocks would not narrow anything
            return self.x[:, : self.limit].topk(n, dim=-1)
        rows = self.x.shape[0]
        # which n: their order does not matter (sorted=False is cheaper)
        chosen = self.maxima.topk(n, dim=-1, sorted=False).indices
        values = _take(self.x, BLOCK, chosen)  # [B, n * BLOCK]
        per_block = BLOCK // SUB
        maxima = values.view(rows, n * per_block, SUB).amax(-1)
        sub = maxima.topk(n, dim=-1, sorted=False).indices
        values = _take(values, SUB, sub)  # [B, n * SUB]
        tail_width = self.limit - self.full * BLOCK
        if tail_width:
            values = torch.cat([values, self.tail], dim=1)
        top, where = values.topk(n, dim=-1)
        in_sub = sub.gather(1, (where // SUB).clamp(max=n - 1))
        block = chosen.gather(1, in_sub // per_block)
        ids = block * BLOCK + (in_sub % per_block) * SUB + where % SUB
        if tail_width:
            in_tail = where >= n * SUB
            ids = torch.where(in_tail, where - n * SUB + self.full * BLOCK, ids)
        return top, ids


def _block_maxima(x: torch.Tensor, full: int) -> torch.Tensor:
    """[B, full]: the maxima of ``x``'s first ``full`` blocks. Over every block of the row
    when its width is a few whole blocks more (a padded vocabulary): torch's reduction of a
    contiguous tensor took 1.27 ms at 256 x 32768 on the 2-core CPU, that of the
    ``[:, :32000]`` view 1.54 ms; the blocks past ``full`` are dropped (each block's maximum
    is its own, whatever the padded ids hold)."""
    width = x.shape[1]
    extra = width - full * BLOCK
    if 0 < extra <= width // 16 and width % BLOCK == 0 and x.is_contiguous():
        # (contiguous again: the compiled loops over a row's maxima vectorise only then)
        return x.unflatten(1, (width // BLOCK, BLOCK)).amax(-1)[:, :full].contiguous()
    return x[:, : full * BLOCK].unflatten(1, (full, BLOCK)).amax(-1)


def compiled_rows(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows take ``engine.sampling_cpu``'s loops: float32 on the CPU with unit
    stride along the vocabulary (rows may be a view of a larger tensor)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.stride(1) == 1
        and os.environ.get(JIT_ENV, "1").strip() != "0"
    )


def _first_hit(values: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """[B]: each row's first position holding ``row_max`` or a NaN (argmax returns the
    first maximum: on bools, the first True)."""
    return ((values == row_max) | values.isnan()).to(torch.uint8).argmax(-1)


def _take(x: torch.Tensor, width: int, chosen: torch.Tensor) -> torch.Tensor:
    """[B, n * width]: chunks ``chosen`` [B, n] of each row of ``x`` (chunk j: ids
    ``j * width`` to ``(j + 1) * width``). Rows whose stride is a multiple of ``width`` are
    read as one [rows * chunks, width] view with one ``index_select`` of whole chunks (a
    gather of single elements costs ~20x more on a CPU)."""
    rows, n = chosen.shape
    per_row, rest = divmod(x.stride(0), width)
    if x.stride(1) == 1 and not rest:
        chunks = x.as_strided((rows * per_row, width), (width, 1))
        index = torch.arange(rows, device=chosen.device)[:, None] * per_row + chosen
        return chunks.index_select(0, index.flatten()).view(rows, n * width)
    blocks = x[:, : x.shape[1] // width * width].unflatten(1, (-1, width))
    return blocks.gather(1, chosen[..., None].expand(-1, -1, width)).flatten(1)
