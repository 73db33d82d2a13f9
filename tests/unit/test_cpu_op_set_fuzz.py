"""The CPU op set (engine/ops.py ``cpu_ops``: Numba kernels for decode rows, verify rows and a
quantized cache's write, the context gather for prompt chunks) against the torch references on
random batches and page layouts (tests/op_set_fuzz.py)."""

from __future__ import annotations

import os
import random
from collections import Counter

from engine.ops import TORCH_OPS, cpu_ops
from tests.op_set_fuzz import attend, draw_case, draw_layout, row_error

# (PAGEDSERVE_FUZZ_TRIALS=N: the first N seeds instead, for a longer hunt)
TRIALS = int(os.environ.get("PAGEDSERVE_FUZZ_TRIALS", 40))
# float32 on both sides, the same codes (the write kernel's are the reference's bit for bit):
# only the order of the sums differs (5.3e-6 at worst over 2300 seeds of wider shapes here; the
# planted wrong reads and masks of stop 61 moved a row by 3.5e-4 to 0.18)
TOL = 3e-5


def test_cpu_op_set_attends_random_batches_as_the_references_do():
    ops = cpu_ops()
    seen: Counter[str] = Counter()
    for seed in range(TRIALS):
        rng = random.Random(seed)
        case = draw_case(rng, max_verify=20)  # (over VERIFY_ROWS = 16: the gather's)
        layout = draw_layout(case, rng)
        out = attend(case, layout, seed, ops)
        ref = attend(case, layout, seed, TORCH_OPS)
        assert row_error(out, ref) <= TOL, (seed, case, layout)
        seen.update({case.quant, *layout.features, *(row.kind for row in case.rows)})
        seen.update(["window"] if case.window else [])
        seen.update(["mixed"] if len({row.kind for row in case.rows}) > 1 else [])
    if TRIALS < 40:  # (fewer seeds need not cover everything)
        return
    # (the seeds' draws do cover every format, kind of row and page layout)
    wanted = ["fp16", "q8", "q6", "q4", "decode", "verify", "chunk", "prompt", "mixed", "window"]
    wanted += ["sink page", "recent page", "2 recent pages", "shared prefix"]
    assert all(seen[name] >= 5 for name in wanted), seen
