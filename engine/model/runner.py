"""``ModelRunner``: one model's forward pass over its paged KV storage.

The generator hands it the scheduler's plan and gets logits back; everything between is here:

    StepPlan entries -> SequenceInput rows -> decode step through the CUDA graphs (DecodeGraphs)
                                           -> or a ForwardBatch and an eager forward
    StepPlan entries -> PersistentBatch (block tables kept across steps) -> an eager forward

plus the op set the forward runs with and the kernels' warm-up. Nothing here knows which op
set it runs: it asks the set's capabilities (``compiles``, ``supports_graphs``).

Rows are typed (``SequenceInput``): each carries its new tokens, its cached length, its pages
and how many trailing tokens need logits (``logits_rows``: 1 + k to verify k draft tokens).
A draft model for speculative decoding gets a runner of its own over its own KV storage; the
rows of both carry the same scheduler page ids.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from engine.batch import ForwardBatch, SequenceInput, build_forward_batch
from engine.cache.kv_cache import KVPages, kv_format
from engine.inflight import TokenPatch
from engine.model.cuda_graphs import DecodeGraphs
from engine.ops import OpSet
from engine.persistent_batch import PersistentBatch
from engine.scheduler import StepPlan

logger = logging.getLogger(__name__)

GRAPHS_ENV = "ENGINE_CUDA_GRAPHS"
PERSISTENT_BATCH_ENV = "ENGINE_PERSISTENT_BATCH"


class ModelRunner:
    """Runs forwards of ``model`` over ``kv_pages`` (pages of ``page_size`` tokens)."""

    def __init__(
        self,
        model,
        kv_pages: KVPages,
        page_size: int,
        *,
        max_batch_size: int,
        max_seq_len: int,
        ops: OpSet | None = None,
        cuda_graphs: bool | None = None,
        persistent_batch: bool | None = None,
    ):
        """``persistent_batch``: eager forwards of scheduler plans get their batch from a
        ``PersistentBatch`` (None: unless ``ENGINE_PERSISTENT_BATCH=0``); False rebuilds it
        from ``SequenceInput`` rows each step (the reference path)."""
        self.model = model
        self.kv_pages = kv_pages
        self.page_size = page_size
        self.ops = model.ops if ops is None else ops
        self.device = model.device
        if self.ops.compiles and (self.device.type == "cuda" or self.ops.compiles_on_cpu):
            self.warm_up()
        self.decode_graphs = self._make_decode_graphs(cuda_graphs, max_batch_size, max_seq_len)
        if persistent_batch is None:
            persistent_batch = os.environ.get(PERSISTENT_BATCH_ENV, "1").strip() != "0"
        self.persistent_batch = (
            PersistentBatch(page_size, self.device) if persistent_batch else None
        )

    def _make_decode_graphs(
        self, wanted: bool | None, max_batch_size: int, max_seq_len: int
    ) -> DecodeGraphs | None:
        """Decode steps as CUDA graphs: on by default on a GPU with an op set that supports
        them (``ENGINE_CUDA_GRAPHS=0`` turns them off); ``True`` on CPU runs the same padded
        static batches eagerly under the simulator (tests)."""
        if wanted is None:
            wanted = (
                self.device.type == "cuda"
                and self.ops.supports_graphs
                and os.environ.get(GRAPHS_ENV, "1").strip() != "0"
            )
        if not wanted:
            return None
        return DecodeGraphs(
            self.model,
            self.kv_pages,
            self.page_size,
            max_batch_size,
            max_seq_len,
            ops=self.ops,
        )

    @property
    def decode_graph_steps(self) -> int:
        return self.decode_graphs.steps if self.decode_graphs is not None else 0

    @property
    def decode_graph_replays(self) -> int:
        """Decode steps replayed as captured CUDA graphs (0 where capture failed or is off)."""
        return self.decode_graphs.replays if self.decode_graphs is not None else 0

    # -- forwards --------------------------------------------------------------------------

    def forward_plan(self, plan: StepPlan, token_patch: TokenPatch | None = None) -> torch.Tensor:
        """The forward of one scheduler step: logits of the entries that want them, in order.
        ``token_patch``: input ids that come from the device (async scheduling: the tokens the
        step before sampled, see engine/inflight.py), written over the batch's before the
        forward."""
        if self.decode_graphs is not None:
            logits = self.decode_graphs.try_run_entries(plan.entries, token_patch)
            if logits is not None:
                return logits
        if self.persistent_batch is None:
            batch = build_forward_batch(plan_rows(plan), self.page_size, self.device)
        else:
            batch = self.persistent_batch.build(plan)
        if token_patch is not None:
            token_patch.apply(batch.input_ids)
        return self.forward_batch(batch)

    def forward(self, rows: Sequence[SequenceInput]) -> torch.Tensor:
        """Float32 logits [sum of logits_rows, vocab]: each row's trailing ``logits_rows``
        positions, row by row. Writes the rows' K/V into this runner's pages."""
        if self.decode_graphs is not None:
            logits = self.decode_graphs.try_run(rows)
            if logits is not None:
                return logits
        return self.forward_batch(build_forward_batch(rows, self.page_size, self.device))

    @torch.inference_mode()
    def forward_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """An eager forward of a built batch (its attention plan is made by the first layer)."""
        return self.model.network(batch, self.kv_pages, self.ops)

    def warm_up(self) -> None:
        """Compile and load every kernel specialisation a forward needs now (never mid-request,
        nor during CUDA-graph capture), for this runner's page size."""
        warm_up(self.model, self.ops, self.page_size, *kv_format(self.kv_pages))


def plan_rows(plan: StepPlan) -> list[SequenceInput]:
    """The rows of a scheduler step: each entry's chunk of tokens over its sequence's pages."""
    return [
        SequenceInput(
            token_ids=e.seq.tokens[e.start : e.start + e.num_tokens] + list(e.drafts),
            num_cached=e.start,
            pages=e.seq.pages,
            logits_rows=e.forward_rows,
            embeddings=e.seq.embeddings,
            prompt_chunk=e.prompt_chunk,
        )
        for e in plan.entries
    ]


def warm_up(
    model,
    ops: OpSet,
    page_size: int,
    quant: str = "fp16",
    rotate: bool | None = None,
    center_keys: bool | None = None,
    sink_pages: bool = False,
) -> None:
    """Run a prefill and a decode forward of ``model`` once with ``ops`` on scratch pages of
    the cache's format (the prefill crosses a page boundary; with ``sink_pages`` its first
    page is one; it is a prompt chunk, as the scheduler marks a prompt's, so that a
    quantized cache's attention reads its own rows as requests will), then whatever the op
    set compiles apart."""
    pages = [0, 1, 2]  # covers page_size + 2 tokens for any page size
    kv = model.allocate_kv(len(pages), page_size, quant, rotate, center_keys, int(sink_pages))
    prefill = SequenceInput([0] * (page_size + 1), num_cached=0, pages=pages, prompt_chunk=True)
    decode = SequenceInput([0], num_cached=page_size + 1, pages=pages)
    with torch.inference_mode():
        for row in (prefill, decode):
            model.network(build_forward_batch([row], page_size, model.device), kv, ops)
    if ops.warm_up_extra is not None:
        ops.warm_up_extra(model.config, model.dtype, model.device, page_size)
