"""The whole generator through the Numba CUDA kernels (simulator on CPU) picks the same greedy
tokens as with the torch references."""

from __future__ import annotations

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings
from engine.ops import OPS_ENV, PREFILL_ATTENTION_ENV, select_ops
from tests.engine.conftest import run_to_end, simulator_model_folder


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    """A 1-layer model with the tiny fixture's tokenizer: the simulator runs every GPU thread
    as a Python thread, so shapes stay minimal."""
    return simulator_model_folder(tiny, tmp_path_factory.mktemp("sim"))


def _greedy(model: Model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    cache = PagedCache(model, 256, page_size=4)
    generator = DynamicGenerator(model, cache, tokenizer, max_chunk_size=16)
    jobs = [
        DynamicJob(p, 3, gen_settings=SamplerSettings.greedy(), stop_conditions=[]) for p in prompts
    ]
    return run_to_end(generator, jobs)


@pytest.mark.parametrize("prefill_attention", ["torch", "kernel"])
def test_generator_through_cuda_kernels_matches_torch(small, tiny, monkeypatch, prefill_attention):
    prompts = [[5, 9, 17, 3, 40, 2], [5, 9, 17, 3, 11], [200]]
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, prefill_attention)
    monkeypatch.setenv(OPS_ENV, "torch")
    reference = _greedy(Model.from_pretrained(small), tiny.tokenizer, prompts)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(small)
    assert model.ops.name == "cuda"
    assert _greedy(model, tiny.tokenizer, prompts) == reference


def test_ops_env_is_validated(monkeypatch):
    monkeypatch.setenv(OPS_ENV, "fast")
    with pytest.raises(ValueError, match="ENGINE_OPS='fast'"):
        select_ops("cpu")
    monkeypatch.setenv(OPS_ENV, "torch")
    assert select_ops("cpu").name == "torch"
    monkeypatch.delenv(OPS_ENV)
    assert select_ops("cpu").name == "cpu"  # auto: the references with a CPU decode kernel


class _Spy:
    """An attention op that records the query lengths of each batch it gets and returns its
    q's shape filled with 1 (the kernel) or 2 (the reference)."""

    def __init__(self, name: str, calls: list[tuple[str, tuple[int, ...]]]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, q, k, v, batch, scale, sliding_window=None):
        self.calls.append((self.name, batch.q_lens))
        return torch.zeros_like(q) + (1.0 if self.name == "kernel" else 2.0)


def test_longer_queries_take_the_reference_and_decode_rows_the_kernel(monkeypatch):
    from engine.batch import SequenceInput, build_forward_batch
    from engine.ops import by_query_length

    def inputs(*specs):  # (cached, new) per sequence, pages 0.. each
        return [SequenceInput([1] * n, c, list(range(-(-(c + n) // 4)))) for c, n in specs]

    def batch(*specs):
        return build_forward_batch(inputs(*specs), 4)

    calls: list[tuple[str, tuple[int, ...]]] = []
    kernel, reference = _Spy("kernel", calls), _Spy("reference", calls)
    attention = by_query_length(kernel, reference)
    decode, prefill, mixed = batch((5, 1), (2, 1)), batch((0, 7)), batch((5, 1), (3, 4), (9, 1))

    def q(b):
        return torch.zeros(b.num_tokens, 2, 8)

    assert attention(q(decode), "k", "v", decode, 0.5).eq(1).all()
    assert attention(q(prefill), "k", "v", prefill, 0.5, 4).eq(2).all()
    assert calls == [("kernel", (1, 1)), ("reference", (7,))]
    calls.clear()
    # a mix: the reference gets the batch (and skips the decode group), the kernel the two
    # one-token sequences as a decode batch; their rows come from the kernel
    out = attention(q(mixed), "k", "v", mixed, 0.5)
    assert calls == [("reference", (1, 4, 1)), ("kernel", (1, 1))]
    assert out[:, 0, 0].tolist() == [1, 2, 2, 2, 2, 1]
    # with ``short`` (the CUDA op set's CUDA_VERIFY_ROWS): the 4 tokens of a sequence that
    # verifies drafts take the kernel too, a row each; a prompt chunk as short, or a longer
    # sequence, stays with the reference
    calls.clear()
    chunk = SequenceInput([1] * 4, 3, [0, 1], prompt_chunk=True)
    mixed = build_forward_batch([chunk, *inputs((5, 1), (3, 4), (2, 7))], 4)
    out = by_query_length(kernel, reference, 4)(q(mixed), "k", "v", mixed, 0.5)
    assert calls == [("reference", (4, 1, 4, 7)), ("kernel", (1, 1, 1, 1, 1))]
    assert out[:, 0, 0].tolist() == [2] * 4 + [1] * 5 + [2] * 7
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    assert by_query_length(kernel, reference) is kernel
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    with pytest.raises(ValueError, match="ENGINE_PREFILL_ATTENTION='sdpa'"):
        by_query_length(kernel, reference)


def test_generator_decodes_on_tensor_cores_as_on_the_cuda_core_kernel(
    tiny, tmp_path_factory, monkeypatch
):
    """With ENGINE_TENSOR_CORE_DECODE's switch on, a q4 cache's decode steps go through the
    tensor-core kernel (engine/cuda/attention_mma.py) and pick the same greedy tokens (q8/q6
    and fp16 pages: the kernel tests)."""
    from engine.cuda import attention_mma

    folder = simulator_model_folder(tiny, tmp_path_factory.mktemp("sim64"), hidden_size=128)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(folder)  # heads of 64: the kernel's smallest
    calls = []
    real = attention_mma.decode_attention_mma
    monkeypatch.setattr(
        attention_mma, "decode_attention_mma", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    prompts = [[5, 9, 17, 3, 40, 2], [200]]

    def greedy(enabled: bool) -> list[list[int]]:
        monkeypatch.setattr(attention_mma, "MODE", "1" if enabled else "0")
        cache = PagedCache(model, 256, page_size=16, quant="q4")
        generator = DynamicGenerator(model, cache, tiny.tokenizer, max_chunk_size=16)
        jobs = [
            DynamicJob(p, 2, gen_settings=SamplerSettings.greedy(), stop_conditions=[])
            for p in prompts
        ]
        return run_to_end(generator, jobs)

    on_cuda_cores = greedy(False)
    assert not calls
    assert greedy(True) == on_cuda_cores
    assert calls  # the decode steps took it
