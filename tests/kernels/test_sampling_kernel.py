"""The sampling kernels (engine.cuda.sampling) against the torch fast path they replace on
the GPU (engine.sampling_fast._choose, and the reference engine.sampling.sample where that
path hands a batch to it), with the same seeded draws.

Without CUDA these run in the Numba CUDA simulator on tiny shapes (a few rows, 200-300 ids).
Tokens must be equal: the kernels keep the torch path's float32 operations per probability
and differ only in summation order (see the kernel module), which these fixed seeds never
reach. Two tests break the kernel on purpose to show the comparisons can fail.
"""

from __future__ import annotations

import random
import textwrap

import pytest
import torch

from engine.cuda import sampling as kernels
from engine.cuda._launch import SIMULATOR
from engine.cuda.sampling import SampleRows, greedy_cuda, sample_cuda
from engine.sampling import SampleRequest, SamplerSettings, sample
from engine.sampling_fast import SamplerState, _choose, _kernels_wanted
from tests.kernels.common import DEVICE, run_without_simulator

S = SamplerSettings
INF = float("inf")


def _logits(rows: int, vocab: int, seed: int, ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 3.0
    return (x.round() if ties else x).to(DEVICE)  # rounded: many exactly equal values


def _requests(settings: list[SamplerSettings], seed: int) -> list[SampleRequest]:
    return [SampleRequest(s, random.Random(seed * 1000 + i)) for i, s in enumerate(settings)]


def _torch_tokens(x: torch.Tensor, limit: int, settings, seed: int) -> list[int]:
    """The torch fast path's tokens (the reference's where it hands the batch over)."""
    requests = _requests(settings, seed)
    params = SamplerState().params(requests, x.device)
    tokens = _choose(x.clone(), limit, params, requests, kernels=False)
    if tokens is None:
        return sample(x.clone(), _requests(settings, seed), limit).tokens
    return tokens.tolist()


def _kernel_tokens(x: torch.Tensor, limit: int, settings, seed: int) -> list[int]:
    requests = _requests(settings, seed)
    params = SamplerState().params(requests, x.device)
    tokens = _choose(x, limit, params, requests, kernels=True)
    after = [r.rng.random() for r in requests]
    assert after == [r.rng.random() for r in _advanced(settings, seed)], "one draw per row"
    return tokens.tolist()


def _advanced(settings, seed: int) -> list[SampleRequest]:
    requests = _requests(settings, seed)
    for r in requests:
        r.rng.random()
    return requests


def _assert_same_tokens(x, limit, settings, seeds=(0, 1)) -> None:
    for seed in seeds:
        expected = _torch_tokens(x, limit, settings, seed)
        assert _kernel_tokens(x, limit, settings, seed) == expected, seed


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_is_the_first_maximum_and_flags_nan_and_infinite_rows():
    x = _logits(8, 200, seed=3, ties=True)
    x[0] = 1.0  # every id tied: the first
    x[1, [7, 60, 150]] = 50.0  # tied maxima far apart: the first
    x[2, 199] = 50.0  # past the limit below: not seen
    x[3, 5] = float("nan")  # flagged
    x[4] = -INF  # every id banned: flagged
    x[5, 10] = INF  # flagged (the torch path would compute NaN probabilities)
    x[6, :150] = -INF  # only the last few ids are candidates
    limit = 190
    tokens, flags = greedy_cuda(x, limit)
    assert flags.tolist() == [False, False, False, True, True, True, False, False]
    expected = x[:, :limit].max(-1).indices
    ok = ~flags
    assert torch.equal(tokens[ok], expected[ok])
    assert tokens[:3].tolist() == [0, 7, expected[2].item()]


def test_greedy_rows_of_a_sampled_batch_take_the_greedy_token():
    x = _logits(3, 250, seed=4, ties=True)
    rows = SampleRows(
        temps=torch.tensor([1.0, 1.0, 0.5], device=DEVICE),
        top_k=torch.tensor([0, 1, 5], device=DEVICE),
        top_p=torch.tensor([1.0, 1.0, 0.9], device=DEVICE),
        min_p=torch.zeros(3, device=DEVICE),
        greedy=torch.tensor([True, True, False], device=DEVICE),
    )
    uniforms = torch.tensor([0.5, 0.9, 0.1], dtype=torch.float64, device=DEVICE)
    tokens, flags = sample_cuda(x, 250, uniforms, rows)
    assert not flags.any()
    assert tokens[:2].tolist() == x[:2].max(-1).indices.tolist()


# -- sampled rows against the torch path ------------------------------------------------------

MIXED = [
    S(temperature=0.0, top_k=50, top_p=0.9),  # greedy inside a sampled batch
    S(top_k=1),  # greedy too
    S(top_k=8, top_p=0.8, min_p=0.02, temperature=1.3),
    S(top_k=40, top_p=0.95, temperature=0.7),
    S(top_p=0.7, min_p=0.1),
    S(top_k=3, min_p=0.3, temperature=2.0),
]

CASES = {
    # top_k 1024 >= the limit: the torch path hands over, the reference keeps every id
    "top_k": [S(top_k=2), S(top_k=5, temperature=0.7), S(top_k=40), S(top_k=1024)],
    "top_p": [S(top_p=0.5), S(top_p=0.9, temperature=1.5), S(top_p=0.99, temperature=0.6)],
    "mixed": MIXED,
    "temperatures": [S(top_k=50, temperature=t) for t in (0.25, 0.9, 2.0, 5.0)],
    # no top_k, no top_p: the whole row (the torch path's compiled dense draw on the CPU)
    "dense": [S(), S(temperature=0.6), S(temperature=1.4, min_p=0.05), S(top_k=5), S.greedy()],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_tokens_match_the_torch_path(case):
    settings = CASES[case]
    x = _logits(len(settings), 300, seed=len(case))
    _assert_same_tokens(x, 300, settings)


def test_ties_at_the_kth_value_and_at_the_top_p_cut():
    """Rounded logits: whole groups of equal values straddle the k-th value and the top-p
    cut (ties at the k-th are all kept; at the cut, lowest ids first)."""
    settings = [S(top_k=3), S(top_k=10, temperature=0.5), S(top_p=0.3), S(top_p=0.6)]
    settings += [S(top_k=20, top_p=0.5, temperature=2.0), S(top_p=0.8, min_p=0.05)]
    x = _logits(len(settings), 240, seed=11, ties=True)
    _assert_same_tokens(x, 240, settings, seeds=(0, 1, 2))


def test_top_k_rows_whose_candidates_do_not_fit_read_the_row(monkeypatch):
    """Top-k rows whose kept ids (k and the ties at the k-th) outnumber the shared-memory
    candidates take the whole-row path; with 6 slots: top_k 3 fits, 10 and 40 do not."""
    monkeypatch.setattr(kernels, "_CANDIDATES", 6)
    settings = [S(top_k=3, top_p=0.9), S(top_k=10), S(top_k=40, top_p=0.8, min_p=0.02)]
    settings += [S(top_k=5, temperature=0.5)]  # rounded logits: ties at the 5th past 6 ids
    x = _logits(len(settings), 240, seed=21, ties=True)
    _assert_same_tokens(x, 240, settings)


def _straddling_row(vocab: int = 256) -> tuple[torch.Tensor, list[int]]:
    """One id above 7 tied ids spread over the row, everything else banned: top_p 0.5 keeps
    the top id and the 3 lowest tied ids (mass above the cut 1, each tie exp(-0.2))."""
    x = torch.full((vocab,), -INF)
    ties = [10, 50, 90, 130, 170, 210, 250]
    x[ties] = 2.0
    x[60] = 2.2
    return x.to(DEVICE), [10, 50, 60, 90]


@pytest.mark.parametrize("threads", [4, 8, 16])
def test_top_p_cut_inside_a_tie_group_keeps_the_lowest_ids(monkeypatch, threads):
    """The tied ids fall in different threads' id ranges: their ranks come from a scan."""
    monkeypatch.setattr(kernels, "_SIM_THREADS", threads)
    row, kept = _straddling_row()
    settings = [S(top_p=0.5)] * 6
    x = row.expand(6, -1).contiguous()
    for seed in (0, 1) if threads == 8 else (2,):
        tokens = _kernel_tokens(x, x.shape[1], settings, seed)
        assert set(tokens) <= set(kept)
        assert tokens == _torch_tokens(x, x.shape[1], settings, seed)


def _random_settings(rng: random.Random) -> SamplerSettings:
    return S(
        temperature=rng.choice([0.0, 0.3, 1.0, 1.0, 2.5]),
        top_k=rng.choice([0, 0, 1, 2, 7, 64, 600]),
        top_p=rng.choice([1.0, 0.4, 0.85, 0.97]),
        min_p=rng.choice([0.0, 0.0, 0.03, 0.2]),
    )


@pytest.mark.parametrize("seed", range(3))
def test_random_settings_match_the_torch_path(seed):
    rng = random.Random(seed)
    # (rows without a top_k or top_p draw from the whole row: the kernels take them too)
    settings = [_random_settings(rng) for _ in range(6)]
    width = rng.choice([233, 256, 301])
    x = _logits(len(settings), width, seed=100 + seed, ties=seed == 1)
    x[rng.randrange(6), rng.sample(range(width), 40)] = -INF  # bans in one row
    _assert_same_tokens(x, width - rng.choice([0, 9]), settings, seeds=(seed,))


def test_bans_limit_and_k_past_the_finite_values():
    settings = [S(top_k=10), S(top_k=5, top_p=0.9), S(top_p=0.95), S(top_k=30, min_p=0.01)]
    x = _logits(len(settings), 300, seed=5)
    x[0, :] = -INF
    x[0, [3, 77, 140]] = torch.tensor([1.0, 2.0, 1.5], device=DEVICE)  # 3 finite ids, top_k 10
    x[1, ::3] = -INF  # scattered bans
    x[2, 100:200] = -INF
    x[3, 0:280:2] = -INF
    x[:, 285:] = 40.0  # past the limit: never picked
    _assert_same_tokens(x, 280, settings)


# -- the comparisons can fail ----------------------------------------------------------------

# These patch a device function. On a GPU the compiled kernels (and the device functions that
# call it) have already bound the original, so the patch cannot take effect there; what they
# check -- that the comparisons above can fail -- does not depend on the device.
simulator_only = pytest.mark.skipif(
    not SIMULATOR, reason="patches a device function that compiled GPU kernels have bound"
)


@simulator_only
def test_a_wrong_top_k_threshold_is_caught(monkeypatch):
    right = kernels._kth_logit

    def one_too_many(vals, n, k, row_max, ibuf):  # the (k+1)-th value
        return right(vals, n, min(k + 1, n - 1), row_max, ibuf)

    monkeypatch.setattr(kernels, "_kth_logit", one_too_many)
    settings = [S(top_k=2, temperature=5.0)] * 8  # hot: the (k+1)-th is about as likely
    x = _logits(len(settings), 200, seed=2)
    assert _kernel_tokens(x, 200, settings, 0) != _torch_tokens(x, 200, settings, 0)


@simulator_only
def test_wrong_tie_handling_at_the_top_p_cut_is_caught(monkeypatch):
    monkeypatch.setattr(kernels, "_ties_kept", lambda topp, level, cap, above, ties: ties)
    row, kept = _straddling_row()
    settings = [S(top_p=0.5)] * 8
    x = row.expand(8, -1).contiguous()
    tokens = _kernel_tokens(x, x.shape[1], settings, 0)
    assert not set(tokens) <= set(kept)


# -- the _choose wiring -----------------------------------------------------------------------


def test_a_nan_row_sends_the_batch_to_the_reference_before_any_draw():
    settings = [S(top_k=5), S(top_p=0.9)]
    x = _logits(2, 200, seed=6)
    x[1, 17] = float("nan")
    requests = _requests(settings, 0)
    params = SamplerState().params(requests, x.device)
    assert _choose(x, 200, params, requests, kernels=True) is None
    fresh = _requests(settings, 0)
    assert [r.rng.random() for r in requests] == [r.rng.random() for r in fresh]


def test_all_greedy_batches_draw_once_per_row():
    settings = [S(temperature=0.0), S(top_k=1, top_p=0.5)]
    x = _logits(2, 200, seed=7, ties=True)
    assert _kernel_tokens(x, 150, settings, 0) == x[:, :150].max(-1).indices.tolist()


def test_sample_on_device_takes_the_kernels():
    """Async scheduling's sampler entry: the host sampler's tokens, penalties and bans
    included, from the kernels; a NaN row is flagged (its job is read through the reference)."""
    settings = [
        S(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3),
        S.greedy(),
        S(temperature=1.1, top_p=0.8, min_p=0.05),
        S(temperature=0.7, top_k=5, presence_penalty=0.5),
        S(temperature=0.9, frequency_penalty=0.3),  # the whole row
    ]
    x = _logits(len(settings), 300, seed=4)
    contexts = [[1, 2, 3, 250], [], [7, 7], [9, 10, 11], [4, 4, 5]]

    def requests(seed):
        reqs = _requests(settings, seed)
        for r, ctx in zip(reqs, contexts, strict=True):
            r.context = ctx
        reqs[2].banned_tokens = (int(x[2].argmax()),)
        return reqs

    for seed in range(3):
        host = SamplerState().sample(x.clone(), requests(seed), 290)
        state = SamplerState(kernels=True)
        state.sample = None  # the host sampler must not run: the kernels answer
        out = state.sample_on_device(x.clone(), requests(seed), 290)
        assert out.tokens.tolist() == host.tokens and not out.flags.any()
    poisoned = x.clone()
    poisoned[1, 7] = float("nan")
    out = SamplerState(kernels=True).sample_on_device(poisoned, requests(0), 290)
    assert out.flags.tolist() == [False, True, False, False, False]
    with pytest.raises(ValueError, match="kernels"):
        SamplerState(kernels="yes")


def test_cpu_tensors_stay_on_the_torch_path():
    assert not _kernels_wanted(torch.zeros(1, 4))


# -- bad input ---------------------------------------------------------------------------------


def _rows(n: int) -> SampleRows:
    return SampleRows(
        torch.ones(n, device=DEVICE), torch.zeros(n, dtype=torch.long, device=DEVICE),
        torch.ones(n, device=DEVICE), torch.zeros(n, device=DEVICE),
        torch.zeros(n, dtype=torch.bool, device=DEVICE),
    )  # fmt: skip


def _zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)  # (on a GPU the device check is first)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: greedy_cuda(_zeros(2, 8, dtype=torch.float16), 8), "float32"),
        (lambda: greedy_cuda(_zeros(2, 8), 9), "limit 9"),
        (lambda: greedy_cuda(_zeros(2, 8), 8, threads=6), "threads 6"),
        (lambda: sample_cuda(_zeros(2, 8), 8, _zeros(2), _rows(2)), "uniforms"),
        (lambda: sample_cuda(_zeros(3, 8), 8, _zeros(3, dtype=torch.float64), _rows(2)),
         "temps"),
    ],
)  # fmt: skip
def test_bad_inputs_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# -- model sizes, GPU only ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [49152, 151936])
def test_gpu_model_sizes_match_the_torch_path(vocab):
    """SmolLM2's and Qwen's vocabularies, 32 rows of random settings, 5 batches."""
    for seed in range(5):
        rng = random.Random(seed)
        # (rows with neither top_k nor top_p: the kernels draw from the whole row, the torch
        # path on CUDA hands the batch to the reference)
        settings = [_random_settings(rng) for _ in range(32)]
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(32, vocab, generator=gen) * 4.0).cuda()
        x[3, rng.sample(range(vocab), 1000)] = -INF
        _assert_same_tokens(x, vocab - 64, settings, seeds=(seed,))


# -- the GPU build: typed and lowered without a GPU -------------------------------------------

_LOWER_SCRIPT = textwrap.dedent(
    """
    import numba.cuda.dispatcher as dispatcher
    from numba.cuda import types
    from numba.cuda.compiler import compile_cuda

    class Device:  # kernels calling device functions ask for the current device
        compute_capability = (9, 0)
        id = 0

    dispatcher.get_current_device = lambda: Device()
    from engine.cuda import sampling as S

    for fn, sig in ((S._sample_kernel_py, S._sample_sig), (S._greedy_kernel_py, S._greedy_sig)):
        ir = compile_cuda(fn, types.void, sig.args, cc=(9, 0)).library.get_llvm_str()
        # float32 math as the torch path's: float32 exp and divisions, never a double exp
        assert "__nv_expf" in ir or fn is S._greedy_kernel_py, fn
        assert "__nv_exp(" not in ir, fn
    print("ok")
    """
)


def test_kernels_type_and_lower_for_the_gpu():
    """The GPU build (libdevice bit casts instead of the simulator's numpy ones) typed and
    lowered to LLVM IR: no GPU or CUDA toolkit needed (PTX would need libdevice)."""
    proc = run_without_simulator(_LOWER_SCRIPT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
