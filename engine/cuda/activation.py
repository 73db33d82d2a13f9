"""SiLU-and-multiply for the gated MLP. Torch reference; the CUDA kernel lives beside it."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from engine.cuda import _launch


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate first, then up) -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --------------------------------------------------------------------------------------------
# Numba CUDA kernel: one thread per output element, grid-stride. fp32 math with the
# reference's rounding points: s = to_dtype(g / (1 + exp(-g))) (F.silu's fp16 result), then
# out = to_dtype(float(s) * u) (the fp16 multiply). For fp32 both casts are no-ops, i.e. plain
# ``g / (1 + exp(-g)) * u``. gate_up is read through its strides (layout "A").
# --------------------------------------------------------------------------------------------

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32

_THREADS = 256
# Grid-stride cap: enough blocks to fill an H100 (132 SMs x 2048 threads / 256) several times
# over; larger inputs loop. Tests lower it to exercise the loop.
_MAX_BLOCKS = 132 * 8 * 4
_EXP_ARG_MAX = float32(700.0)  # expf(x > 88.7) is inf on a GPU; Python's exp raises past 709


@functools.cache
def _silu_mul_kernel(dtype: torch.dtype):
    io = _launch.NUMBA_DTYPES[dtype]
    sig = nbt.void(nbt.Array(io, 2, "A"), nbt.Array(io, 2, "A"))
    inf = float32(math.inf)

    def silu_mul_kernel(gate_up, out):
        inter = out.shape[1]
        total = out.shape[0] * inter
        for idx in range(cuda.grid(1), total, cuda.gridsize(1)):
            t = idx // inter
            i = idx - t * inter
            g = float32(gate_up[t, i])
            u = float32(gate_up[t, i + inter])
            # The guard only keeps the simulator's float64 exp from raising: on a GPU
            # expf(-g) is already inf there, and g / inf = -0 like torch's.
            e = float32(math.exp(-g)) if -g < _EXP_ARG_MAX else inf
            s = io(g / (float32(1.0) + e))
            out[t, i] = io(float32(s) * u)

    return cuda.jit(sig)(silu_mul_kernel)


def silu_mul_cuda(gate_up: torch.Tensor) -> torch.Tensor:
    """Numba CUDA SiLU-and-multiply; same contract as ``silu_mul_reference``.

    gate_up: [T, 2I] (gate first, then up; any strides) -> new contiguous [T, I].
    """
    _launch.check_dtype("silu_mul", gate_up)
    want = "cpu" if _launch.SIMULATOR else "cuda"
    if gate_up.device.type != want:
        raise ValueError(f"silu_mul: gate_up must be on a {want} device (is on {gate_up.device})")
    if gate_up.dim() != 2:
        raise ValueError(f"silu_mul: gate_up must be [T, 2I] (got shape {tuple(gate_up.shape)})")
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: the last dim of gate_up must be even (got {gate_up.shape[1]})")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    total = num_tokens * inter
    if total == 0:
        return out
    threads = min(_THREADS, max(32, 1 << (total - 1).bit_length()))
    grid = min(_launch.blocks(total, threads), _MAX_BLOCKS)
    _launch.launch(_silu_mul_kernel(gate_up.dtype), grid, threads, gate_up, out)
    return out


def warm_up(dtype: torch.dtype, device: torch.device | str) -> None:
    """Compile (explicit signature) and launch the kernel once for ``dtype``, so that no later
    launch (e.g. one inside CUDA-graph capture) compiles or loads a module."""
    silu_mul_cuda(torch.zeros(1, 64, dtype=dtype, device=device))
