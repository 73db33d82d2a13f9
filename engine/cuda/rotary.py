"""Rotary position embedding (rotate-half / NeoX layout, as HF Llama checkpoints use), fused
with the paged K/V cache write.

Torch references; the CUDA kernel (one launch: rotate q and k, write k and v into their pages)
lives beside them.
"""

from __future__ import annotations

import functools

import torch

from engine.cuda import _launch
from engine.cuda.cache_write import cache_write_reference


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KV, D], cos/sin: [T, D/2] (already in q's dtype) -> rotated q, k."""
    cos, sin = _full_tables(cos, sin)
    return _rotated(q, cos, sin), _rotated(k, cos, sin)


def rotary_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, N, D] rotated as ``rotary_reference`` rotates q and k."""
    cos, sin = _full_tables(cos.to(x.dtype), sin.to(x.dtype))
    return _rotated(x, cos, sin)


def _full_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D/2] tables -> [T, 1, D], both halves of a head."""
    return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((sin, sin), dim=-1).unsqueeze(1)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cache_write_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k, write rotated k and v into the pages at ``slot_mapping`` (negative
    slots are padding: not written); returns the rotated q [T, H, D]."""
    q, k = rotary_reference(q, k, cos, sin)
    cache_write_reference(k, v, k_pages, v_pages, slot_mapping)
    return q


# --------------------------------------------------------------------------------------------
# Numba CUDA kernel: rotary on q and k + paged K/V write, one launch.
#
# One block per token. Its threads stride over the token's rotation pairs (j, j + D/2) of all
# H query heads and KV key heads (each pair read and written by one thread, so rotating q in
# place is safe), then over the KV*D values of v. A token whose slot is negative (padding) or
# past the end of the pages still has its q rotated but writes nothing. Rounding follows the
# reference: to_dtype(to_dtype(x1*c) + to_dtype(-x2*s)), etc. (fp32 math, one rounding per
# torch op; for fp16 this is torch's result bit for bit).
#
# q, k, v, cos, sin and the output are read through their strides (layout "A"): the q/k/v
# views that ``split`` + ``reshape`` make of the fused qkv matmul output are used as they are,
# no copy. The pages and the slot mapping are typed C-contiguous (the cache allocates them so).
# --------------------------------------------------------------------------------------------

cuda = _launch.cuda
nbt = cuda.types
float32 = nbt.float32

_MAX_THREADS = 256


@functools.cache
def _rotary_cache_write_kernel(dtype: torch.dtype, slot_dtype: torch.dtype):
    io = _launch.NUMBA_DTYPES[dtype]
    heads = nbt.Array(io, 3, "A")
    table = nbt.Array(io, 2, "A")
    pages = nbt.Array(io, 4, "C")
    slots_t = nbt.Array(_launch.NUMBA_INDEX_DTYPES[slot_dtype], 1, "C")
    sig = nbt.void(heads, heads, heads, table, table, pages, pages, slots_t, heads)

    def rotary_cache_write_kernel(q, k, v, cos, sin, k_pages, v_pages, slot_mapping, q_out):
        t = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        num_heads = q.shape[1]
        num_kv_heads = k.shape[1]
        head_dim = q.shape[2]
        half = head_dim // 2
        page_size = k_pages.shape[1]
        slot = slot_mapping[t]
        write = slot >= 0 and slot < k_pages.shape[0] * page_size
        page = slot // page_size
        offset = slot - page * page_size
        for p in range(tid, (num_heads + num_kv_heads) * half, nt):
            h = p // half
            j = p - h * half
            c = float32(cos[t, j])
            s = float32(sin[t, j])
            if h < num_heads:
                x1 = float32(q[t, h, j])
                x2 = float32(q[t, h, j + half])
                q_out[t, h, j] = io(float32(io(x1 * c)) + float32(io(-x2 * s)))
                q_out[t, h, j + half] = io(float32(io(x2 * c)) + float32(io(x1 * s)))
            elif write:
                kh = h - num_heads
                x1 = float32(k[t, kh, j])
                x2 = float32(k[t, kh, j + half])
                k_pages[page, offset, kh, j] = io(float32(io(x1 * c)) + float32(io(-x2 * s)))
                k_pages[page, offset, kh, j + half] = io(float32(io(x2 * c)) + float32(io(x1 * s)))
        if write:
            for e in range(tid, num_kv_heads * head_dim, nt):
                kh = e // head_dim
                j = e - kh * head_dim
                v_pages[page, offset, kh, j] = v[t, kh, j]

    return cuda.jit(sig)(rotary_cache_write_kernel)


def _check_rotary_dtypes(tensors: dict[str, torch.Tensor]) -> None:
    name = "rotary_cache_write"
    q = tensors["q"]
    slot_mapping = tensors["slot_mapping"]
    _launch.check_dtype(name, *(t for label, t in tensors.items() if label != "slot_mapping"))
    want = "cpu" if _launch.SIMULATOR else "cuda"
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type != want:
        found = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"{name}: tensors must all be on one {want} device (found {found})")
    for label, t in tensors.items():
        if label not in ("q", "slot_mapping") and t.dtype != q.dtype:
            raise ValueError(f"{name}: {label} dtype {t.dtype} != q dtype {q.dtype}")
    if slot_mapping.dtype not in _launch.NUMBA_INDEX_DTYPES:
        raise ValueError(f"{name}: slot_mapping dtype {slot_mapping.dtype} is not int32/int64")


def _check_rotary_shapes(tensors: dict[str, torch.Tensor]) -> None:
    name = "rotary_cache_write"
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    cos, sin = tensors["cos"], tensors["sin"]
    k_pages, v_pages = tensors["k_pages"], tensors["v_pages"]
    slot_mapping = tensors["slot_mapping"]
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"{name}: q and k must be [T, heads, D] (got {tuple(q.shape)}, {tuple(k.shape)})"
        )
    num_tokens, _, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(
            f"{name}: k {tuple(k.shape)} does not match q {tuple(q.shape)} (same T and an even D)"
        )
    if v.shape != k.shape:
        raise ValueError(f"{name}: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    if cos.shape != (num_tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"{name}: cos/sin must be [T, D/2] = {(num_tokens, head_dim // 2)} (got "
            f"{tuple(cos.shape)}, {tuple(sin.shape)})"
        )
    if k_pages.dim() != 4 or tuple(k_pages.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(
            f"{name}: k_pages must be [P, S, {k.shape[1]}, {head_dim}] (got {tuple(k_pages.shape)})"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"{name}: v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}"
        )
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        # Typed C-contiguous (fewer live strides: no register spills); a copy would lose the
        # writes, so refuse rather than copy.
        raise ValueError(f"{name}: k_pages and v_pages must be contiguous")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"{name}: slot_mapping must be [T] = [{num_tokens}] (got {tuple(slot_mapping.shape)})"
        )


def rotary_cache_write_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Numba CUDA fused rotary + paged cache write; same contract as
    ``rotary_cache_write_reference`` (one launch).

    q: [T, H, D], k, v: [T, KV, D] (any strides: split views of the fused qkv output are read
    in place); cos, sin: [T, D/2] in q's dtype; k_pages, v_pages: [P, S, KV, D] in q's dtype;
    slot_mapping: [T] int32/int64, page * S + offset, negative = padding (q still rotated,
    nothing written). Slots >= P * S are skipped as well (the reference would raise; a kernel
    cannot without a host sync). Returns the rotated q in ``out`` (a new contiguous [T, H, D]
    by default; ``out=q`` rotates q in place).
    """
    tensors = {"q": q, "k": k, "v": v, "cos": cos, "sin": sin}
    tensors |= {"k_pages": k_pages, "v_pages": v_pages, "slot_mapping": slot_mapping}
    _check_rotary_dtypes(tensors)
    _check_rotary_shapes(tensors)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"rotary_cache_write: out must be {tuple(q.shape)} {q.dtype} on {q.device} (got "
            f"{tuple(out.shape)} {out.dtype} on {out.device})"
        )
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0 or num_heads == 0 or head_dim == 0:
        return out
    work = max((num_heads + k.shape[1]) * (head_dim // 2), k.shape[1] * head_dim)
    threads = 32
    while threads < work and threads < _MAX_THREADS:
        threads *= 2
    slot_mapping = slot_mapping.contiguous()  # typed C-contiguous; a no-op in the model
    kernel = _rotary_cache_write_kernel(q.dtype, slot_mapping.dtype)
    _launch.launch(
        kernel, num_tokens, threads, q, k, v, cos, sin, k_pages, v_pages, slot_mapping, out
    )
    return out


def warm_up(
    dtype: torch.dtype, device: torch.device | str, slot_dtype: torch.dtype = torch.int64
) -> None:
    """Compile (explicit signature) and launch the kernel once for ``dtype`` / ``slot_dtype``,
    so that no later launch (e.g. one inside CUDA-graph capture) compiles or loads a module."""
    q = torch.zeros(1, 1, 2, dtype=dtype, device=device)
    cs = torch.zeros(1, 1, dtype=dtype, device=device)
    pages = torch.zeros(1, 1, 1, 2, dtype=dtype, device=device)
    slots = torch.zeros(1, dtype=slot_dtype, device=device)
    rotary_cache_write_cuda(q, q, q, cs, cs, pages, pages.clone(), slots)
