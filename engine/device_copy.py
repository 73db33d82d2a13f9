"""Host values to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` copies synchronously: the host waits until every
kernel queued before the copy has run. With async scheduling (engine/inflight.py) the host
samples and plans while the forward runs, so such a wait would put the whole forward back
on the host's path. ``upload`` stages the values in pinned memory and queues the copy on the
current stream instead (torch's pinned allocator keeps the staging buffer alive until the
copy has run). On a CPU it is ``torch.tensor``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def upload(values: Any, device: torch.device | str, dtype: torch.dtype | None = None):
    """``torch.tensor(values, dtype=dtype, device=device)``, queued rather than waited for
    on a GPU. ``values``: a (nested) list, a numpy array or a CPU tensor."""
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values)
        if dtype is not None:
            host = host.to(dtype)
    elif isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
