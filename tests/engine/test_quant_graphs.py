"""Quantized caches through the Numba kernels (simulator on CPU): the generator picks the same
greedy tokens as with the torch references, and decode steps through the CUDA-graph runner's
static padded buffers match eager reference forwards. A 1-layer model with head_dim 32 (one
quantization group per head)."""

from __future__ import annotations

import pytest

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings
from engine.model.cuda_graphs import DecodeGraphs
from engine.ops import OPS_ENV, PREFILL_ATTENTION_ENV
from tests.engine.conftest import run_to_end, simulator_model_folder
from tests.engine.test_decode_graphs import PAGE, _decode_inputs, _fill_cache, _reference


@pytest.fixture(scope="module")
def small32(tiny, tmp_path_factory):
    return simulator_model_folder(tiny, tmp_path_factory.mktemp("sim32"), hidden_size=64)


def _greedy(
    model: Model,
    tokenizer,
    prompts,
    quant: str,
    rotate: bool,
    sink_pages: int,
    exact: bool,
    recent_pages: int = 0,
    new_tokens: int = 3,
):
    cache = PagedCache(
        model,
        256,
        page_size=PAGE,
        quant=quant,
        rotate=rotate,
        sink_pages=sink_pages,
        exact_chunks=exact,
        recent_pages=recent_pages,
    )
    generator = DynamicGenerator(model, cache, tokenizer, max_chunk_size=8)
    settings = SamplerSettings.greedy()
    jobs = [DynamicJob(p, new_tokens, gen_settings=settings, stop_conditions=[]) for p in prompts]
    return run_to_end(generator, jobs)


@pytest.mark.parametrize(
    ("sink_pages", "exact", "recent_pages"),
    [(0, True, 0), (2, True, 0), (0, False, 0), (2, False, 4), (0, False, 4), (2, True, 4)],
)
def test_generator_on_q4_pages_through_kernels_matches_torch(
    small32, tiny, monkeypatch, sink_pages, exact, recent_pages
):
    # Unrotated: the kernel's codes equal the reference's bit for bit in float32, so the
    # greedy picks must match exactly (chunked prefill: 11 tokens in chunks of 8 and 3, the
    # second prompt 3 tokens after a prefix hit: in this one-layer model only a prompt's last
    # chunk reaches a sampled token, so it has several); with sink
    # pages the first page of each sequence is read from its unquantized rows, with recent
    # pages its last two blocks (8 new tokens: blocks settle as the sequences grow past 4
    # pages). With exact chunks the
    # prompt chunks go to the reference on the rows the write kernel left; without, every
    # batch goes to the attention kernel (ENGINE_PREFILL_ATTENTION=kernel).
    prompts = [[5, 9, 17, 3, 40, 2, 8, 8, 1, 22, 6], [5, 9, 17, 3, 11, 12, 13]]
    new_tokens = 8 if recent_pages else 3
    args = (tiny.tokenizer, prompts, "q4", False, sink_pages, exact, recent_pages, new_tokens)
    if not exact:
        monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    monkeypatch.setenv(OPS_ENV, "torch")
    reference = _greedy(Model.from_pretrained(small32), *args)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small32)
    assert model.ops.name == "cuda"
    assert _greedy(model, *args) == reference


@pytest.mark.parametrize(("quant", "rotate"), [("q8", True), ("q6", False)])
def test_decode_graph_steps_on_quantized_pages(small32, monkeypatch, quant, rotate):
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small32)
    kv = model.allocate_kv(8, PAGE, quant, rotate)
    graphs = DecodeGraphs(model, kv, PAGE, max_batch_size=3, max_seq_len=16, capture=False)
    seqs = _decode_inputs([3, 6])  # bucket 2 of [1, 2, 3]
    _fill_cache(model, kv, seqs)  # the reference's writes: the kernels read them in place
    got = graphs.run(seqs)
    want = _reference(model, kv, seqs)
    # The graph step wrote each token's K/V through the kernel, the reference rewrote them
    # (rotated codes may differ by a step at rounding boundaries); logits agree to a step of
    # the quantization, far below their spread.
    assert got.shape == want.shape
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert graphs.steps == 1


def test_decode_graph_steps_on_sink_pages(small32, monkeypatch):
    """First pages are sink pages (0 and 1), the rest quantized: the graph step reads both."""
    from engine.batch import SequenceInput

    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small32)
    kv = model.allocate_kv(8, PAGE, "q4", True, num_sink_pages=2)
    graphs = DecodeGraphs(model, kv, PAGE, max_batch_size=3, max_seq_len=16, capture=False)
    seqs = [SequenceInput([7], num_cached=3, pages=[1]), SequenceInput([8], 6, pages=[0, 5])]
    _fill_cache(model, kv, seqs)
    got = graphs.run(seqs)
    want = _reference(model, kv, seqs)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-2
    assert kv[0][0].sinks[:2].abs().sum() > 0 and graphs.steps == 1
