"""The whole generator through the Numba CUDA kernels (simulator on CPU) picks the same greedy
tokens as with the torch references."""

from __future__ import annotations

import pytest

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
    assert select_ops("cpu").name == "torch"  # auto: references off CUDA


class _Spy:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, *args, **kwargs):
        self.calls.append(self.name)
        return self.name


def test_longer_queries_take_the_reference_and_decode_the_kernel(monkeypatch):
    from types import SimpleNamespace

    from engine.ops import by_query_length

    calls: list[str] = []
    kernel, reference = _Spy("kernel", calls), _Spy("reference", calls)
    decode, prefill = SimpleNamespace(max_query_len=1), SimpleNamespace(max_query_len=7)
    attention = by_query_length(kernel, reference)
    assert attention("q", "k", "v", decode, 0.5) == "kernel"
    assert attention("q", "k", "v", prefill, 0.5, 4) == "reference"
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    assert by_query_length(kernel, reference) is kernel
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    with pytest.raises(ValueError, match="ENGINE_PREFILL_ATTENTION='sdpa'"):
        by_query_length(kernel, reference)
