"""``_launch.device_function``: which device functions the simulator runs as plain Python."""

from __future__ import annotations

import pytest
import torch

from engine.cuda import _launch
from engine.cuda._launch import cuda, device_function

pytestmark = pytest.mark.skipif(not _launch.SIMULATOR, reason="simulator behaviour")


def _arithmetic(x):
    return (x ^ (x >> 1)) & 1


def _reads_the_thread(x):
    return x + cuda.threadIdx.x


def _calls_a_thread_reader(x):
    return _reads_the_thread(x) * 2


def test_functions_that_never_reach_cuda_stay_plain():
    assert device_function(_arithmetic) is _arithmetic
    assert device_function(inline=True)(_arithmetic) is _arithmetic


def test_functions_that_reach_cuda_directly_or_through_a_helper_are_device_functions():
    """The simulator swaps the fake cuda module into the globals of the function it calls, so
    a plain helper of the same module that reads the thread index needs its caller wrapped."""
    for fn in (_reads_the_thread, _calls_a_thread_reader):
        assert device_function(fn) is not fn

    def in_a_closure(x):
        return _calls_a_thread_reader(x)

    assert device_function(in_a_closure) is not in_a_closure


def test_a_kernel_runs_plain_and_wrapped_device_functions_alike():
    parity, thread = device_function(_arithmetic), device_function(_calls_a_thread_reader)

    @cuda.jit
    def kernel(out):
        i = cuda.threadIdx.x
        out[i] = parity(i) + 10 * thread(i)

    out = torch.zeros(8, dtype=torch.int64)
    _launch.launch(kernel, 1, 8, out)
    assert out.tolist() == [_arithmetic(i) + 10 * 4 * i for i in range(8)]
