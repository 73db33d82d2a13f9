"""Shared test setup.

Without a CUDA device the Numba CUDA kernels run in the CUDA simulator; the switch must be set
before numba is first imported, which is why it lives at the top of the root conftest. (The
simulator's own repairs are made by ``engine.cuda._launch``, for every simulated process.)
GPU tests (marked ``gpu``) skip themselves on machines without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import pytest


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
