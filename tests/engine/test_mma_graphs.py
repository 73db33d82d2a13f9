"""Decode steps through the CUDA-graph runner's static, padded buffers with the tensor-core
decode kernel switched on (engine/cuda/attention_mma.py): a 1-layer model with heads of 64 and
pages of 16, the kernel's smallest. In the simulator the runner runs its bucket batches
eagerly; on a GPU it captures and replays them."""

from __future__ import annotations

import pytest
import torch

from engine import Model
from engine.batch import SequenceInput, build_forward_batch
from engine.cuda._launch import SIMULATOR
from engine.model.cuda_graphs import DecodeGraphs
from engine.ops import OPS_ENV, TORCH_OPS
from tests.engine.conftest import simulator_model_folder

PAGE = 16


@pytest.fixture(scope="module")
def heads64(tiny, tmp_path_factory):
    return simulator_model_folder(tiny, tmp_path_factory.mktemp("sim64"), hidden_size=128)


def _forward(model: Model, kv, seqs: list[SequenceInput], ops=TORCH_OPS) -> torch.Tensor:
    batch = build_forward_batch(seqs, PAGE, model.device)
    with torch.inference_mode():
        return model.network(batch, kv, ops)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # (the padding row: no 0 / 0 in the kernel)
@pytest.mark.parametrize(("quant", "mode"), [("q4", "graphs"), ("q8", "1")])
def test_decode_graph_steps_on_tensor_cores(heads64, monkeypatch, quant, mode):
    """Three sequences in a bucket of four (a padding row with no keys): the graph step's
    logits match an eager forward through the same kernels (the kernel's numerics against the
    torch reference: tests/kernels/test_attention_mma.py), and the step went through it, by
    default too ("graphs": the runner's steps, captured or, as here, eager)."""
    from engine.cuda import attention_mma

    monkeypatch.setenv(OPS_ENV, "cuda")
    monkeypatch.setattr(attention_mma, "MODE", mode)
    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    model = Model.from_pretrained(heads64)
    kv = model.allocate_kv(8, PAGE, quant, True)
    graphs = DecodeGraphs(model, kv, PAGE, max_batch_size=4, max_seq_len=64,
                          capture=not SIMULATOR)  # fmt: skip
    seqs = [  # bucket 4 of [1, 2, 4]: one padding row
        SequenceInput([7], num_cached=20, pages=[5, 2]),
        SequenceInput([8], 5, pages=[0]),
        SequenceInput([9], 33, pages=[1, 3, 4]),
    ]
    prefill = [
        SequenceInput([(3 * j + i) % 50 + 1 for j in range(s.num_cached)], 0, s.pages)
        for i, s in enumerate(seqs)
    ]
    _forward(model, kv, prefill)  # the reference's writes: the kernels read them in place
    got = graphs.run(seqs)
    assert calls and graphs.steps == 1
    calls.clear()
    # (by default an eager forward outside the runner takes the CUDA-core kernel)
    assert attention_mma.routes_decode(torch.zeros(1)) == (mode == "1")
    with attention_mma.graph_steps():  # (the eager forward through the same kernels)
        want = _forward(model, kv, seqs, model.ops)  # (rewrites the step's K/V, the same values)
    assert calls
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_graph_steps_on_tensor_cores_read_sink_and_recent_pages(heads64, monkeypatch):
    """Sequences laid out as the page table lays them out with sink and recent pages (pages
    0..6 unquantized: a sink page per sequence, then the last two blocks of the longer ones):
    the graph step goes through the tensor-core kernel's sink variant and matches the torch
    reference to q4's rounding, and an eager forward through the same kernels closely."""
    from engine.cuda import attention_mma

    monkeypatch.setenv(OPS_ENV, "cuda")
    monkeypatch.setattr(attention_mma, "MODE", "graphs")
    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(
        attention_mma,
        "decode_attention_mma",
        lambda *a, **k: calls.append(k.get("k_sinks") is not None) or real(*a, **k),
    )
    model = Model.from_pretrained(heads64, dtype=torch.float16)  # (the kernel reads fp16 rows)
    kv = model.allocate_kv(10, PAGE, "q4", True, num_sink_pages=7)
    graphs = DecodeGraphs(model, kv, PAGE, max_batch_size=4, max_seq_len=64,
                          capture=not SIMULATOR)  # fmt: skip
    seqs = [
        SequenceInput([7], num_cached=40, pages=[0, 3, 4]),  # sink, two recent blocks
        SequenceInput([8], 5, pages=[1]),  # one block: the sink
        SequenceInput([9], 50, pages=[2, 8, 5, 6]),  # sink, a code block, two recent
    ]
    prefill = [
        SequenceInput([(3 * j + i) % 50 + 1 for j in range(s.num_cached)], 0, s.pages)
        for i, s in enumerate(seqs)
    ]
    _forward(model, kv, prefill)
    assert kv[0][0].sinks[:7].abs().sum() > 0 and kv[0][0].sinks.shape[0] == 7
    got = graphs.run(seqs)
    assert calls and all(calls) and graphs.steps == 1
    with attention_mma.graph_steps():
        eager = _forward(model, kv, seqs, model.ops)
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)
    want = _forward(model, kv, seqs)
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() <= 1e-2
