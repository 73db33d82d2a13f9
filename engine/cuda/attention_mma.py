"""Decode attention on tensor cores (engine/cuda/mma.py): q4, q6, q8 and fp16 pages, one warp
per split.

The CUDA-core decode kernel (attention.py) issues about 180 instructions per key for q4 at the
8B shape: the same 64 FMAs per key as fp16 plus the unpack, so q4's quarter of the bytes never
shows as speed. Here each warp takes 16 keys at a time and one KV head's query heads (at most
8) as the MMA's 8 columns:

- 4-bit scores: S^T[key, head] = K (16 x 32, one quantization group) times q^T, one
  ``mma_u8s8`` (m16n8k32) per group. K's nibbles go in as unsigned bytes (w & 0x0F0F0F0F: no
  unpack beyond a mask), q as signed bytes, quantized once per warp with one scale per head
  (q's rounding, |q| / 254 per element, is small beside K's 4-bit step). The accumulator
  starts at -8 * sum(q) over the group, which turns the stored u = code + 8 into the code;
  each key's group scale multiplies the integer sum after.
- 8-bit scores (q8, q6): fp16 MMAs (m16n8k16) with q in fp16, each code byte an exact fp16
  by one mask-xor under 0x64 and one subtract; the group scale multiplies after, as above.
  (q rounded to bytes would add an error as large as the keys' own.)
- Output: O^T[dim, head] += V^T (16 dims x 16 keys) times P^T, one ``mma_f16`` per 16 dims:
  4-bit values become fp16 by the 0x6400 trick (1024 + u, exact) minus 1032, 8-bit ones as
  the keys above, times the key's scale (packed-half ops); P goes in as fp16, as
  FlashAttention's does.
- fp16 rows (fp16 pages, and a quantized cache's sink and recent pages) go through the same
  fp16 MMAs as they are (``exact_scores`` / ``exact_values``). A sequence holds those only in
  its first block and its last RECENT_BLOCKS (engine/cache/page_table.py), so a split reads
  them in tiles before and after its code tiles (``code_range``), which keep their load
  pipeline.
- The page layout is unchanged. Lanes map to the MMA's k index so that a lane's 8 K nibbles
  per key and group are one 32-bit word (engine/cache/quant.py: byte b of group g holds dims
  32 g + b and 32 g + 16 + b), and own V's dims as bytes gid * D / 16 ... of each row: one
  quantization group, so one scale per key and lane.
- Softmax online per head in log2 units, the accumulator rescaled only when a tile moved a
  column's maximum (a warp vote); split partials leave in attention.py's format and its merge
  kernel combines them.
- Rotated pages: q is rotated per group of 32 (a Walsh-Hadamard transform in registers, two
  of its five levels across lanes) and the output rotated back the same way.

Serves decode batches (one query token per sequence), with a sliding window or without,
head_dim 64, 128 or 256, at most 8 query heads per KV head, pages a multiple of 16 slots,
fp16 sink and recent pages or none (``supports``, ``supports_fp16``); attention.py's kernel
serves everything else.

On the H200 (8B shape, batch 32 x 4k, bench/results/attention_keys_per_step_h200_2026-11-27_
pipeline.json) q4 decode attention takes 0.092 ms against fp16's 0.207 on the CUDA-core kernel
(2.25x) and 0.156 here; the op set sends it the decode batches that ``routes_decode`` names
(by default the CUDA-graph runner's decode steps).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.batch import ForwardBatch
from engine.cache.page_table import RECENT_BLOCKS
from engine.cuda._launch import SIMULATOR, cuda, device_function, launch
from engine.cuda.bits import byte_perm
from engine.cuda.mma import (
    HALF2_1032,
    HALF2_1152,
    HALF2_MAGIC,
    hmul2,
    hsub2,
    mma_f16,
    mma_u8s8,
    pack_half2,
    warp_any,
    warp_shfl,
    warp_shfl_xor,
    warp_shfl_xor_all,
    wrap_i32,
)

float32 = cuda.float32
int32 = cuda.int32
uint32 = cuda.uint32
int64 = cuda.int64  # (loads widened: simulator scalars are numpy's, which wrap or refuse)
uint64 = cuda.uint64

# Which of the op set's decode batches that this kernel serves come here
# (quant_kernels.paged_attention_quant_cuda, attention.paged_attention_cuda), by
# ENGINE_TENSOR_CORE_DECODE: "graphs" (the default) the CUDA-graph runner's decode steps
# (``graph_steps``; also any batch a CUDA graph captures); "1" every one, the decode rows of
# eager mixed steps too; "0" none. (An eager mixed step of 32 decode rows at 4k context and a
# 2048-token prompt chunk, 8B shape, H200, took 28.2 instead of 18.2 ms with fp16 pages and
# 57.9 instead of 41.0 with q4 with every decode batch here, not yet understood, while its
# graph-captured decode forwards ran 9% (fp16) and 15% (q4) more tokens/s:
# bench/results/gpu_decode_h200_2026-11-27_kv_mma*.json.)
MODE = os.environ.get("ENGINE_TENSOR_CORE_DECODE", "graphs")
if MODE not in ("graphs", "1", "0"):
    raise ValueError(f"ENGINE_TENSOR_CORE_DECODE={MODE!r}: expected graphs, 1 or 0")


def routes_decode(q: torch.Tensor) -> bool:
    """Whether a decode batch of ``q`` that this kernel serves goes to it (``MODE``)."""
    return MODE == "1" or (MODE == "graphs" and _capturing(q))


def _capturing(q: torch.Tensor) -> bool:
    if getattr(_graph_work, "depth", 0):
        return True
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


_graph_work = threading.local()


@contextlib.contextmanager
def graph_steps() -> Iterator[None]:
    """Decode batches inside count as a CUDA graph's (``MODE`` "graphs"): the graph runner's
    steps that run eagerly, i.e. its run of each bucket before the capture, which compiles and
    loads every kernel the capture then only launches (a first launch inside a capture would
    fail it), and its buckets where capture is off or failed."""
    _graph_work.depth = getattr(_graph_work, "depth", 0) + 1
    try:
        yield
    finally:
        _graph_work.depth -= 1


GROUP = 32
TILE = 16  # keys per MMA step
MAX_HEADS = 8  # the MMA's columns
_WARPS = 1 if SIMULATOR else 4  # splits per block (the simulator's shuffles are block-wide)
_NEG = float32(-1e30)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_MIN_SPLIT_KEYS = 256
_MIN_CHUNK = 64  # keys a split takes at least (whole tiles)
_MAX_SPLITS = 64
_MIN_BLOCKS = 4  # launch bound of the sink-page and double-buffered kernels (registers <= 128)
# The code pages' load pipeline (``_decode_kernel``'s ``pipeline``). H200, 8B shape, batch 32 x
# 4k, 8 splits (bench/results/attention_keys_per_step_h200_2026-11-27_pipeline.json): q4 0.103
# ms at 0, 0.092 at 1, 0.108 at 2 (128 registers, 16 bytes spilled). q8 and q6 take 1 too (128
# and 125 registers, no spills: bench/kernel_sass.py), not yet timed against 0 (the sweep's
# modes q8-mma-pipe0 and q6-mma-pipe0).
_PIPELINE = 1
_BLOCKS_PER_SM = 4  # (untuned: bench/attention_keys_per_step.py times q4-mma at 4, 8, 16 too)


def supports(
    k_bits: int,
    v_bits: int,
    sink_dtype: torch.dtype | None,
    head_dim: int,
    group: int,
    page_size: int,
    max_query_len: int,
) -> bool:
    """Whether this kernel serves the batch (otherwise attention.py's does): q4, q6 or q8
    pages. ``sink_dtype``: the sink pages' dtype (None: no sink pages); it reads fp16 ones."""
    return (
        (k_bits, v_bits) in ((4, 4), (8, 4), (8, 8))  # q4, q6, q8
        and sink_dtype in (None, torch.float16)
        and head_dim in (64, 128, 256)
        and 1 <= group <= MAX_HEADS
        and page_size % TILE == 0
        and max_query_len == 1
    )


@functools.cache
def _decode_kernel(  # noqa: C901, PLR0915
    head_dim: int,
    page_size: int,
    group: int,
    kv_heads: int,
    rotate: bool,
    sinks: bool = False,
    fp16_pages: bool = False,
    k_bits: int = 4,
    v_bits: int = 4,
    pipeline: int = 0,
):
    """The decode kernel specialised on its shape and page formats: ``k_bits`` / ``v_bits``
    4 or 8 (quantized pages, ``rotate``: stored rotated), ``sinks``: fp16 sink (and recent)
    pages among them, ``fp16_pages``: unquantized fp16 pages (the bits then do not apply);
    ``pipeline`` (code pages; ``_PIPELINE``): 0, each tile's V loaded after its scores; 1, its
    K and V loads issued together and the page-table read one tile early; 2, the next tile's
    loads in flight while this one computes (double-buffered)."""
    D = head_dim
    NG = D // GROUP  # quantization groups per row
    NC = D // 16  # output MMA chunks (16 dims each)
    QN = 8 * NG  # q values per lane
    NA = 4 * NC  # accumulator values per lane
    W4 = D // 8  # 32-bit words per 4-bit row (K or V)
    WPL = D // 64  # V words per lane and key: bytes gid * D / 16 ... of the row, one group
    KS = 2 * NG  # a tile's K scales per lane: rows gid, gid + 8 per group
    KT = 2 * NC if k_bits == 8 else 2 * NG  # its K words per lane (fetch_k8 / fetch_k4)
    VT = 2 * NC if v_bits == 8 else 4 * WPL  # its V words per lane (fetch_v8 / fetch_v4)
    CROSS = {64: 2, 128: 1, 256: 0}[D]  # output index bits held across lanes (rotate_out)
    HQ = D // 4  # 64-bit words (four fp16) per fp16 row
    W8 = D // 4  # 32-bit words per 8-bit row
    SINKS = sinks
    TAIL_BLOCKS = RECENT_BLOCKS  # a sequence's last blocks that may be on recent pages
    FP16 = fp16_pages
    K8 = k_bits == 8  # 8-bit keys (q8, q6): fp16 MMAs with fp16 q, no byte rounding of q
    V8 = v_bits == 8  # 8-bit values (q8)
    PIPE = pipeline if not FP16 else 0
    DOUBLE_BUFFER = PIPE == 2
    BYTE_Q = not (FP16 or K8)  # q rounded to bytes for the int8 MMA over 4-bit keys
    HALF_Q = SINKS or FP16 or K8  # q as fp16 pairs (qh0 / qh1)
    PS = page_size
    KV = kv_heads
    G = group
    W = _WARPS
    NEG = _NEG
    MIN_CHUNK = _MIN_CHUNK
    INV_SQRT = float32(1.0 / math.sqrt(GROUP))
    LOG2E = float32(_LOG2E)
    LN2 = float32(_LN2)

    @device_function(inline=True)
    def butterfly(x, partner, upper):
        return partner - x if upper else x + partner

    @device_function
    def rotate_q(qv, t):
        """qv[g * 8 + i]: dim 32 g + 16 (i >> 2) + 4 t + (i & 3) of this lane's head; in place
        times H_32 / sqrt(32) per group (index bits 0-1 and 4 in the lane, 2-3 across it; the
        levels commute, so the lane's come first)."""
        for g in range(NG):
            b = g * 8
            for stride in (1, 2, 4):
                for i in range(8):
                    if i & stride == 0:
                        x, y = qv[b + i], qv[b + i + stride]
                        qv[b + i], qv[b + i + stride] = x + y, x - y
        partner = cuda.local.array(QN, float32)
        for bit in range(2):
            upper = (t >> bit) & 1
            warp_shfl_xor_all(qv, partner, QN, 1 << bit)
            for i in range(QN):
                qv[i] = butterfly(qv[i], partner[i], upper)
        for i in range(QN):
            qv[i] *= INV_SQRT

    @device_function
    def rotate_out(acc, gid):
        """acc[c * 4 + r]: dim index (gid * NC + c) % 16 + 16 (r >> 1) within its group (the
        lane's one group); rotated back: index bits 4 (r) and those of c in the lane, the
        ``CROSS`` bits above them across lanes 4, 8 apart."""
        for c in range(NC):
            for r in range(2):
                x, y = acc[c * 4 + r], acc[c * 4 + r + 2]
                acc[c * 4 + r], acc[c * 4 + r + 2] = x + y, x - y
        for stride in (1, 2, 4, 8):
            if stride < NC:
                for c in range(NC):
                    if c & stride == 0:
                        for r in range(4):
                            x, y = acc[c * 4 + r], acc[(c + stride) * 4 + r]
                            acc[c * 4 + r], acc[(c + stride) * 4 + r] = x + y, x - y
        partner = cuda.local.array(NA, float32)
        for bit in range(CROSS):
            upper = (gid >> bit) & 1
            warp_shfl_xor_all(acc, partner, NA, 4 << bit)
            for i in range(NA):
                acc[i] = butterfly(acc[i], partner[i], upper)
        for i in range(NA):
            acc[i] *= INV_SQRT

    @device_function
    def pack_bytes(qv, at, inv):
        """Four of qv from ``at`` rounded to signed bytes (|x * inv| <= 127); (word, sum)."""
        word = 0
        total = 0
        for i in range(4):
            v = int32(math.floor(qv[at + i] * inv + float32(0.5)))
            word |= (int64(v) & 255) << (8 * i)
            total += v
        return wrap_i32(word), total

    @device_function
    def v_operand(word, shift, scales):
        """Two keys' nibbles at ``shift`` of each 16-bit half, as codes times the keys' scales
        in one fp16 pair."""
        raw = ((word >> shift) & 0x000F000F) | HALF2_MAGIC
        return hmul2(hsub2(raw, HALF2_1032), scales)

    @device_function
    def lane_dim(gid):
        """d0, the first of this lane's output dims: chunk c's MMA rows gid / gid + 8 are dims
        d0 + c and d0 + 16 + c, all in group d0 // 32 (d0 % 4 == 0)."""
        return ((gid * NC) >> 4) * GROUP + ((gid * NC) & 15)

    @device_function
    def v_scale(v_scale_bits, row, group, live):
        """The fp16 bits of V's ``group`` scale of ``row``; 0 for a key out of range."""
        return int64(v_scale_bits[uint64(row * NG + group)]) & 0xFFFF if live else 0

    @device_function
    def scale_pairs(v_scale_bits, r0, live, gid):
        """The V scales of the lane's group for keys 2t, 2t+1 and 2t+8, 2t+9 (rows r0, r0 +
        KV, r0 + 8 KV, r0 + 9 KV) as two fp16 pairs; a key past the range gets scale 0: its
        page slot may hold anything."""
        group = lane_dim(gid) // GROUP
        r8 = r0 + 8 * KV
        sc0 = v_scale(v_scale_bits, r0, group, live[0])
        sc0 |= v_scale(v_scale_bits, r0 + KV, group, live[1]) << 16
        sc1 = v_scale(v_scale_bits, r8, group, live[2])
        sc1 |= v_scale(v_scale_bits, r8 + KV, group, live[3]) << 16
        return sc0, sc1

    @device_function
    def fetch_k4(k_words, k_scales, row_a, row_b, t, kw, ks):
        """This lane's 4-bit key words of rows row_a / row_b (its MMA rows), one per group
        (kw[2 g], kw[2 g + 1]), and the groups' scales (ks, same order)."""
        base_a = uint64(row_a * W4 + t)
        base_b = uint64(row_b * W4 + t)
        for g in range(NG):
            kw[2 * g] = k_words[base_a + uint64(4 * g)]
            kw[2 * g + 1] = k_words[base_b + uint64(4 * g)]
            ks[2 * g] = float32(k_scales[uint64(row_a * NG + g)])
            ks[2 * g + 1] = float32(k_scales[uint64(row_b * NG + g)])

    @device_function
    def code_scores(kw, ks, qb0, qb1, ci0, ci1):
        """Scores of the fetched keys (``fetch_k4``) against columns 2t, 2t + 1 from the 4-bit
        codes, before the per-column factor: one int8 MMA per group."""
        s0 = float32(0.0)  # (key gid, column 2t), (gid, 2t+1), (gid+8, 2t), (gid+8, 2t+1)
        s1 = float32(0.0)
        s2 = float32(0.0)
        s3 = float32(0.0)
        for g in range(NG):
            wa = int64(kw[2 * g])
            wb = int64(kw[2 * g + 1])
            d0, d1, d2, d3 = mma_u8s8(
                wa & 0x0F0F0F0F, wb & 0x0F0F0F0F, (wa >> 4) & 0x0F0F0F0F,
                (wb >> 4) & 0x0F0F0F0F, qb0[g], qb1[g], ci0[g], ci1[g], ci0[g], ci1[g],
            )  # fmt: skip
            s0 += ks[2 * g] * float32(d0)
            s1 += ks[2 * g] * float32(d1)
            s2 += ks[2 * g + 1] * float32(d2)
            s3 += ks[2 * g + 1] * float32(d3)
        return s0, s1, s2, s3

    @device_function
    def byte_codes(word):
        """Bytes 0 and 2 of ``word`` as signed 8-bit codes, an exact fp16 pair: (b ^ 0x80) under
        0x64 is 1152 + code."""
        return hsub2((word & 0x00FF00FF) ^ HALF2_1152, HALF2_1152)

    @device_function
    def fetch_k8(k_bytes, k_scales, row_a, row_b, t, kw, ks):
        """This lane's 8-bit key words of rows row_a / row_b: lane t's dims 16 c + 4 t ... of
        chunk c are one 32-bit word per row (kw[2 c], kw[2 c + 1]); the groups' scales as
        ``fetch_k4``'s."""
        base_a = uint64(row_a * W8 + t)
        base_b = uint64(row_b * W8 + t)
        for c in range(NC):
            kw[2 * c] = k_bytes[base_a + uint64(4 * c)]
            kw[2 * c + 1] = k_bytes[base_b + uint64(4 * c)]
        for g in range(NG):
            ks[2 * g] = float32(k_scales[uint64(row_a * NG + g)])
            ks[2 * g + 1] = float32(k_scales[uint64(row_b * NG + g)])

    @device_function
    def code_scores8(kw, ks, qh0, qh1):
        """``code_scores`` over fetched 8-bit keys (``fetch_k8``; fp16 q): the two chunks of a
        group share its scale."""
        s0 = float32(0.0)
        s1 = float32(0.0)
        s2 = float32(0.0)
        s3 = float32(0.0)
        for g in range(NG):
            e0 = float32(0.0)
            e1 = float32(0.0)
            e2 = float32(0.0)
            e3 = float32(0.0)
            for h in range(2):
                c = 2 * g + h
                wa = kw[2 * c]
                wb = kw[2 * c + 1]
                e0, e1, e2, e3 = mma_f16(
                    byte_codes(byte_perm(wa, 0, 0x4140)), byte_codes(byte_perm(wb, 0, 0x4140)),
                    byte_codes(byte_perm(wa, 0, 0x4342)), byte_codes(byte_perm(wb, 0, 0x4342)),
                    qh0[c], qh1[c], e0, e1, e2, e3,
                )  # fmt: skip
            s0 += ks[2 * g] * e0
            s1 += ks[2 * g] * e1
            s2 += ks[2 * g + 1] * e2
            s3 += ks[2 * g + 1] * e3
        return s0, s1, s2, s3

    @device_function
    def fetch_v8(v_bytes, v_scale_bits, r0, live, gid, vw, vs):
        """This lane's 8-bit value words of keys 2t, 2t+1, 2t+8, 2t+9 (rows r0, r0 + KV, r0 +
        8 KV, r0 + 9 KV): per j < NC / 4, the word of dims d0 + 4 j ... (vw[8 j ...]) and of
        dims d0 + 16 + 4 j ... (vw[8 j + 4 ...]) of each key; scales as ``fetch_v4``'s."""
        r1 = r0 + KV
        r8 = r0 + 8 * KV
        r9 = r8 + KV
        sc0, sc1 = scale_pairs(v_scale_bits, r0, live, gid)
        vs[0] = wrap_i32(sc0)
        vs[1] = wrap_i32(sc1)
        first = lane_dim(gid) // 4
        b0 = uint64(r0 * W8 + first)
        b1 = uint64(r1 * W8 + first)
        b8 = uint64(r8 * W8 + first)
        b9 = uint64(r9 * W8 + first)
        for j in range(NC // 4):
            for half in range(2):
                at = uint64(j + 4 * half)  # (dims + 16 for the second half)
                vw[8 * j + 4 * half] = v_bytes[b0 + at]
                vw[8 * j + 4 * half + 1] = v_bytes[b1 + at]
                vw[8 * j + 4 * half + 2] = v_bytes[b8 + at]
                vw[8 * j + 4 * half + 3] = v_bytes[b9 + at]

    @device_function
    def code_values8(acc, vw, vs, pb0, pb1):
        """``code_values`` over fetched 8-bit values (``fetch_v8``): chunk c's MMA rows gid /
        gid + 8 are bytes (dims) d0 + c and d0 + 16 + c of each key's row, one group, one
        scale per key."""
        sc0 = vs[0]
        sc1 = vs[1]
        for j in range(NC // 4):  # chunks 4j .. 4j + 3: one word per key for each MMA row
            w0, w1, w8, w9 = vw[8 * j], vw[8 * j + 1], vw[8 * j + 2], vw[8 * j + 3]
            u0, u1, u8, u9 = vw[8 * j + 4], vw[8 * j + 5], vw[8 * j + 6], vw[8 * j + 7]
            for i in range(4):
                c = 4 * j + i
                sel = i | ((4 + i) << 8)  # byte i of each key's word to bytes 0 and 2
                acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3] = mma_f16(
                    hmul2(byte_codes(byte_perm(w0, w1, sel)), sc0),
                    hmul2(byte_codes(byte_perm(u0, u1, sel)), sc0),
                    hmul2(byte_codes(byte_perm(w8, w9, sel)), sc1),
                    hmul2(byte_codes(byte_perm(u8, u9, sel)), sc1),
                    pb0, pb1, acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3],
                )  # fmt: skip

    @device_function
    def exact_scores(k_rows, row_a, row_b, qh0, qh1, t):
        """``code_scores`` from fp16 rows (fp16 pages, or a 4-bit cache's sink page): one fp16
        MMA per 16 dims, lane t giving dims 16 c + 4 t .. 4 t + 3 (as q's halves in qh0 /
        qh1)."""
        s0 = float32(0.0)
        s1 = float32(0.0)
        s2 = float32(0.0)
        s3 = float32(0.0)
        base_a = uint64(row_a * HQ + t)  # (64-bit words: dims 16 c + 4 t ... are one)
        base_b = uint64(row_b * HQ + t)
        for c in range(NC):
            wa = k_rows[base_a + uint64(4 * c)]
            wb = k_rows[base_b + uint64(4 * c)]
            s0, s1, s2, s3 = mma_f16(wa, wb, wa >> 32, wb >> 32, qh0[c], qh1[c], s0, s1, s2, s3)
        return s0, s1, s2, s3

    @device_function
    def fetch_v4(v_words, v_scale_bits, r0, live, gid, vw, vs):
        """This lane's WPL words of the 4-bit value rows of keys 2t, 2t+1, 2t+8, 2t+9 (rows
        r0, r0 + KV, r0 + 8 KV, r0 + 9 KV; vw[4 w ...], bytes gid * NC ... of each row: one
        group) and that group's scales as two fp16 pairs (vs; 0 for a key past the range)."""
        r1 = r0 + KV
        r8 = r0 + 8 * KV
        r9 = r8 + KV
        sc0, sc1 = scale_pairs(v_scale_bits, r0, live, gid)
        vs[0] = wrap_i32(sc0)
        vs[1] = wrap_i32(sc1)
        for w in range(WPL):
            at = gid * WPL + w
            vw[4 * w] = v_words[uint64(r0 * W4 + at)]
            vw[4 * w + 1] = v_words[uint64(r1 * W4 + at)]
            vw[4 * w + 2] = v_words[uint64(r8 * W4 + at)]
            vw[4 * w + 3] = v_words[uint64(r9 * W4 + at)]

    @device_function
    def code_values(acc, vw, vs, pb0, pb1):
        """acc += V^T P^T over keys 2t, 2t+1 (pair 0) and 2t+8, 2t+9 (pair 1) from the fetched
        codes (``fetch_v4``): chunk c is byte c of the lane's words, low nibble MMA row gid,
        high nibble row gid + 8, times the one scale of its group."""
        sc0 = vs[0]
        sc1 = vs[1]
        for w in range(WPL):
            k0 = vw[4 * w]
            k1 = vw[4 * w + 1]
            k8 = vw[4 * w + 2]
            k9 = vw[4 * w + 3]
            for half in range(2):  # bytes 2 half, 2 half + 1 of the words: chunks c, c + 1
                sel = 0x7632 if half else 0x5410
                x0 = byte_perm(k0, k1, sel)  # [k0 byte, k0 byte + 1, k1 byte, k1 byte + 1]
                x1 = byte_perm(k8, k9, sel)
                for step in range(2):
                    c = 4 * w + 2 * half + step
                    lo = 8 * step
                    acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3] = mma_f16(
                        v_operand(x0, lo, sc0), v_operand(x0, lo + 4, sc0),
                        v_operand(x1, lo, sc1), v_operand(x1, lo + 4, sc1), pb0, pb1,
                        acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3],
                    )  # fmt: skip

    @device_function
    def row_word(v_rows, base, at, live):
        return v_rows[base + uint64(at)] if live else int64(0)  # (unwritten: any bits)

    @device_function
    def exact_values(acc, v_rows, r0, live, pb0, pb1, gid):
        """``code_values`` from fp16 rows: chunk c's MMA rows gid / gid + 8 are dims d0 + c and
        d0 + 16 + c, each key pair's halves paired by a byte permute."""
        r1 = r0 + KV
        r8 = r0 + 8 * KV
        r9 = r8 + KV
        first = lane_dim(gid) // 4
        r0 = uint64(r0 * HQ + first)  # (from here: the keys' first words)
        r1 = uint64(r1 * HQ + first)
        r8 = uint64(r8 * HQ + first)
        r9 = uint64(r9 * HQ + first)
        for j in range(NC // 4):  # chunks 4j .. 4j + 3: one 64-bit word per key and row
            lo = j
            hi = j + 4  # dims + 16
            w0, w1 = row_word(v_rows, r0, lo, live[0]), row_word(v_rows, r1, lo, live[1])
            w8, w9 = row_word(v_rows, r8, lo, live[2]), row_word(v_rows, r9, lo, live[3])
            u0, u1 = row_word(v_rows, r0, hi, live[0]), row_word(v_rows, r1, hi, live[1])
            u8, u9 = row_word(v_rows, r8, hi, live[2]), row_word(v_rows, r9, hi, live[3])
            for sub in range(2):
                at = 32 * sub  # (byte_perm takes the low 32 bits)
                for step in range(2):
                    c = 4 * j + 2 * sub + step
                    sel = 0x7632 if step else 0x5410
                    acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3] = mma_f16(
                        byte_perm(w0 >> at, w1 >> at, sel), byte_perm(u0 >> at, u1 >> at, sel),
                        byte_perm(w8 >> at, w9 >> at, sel), byte_perm(u8 >> at, u9 >> at, sel),
                        pb0, pb1, acc[c * 4], acc[c * 4 + 1], acc[c * 4 + 2], acc[c * 4 + 3],
                    )  # fmt: skip

    # resident blocks per SM: the sink variants' registers capped at 128 for 4 blocks (no
    # spills for q4, q6, q8 at the 8B shape with the default pipeline, bench/kernel_sass.py,
    # 2026-11-28); without sinks ptxas takes 96 uncapped at pipeline 0 (5 blocks), and 116
    # with the same cap, for a longer loop
    # (registers <= 128: 4 blocks per SM; the sink pages' and the double buffer's would exceed)
    bounded = (sinks or DOUBLE_BUFFER) and not SIMULATOR
    options = {"launch_bounds": (W * 32, _MIN_BLOCKS)} if bounded else {}
    # (fp16 pages: registers not yet looked at)

    @device_function
    def tile_live(rel, t, span):
        """Whether keys 2t, 2t+1, 2t+8, 2t+9 of the tile at ``rel`` keys past the first live
        one are live (0 <= key - first < span: one unsigned test each)."""
        k0 = rel + 2 * t
        return (uint32(k0) < span, uint32(k0 + 1) < span, uint32(k0 + 8) < span,
                uint32(k0 + 9) < span)  # fmt: skip

    @device_function
    def fetch_tile(k_words, k_scales, v_words, v_scale_bits, j0, page, kv, gid, t, first,
                   span, kw, ks, vw, vs):  # fmt: skip
        """All of this lane's loads of the code tile of keys j0 .. j0 + 15 (on ``page``)."""
        base = (page * PS + j0 % PS) * KV + kv
        row_a = base + gid * KV
        if K8:
            fetch_k8(k_words, k_scales, row_a, row_a + 8 * KV, t, kw, ks)
        else:
            fetch_k4(k_words, k_scales, row_a, row_a + 8 * KV, t, kw, ks)
        live = tile_live(j0 - first, t, span)
        if V8:
            fetch_v8(v_words, v_scale_bits, base + (2 * t) * KV, live, gid, vw, vs)
        else:
            fetch_v4(v_words, v_scale_bits, base + (2 * t) * KV, live, gid, vw, vs)

    @device_function
    def online_softmax(acc, s0, s1, s2, s3, rel, gid, span, m0, m1, l0, l1, src_a, src_b, odd):
        """One tile's scores (log2 units; keys gid and gid + 8 of the tile ``rel`` keys past
        the first live one, dead ones masked here: key j is live when 0 <= j - first < span,
        one unsigned test) into the running maxima m and sums l of columns 2t, 2t + 1, the
        accumulator rescaled where a maximum moved; returns them and P^T as the PV product's
        B operand (column gid, keys 2t, 2t+1 | 2t+8, 2t+9)."""
        live_a = uint32(rel + gid) < span
        live_b = uint32(rel + gid + 8) < span
        s0 = s0 if live_a else NEG
        s1 = s1 if live_a else NEG
        s2 = s2 if live_b else NEG
        s3 = s3 if live_b else NEG
        top0 = max(s0, s2)
        top1 = max(s1, s3)
        for off in (4, 8, 16):
            top0 = max(top0, warp_shfl_xor(top0, off))
            top1 = max(top1, warp_shfl_xor(top1, off))
        # every tile holds a live key (the first tile holds ``first``), so the tile's maximum
        # is a real score
        new0 = max(m0, top0)
        new1 = max(m1, top1)
        alpha0 = math.exp2(m0 - new0)
        alpha1 = math.exp2(m1 - new1)
        p0 = math.exp2(s0 - new0)
        p1 = math.exp2(s1 - new1)
        p2 = math.exp2(s2 - new0)
        p3 = math.exp2(s3 - new1)
        l0 = l0 * alpha0 + p0 + p2
        l1 = l1 * alpha1 + p1 + p3
        # once the running maxima settle, no column moves: skip the accumulator's rescale
        if warp_any(alpha0 != float32(1.0) or alpha1 != float32(1.0)):
            for c in range(NC):
                acc[c * 4] *= alpha0
                acc[c * 4 + 1] *= alpha1
                acc[c * 4 + 2] *= alpha0
                acc[c * 4 + 3] *= alpha1
        even_col = pack_half2(p0, p2)
        odd_col = pack_half2(p1, p3)
        xe = warp_shfl(even_col, src_a)
        xo = warp_shfl(odd_col, src_a)
        ye = warp_shfl(even_col, src_b)
        yo = warp_shfl(odd_col, src_b)
        x = xo if odd else xe
        y = yo if odd else ye
        return new0, new1, l0, l1, byte_perm(x, y, 0x5410), byte_perm(x, y, 0x7632)

    @device_function
    def exact_tiles(acc, k_rows, v_rows, block_tables, seq, j0, end, kv, gid, t, first, span,
                    qh0, qh1, m0, m1, l0, l1, src_a, src_b, odd, mult):  # fmt: skip
        """The tiles of keys j0 .. end - 1 (j0 a tile boundary) on unquantized pages (fp16
        pages, or a quantized cache's sink and recent pages: their fp16 rows) into acc and
        the softmax state, which it returns."""
        while j0 < end:
            page = block_tables[seq, j0 // PS]
            base = (page * PS + j0 % PS) * KV + kv  # row of key j0; key j0 + x: + x * KV
            row_a = base + gid * KV
            s0, s1, s2, s3 = exact_scores(k_rows, row_a, row_a + 8 * KV, qh0, qh1, t)
            rel = j0 - first
            m0, m1, l0, l1, pb0, pb1 = online_softmax(
                acc, s0 * mult, s1 * mult, s2 * mult, s3 * mult, rel, gid, span, m0, m1, l0,
                l1, src_a, src_b, odd,
            )  # fmt: skip
            live = tile_live(rel, t, span)
            exact_values(acc, v_rows, base + (2 * t) * KV, live, pb0, pb1, gid)
            j0 += TILE
        return m0, m1, l0, l1

    @device_function
    def code_range(block_tables, seq, lo, hi, num_sink_pages):
        """The keys [main_lo, main_hi) of the split [lo, hi) on code pages: a sequence's
        unquantized pages (engine/cache/page_table.py) are its first block when that is a sink
        page (or, in a cache without sink pages, a recent one) and up to TAIL_BLOCKS last
        blocks on recent pages after it, so the split
        reads [lo, main_lo) and [main_hi, hi) from rows and the rest through codes, pipelined.
        (Block boundaries are tile boundaries: pages hold a multiple of 16 slots.)"""
        main_lo = lo
        main_hi = hi
        if lo < hi and lo < PS and block_tables[seq, 0] < num_sink_pages:
            main_lo = min(hi, PS)
        blk = (hi - 1) // PS
        for _ in range(TAIL_BLOCKS):
            if hi <= main_lo or blk < 1 or (blk + 1) * PS <= main_lo:
                break
            page = block_tables[seq, blk]
            if page < 0 or page >= num_sink_pages:
                break
            main_hi = max(main_lo, blk * PS)
            blk -= 1
        return main_lo, main_hi

    @cuda.jit(fastmath=True, **options)
    def decode(  # noqa: C901, PLR0915
        q, k_words, v_words, k_scales, v_scale_bits, out, part_ml, part_o, block_tables,
        seq_lens, scale, num_splits, k_rows, v_rows, num_sink_pages, window,
    ):  # fmt: skip
        seq = cuda.blockIdx.x
        kv = cuda.blockIdx.y
        lane = cuda.threadIdx.x & 31
        split = cuda.blockIdx.z * W + (cuda.threadIdx.x >> 5)
        if split >= num_splits:
            return
        gid = lane >> 2
        t = lane & 3
        n_ctx = seq_lens[seq]
        # keys [first, n_ctx) count (a sliding window of ``window`` keys; 0: none); tiles start
        # at multiples of 16, so the first may hold keys below ``first`` (masked)
        first = max(0, n_ctx - window) if window > 0 else 0
        start = first // TILE * TILE
        # an even share of those keys in whole tiles, at least MIN_CHUNK (a CUDA graph plans
        # the split count for the longest context; short ones fill fewer splits)
        chunk = max((-(-(n_ctx - start) // num_splits) + TILE - 1) // TILE * TILE, MIN_CHUNK)
        lo = start + split * chunk
        hi = min(lo + chunk, n_ctx)
        span = uint32(max(hi - first, 0))  # (live keys: first .. hi - 1)

        # this lane's head (column gid) and dims of q, rotated; as signed bytes for 4-bit keys,
        # as fp16 pairs for 8-bit keys and fp16 rows
        qv = cuda.local.array(QN, float32)
        head = kv * G + gid
        for g in range(NG):
            for i in range(8):
                d = g * GROUP + (i >> 2) * 16 + 4 * t + (i & 3)
                qv[g * 8 + i] = float32(q[seq, head, d]) if gid < G else float32(0.0)
        if rotate:
            rotate_q(qv, t)
        qb0 = cuda.local.array(NG, int32)
        qb1 = cuda.local.array(NG, int32)
        ci0 = cuda.local.array(NG, int32)  # accumulator start, column 2t: -8 * sum(q) of group
        ci1 = cuda.local.array(NG, int32)  # column 2t + 1
        mult0 = float32(0.0)
        mult1 = float32(0.0)
        if BYTE_Q:  # (8-bit keys and fp16 pages take q in fp16)
            amax = float32(0.0)
            for i in range(QN):
                amax = max(amax, abs(qv[i]))
            amax = max(amax, warp_shfl_xor(amax, 1))
            amax = max(amax, warp_shfl_xor(amax, 2))
            inv = float32(127.0) / amax if amax > 0.0 else float32(0.0)
            q_scale = amax / float32(127.0)
            for g in range(NG):
                qb0[g], s0 = pack_bytes(qv, g * 8, inv)
                qb1[g], s1 = pack_bytes(qv, g * 8 + 4, inv)
                total = int32(s0 + s1)
                total += warp_shfl_xor(total, 1)
                total += warp_shfl_xor(total, 2)
                ci0[g] = -8 * warp_shfl(total, (2 * t) * 4)
                ci1[g] = -8 * warp_shfl(total, (2 * t + 1) * 4)
            mult0 = warp_shfl(q_scale, (2 * t) * 4) * scale * LOG2E
            mult1 = warp_shfl(q_scale, (2 * t + 1) * 4) * scale * LOG2E
        exact_mult = scale * LOG2E  # exact tiles: fp16 q, no byte scale
        qh0 = cuda.local.array(NC, int32)  # q's halves for exact tiles' fp16 MMA (B operand)
        qh1 = cuda.local.array(NC, int32)
        if HALF_Q:
            for c in range(NC):
                at = (c >> 1) * 8 + (c & 1) * 4  # dims 16 c + 4 t ... in qv
                qh0[c] = pack_half2(qv[at], qv[at + 1])
                qh1[c] = pack_half2(qv[at + 2], qv[at + 3])

        acc = cuda.local.array(NA, float32)
        for i in range(NA):
            acc[i] = float32(0.0)
        m0 = NEG  # running maxima of columns 2t, 2t + 1 (log2 units)
        m1 = NEG
        l0 = float32(0.0)  # this lane's share of the sums
        l1 = float32(0.0)
        src_a = (2 * t) * 4 + (gid >> 1)  # lanes holding P for keys 2t (+8) and 2t+1 (+9)
        src_b = (2 * t + 1) * 4 + (gid >> 1)
        odd = gid & 1
        kw = cuda.local.array(KT, int32)  # a code tile's K / V (fetch_k4 / fetch_k8 ...)
        ks = cuda.local.array(KS, float32)
        vw = cuda.local.array(VT, int32)
        vs = cuda.local.array(2, int32)
        main_lo = lo  # the split's keys on code pages (or fp16 pages): [main_lo, main_hi)
        main_hi = hi
        if SINKS:  # the first block's keys when it is a sink page, exactly
            main_lo, main_hi = code_range(block_tables, seq, lo, hi, num_sink_pages)
            m0, m1, l0, l1 = exact_tiles(
                acc, k_rows, v_rows, block_tables, seq, lo, main_lo, kv, gid, t, first, span,
                qh0, qh1, m0, m1, l0, l1, src_a, src_b, odd, exact_mult,
            )  # fmt: skip
        if FP16:  # fp16 pages: every tile from its rows (the code loops below then skip)
            m0, m1, l0, l1 = exact_tiles(
                acc, k_rows, v_rows, block_tables, seq, lo, hi, kv, gid, t, first, span, qh0,
                qh1, m0, m1, l0, l1, src_a, src_b, odd, exact_mult,
            )  # fmt: skip
        j0 = hi if FP16 else main_lo
        if PIPE:  # code pages: a tile's K and V loads together, ahead of use
            nkw = cuda.local.array(KT, int32)  # the next tile, in flight (pipeline 2)
            nks = cuda.local.array(KS, float32)
            nvw = cuda.local.array(VT, int32)
            nvs = cuda.local.array(2, int32)
            # the page of the next tile to fetch, read one fetch early: a fetch never waits on
            # its page-table read
            page_next = block_tables[seq, main_lo // PS] if main_lo < main_hi else 0
            if DOUBLE_BUFFER and main_lo < main_hi:
                fetch_tile(k_words, k_scales, v_words, v_scale_bits, main_lo, page_next, kv,
                           gid, t, first, span, kw, ks, vw, vs)  # fmt: skip
                page_next = (block_tables[seq, (main_lo + TILE) // PS]
                             if main_lo + TILE < main_hi else 0)  # fmt: skip
            while j0 < main_hi:
                ahead = j0 + TILE if DOUBLE_BUFFER else j0  # the tile fetched now
                if ahead < main_hi:
                    page = page_next
                    if ahead + TILE < main_hi:
                        page_next = block_tables[seq, (ahead + TILE) // PS]
                    if DOUBLE_BUFFER:
                        fetch_tile(k_words, k_scales, v_words, v_scale_bits, ahead, page, kv,
                                   gid, t, first, span, nkw, nks, nvw, nvs)  # fmt: skip
                    else:
                        fetch_tile(k_words, k_scales, v_words, v_scale_bits, ahead, page, kv,
                                   gid, t, first, span, kw, ks, vw, vs)  # fmt: skip
                if K8:
                    s0, s1, s2, s3 = code_scores8(kw, ks, qh0, qh1)
                    f0 = exact_mult
                    f1 = exact_mult
                else:
                    s0, s1, s2, s3 = code_scores(kw, ks, qb0, qb1, ci0, ci1)
                    f0 = mult0
                    f1 = mult1
                m0, m1, l0, l1, pb0, pb1 = online_softmax(
                    acc, s0 * f0, s1 * f1, s2 * f0, s3 * f1, j0 - first, gid, span, m0, m1, l0,
                    l1, src_a, src_b, odd,
                )  # fmt: skip
                if V8:
                    code_values8(acc, vw, vs, pb0, pb1)
                else:
                    code_values(acc, vw, vs, pb0, pb1)
                if DOUBLE_BUFFER:
                    for i in range(KT):
                        kw[i] = nkw[i]
                    for i in range(KS):
                        ks[i] = nks[i]
                    for i in range(VT):
                        vw[i] = nvw[i]
                    vs[0] = nvs[0]
                    vs[1] = nvs[1]
                j0 += TILE
        while j0 < main_hi:  # (code pages when PIPE is 0)
            page = block_tables[seq, j0 // PS]
            base = (page * PS + j0 % PS) * KV + kv  # row of key j0; key j0 + x: + x * KV
            row_a = base + gid * KV
            row_b = row_a + 8 * KV
            if K8:
                fetch_k8(k_words, k_scales, row_a, row_b, t, kw, ks)
                s0, s1, s2, s3 = code_scores8(kw, ks, qh0, qh1)
                f0 = exact_mult
                f1 = exact_mult
            else:
                fetch_k4(k_words, k_scales, row_a, row_b, t, kw, ks)
                s0, s1, s2, s3 = code_scores(kw, ks, qb0, qb1, ci0, ci1)
                f0 = mult0
                f1 = mult1
            rel = j0 - first
            m0, m1, l0, l1, pb0, pb1 = online_softmax(
                acc, s0 * f0, s1 * f1, s2 * f0, s3 * f1, rel, gid, span, m0, m1, l0, l1, src_a,
                src_b, odd,
            )  # fmt: skip
            r0 = base + (2 * t) * KV  # key 2t's row
            live = tile_live(rel, t, span)
            if V8:
                fetch_v8(v_words, v_scale_bits, r0, live, gid, vw, vs)
                code_values8(acc, vw, vs, pb0, pb1)
            else:
                fetch_v4(v_words, v_scale_bits, r0, live, gid, vw, vs)
                code_values(acc, vw, vs, pb0, pb1)
            j0 += TILE
        if SINKS:  # the last blocks' keys on recent pages, exactly
            m0, m1, l0, l1 = exact_tiles(
                acc, k_rows, v_rows, block_tables, seq, main_hi, hi, kv, gid, t, first, span,
                qh0, qh1, m0, m1, l0, l1, src_a, src_b, odd, exact_mult,
            )  # fmt: skip

        for off in (4, 8, 16):
            l0 += warp_shfl_xor(l0, off)
            l1 += warp_shfl_xor(l1, off)
        if rotate:
            rotate_out(acc, gid)
        cols_live = 2 * t < G
        for r in range(4):
            col = 2 * t + (r & 1)
            if col < G:
                h = kv * G + col
                total = l1 if r & 1 else l0
                # (a CUDA graph's padding rows have no keys: zeros, as attention.py gives)
                inv_total = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                for c in range(NC):
                    d = lane_dim(gid) + c + 16 * (r >> 1)
                    if num_splits == 1:
                        out[seq, h, d] = acc[c * 4 + r] * inv_total
                    else:
                        part_o[split, seq, h, d] = acc[c * 4 + r]
        if num_splits > 1 and gid == 0 and cols_live:
            h = kv * G + 2 * t
            part_ml[split, seq, h, 0] = m0 * LN2
            part_ml[split, seq, h, 1] = l0
            if 2 * t + 1 < G:
                part_ml[split, seq, h + 1, 0] = m1 * LN2
                part_ml[split, seq, h + 1, 1] = l1

    return decode


def round_q_bytes(q: torch.Tensor, rotate: bool) -> torch.Tensor:
    """q [..., H, D] rounded to signed bytes per head as the kernel rounds it for 4-bit keys
    (in the rotated basis when ``rotate``: one step of max|q| / 127 per head), returned in
    q's own basis and dtype: a torch model of that rounding (tests, bench/kv_quant_quality.py).
    """
    from engine.cache.quant import rotate_groups

    x = rotate_groups(q) if rotate else q.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    step = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    rounded = torch.floor(x / step + 0.5) * step
    return (rotate_groups(rounded) if rotate else rounded).to(q.dtype)


def _auto_splits(num_seqs: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Splits per (sequence, KV head): enough warps for ``_BLOCKS_PER_SM`` blocks per SM, a
    multiple of the block's warps (a block's idle warps return at once), each split at least
    ``_MIN_SPLIT_KEYS`` keys of the longest context."""
    if SIMULATOR:
        return 1
    from engine.cuda.attention import num_sms  # (cached per device)

    return split_count(num_seqs * kv_heads, max_len, num_sms(device))


def split_count(items: int, max_len: int, sms: int) -> int:
    """``_auto_splits`` for ``items`` (sequence, KV head) pairs on ``sms`` SMs."""
    want = -(-_BLOCKS_PER_SM * _WARPS * sms // items)
    cap = max(1, min(max_len // _MIN_SPLIT_KEYS, _MAX_SPLITS))
    splits = min(want, cap)
    if splits > _WARPS:
        splits = splits // _WARPS * _WARPS
    return max(1, splits)


def decode_attention_mma(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    rotate: bool,
    k_bits: int = 4,
    v_bits: int = 4,
    k_sinks: torch.Tensor | None = None,
    v_sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over quantized pages; returns a new
    [T, H, D].

    q [T, H, D] (row i is sequence i's token); k_pages / v_pages in engine/cache/quant.py's
    layout for ``k_bits`` / ``v_bits`` (4: uint8 [P, S, KV, D / 2]; 8: int8 [P, S, KV, D]),
    k_scales / v_scales float16 [P, S, KV, D / 32], stored rotated when ``rotate``;
    k_sinks / v_sinks: the sink pages' fp16 rows [R, S, KV, D] (pages 0..R-1 are read from
    there; QuantPages.sinks); ``sliding_window``: each query sees its last that many keys.
    ``num_splits`` forces the split count (tests, benchmarks).
    """
    sink_dtype = None if k_sinks is None else k_sinks.dtype
    _check(q, k_pages.shape[2], batch, supports(k_bits, v_bits, sink_dtype, q.shape[2],
           q.shape[1] // k_pages.shape[2], batch.page_size, batch.max_query_len),
           f"{k_bits}/{v_bits}-bit pages, sink pages {sink_dtype}")  # fmt: skip
    sinks = k_sinks is not None
    if sinks:
        rows = tuple(x.view(torch.int64).reshape(-1) for x in (k_sinks, v_sinks))
    else:  # (never read)
        rows = (_dummy(torch.int64, q.device),) * 2
    kernel = _decode_kernel(q.shape[2], batch.page_size, q.shape[1] // k_pages.shape[2],
                            k_pages.shape[2], rotate, sinks, False, k_bits, v_bits,
                            _PIPELINE)  # fmt: skip
    codes = (
        k_pages.view(torch.int32).reshape(-1),
        v_pages.view(torch.int32).reshape(-1),
        k_scales.reshape(-1),
        v_scales.view(torch.int16).reshape(-1),
    )
    pages = _Pages(k_pages.shape[2], codes, rows, k_sinks.shape[0] if sinks else 0)
    return _launch_decode(kernel, q, batch, scale, pages, sliding_window, num_splits)


def supports_fp16(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    page_size: int,
    max_query_len: int,
) -> bool:
    """Whether ``decode_attention_mma_fp16`` serves the batch: fp16 pages, otherwise as
    ``supports``."""
    return dtype == torch.float16 and supports(4, 4, None, head_dim, group, page_size,
                                               max_query_len)  # fmt: skip


def decode_attention_mma_fp16(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    *,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``decode_attention_mma`` over unquantized fp16 pages [P, S, KV, D]: every tile through
    the fp16 MMAs a 4-bit cache's sink pages take (q in fp16, no byte rounding)."""
    kv_heads = k_pages.shape[2]
    _check(q, kv_heads, batch, supports_fp16(k_pages.dtype, q.shape[2],
           q.shape[1] // kv_heads, batch.page_size, batch.max_query_len),
           f"{k_pages.dtype} pages")  # fmt: skip
    kernel = _decode_kernel(q.shape[2], batch.page_size, q.shape[1] // kv_heads, kv_heads,
                            False, False, True)  # fmt: skip
    device = q.device
    codes = (_dummy(torch.int32, device), _dummy(torch.int32, device),
             _dummy(torch.float16, device), _dummy(torch.int16, device))  # fmt: skip
    rows = tuple(x.view(torch.int64).reshape(-1) for x in (k_pages, v_pages))
    pages = _Pages(kv_heads, codes, rows, 0)
    return _launch_decode(kernel, q, batch, scale, pages, sliding_window, num_splits)


@functools.cache
def _dummy(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element stand-in for an array the kernel variant never reads (made once: a fill
    per layer and step would be a launch each)."""
    return torch.zeros(1, dtype=dtype, device=device)


def _check(q: torch.Tensor, kv_heads: int, batch: ForwardBatch, supported: bool, what: str):
    tokens, heads, head_dim = q.shape
    if not supported:
        raise ValueError(
            f"decode_attention_mma: head_dim {head_dim}, {heads // kv_heads} query heads per "
            f"KV head, page size {batch.page_size}, longest query {batch.max_query_len}, "
            f"{what} is not a decode batch this kernel serves"
        )
    if tokens != batch.num_seqs:
        raise ValueError(
            f"decode_attention_mma: {tokens} query rows for {batch.num_seqs} sequences"
        )


@dataclass(frozen=True, slots=True)
class _Pages:
    """What one decode launch reads: the code arrays (K words, V words, K scales, V scale
    bits; dummies for fp16 pages) and the fp16 rows (sink pages, or fp16 pages; dummies
    without), as the kernel indexes them flat."""

    kv_heads: int
    codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    rows: tuple[torch.Tensor, torch.Tensor]
    num_sink_pages: int


def _launch_decode(kernel, q, batch, scale, pages: _Pages, sliding_window, num_splits):
    """The decode launch (+ the merge of its splits); returns a new [T, H, D]."""
    from engine.cuda.attention import merge_splits

    tokens, heads, head_dim = q.shape
    span = min(batch.max_seq_len, sliding_window or batch.max_seq_len)
    splits = num_splits or _auto_splits(tokens, pages.kv_heads, span, q.device)
    out = torch.empty_like(q)
    parts = (splits, tokens, heads) if splits > 1 else (1, 1, 1)  # (dummies when unsplit)
    part_ml = torch.empty((*parts, 2), dtype=torch.float32, device=q.device)
    part_o = torch.empty((*parts, head_dim if splits > 1 else 1), dtype=torch.float32,
                         device=q.device)  # fmt: skip
    if SIMULATOR and not q.is_contiguous():
        q = q.contiguous()
    launch(kernel, (tokens, pages.kv_heads, -(-splits // _WARPS)), _WARPS * 32, q,
           *pages.codes, out, part_ml, part_o, batch.block_tables, batch.seq_lens,
           np.float32(scale), splits, *pages.rows, pages.num_sink_pages,
           sliding_window or 0)  # fmt: skip
    if splits > 1:
        merge_splits(part_ml, part_o, out, splits)
    return out
