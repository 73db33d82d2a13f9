"""Work shared on torch's OpenMP team (engine/cpu/team.py): every item done once, by more than
one thread, with the arguments the kernel would get called directly; our own pool where the
team cannot be used (a forked child, no runtime)."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import numba
import numpy as np
import pytest
import torch

from engine.cpu import team

_libc = ctypes.CDLL(None)
_thread_id = _libc.pthread_self
_thread_id.restype = ctypes.c_ulong
_thread_id.argtypes = []

WORK = 200  # per item, so that a call lasts long enough for every team thread to take part


@numba.njit(nogil=True)
def _record(values, codes, grid, scale, flag, out, who, first, last):
    """out[i] += a value of each argument for item i; who[i] = the thread that did it."""
    for i in range(first, last):
        busy = 0.0
        for k in range(WORK):
            busy += np.sqrt(np.float64(k + i))
        out[i] += values[i] * scale + codes[i % codes.shape[0], i % 3] + (1.0 if flag else 0.0)
        out[i] += grid[i % 2, 1, 0, i % 5] + busy * 0.0
        who[i] = _thread_id()


def _case(items: int, seed: int = 0):
    gen = np.random.default_rng(seed)
    values = gen.standard_normal(2 * items)[::2]  # (strided: read through its strides)
    codes = gen.integers(0, 255, (7, 3), dtype=np.uint8)
    grid = gen.standard_normal((2, 3, 1, 5)).astype(np.float32)
    return values, codes, grid


def _expected(values, codes, grid, scale, flag):
    i = np.arange(values.shape[0])
    return values * scale + codes[i % 7, i % 3] + float(flag) + grid[i % 2, 1, 0, i % 5]


def _threads(n: int):
    class _Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)

    return _Threads()


def _no_pool(*args):
    raise AssertionError("the work went to our own pool, not torch's team")


def test_the_team_does_every_item_once_with_the_kernels_arguments(monkeypatch):
    """Two threads: each item once (``+=`` would double one done twice), the values the
    kernel computes when called directly, and both threads took items."""
    assert team.team_runtime(os.getpid()) is not None  # (Linux, torch on OpenMP: CI's box)
    monkeypatch.setattr(team, "in_turns", _no_pool)
    items = 4000
    values, codes, grid = _case(items)
    out, who = np.zeros(items), np.zeros(items, np.uint64)
    with _threads(2):
        team.share(_record, (values, codes, grid, 3, True, out, who), items)
    assert np.array_equal(out, _expected(values, codes, grid, 3, True))
    assert len(set(who.tolist())) == 2


def test_one_thread_runs_the_kernel_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(team, "in_turns", _no_pool)
    values, codes, grid = _case(50)
    out, who = np.zeros(50), np.zeros(50, np.uint64)
    with _threads(1):
        team.share(_record, (values, codes, grid, -2, False, out, who), 50)
    assert np.array_equal(out, _expected(values, codes, grid, -2, False))
    assert set(who.tolist()) == {_thread_id()}


def test_two_callers_at_once_each_get_their_own():
    """Two Python threads sharing at the same time (each its own OpenMP team)."""
    items = 1000
    cases = [_case(items, seed) for seed in (1, 2)]
    outs = [[] for _ in cases]

    def call(k: int) -> None:
        for _ in range(10):
            out, who = np.zeros(items), np.zeros(items, np.uint64)
            team.share(_record, (*cases[k], 5, k == 1, out, who), items)
            outs[k].append(out)

    with _threads(2):
        callers = [threading.Thread(target=call, args=(k,)) for k in range(2)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    for k, case in enumerate(cases):
        want = _expected(*case, 5, k == 1)
        assert len(outs[k]) == 10 and all(np.array_equal(out, want) for out in outs[k])


def test_arguments_that_cannot_be_packed_are_refused():
    """A float scalar or an array of more than ``MAX_NDIM`` dimensions is a typing error, not
    a wrong value."""

    @numba.njit
    def kernel(x, out, first, last):
        pass

    with _threads(2):
        for bad in (0.5, np.zeros((1,) * (team.MAX_NDIM + 1))):
            with pytest.raises(numba.core.errors.TypingError, match="share"):
                team.share(kernel, (bad, np.zeros(4)), 4)


def test_a_forked_child_shares_on_its_own_pool_not_the_team():
    """libgomp's pool in a child forked after the team ran lists threads the fork did not
    copy, and a parallel region there waits for them forever: the child uses our pool."""
    values, codes, grid = _case(400)
    with _threads(2):
        who = np.zeros(400, np.uint64)
        team.share(_record, (values, codes, grid, 1, True, np.zeros(400), who), 400)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only for the right values
            out = np.zeros(400)
            team.share(_record, (values, codes, grid, 1, True, out, np.zeros(400, np.uint64)), 400)
            os._exit(0 if np.array_equal(out, _expected(values, codes, grid, 1, True)) else 3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's shared call never returned")
    assert os.waitstatus_to_exitcode(status) == 0
    assert team.team_runtime(os.getpid() + 1) is None


@pytest.mark.parametrize("threads", [1, 2])
def test_warm_up_compiles_the_decode_kernels_callback_where_it_will_share(monkeypatch, threads):
    """The engine's warm-up compiles the decode kernel's callback for torch's team (~0.5 s),
    so that the first long decode batch does not, mid-request; on one thread it never shares,
    so nothing is compiled."""
    from engine.cpu import decode_attention

    monkeypatch.setattr(team, "_callbacks", {})
    with _threads(threads):
        decode_attention.warm_up_decode_attention_cpu(torch.float32, 4, 2, 64)
    kernels = [kernel for kernel, _ in team._callbacks]
    assert kernels == ([decode_attention._attend_items] if threads > 1 else [])
