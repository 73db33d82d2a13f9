"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is a few hundred kernel launches whose CPU cost (Python, torch
dispatch, Numba argument packing) exceeds the GPU time, so it is captured once per bucket and
replayed. What a graph freezes, and how each is handled:

- Buffer addresses. Every per-step value (token ids, positions, slot mapping, context lengths,
  block tables) lives in static device buffers; a step copies its values into the first rows
  and replays the bucket's graph, whose batch views those rows.
- Batch size. A step of n sequences runs the smallest bucket >= n; the rows past n are padding:
  token 0 at position 0, slot -1 (the cache write skips it) and context length 0 (attention
  reads no page and returns zeros), so padding touches no page.
- Grid sizes and scalar kernel arguments. The attention plan (work list, split count, partial
  buffers) is made once per bucket for the longest context the generator allows; each tile
  splits its own key range in the kernel, so short contexts stay cheap.

The graph ends at the final-normed hidden states; the vocab matmul runs outside it, on the n
real rows only (one launch, and no [bucket, vocab] output held per graph).

Without a CUDA device (the simulator in CI, ``capture=False``) the same static buffers and
padded batches are run eagerly: everything but the capture itself is exercised on CPU.

Numba launches are captured like torch's own: ``engine.cuda._launch.stream`` resolves torch's
current stream per launch (the capture stream inside ``torch.cuda.graph``), tensors are handed
over by DLPack on that same stream (no event, no sync), and every kernel is compiled and loaded
by an eager run of the same bucket before capture. If capture fails anyway, the runner logs why
and the generator runs eager forwards.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch, SequenceInput
from engine.cache.page_table import RECENT_BLOCKS
from engine.cuda.attention_mma import graph_steps
from engine.embeddings import EMBEDDING_ID_BASE
from engine.inflight import TokenPatch
from engine.ops import OpSet
from engine.scheduler import StepEntry

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PAD_SLOT = -1


# one decode row: (its input token, its position (= tokens already cached), its pages)
DecodeRow = tuple[int, int, Sequence[int]]


@dataclass(slots=True)
class _Bucket:
    size: int
    batch: ForwardBatch  # views of the first ``size`` rows of the static buffers
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None  # the graph's output [size, hidden]


def bucket_sizes(max_batch_size: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[int]:
    """The buckets up to ``max_batch_size``, which is always the last one."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = sorted({b for b in buckets if 1 <= b < max_batch_size} | {max_batch_size})
    return sizes


class DecodeGraphs:
    """Runs decode steps (one new token per sequence) through per-bucket CUDA graphs."""

    def __init__(
        self,
        model,
        kv_pages,
        page_size: int,
        max_batch_size: int,
        max_seq_len: int,
        *,
        ops: OpSet | None = None,
        capture: bool | None = None,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
    ):
        ops = model.ops if ops is None else ops
        if not ops.supports_graphs:
            raise ValueError(
                f"decode graphs need an op set that supports graphs; {ops.name!r} does not"
            )
        if capture is None:
            capture = model.device.type == "cuda"
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA-graph capture needs a CUDA device, not {model.device}")
        self.model = model
        self.ops = ops
        self.kv_pages = kv_pages
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.max_pages = -(-max_seq_len // page_size)
        self.capture = capture
        self.sizes = bucket_sizes(max_batch_size, buckets)
        self.max_size = self.sizes[-1]
        self._make_buffers()
        self._buckets = {size: self._make_bucket(size) for size in self.sizes}
        self._copied: torch.cuda.Event | None = None
        self.steps = 0  # decode steps run through the buckets
        self.replays = 0  # of those, replayed as captured graphs (not eager bucket runs)
        if capture:
            self._capture_all()

    # -- buffers ---------------------------------------------------------------------------

    def _make_buffers(self) -> None:
        device = self.model.device
        n, pages = self.max_size, self.max_pages
        pin = device.type == "cuda"
        # ids, positions, slots | context lengths, then the block tables row by row
        self._longs = torch.zeros((3, n), dtype=torch.long, device=device)
        self._ints = torch.zeros(n * (1 + pages), dtype=torch.int32, device=device)
        self._host_longs = torch.zeros((3, n), dtype=torch.long, pin_memory=pin)
        self._host_ints = torch.zeros(n * (1 + pages), dtype=torch.int32, pin_memory=pin)
        self._np_longs = self._host_longs.numpy()
        self._np_ints = self._host_ints.numpy()
        self._query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(n, dtype=torch.long, device=device)
        # Which pages list each block-table row holds, and how many of its leading entries
        # can no longer change (full pages when the row was last written).
        self._row_pages: list[Sequence[int] | None] = [None] * n
        self._row_frozen = [0] * n

    def _make_bucket(self, size: int) -> _Bucket:
        tables = self._ints[self.max_size :].view(self.max_size, self.max_pages)
        batch = ForwardBatch(
            input_ids=self._longs[0, :size],
            positions=self._longs[1, :size],
            slot_mapping=self._longs[2, :size],
            query_start_loc=self._query_start_loc[: size + 1],
            seq_lens=self._ints[:size],
            block_tables=tables[:size],
            logits_indices=self._rows[:size],
            q_lens=(1,) * size,
            # Plans (split counts, partial buffers) are sized for the longest allowed context.
            seq_lens_host=(self.max_seq_len,) * size,
            page_size=self.page_size,
        )
        return _Bucket(size, batch)

    # -- capture ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        try:
            # Largest first: the smaller graphs then reuse the pool's blocks.
            for size in reversed(self.sizes):
                self._capture(self._buckets[size], pool)
        except Exception:  # any capture failure means: run eagerly
            logger.exception("CUDA-graph capture failed; decode steps will run eagerly")
            for bucket in self._buckets.values():
                bucket.graph = bucket.hidden = None
            self.capture = False
            torch.cuda.synchronize()
            return
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _capture(self, bucket: _Bucket, pool) -> None:
        self._stage([], bucket.size)
        self._upload(bucket.size)
        network, ops = self.model.network, self.ops
        # An eager run on a side stream first: it plans the attention (work list and partial
        # buffers, cached on the batch and reused by the graph) and loads every kernel module,
        # so the capture itself launches only.
        # (graph_steps: the warm-up routes decode attention as the capture does)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with graph_steps(), torch.inference_mode(), torch.cuda.stream(side):
            network.hidden_states(bucket.batch, self.kv_pages, ops)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        capturing = torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
        with _nothing_freed(), graph_steps(), torch.inference_mode(), capturing:
            hidden = network.hidden_states(bucket.batch, self.kv_pages, ops)
        bucket.graph, bucket.hidden = graph, hidden

    # -- steps -----------------------------------------------------------------------------

    def supports(self, seqs: Sequence[SequenceInput]) -> bool:
        """True when ``seqs`` is a decode step that fits a bucket."""
        if not 1 <= len(seqs) <= self.max_size:
            return False
        # A prompt's last token after a prefix hit looks like a decode token; if it is an
        # embedding placeholder, the eager forward (which substitutes rows) must run it.
        return all(
            len(s.token_ids) == 1
            and s.logits_rows == 1
            and s.num_cached < self.max_seq_len
            and not (s.embeddings and s.token_ids[0] >= EMBEDDING_ID_BASE)
            for s in seqs
        )

    def bucket_for(self, num_seqs: int) -> int:
        return next(size for size in self.sizes if size >= num_seqs)

    def run(self, seqs: Sequence[SequenceInput]) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] of one decode step (writes its K/V)."""
        logits = self.try_run(seqs)
        if logits is None:
            raise ValueError(
                f"not a decode step of <= {self.max_size} sequences within {self.max_seq_len} "
                "tokens"
            )
        return logits

    @torch.inference_mode()
    def supports_entries(self, entries: Sequence[StepEntry]) -> bool:
        """``supports(plan_rows(plan))`` for a plan's entries, without building the rows."""
        if not 1 <= len(entries) <= self.max_size:
            return False
        return all(
            e.num_tokens == 1
            and not e.drafts
            and e.samples
            and e.start < self.max_seq_len
            and not (e.seq.embeddings and e.seq.tokens[e.start] >= EMBEDDING_ID_BASE)
            for e in entries
        )

    def try_run(
        self, seqs: Sequence[SequenceInput], token_patch: TokenPatch | None = None
    ) -> torch.Tensor | None:
        """``run`` when ``seqs`` is a supported decode step, else None (nothing done).
        ``token_patch``: input ids taken from the device (row i's token is input id i)."""
        if not self.supports(seqs):
            return None
        return self._replay([(s.token_ids[0], s.num_cached, s.pages) for s in seqs], token_patch)

    def try_run_entries(
        self, entries: Sequence[StepEntry], token_patch: TokenPatch | None = None
    ) -> torch.Tensor | None:
        """``try_run(plan_rows(plan))`` read straight from a plan's entries: a decode step
        builds no ``SequenceInput`` rows, and a step the graphs decline builds nothing."""
        if not self.supports_entries(entries):
            return None
        rows = [(e.seq.tokens[e.start], e.start, e.seq.pages) for e in entries]
        return self._replay(rows, token_patch)

    def _replay(self, rows: list[DecodeRow], token_patch: TokenPatch | None) -> torch.Tensor:
        bucket = self._buckets[self.bucket_for(len(rows))]
        self._stage(rows, bucket.size)
        self._upload(bucket.size)
        if token_patch is not None:
            token_patch.apply(self._longs[0])
        self.steps += 1
        if bucket.graph is not None:
            self.replays += 1
            bucket.graph.replay()
            hidden = bucket.hidden
        else:  # (the same kernels as a captured step)
            with graph_steps():
                hidden = self.model.network.hidden_states(bucket.batch, self.kv_pages, self.ops)
        return self.model.network.logits(hidden[: len(rows)])

    def _stage(self, rows: Sequence[DecodeRow], size: int) -> None:
        """Write the step's values (and padding rows up to ``size``) into the host buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's upload has left the host buffers
        longs, ints = self._np_longs, self._np_ints
        n, ps = len(rows), self.page_size
        for i, (token, pos, pages) in enumerate(rows):
            if len(pages) <= pos // ps:
                raise ValueError(f"sequence of {pos + 1} tokens needs more than {len(pages)} pages")
            longs[0, i] = token
            longs[1, i] = pos
            longs[2, i] = pages[pos // ps] * ps + pos % ps
            ints[i] = pos + 1
            self._stage_table_row(i, pages, max(0, pos // ps - RECENT_BLOCKS))
        longs[:, n:size] = 0
        longs[2, n:size] = PAD_SLOT
        ints[n:size] = 0

    def _stage_table_row(self, row: int, pages: Sequence[int], full: int) -> None:
        """Row ``row`` of the block tables; ``full``: pages of the sequence already full, less
        the last RECENT_BLOCKS (which may still settle from recent pages).

        A sequence that had this row before (the same pages list object) rewrites only the
        entries from its full-page count then: by the scheduler's page-list INVARIANT (see
        ``Scheduler._grow`` in engine/scheduler.py) the entries of full pages never change
        while the list object lives; pages only get appended, and dedup swaps only a page in
        the commit that fills it. That makes a step cost O(batch), not O(batch x pages)."""
        used = min(len(pages), self.max_pages)
        start = 0
        if self._row_pages[row] is pages:
            start = min(self._row_frozen[row], used)
        base = self.max_size + row * self.max_pages
        self._np_ints[base + start : base + used] = pages[start:used]
        self._row_pages[row] = pages
        self._row_frozen[row] = full

    def _upload(self, size: int) -> None:
        tables = self.max_size + size * self.max_pages
        self._longs.copy_(self._host_longs, non_blocking=True)
        self._ints[:tables].copy_(self._host_ints[:tables], non_blocking=True)
        if self._longs.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()


@contextlib.contextmanager
def _nothing_freed() -> Iterator[None]:
    """No CUDA resource freed while a graph is captured: freeing one (a CUDA call the capture
    forbids) invalidates the capture. Seen on an H200: the garbage collector ran inside a
    capture and destroyed an earlier generator's graph ("operation not permitted when stream
    is capturing"), so that generator ran every decode step eagerly. The collector is paused
    (torch collects on entering the capture) and Numba's deallocations are deferred."""
    from engine.cuda._launch import cuda

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with cuda.defer_cleanup():
            yield
    finally:
        if was_enabled:
            gc.enable()
