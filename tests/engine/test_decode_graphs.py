"""Decode steps through the CUDA-graph runner's static, padded buffers.

Without a GPU the runner runs its bucket batches eagerly (``capture=False``) through the
kernels in the simulator: the buffers, the padding rows and the fixed attention plan are the
ones a graph would replay. The ``gpu`` test at the end captures and replays real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings
from engine.batch import SequenceInput, build_forward_batch
from engine.cuda import attention
from engine.inflight import PENDING_TOKEN, TokenPatch
from engine.model.cuda_graphs import DecodeGraphs, bucket_sizes
from engine.model.runner import plan_rows
from engine.ops import OPS_ENV, TORCH_OPS
from tests.engine.conftest import assert_no_pages_in_use
from tests.engine.test_cuda_ops import small  # noqa: F401 - fixture
from tests.kernels.common import TOL
from tests.unit.test_scheduler import Sim, content_sampler

PAGE = 4


@pytest.fixture
def cuda_model(small, monkeypatch):  # noqa: F811
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small)
    assert model.ops.name == "cuda"
    return model


def _decode_inputs(contexts: list[int], first_page: int = 0) -> list[SequenceInput]:
    """One decode token per sequence after ``contexts[i]`` cached tokens, disjoint pages."""
    seqs, page = [], first_page
    for i, cached in enumerate(contexts):
        n_pages = cached // PAGE + 1
        pages = list(range(page, page + n_pages))[::-1]  # out of order on purpose
        page += n_pages
        seqs.append(SequenceInput([7 + i], num_cached=cached, pages=pages))
    return seqs


def _reference(model: Model, kv, seqs: list[SequenceInput]) -> torch.Tensor:
    """An eager forward through the torch references (fast in CI; the kernels match them)."""
    batch = build_forward_batch(seqs, PAGE, model.device)
    with torch.inference_mode():
        return model.network(batch, kv, TORCH_OPS)


def _fill_cache(model: Model, kv, seqs: list[SequenceInput]) -> None:
    """Prefill each sequence's cached tokens so attention reads real K/V."""
    prefill = [
        SequenceInput([(3 * j + i) % 50 + 1 for j in range(s.num_cached)], 0, s.pages)
        for i, s in enumerate(seqs)
        if s.num_cached
    ]
    if prefill:
        _reference(model, kv, prefill)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(32)[-3:] == [16, 24, 32]
    with pytest.raises(ValueError, match="max_batch_size"):
        bucket_sizes(0)


@pytest.mark.parametrize("splits", [1, 3])
def test_padded_static_steps_match_eager_forwards(cuda_model, monkeypatch, splits):
    # 3 sequences run in bucket 4 (one padding row), then 1 in bucket 1, then 3 again: the
    # buffers are rewritten in place and stale rows become padding. With 3 splits the plan
    # fixed for the longest allowed context (32 tokens) is reused for short contexts.
    monkeypatch.setattr(attention, "_auto_splits", lambda *args: splits)
    kv = cuda_model.allocate_kv(16, PAGE)
    graphs = DecodeGraphs(cuda_model, kv, PAGE, max_batch_size=6, max_seq_len=32, capture=False)
    assert graphs.sizes == [1, 2, 4, 6] and graphs.bucket_for(3) == 4
    for contexts in ([3, 5, 8], [13], [0, 4, 2]):
        seqs = _decode_inputs(contexts)
        _fill_cache(cuda_model, kv, seqs)
        got = graphs.run(seqs)
        want = _reference(cuda_model, kv, seqs)
        assert got.shape == want.shape
        assert _rel(got, want) <= TOL[cuda_model.dtype]


def test_input_ids_from_the_device_replace_the_placeholders(cuda_model):
    """Async scheduling: rows whose token is still on the device hold PENDING_TOKEN; the
    step's TokenPatch writes their ids into the static buffer before the replay."""
    kv = cuda_model.allocate_kv(16, PAGE)
    graphs = DecodeGraphs(cuda_model, kv, PAGE, max_batch_size=4, max_seq_len=32, capture=False)
    seqs = _decode_inputs([3, 5, 8])  # tokens 7, 8, 9
    _fill_cache(cuda_model, kv, seqs)
    want = _reference(cuda_model, kv, seqs)
    pending = [
        s if i == 1 else SequenceInput([PENDING_TOKEN], s.num_cached, s.pages)
        for i, s in enumerate(seqs)
    ]
    # positions stay on the host (the runner moves them); values come from the device
    patch = TokenPatch(torch.tensor([0, 2]), torch.tensor([7, 9], device=cuda_model.device))
    got = graphs.try_run(pending, patch)
    assert _rel(got, want) <= TOL[cuda_model.dtype]
    assert graphs._longs[0, :3].tolist() == [7, 8, 9]


def test_padding_rows_write_no_page(cuda_model):
    kv = cuda_model.allocate_kv(8, PAGE)
    for k, v in kv:
        k.fill_(3.0)
        v.fill_(3.0)
    graphs = DecodeGraphs(cuda_model, kv, PAGE, max_batch_size=4, max_seq_len=16, capture=False)
    graphs.run(_decode_inputs([2], first_page=5))  # bucket 1, no padding: writes page 5
    graphs.run(_decode_inputs([0, 1, 2], first_page=1))  # pages 1-3, one padding row
    for k, v in kv:
        for t in (k, v):
            assert torch.all(t[[0, 4, 6, 7]] == 3.0)  # padding would have written page 0
            assert not torch.all(t[[1, 2, 3, 5]] == 3.0)


def test_block_table_rows_follow_growth_swaps_and_row_changes(cuda_model):
    # Rows rewrite only their tail when the same pages list comes back: check the staged
    # tables against the pages after appends, a dedup swap of the page just filled, rows
    # trading places, and a sequence returning to its old row after growing elsewhere.
    graphs = DecodeGraphs(
        cuda_model, cuda_model.allocate_kv(4, PAGE), PAGE, 4, max_seq_len=64, capture=False
    )
    tables = graphs._np_ints[graphs.max_size :].reshape(graphs.max_size, graphs.max_pages)
    a, b = [1, 2], [3]

    def step(*pages_lists: list[int]) -> None:
        rows = [(5, len(p) * PAGE - 1, p) for p in pages_lists]  # (token, position, pages)
        graphs._stage(rows, graphs.bucket_for(len(rows)))
        for row, pages in enumerate(pages_lists):
            assert tables[row, : len(pages)].tolist() == pages

    step(a, b)
    a.append(9)
    a[1] = 7  # registration found page 2's content cached as page 7
    step(a, b)
    step(b, a)
    a += [11, 12, 13]
    a[3] = 14
    b.append(4)
    step(a, b)
    step(a[:], b)  # a new list object (a re-admitted sequence): the whole row is written


@pytest.mark.parametrize("seed", range(3))
def test_block_tables_staged_from_scheduler_runs_match_the_pages(cuda_model, seed):
    # The scheduler drives the staging: repeated prompts that decode identically (dedup swaps
    # of prompt and generated pages), a table small enough to preempt, rows changing hands.
    # Every decode step is staged as the generator would; each row must equal its pages.
    rng = random.Random(seed)
    sim = Sim(20, PAGE, sampler=content_sampler, max_batch_size=4, max_chunk_size=10)
    graphs = DecodeGraphs(
        cuda_model, cuda_model.allocate_kv(1, PAGE), PAGE, 4, max_seq_len=80, capture=False
    )
    tables = graphs._np_ints[graphs.max_size :].reshape(graphs.max_size, graphs.max_pages)
    staged = []

    def stage(plan) -> None:
        # the runner stages from the plan's entries; the rows are what it stands for
        rows = plan_rows(plan)
        supported = graphs.supports_entries(plan.entries)
        assert supported == graphs.supports(rows)
        if not supported:
            return
        entries = [(e.seq.tokens[e.start], e.start, e.seq.pages) for e in plan.entries]
        assert entries == [(r.token_ids[0], r.num_cached, r.pages) for r in rows]
        graphs._stage(entries, graphs.bucket_for(len(rows)))
        staged.append(len(rows))
        for i, row in enumerate(rows):
            assert tables[i, : len(row.pages)].tolist() == list(row.pages)

    sim.on_plan = stage
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    for _ in range(10):
        sim.add(list(rng.choice(prompts)), generate=rng.randint(3, 30))
        for _ in range(rng.randint(0, 4)):
            sim.step()
    sim.run()
    sim.check_done()
    assert len(staged) > 10 and sim.swaps_seen > 0


def test_only_decode_steps_that_fit_are_supported(cuda_model):
    kv = cuda_model.allocate_kv(16, PAGE)
    graphs = DecodeGraphs(cuda_model, kv, PAGE, max_batch_size=2, max_seq_len=12, capture=False)
    assert graphs.supports(_decode_inputs([3, 5]))
    assert not graphs.supports(_decode_inputs([3, 5, 6]))  # more rows than the largest bucket
    assert not graphs.supports([SequenceInput([1, 2], 0, [0])])  # a prefill
    assert not graphs.supports([SequenceInput([1], 3, [0], logits_rows=0)])
    assert not graphs.supports(_decode_inputs([12]))  # past max_seq_len
    with pytest.raises(ValueError, match="decode step"):
        graphs.run([SequenceInput([1, 2], 0, [0])])


def test_graphs_need_the_kernel_op_set(small, monkeypatch):  # noqa: F811
    monkeypatch.setenv(OPS_ENV, "torch")
    model = Model.from_pretrained(small)
    with pytest.raises(ValueError, match="op set that supports graphs; 'torch'"):
        DecodeGraphs(model, model.allocate_kv(4, PAGE), PAGE, 2, 8, capture=False)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small)
    if model.device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA device"):
            DecodeGraphs(model, model.allocate_kv(4, PAGE), PAGE, 2, 8, capture=True)


def test_generator_with_decode_graphs_matches_torch(cuda_model, small, tiny, monkeypatch):  # noqa: F811
    prompts = [[5, 9, 17, 3, 40, 2], [5, 9, 17, 3, 11], [200], [7, 7]]

    def greedy(model: Model, graphs: bool, late: bool = False) -> list[list[int]]:
        cache = PagedCache(model, 128, page_size=PAGE)
        generator = DynamicGenerator(
            model,
            cache,
            tiny.tokenizer,
            max_chunk_size=16,
            max_batch_size=6,
            cuda_graphs=graphs,
            async_scheduling=late,
        )
        assert (generator.runner.decode_graphs is not None) == graphs
        jobs = [
            DynamicJob(p, 4, gen_settings=SamplerSettings.greedy(), stop_conditions=[])
            for p in prompts
        ]
        for job in jobs:
            generator.enqueue(job)
        while generator.num_remaining_jobs():
            generator.iterate()
        assert_no_pages_in_use(generator)
        if graphs:
            assert generator.runner.decode_graphs.steps >= 3  # each decode after the prefills
        return [job.new_token_ids for job in jobs]

    with_graphs = greedy(cuda_model, True)
    # async scheduling: the graphs' input ids come from the device (TokenPatch)
    assert greedy(cuda_model, True, late=True) == with_graphs
    monkeypatch.setenv(OPS_ENV, "torch")
    assert with_graphs == greedy(Model.from_pretrained(small), False)


@pytest.mark.gpu
def test_gpu_captured_graphs_match_eager(small):  # noqa: F811
    model = Model.from_pretrained(small, device="cuda", dtype="float16")
    assert model.ops.name == "cuda"
    kv = model.allocate_kv(64, PAGE)
    graphs = DecodeGraphs(model, kv, PAGE, max_batch_size=8, max_seq_len=64)
    assert graphs.capture, "capture failed (see the log)"
    for contexts in ([3, 8, 13], [20], [0, 4, 9, 30, 1]):
        seqs = _decode_inputs(contexts)
        _fill_cache(model, kv, seqs)
        got = graphs.run(seqs)
        want = model.forward(build_forward_batch(seqs, PAGE, model.device), kv)
        assert _rel(got, want) <= TOL[torch.float16]


def test_capture_runs_with_the_collector_paused():
    """Collecting inside a capture can free an earlier graph (a CUDA call the capture forbids:
    seen on an H200, where it left a generator without graphs)."""
    import gc

    from engine.model.cuda_graphs import _nothing_freed

    with _nothing_freed():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _nothing_freed():
            pass
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()
