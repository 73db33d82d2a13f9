"""``upload`` gives what ``torch.tensor`` gives (values, dtype, device) for every input kind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.device_copy import upload


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([1, 2, 3], None),
        ([True, False], None),
        ([0.25, 1.5], None),
        ([[1.0, 2.0, 3.0]], None),
        ([1, 2], torch.long),
        ([0.1, 0.9], torch.float64),
    ],
)
def test_lists_upload_as_torch_tensor_makes_them(values, dtype):
    got = upload(values, "cpu", dtype)
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu"
    assert torch.equal(got, want)


def test_arrays_and_tensors_keep_their_values_and_take_the_dtype():
    array = np.array([3, 1, 2], dtype=np.int32)
    assert upload(array, "cpu").dtype == torch.int32
    assert upload(array, "cpu", torch.long).tolist() == [3, 1, 2]
    assert upload(array, "cpu", torch.long).dtype == torch.long
    tensor = torch.tensor([1.5, 2.5])
    assert torch.equal(upload(tensor, "cpu", torch.float64), tensor.double())
