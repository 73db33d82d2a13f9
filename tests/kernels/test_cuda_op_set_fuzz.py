"""The CUDA op set (engine/ops.py ``cuda_ops``) against the torch references on random batches
and page layouts (tests/op_set_fuzz.py): its CUDA-core kernels for decode and verify rows, the
context gather for prompt chunks, its cache-write kernels, and the tensor-core decode kernel
(engine/cuda/attention_mma.py) as a CUDA graph's decode steps take it. The simulator runs a few
small cases; a GPU runs many more (bench/gpu_session.sh's kernel tests)."""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine.cuda import attention_mma
from engine.cuda._launch import SIMULATOR
from engine.ops import TORCH_OPS, cuda_ops
from tests.call_records import record_calls
from tests.kernels.common import DEVICE
from tests.op_set_fuzz import attend, draw_case, draw_layout, row_error

# The simulator's seeds, picked for what their draws hold and for their speed there (a GPU
# takes the first 30): 11, q4, a prompt chunk, a fresh prompt and a decode row, a sink page and
# two recent ones; 20, q8, two decode rows, a window, a shared prefix, two recent pages; 79,
# q8, a verifying row beside a decode row, a sink page; 45, q6, a chunk and a verifying row, a
# recent page; 72, fp16, two verifying rows and a decode row, a shared prefix. For the tensor
# cores: 5, q4, a verifying and a decode row, two recent pages; 8, q8, the same with a sink
# page; 30, q4, a window of 2 keys, a sink page; over fp16 pages 3, three verifying rows, a
# window, a shared prefix.


def _seeds(picked: tuple[int, ...]) -> tuple[int, ...] | range:
    """``picked`` in the simulator, the first 30 on a GPU; PAGEDSERVE_FUZZ_TRIALS=N: the
    first N on either (a longer hunt)."""
    trials = os.environ.get("PAGEDSERVE_FUZZ_TRIALS")
    if trials:
        return range(int(trials))
    return picked if SIMULATOR else range(30)


SEEDS = _seeds((11, 20, 79, 45, 72))
MMA_SEEDS = {"quantized": _seeds((5, 8, 30)), "fp16": _seeds((3,))}
# float32 pages: the same codes (the write kernel's are the reference's), sums in another order
# and, on a GPU, fused multiply-adds (the planted wrong reads and masks of stop 61 moved a row
# by 7e-4 to 1.6)
TOL = 1e-4
# the tensor cores' fp16 operands (q, the weights, and values times their scales) round to 11
# bits: a quarter of a percent of a row's largest value leaves room for the sums over 70 keys
MMA_TOL = 4e-3


def test_cuda_op_set_attends_random_batches_as_the_references_do():
    ops = cuda_ops()
    for seed in SEEDS:
        rng = random.Random(seed)
        case = draw_case(rng, max_rows=3, max_cached=40)  # (the simulator's speed)
        layout = draw_layout(case, rng)
        out = attend(case, layout, seed, ops, device=DEVICE)
        ref = attend(case, layout, seed, TORCH_OPS, device=DEVICE)
        assert row_error(out, ref) <= TOL, (seed, case, layout)


@pytest.mark.parametrize("pages", ["quantized", "fp16"])
def test_tensor_core_decode_attends_random_batches_as_the_references_do(pages, monkeypatch):
    """Decode and verify rows over q8, q6 and q4 pages, or fp16 ones (float16, as the kernel
    takes them), in ``graph_steps``: every such batch goes to the tensor-core kernel. For 4-bit
    keys the kernel rounds q to bytes; q arrives on both sides already rounded so
    (``round_q_bytes``, which the kernel's own rounding leaves as it is), and the sink and
    recent rows it reads exactly see that same q."""
    if attention_mma.MODE == "0":
        pytest.skip("ENGINE_TENSOR_CORE_DECODE=0 sends no batch to the tensor-core kernel")
    calls = [
        record_calls(monkeypatch, attention_mma, name, 0)
        for name in ("decode_attention_mma", "decode_attention_mma_fp16")
    ]
    ops = cuda_ops()
    quants = ("q8", "q6", "q4") if pages == "quantized" else ("fp16",)
    for seed in MMA_SEEDS[pages]:
        rng = random.Random(seed)
        case = draw_case(
            rng, max_rows=3, kinds=("decode", "decode", "verify"), page_sizes=(16,),
            head_dims=(64,), groups=(1, 2, 4, 8), quants=quants, max_verify=5,
        )  # fmt: skip
        layout = draw_layout(case, rng)
        bytes_q = case.quant == "q4"

        def round_q(q, rotate=case.rotate):
            return attention_mma.round_q_bytes(q, rotate)

        args = {"device": DEVICE, "dtype": torch.float16, "round_q": round_q if bytes_q else None}
        before = sum(map(len, calls))
        out = attend(case, layout, seed, ops, around=attention_mma.graph_steps, **args)
        assert sum(map(len, calls)) == before + 1, (seed, case)  # (the kernel took the batch)
        ref = attend(case, layout, seed, TORCH_OPS, **args)
        assert row_error(out, ref) <= MMA_TOL, (seed, case, layout)
