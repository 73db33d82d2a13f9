"""RMSNorm family: plain, fused with the residual add, and per-head (Qwen3 q/k norm).

Torch references; the Numba CUDA kernels of this family live beside them.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from engine.cuda import _launch
from engine.cuda._launch import device_function


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like the HF reference.

    x: [..., D]; weight: [D] -> [..., D] in x's dtype.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    # HF casts back to the input dtype *before* the weight multiply; keep that rounding order.
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; returns (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


# --------------------------------------------------------------------------------------------
# Numba CUDA kernels
#
# One block per row. Each thread strides over the row accumulating its fp32 sum of squares;
# a block-wide sum gives the row's mean square; a second pass (re-reading the row, which is in
# L1/L2) writes the output with the reference's rounding order:
#     n = to_dtype(x32 * (1 / sqrt(mean + eps)));  out = to_dtype(float(w) * float(n)).
# The product of two fp16 values is exact in fp32, so the fp16 output equals torch's
# ``weight * n.to(fp16)`` bit for bit whenever the inverse norm agrees.
#
# Rows are addressed as a 3-D [A, B, D] array with arbitrary strides (numba layout "A"), so a
# strided [T, H, D] view (q/k from the split of the fused qkv matmul, for Qwen3's q/k norm) is
# read in place with no copy. Other shapes are viewed as [rows, 1, D].
#
# Kernels are compiled per dtype with an explicit signature on first use (one specialised
# dispatcher each: launches skip argument typing); ``warm_up`` does that ahead of time.
# --------------------------------------------------------------------------------------------

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32

_FULL_MASK = 0xFFFFFFFF
_MAX_THREADS = 1024


@device_function
def _block_sum_shared_tree(v):
    """Block-wide fp32 sum, simulator path (it has no warp shuffles); every thread gets the
    total. blockDim.x: a power of 2, at most 1024. One call per kernel: a second call would
    need a syncthreads before its buffer is reused."""
    buf = cuda.shared.array(_MAX_THREADS, float32)
    tid = cuda.threadIdx.x
    buf[tid] = v
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            buf[tid] += buf[tid + step]
        cuda.syncthreads()
        step //= 2
    return buf[0]


@device_function
def _block_sum_warp_shuffle(v):
    """Block-wide fp32 sum, GPU path: butterfly shuffles within each warp, one shared slot per
    warp, then every warp reduces the per-warp partials itself, so all threads get the total
    after a single syncthreads. blockDim.x: a multiple of 32, at most 1024. One call per
    kernel (same reason as above)."""
    partials = cuda.shared.array(32, float32)
    lane = cuda.threadIdx.x & 31
    offset = 16
    while offset > 0:
        v += cuda.shfl_xor_sync(_FULL_MASK, v, offset)
        offset >>= 1
    if lane == 0:
        partials[cuda.threadIdx.x >> 5] = v
    cuda.syncthreads()
    s = partials[lane] if lane < (cuda.blockDim.x >> 5) else float32(0.0)
    offset = 16
    while offset > 0:
        s += cuda.shfl_xor_sync(_FULL_MASK, s, offset)
        offset >>= 1
    return s


# Chosen once at import. Both sum in fp32 and only the summation order differs (a few ulps
# of the mean square), so the simulator tests check the same arithmetic as the GPU runs.
_block_sum = _block_sum_shared_tree if _launch.SIMULATOR else _block_sum_warp_shuffle


def _row_threads(d: int) -> int:
    """Threads per row: ~8 elements per thread, a power of 2 in [32, 1024] (whole warps).
    D=128 -> 32 threads, 4096 -> 512, 8192 -> 1024."""
    threads = 32
    while threads * 8 < d and threads < _MAX_THREADS:
        threads *= 2
    return threads


@functools.cache
def _rms_norm_kernel(dtype: torch.dtype):
    io = _launch.NUMBA_DTYPES[dtype]  # the cast to the storage dtype (fp16: one cvt.rn on a GPU)
    rows = nbt.Array(io, 3, "A")
    sig = nbt.void(rows, nbt.Array(io, 1, "A"), rows, float32)

    def rms_norm_kernel(x, weight, out, eps):
        row = cuda.blockIdx.x
        a = row // x.shape[1]
        b = row - a * x.shape[1]
        d = x.shape[2]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ss = float32(0.0)
        for i in range(tid, d, nt):
            v = float32(x[a, b, i])
            ss += v * v
        total = _block_sum(ss)
        inv = float32(1.0) / float32(math.sqrt(total / float32(d) + eps))
        for i in range(tid, d, nt):
            n = io(float32(x[a, b, i]) * inv)
            out[a, b, i] = io(float32(weight[i]) * float32(n))

    return cuda.jit(sig)(rms_norm_kernel)


@functools.cache
def _add_rms_norm_kernel(dtype: torch.dtype):
    io = _launch.NUMBA_DTYPES[dtype]
    rows = nbt.Array(io, 3, "A")
    sig = nbt.void(rows, rows, nbt.Array(io, 1, "A"), rows, float32)

    def add_rms_norm_kernel(x, residual, weight, out, eps):
        row = cuda.blockIdx.x
        a = row // x.shape[1]
        b = row - a * x.shape[1]
        d = x.shape[2]
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        ss = float32(0.0)
        for i in range(tid, d, nt):
            # Rounded to the storage dtype, like the reference's ``x + residual``, and the
            # norm is taken of that rounded value.
            r = io(float32(x[a, b, i]) + float32(residual[a, b, i]))
            residual[a, b, i] = r
            v = float32(r)
            ss += v * v
        total = _block_sum(ss)
        inv = float32(1.0) / float32(math.sqrt(total / float32(d) + eps))
        for i in range(tid, d, nt):
            # Each thread re-reads only the elements it wrote itself: no barrier needed.
            n = io(float32(residual[a, b, i]) * inv)
            out[a, b, i] = io(float32(weight[i]) * float32(n))

    return cuda.jit(sig)(add_rms_norm_kernel)


def _as_rows3(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> an [A, B, D] view (a copy only for a >3-D input that cannot be flattened)."""
    if t.dim() == 3:
        return t
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 1:
        return t.view(1, 1, -1)
    return t.flatten(0, -3)


def _check_norm_args(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    _launch.check_dtype(name, x, weight)
    _launch.check_device(name, x, weight)
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have at least one dimension (got a scalar)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name}: weight shape {tuple(weight.shape)} does not match the last dim of x "
            f"({x.shape[-1]})"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"{name}: weight dtype {weight.dtype} != x dtype {x.dtype}")


def rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Numba CUDA RMSNorm; same contract as ``rms_norm_reference``.

    x: [..., D], any strides (a strided [T, H, D] view is read in place); weight: [D] in x's
    dtype. Returns a new contiguous tensor shaped like x. One block per row.
    """
    _check_norm_args("rms_norm", x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = _as_rows3(x)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0 or x3.shape[2] == 0:
        return out
    kernel = _rms_norm_kernel(x.dtype)
    _launch.launch(
        kernel, num_rows, _row_threads(x3.shape[2]), x3, weight, out.view(x3.shape), np.float32(eps)
    )
    return out


def add_rms_norm_cuda(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Numba CUDA fused residual add + RMSNorm: ``(rms_norm(x + residual), x + residual)``,
    the values of ``add_rms_norm_reference``, in one pass.

    Unlike the reference, the new residual is written IN PLACE into ``residual`` and that same
    tensor is returned (the model rebinds its residual to the returned tensor and never reads
    the old value again). The normalised output is a new contiguous tensor. x and residual:
    same shape and dtype, any strides; x must not overlap residual except exactly (x is
    residual is allowed: each element is read and written by one thread). A >3-D residual
    that cannot be viewed as rows is updated in a copy, which is what is returned.
    """
    _check_norm_args("add_rms_norm", x, weight)
    _launch.check_dtype("add_rms_norm", residual)
    _launch.check_device("add_rms_norm", x, residual)
    if residual.shape != x.shape:
        raise ValueError(
            f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )
    if residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual dtype {residual.dtype} != x dtype {x.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x3 = _as_rows3(x)
    r3 = _as_rows3(residual)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows == 0 or x3.shape[2] == 0:
        return out, residual
    kernel = _add_rms_norm_kernel(x.dtype)
    _launch.launch(
        kernel,
        num_rows,
        _row_threads(x3.shape[2]),
        x3,
        r3,
        weight,
        out.view(x3.shape),
        np.float32(eps),
    )
    if r3.data_ptr() != residual.data_ptr():
        return out, r3.view(residual.shape)  # the flatten had to copy
    return out, residual


def warm_up(dtype: torch.dtype, device: torch.device | str) -> None:
    """Compile (explicit signature) and launch once both norm kernels for ``dtype``, so that
    no later launch (e.g. one inside CUDA-graph capture) compiles or loads a module."""
    x = torch.ones(2, 32, dtype=dtype, device=device)
    w = torch.ones(32, dtype=dtype, device=device)
    rms_norm_cuda(x, w, 1e-6)
    add_rms_norm_cuda(x, x.clone(), w, 1e-6)
