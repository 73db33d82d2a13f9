"""The fast kernel-launch path's bookkeeping, on the CPU (its launches need a GPU).

What a GPU run checks (every kernel test on the device goes through it): that the packed
arguments are the ones Numba's own path passes. Here: which signatures take which path, that
the first launch of a signature is Numba's, the values packed per declared type, and the
fall-backs. CPU tensors stand in for CUDA ones where a packer is built directly.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from numba.cuda import types

from engine.cuda import fast_launch
from engine.cuda.fast_launch import FastLauncher, _array_packer, _packer, signature_key


def _pack(packer, value) -> list:
    out: list = []
    packer(value, out)
    return out


def test_signature_key_tells_dtype_rank_contiguity_and_scalars_apart():
    a = torch.zeros(2, 3)
    assert signature_key([a, 1, 2.0]) == signature_key([torch.ones(5, 7), 3, 1.5])
    assert signature_key([a]) != signature_key([a.t()])  # contiguity
    assert signature_key([a]) != signature_key([a.half()])
    assert signature_key([a]) != signature_key([a.reshape(6)])
    assert signature_key([1]) != signature_key([np.float32(1)])
    assert signature_key([True]) != signature_key([1])


def test_c_layout_arrays_pack_strides_from_the_shape():
    t = torch.zeros(2, 1, 3, dtype=torch.float16)
    ty = types.Array(types.float16, 3, "C")
    packer = _array_packer(ty, _as_cuda(t))
    assert _pack(packer, t) == [0, 0, 6, 2, t.data_ptr(), 2, 1, 3, 6, 6, 2]


def test_any_layout_views_pack_their_own_byte_strides():
    base = torch.zeros(4, 6)
    view = base[:, 1:5:2]  # not contiguous
    ty = types.Array(types.float32, 2, "A")
    packer = _array_packer(ty, _as_cuda(view))
    assert _pack(packer, view) == [0, 0, 8, 4, view.data_ptr(), 4, 2, 24, 8]


def test_arrays_that_do_not_fit_the_declared_type_get_no_packer():
    t = _as_cuda(torch.zeros(2, 3))
    assert _array_packer(types.Array(types.float16, 2, "C"), t) is None  # dtype
    assert _array_packer(types.Array(types.float32, 3, "C"), t) is None  # rank
    assert _array_packer(types.Array(types.float32, 2, "F"), t) is None  # layout
    assert _array_packer(types.Array(types.float32, 2, "C"), _as_cuda(t.t())) is None
    assert _array_packer(types.Array(types.float32, 2, "C"), torch.zeros(2, 3)) is None  # cpu


def test_scalars_pack_as_their_declared_ctypes():
    def one(ty, v):
        (value,) = _pack(_packer(ty, v), v)
        return value

    assert isinstance(one(types.int64, 7), ctypes.c_int64) and one(types.int64, 7).value == 7
    assert isinstance(one(types.int32, 7), ctypes.c_int32)
    assert one(types.float32, np.float32(0.5)).value == 0.5
    assert isinstance(one(types.float64, 0.5), ctypes.c_double)
    assert one(types.float16, 1.0).value == 0x3C00
    assert one(types.boolean, 1) is True
    assert _packer(types.int64, torch.zeros(1)) is None  # a tensor for a scalar
    assert _packer(types.UniTuple(types.int64, 2), (1, 2)) is None  # tuples: Numba's path


class _FakeKernel:
    def __init__(self, argument_types, cooperative=False):
        self.argument_types = argument_types
        self.cooperative = cooperative
        self.debug = False
        self._codelibrary = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(kernel="fn"))


class _FakeDispatcher:
    def __init__(self, kernel):
        self.overloads = {"sig": kernel}


def _launcher(kernel, monkeypatch):
    numba_calls, fast_calls = [], []
    monkeypatch.setattr(fast_launch, "_core_stream", lambda: "stream")
    monkeypatch.setattr(fast_launch, "_launch_config", lambda grid, block: (grid, block))
    launcher = FastLauncher(_FakeDispatcher(kernel), lambda d, g, b, a: numba_calls.append(a))
    return launcher, numba_calls, fast_calls


def test_first_launch_of_a_signature_is_numbas_then_packed(monkeypatch):
    kernel = _FakeKernel((types.Array(types.float32, 1, "C"), types.int64))
    launcher, numba_calls, fast_calls = _launcher(kernel, monkeypatch)
    x = _as_cuda(torch.zeros(4))
    launcher.launch(8, 32, (x, 3))
    assert len(numba_calls) == 1
    packed = launcher._by_signature[signature_key((x, 3))]
    packed._launch = lambda stream, config, fn, *values: fast_calls.append(
        (stream, config, fn, values)
    )
    launcher.launch(8, 32, (x, 5))
    assert len(numba_calls) == 1
    ((stream, config, fn, values),) = fast_calls
    assert (stream, config, fn) == ("stream", (8, 32), "fn")
    assert values[:7] == (0, 0, 4, 4, x.data_ptr(), 4, 4) and values[7].value == 5
    # another signature (a float64 tensor) starts on Numba's path again
    launcher.launch(8, 32, (_as_cuda(torch.zeros(4, dtype=torch.float64)), 5))
    assert len(numba_calls) == 2


@pytest.mark.parametrize(
    ("argument_types", "cooperative"),
    [
        ((types.Array(types.float32, 1, "F"), types.int64), False),  # no packer for F
        ((types.Array(types.float32, 1, "C"),), False),  # argument count differs
        ((types.Array(types.float32, 1, "C"), types.int64), True),  # cooperative
    ],
)
def test_unsupported_signatures_stay_on_numbas_path(monkeypatch, argument_types, cooperative):
    launcher, numba_calls, _ = _launcher(_FakeKernel(argument_types, cooperative), monkeypatch)
    x = _as_cuda(torch.zeros(4))
    for _ in range(3):
        launcher.launch(1, 32, (x, 1))
    assert len(numba_calls) == 3


def test_launch_mode_is_validated(monkeypatch):
    monkeypatch.setenv(fast_launch.LAUNCH_ENV, "numba")
    assert fast_launch.launch_mode() == "numba"
    monkeypatch.setenv(fast_launch.LAUNCH_ENV, "quick")
    with pytest.raises(ValueError, match="quick"):
        fast_launch.launch_mode()


class _CudaLike(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (the packers read only its layout)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _as_cuda(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_CudaLike)
