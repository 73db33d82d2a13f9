"""ModelRunner: rows -> one forward (decode graphs or eager), the op set's capabilities, and
the kernels' warm-up (simulator on CPU, a 1-layer model)."""

from __future__ import annotations

import pytest
import torch

from engine import Model
from engine.batch import SequenceInput, build_forward_batch
from engine.cache.kv_cache import kv_format
from engine.cuda import activation, attention, norm, rotary
from engine.model.runner import ModelRunner, plan_rows, warm_up
from engine.ops import OPS_ENV, TORCH_OPS, cpu_ops, cuda_ops
from engine.scheduler import SeqState, StepEntry, StepPlan
from tests.call_records import record_calls
from tests.engine.test_cuda_ops import small  # noqa: F401 - fixture
from tests.kernels.common import TOL

PAGE = 4
KERNEL_FACTORIES = (
    norm._rms_norm_kernel,
    norm._add_rms_norm_kernel,
    activation._silu_mul_kernel,
    rotary._rotary_cache_write_kernel,
    attention._attention_kernel,
    attention._merge_kernel,
)


@pytest.fixture
def cuda_model(small, monkeypatch):  # noqa: F811
    monkeypatch.setenv(OPS_ENV, "cuda")
    return Model.from_pretrained(small)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _runner(model: Model, num_pages: int = 16, **kwargs) -> ModelRunner:
    kv = model.allocate_kv(num_pages, PAGE)
    return ModelRunner(model, kv, PAGE, max_batch_size=4, max_seq_len=32, **kwargs)


def _reference(model: Model, rows: list[SequenceInput]) -> torch.Tensor:
    """The same rows through ``Model.forward`` on fresh pages."""
    return model.forward(build_forward_batch(rows, PAGE), model.allocate_kv(16, PAGE))


def test_op_set_capabilities():
    assert not TORCH_OPS.compiles and not TORCH_OPS.supports_graphs
    assert TORCH_OPS.warm_up_extra is None
    assert all(TORCH_OPS.supports_dtype(d) for d in (torch.float32, torch.bfloat16))
    kernels = cuda_ops()
    assert kernels.compiles and kernels.supports_graphs and kernels.warm_up_extra is not None
    assert kernels.supports_dtype(torch.float16) and not kernels.supports_dtype(torch.bfloat16)


def test_cpu_runners_warm_up_the_cpu_kernels(tiny32, monkeypatch):
    """The CPU op set's kernels serve every cache format (float pages and quantized ones): a
    CPU runner warms them up (never mid-request); the references alone compile nothing."""
    warmed = []
    monkeypatch.setattr(ModelRunner, "warm_up", lambda runner: warmed.append(runner))
    assert cpu_ops().compiles and not cpu_ops().supports_graphs
    for quant in ("fp16", "q4"):
        kv = tiny32.model.allocate_kv(16, PAGE, quant)
        ModelRunner(tiny32.model, kv, PAGE, max_batch_size=4, max_seq_len=32, ops=cpu_ops())
        ModelRunner(tiny32.model, kv, PAGE, max_batch_size=4, max_seq_len=32, ops=TORCH_OPS)
    assert [kv_format(runner.kv_pages)[0] for runner in warmed] == ["fp16", "q4"]
    assert all(runner.ops is cpu_ops() for runner in warmed)


def test_cpu_warm_up_compiles_the_decode_kernel_over_float_pages(tiny32, monkeypatch):
    """A warm-up forward's single decode row stays on the reference over float pages (no
    padding to save), so the warm-up calls the kernel itself: the first ragged batch finds it
    compiled."""
    from engine.cpu import decode_attention

    calls = record_calls(monkeypatch, decode_attention, "_run_items", 1)
    warm_up(tiny32.model, cpu_ops(), PAGE, "fp16")
    assert calls  # the kernel ran (compiled or loaded) during the warm-up
    calls.clear()
    warm_up(tiny32.model, TORCH_OPS, PAGE, "fp16")
    assert not calls


def test_cpu_warm_up_gathers_a_quantized_prompt_chunks_own_rows(tiny32, monkeypatch):
    """The warm-up's prefill is a prompt chunk, as requests' are: over quantized pages the
    CPU gather kernel runs with the chunk's own rows of keys (rotary tables, the stash the
    write leaves), the path every prompt takes."""
    from engine.cpu import kv_gather

    seen = []
    gather = kv_gather.gather_context_cpu

    def recorded(pages, index, dtype, own=None, unrotate=False):
        seen.append(own is not None and own.cos is not None and kv_gather.takes(pages, dtype, own))
        return gather(pages, index, dtype, own, unrotate)

    monkeypatch.setattr(kv_gather, "gather_context_cpu", recorded)
    warm_up(tiny32.model, cpu_ops(), PAGE, "q4")
    assert any(seen)  # (keys with their own rows, by the kernel)


def test_plan_rows_carry_the_entries_chunks_and_logits_rows():
    a = SeqState(tokens=[1, 2, 3, 4, 5], num_computed=2, pages=[7, 3])
    b = SeqState(tokens=[9, 8, 7, 6, 5, 4], pages=[2, 5])
    plan = StepPlan(entries=[StepEntry(a, 2, 3), StepEntry(b, 0, 4)])
    first, second = plan_rows(plan)
    assert list(first.token_ids) == [3, 4, 5] and first.num_cached == 2
    assert first.pages is a.pages and first.logits_rows == 1  # reaches the end: samples
    assert list(second.token_ids) == [9, 8, 7, 6] and second.logits_rows == 0  # mid-prompt
    assert first.prompt_chunk and second.prompt_chunk  # (all their tokens: the prompt)


def test_plan_rows_mark_only_multi_token_prompt_chunks():
    """Generated tokens (recomputed after a preemption), drafts to verify and single tokens
    are no prompt chunk: they read their own K/V as decode does (exact_chunks)."""
    seq = SeqState(tokens=[1, 2, 3, 4, 5, 6], pages=[0, 1], prompt_len=4)
    entries = [
        StepEntry(seq, 0, 4),  # the prompt
        StepEntry(seq, 0, 6),  # the prompt and two generated tokens
        StepEntry(seq, 5, 1, lookahead=2, drafts=(7, 8)),  # a token and drafts to verify
        StepEntry(seq, 2, 1),  # one prompt token
    ]
    marks = [row.prompt_chunk for row in plan_rows(StepPlan(entries=entries))]
    assert marks == [True, False, False, False]


def test_eager_runner_matches_model_forward(tiny):
    runner = _runner(tiny.model)
    assert runner.decode_graphs is None and runner.ops is tiny.model.ops  # torch on CPU
    rows = [
        SequenceInput([5, 6, 7, 8, 9], 0, [3, 1], logits_rows=2),
        SequenceInput([11, 12], 0, [0], logits_rows=0),
        SequenceInput([13], 0, [4]),
    ]
    got = runner.forward(rows)
    assert got.shape == (3, tiny.model.config.vocab_size)
    assert torch.equal(got, _reference(tiny.model, rows))


def test_graphs_need_an_op_set_that_supports_them(tiny):
    with pytest.raises(ValueError, match="op set that supports graphs; 'cpu'"):
        _runner(tiny.model, cuda_graphs=True)


def _torch_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence through the torch references."""
    pages = list(range(-(-len(ids) // PAGE)))
    batch = build_forward_batch([SequenceInput(ids, 0, pages, len(ids))], PAGE)
    with torch.inference_mode():
        return model.network(batch, model.allocate_kv(len(pages), PAGE), TORCH_OPS)


def test_decode_rows_go_through_the_graphs_and_others_run_eagerly(cuda_model):
    runner = _runner(cuda_model, cuda_graphs=True)
    a, b = [5, 9, 17, 3, 40, 21, 30, 31], [6, 2, 22, 32, 33]  # prompt, decode, 2 to verify
    pages_a, pages_b = [0, 1], [2, 3]
    prefill = runner.forward([SequenceInput(a[:5], 0, pages_a), SequenceInput(b[:2], 0, pages_b)])
    assert runner.decode_graph_steps == 0  # a prefill: eager
    decode = runner.forward([SequenceInput(a[5:6], 5, pages_a), SequenceInput(b[2:3], 2, pages_b)])
    assert runner.decode_graph_steps == 1
    # two tokens per row, logits for both (draft verification): eager, not a graph step
    verify = [SequenceInput(a[6:], 6, pages_a, 2), SequenceInput(b[3:], 3, pages_b, 2)]
    verified = runner.forward(verify)
    assert runner.decode_graph_steps == 1 and verified.shape[0] == 4

    want_a, want_b = _torch_logits(cuda_model, a), _torch_logits(cuda_model, b)
    tol = TOL[torch.float32]
    assert _rel(prefill, torch.stack([want_a[4], want_b[1]])) <= tol
    assert _rel(decode, torch.stack([want_a[5], want_b[2]])) <= tol
    assert _rel(verified, torch.cat([want_a[6:], want_b[3:]])) <= tol


def test_warm_up_compiles_every_kernel_a_forward_needs(cuda_model):
    for factory in KERNEL_FACTORIES:
        factory.cache_clear()
    runner = _runner(cuda_model)  # no warm-up at construction off CUDA devices
    assert all(f.cache_info().currsize == 0 for f in KERNEL_FACTORIES)
    runner.warm_up()
    assert attention._merge_kernel.cache_info().currsize == 1  # the split decode ran
    assert all(f.cache_info().currsize >= 1 for f in KERNEL_FACTORIES)
    misses = [f.cache_info().misses for f in KERNEL_FACTORIES]
    # A prefill crossing a page and a decode afterwards, at the runner's page size, compile
    # nothing more: every specialisation they launch was made by the warm-up.
    runner.forward([SequenceInput(list(range(1, 7)), 0, [0, 1])])
    runner.forward([SequenceInput([9], 6, [0, 1])])
    assert [f.cache_info().misses for f in KERNEL_FACTORIES] == misses
