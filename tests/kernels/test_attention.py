"""paged_attention_cuda against the torch reference.

Without a GPU the kernels run in the Numba CUDA simulator (see tests/conftest.py), which runs
one Python thread per CUDA thread: shapes stay tiny (head_dim 16/32, page size 4, contexts of
a few pages). On a GPU the same tests run on CUDA tensors, plus the ``gpu`` tests at real sizes.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.cuda import _launch, attention
from engine.cuda.attention import paged_attention_cuda, paged_attention_reference
from tests.kernels.common import (
    DEVICE,
    TOL,
    emulate_warp_shuffles,
    run_without_simulator_in_parts,
)


def make_case(specs, heads, kv_heads, head_dim, dtype, page_size=4, seed=0, device=DEVICE):
    """specs: [(num_cached, num_new)] per sequence. Pages are a shuffled subset of a larger
    pool whose other pages hold random values, so reading a wrong page shows up."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // page_size) for c, n in specs]
    pool = sum(needed) + 5
    ids = torch.randperm(pool, generator=gen).tolist()
    seqs = []
    for (cached, new), n_pages in zip(specs, needed, strict=True):
        pages, ids = ids[:n_pages], ids[n_pages:]
        seqs.append(SequenceInput(token_ids=[1] * new, num_cached=cached, pages=pages))
    batch = build_forward_batch(seqs, page_size, device)
    shape = (pool, page_size, kv_heads, head_dim)
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), batch


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check(specs, heads, kv_heads, head_dim, dtype, window=None, num_splits=None, **kw):
    q, k, v, batch = make_case(specs, heads, kv_heads, head_dim, dtype, **kw)
    scale = head_dim**-0.5
    out = paged_attention_cuda(q, k, v, batch, scale, window, num_splits=num_splits)
    # The spec in fp32 math: the reference on fp32 copies of the same values.
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, scale, window)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = rel_error(out, ref)
    assert err <= TOL[dtype], f"max rel error {err:.2e} > {TOL[dtype]:.0e}"
    return q, k, v, batch, out


# --- decode-only batches (one new token per sequence) --------------------------------------


def test_decode_mha_page_boundaries_fp32():
    # contexts 1 (one slot), 4 (exactly one page), 9 (into the third page)
    check([(0, 1), (3, 1), (8, 1)], heads=2, kv_heads=2, head_dim=16, dtype=torch.float32)


def test_decode_gqa4_fp32():
    check([(6, 1), (12, 1)], heads=4, kv_heads=1, head_dim=32, dtype=torch.float32)


def test_decode_gqa8_fp16():
    check([(4, 1), (16, 1)], heads=8, kv_heads=1, head_dim=16, dtype=torch.float16)


def test_decode_gqa2_sliding_window_fp16():
    check(
        [(2, 1), (13, 1)], heads=4, kv_heads=2, head_dim=16, dtype=torch.float16, window=3, seed=1
    )


def test_decode_splits_fp32():
    # 3 splits of the key range, partials merged by the second kernel; a 2-token context
    # leaves some splits empty.
    _, _, _, batch, _ = check(
        [(10, 1), (18, 1), (1, 1)],
        heads=4,
        kv_heads=1,
        head_dim=16,
        dtype=torch.float32,
        num_splits=3,
        seed=2,
    )
    plans = list(batch.attention.kernel.values())
    assert [p.num_splits for p in plans] == [3]


def test_decode_each_tile_splits_its_own_range_fp32():
    # Forced 4 splits: the 30-key row splits into 4 chunks of 8 keys, the 3-key row into one
    # chunk of 8 (its other splits empty) -- each tile splits its own key range.
    _, _, _, batch, _ = check(
        [(29, 1), (2, 1), (13, 1)],
        heads=4,
        kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        num_splits=4,
        seed=9,
    )
    (plan,) = batch.attention.kernel.values()
    assert plan.num_splits == 4 and plan.min_chunk == 1


@pytest.mark.parametrize("num_splits", [1, 3])
def test_padding_rows_with_no_context_give_zeros(num_splits):
    # CUDA-graph buckets pad the batch with rows of context length 0 (and slot -1): they read
    # no page and return zeros, and the real rows are unaffected.
    q, k, v, batch = make_case([(9, 1), (0, 1), (0, 1)], 2, 1, 16, torch.float32, seed=10)
    batch.seq_lens[1:] = 0
    out = paged_attention_cuda(q, k, v, batch, 0.25, num_splits=num_splits)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    ref = paged_attention_reference(q, k, v, batch, 0.25)  # reads the host lengths: unpadded
    assert rel_error(out[:1], ref[:1]) <= TOL[torch.float32]


def test_decode_whole_warp_lanes(monkeypatch):
    # 32 lanes per key (the choice for big tiles at head_dim >= 64), tested at head_dim 32.
    monkeypatch.setattr(attention, "_FORCE_LANES", 32)
    check([(5, 1), (9, 1)], heads=2, kv_heads=1, head_dim=32, dtype=torch.float32, seed=3)


@pytest.mark.parametrize(
    ("specs", "window", "num_splits"),
    [
        ([(0, 1), (8, 1), (21, 1)], None, None),  # contexts shorter than one step's keys
        ([(13, 1), (30, 1)], 5, None),  # sliding window inside a step
        ([(29, 1), (2, 1)], None, 2),  # split chunks of 16 keys: the second step is partial
        ([(0, 5), (9, 3), (6, 1)], None, 2),  # prefill tiles: causal masks inside a step
    ],
)
def test_several_keys_per_step(monkeypatch, specs, window, num_splits):
    # Each key group reads 3 keys per step before using them (keys_per_step): the keys past
    # the chunk's end, outside the window or after the query are masked within a step.
    monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", 3)
    check(specs, 4, 2, 16, torch.float32, window=window, num_splits=num_splits, seed=4)


@pytest.mark.skipif(not _launch.SIMULATOR, reason="emulates warp shuffles in the simulator")
@pytest.mark.parametrize(
    ("heads", "keys", "lanes", "specs"),
    [
        (4, 1, 16, [(6, 1), (12, 1)]),  # 4 rows (transposed: 2 halving levels, 2 butterflies)
        (4, 2, 16, [(6, 1), (21, 1)]),  # 8 rows
        (2, 1, 32, [(5, 1), (9, 1)]),  # 2 rows over 32 lanes (transposed: 1 level, 4 butterflies)
        (4, 3, 16, [(6, 1), (21, 1)]),  # 12 rows: a butterfly per row either way
        (2, 1, 16, [(0, 6), (3, 4)]),  # prefill tiles: 8 rows of 4 tokens x 2 heads
    ],
)
@pytest.mark.parametrize("transposed", [True, False])
def test_warp_shuffle_row_sums_in_simulator(monkeypatch, heads, keys, lanes, specs, transposed):
    """The GPU's row sums (``_row_sum_impl`` with shuffles) in the simulator with emulated
    shuffles, so the code path real GPUs take is checked here too."""
    emulate_warp_shuffles(monkeypatch)
    monkeypatch.setattr(attention, "_SHUFFLES", True)
    monkeypatch.setattr(attention, "_FORCE_TRANSPOSED_SUMS", transposed)
    monkeypatch.setattr(attention, "_FORCE_KEYS_PER_STEP", keys)
    monkeypatch.setattr(attention, "_FORCE_LANES", lanes)
    check(specs, heads, 1, 32, torch.float32, seed=6)


# --- prefill-only and mixed batches --------------------------------------------------------


def test_prefill_mha_tiles_fp32():
    # G = 1 -> tiles of 8 query tokens: 9 tokens = a full tile + a 1-token tile.
    check([(0, 9), (0, 3)], heads=2, kv_heads=2, head_dim=16, dtype=torch.float32, seed=4)


def test_prefill_gqa4_fp16():
    check([(0, 6)], heads=4, kv_heads=1, head_dim=32, dtype=torch.float16, seed=5)


def test_mixed_chunked_prefill_and_decode_fp16():
    # A prefill chunk over a 5-token cached prefix, two decodes, q a strided view (as from a
    # fused QKV projection).
    specs = [(5, 6), (12, 1), (3, 1)]
    q, k, v, batch = make_case(specs, 4, 2, 16, torch.float16, seed=6)
    qkv = torch.cat((q, torch.zeros_like(q)), dim=1)  # [T, 2H, D]
    q_view = qkv[:, :4]
    assert not q_view.is_contiguous()
    out = paged_attention_cuda(q_view, k, v, batch, 0.25)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, 0.25)
    assert rel_error(out, ref) <= TOL[torch.float16]


def test_cuda_op_set_attends_a_mixed_batchs_decode_rows_with_the_kernel():
    """Decode rows beside a prefill chunk and a multi-token row go to the kernel as a decode
    batch of their own, the rest to the reference; together they are the reference's
    attention over the whole batch (a sliding window too)."""
    from engine.batch import AttentionPlan
    from engine.ops import by_query_length, cuda_ops

    specs = [(5, 1), (3, 6), (12, 1), (2, 3)]
    q, k, v, batch = make_case(specs, 4, 2, 16, torch.float32, seed=9)
    op = by_query_length(paged_attention_cuda, paged_attention_reference)
    for window in (None, 4):
        out = op(q, k, v, batch, 0.25, window)
        ref = paged_attention_reference(q, k, v, batch, 0.25, window)
        assert rel_error(out, ref) <= TOL[torch.float32]
    split = batch.attention.decode_split
    assert split.decode.q_lens == (1, 1)
    assert split.rows.tolist() == [0, 7]
    # the CUDA op set (CUDA_VERIFY_ROWS): the 3-token sequence (drafts to verify, no prompt
    # chunk) takes the kernel too, a row per token; the 6-token one stays with the reference
    op = cuda_ops().paged_attention
    for window in (None, 4):
        batch.attention = AttentionPlan()
        out = op(q, k, v, batch, 0.25, window)
        ref = paged_attention_reference(q, k, v, batch, 0.25, window)
        assert rel_error(out, ref) <= TOL[torch.float32]
    split = batch.attention.decode_split
    assert split.decode.q_lens == (1,) * 5
    assert split.rows.tolist() == [0, 7, 8, 9, 10]


def test_mixed_gqa8_sliding_window_fp32():
    check(
        [(3, 4), (10, 1)],
        heads=8,
        kv_heads=1,
        head_dim=16,
        dtype=torch.float32,
        window=5,
        seed=7,
    )


def test_mixed_splits_fp16():
    check(
        [(4, 3), (14, 1)],
        heads=4,
        kv_heads=2,
        head_dim=16,
        dtype=torch.float16,
        num_splits=2,
        seed=8,
    )


def test_warm_up_compiles_the_split_merge_kernel():
    attention._merge_kernel.cache_clear()
    attention.warm_up_split_merge(torch.float32, DEVICE, 4, 2, 16, page_size=4)
    assert attention._merge_kernel.cache_info().currsize == 1


# --- plan caching and validation -----------------------------------------------------------


def test_plan_is_cached_per_forward():
    q, _, _, batch = make_case([(2, 1), (5, 1)], 2, 1, 16, torch.float32)
    plan = attention._plan(batch, 2, 1, 16, None, None, q.device)
    assert attention._plan(batch, 2, 1, 16, None, None, q.device) is plan
    assert plan.q_tile == 1 and plan.num_items == 2 and plan.num_splits == 1
    assert plan.work.tolist() == [[0, 0], [1, 0]]
    # a prefill batch tiles query tokens: G = 2 -> 4 tokens per item
    _, _, _, batch = make_case([(0, 6), (3, 1), (0, 4)], 2, 1, 16, torch.float32)
    plan = attention._plan(batch, 2, 1, 16, None, None, q.device)
    assert plan.q_tile == 4
    assert plan.work.tolist() == [[0, 0], [0, 4], [1, 0], [2, 0]]


def test_split_chunks_cover_the_longest_context():
    _, _, _, batch = make_case([(18, 1)], 2, 1, 16, torch.float32)
    plan = attention._plan(batch, 2, 1, 16, None, 4, torch.device(DEVICE))
    assert plan.num_splits * plan.chunk >= 19
    assert (plan.num_splits - 1) * plan.chunk < 19
    assert plan.part_o.shape == (plan.num_splits, 1, 2, 16)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda q, k, v, b: (q[0], k, v, b), "q must be"),
        (lambda q, k, v, b: (q, k, v[:, :, :, :8], b), "k_pages and v_pages"),
        (lambda q, k, v, b: (q.double(), k, v, b), "dtype"),
        (lambda q, k, v, b: (q.half(), k, v, b), "share a dtype"),
        (lambda q, k, v, b: (q[:, :3], k, v, b), "not a multiple"),
        (lambda q, k, v, b: (q[:1], k, v, b), "rows"),
        (lambda q, k, v, b: (q[..., :8], k[..., :8], v[..., :8], b), "multiple of 16"),
    ],
)
def test_bad_inputs_raise(mutate, message):
    q, k, v, batch = make_case([(2, 1), (5, 1)], 4, 2, 16, torch.float32)
    q, k, v, batch = mutate(q, k, v, batch)
    with pytest.raises(ValueError, match=message):
        paged_attention_cuda(q, k, v, batch, 0.25)


def test_bad_batch_and_window_raise():
    q, k, v, batch = make_case([(2, 1), (5, 1)], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_cuda(q, k, v, batch, 0.25, 0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_cuda(q, k, v, batch, 0.25, num_splits=0)
    batch.seq_lens = batch.seq_lens.long()
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        paged_attention_cuda(q, k, v, batch, 0.25)


def test_pages_past_the_kernels_32_bit_rows_raise(monkeypatch):
    """The kernel's row arithmetic is 32-bit: a layer's pages with more slot-heads than that
    are refused by name (here with the limit lowered to the case's 2 KV heads x 1 page)."""
    q, k, v, batch = make_case([(2, 1), (5, 1)], 4, 2, 16, torch.float32)
    monkeypatch.setattr(attention, "_MAX_ROWS", 2 * batch.page_size - 1)
    with pytest.raises(ValueError, match=r"KV heads = \d+ rows, over the kernel's"):
        paged_attention_cuda(q, k, v, batch, 0.25)


def test_segment_shuffle_reads_the_lane_the_xor_shuffle_reads():
    """Transposed row sums of 16 rows over 16 lanes fetch row r on a GPU by
    ``shfl_segment16_sync(x, r)`` (PTX shfl.idx with segment mask 16: lane (L & 16) | r), where
    the general form (and the simulator) shuffles by xor with (L & held) ^ bits(r): the same
    lane for every lane L of the warp and every row."""
    rows = lanes = 16
    levels = rows.bit_length() - 1
    held = sum(lanes >> (t + 1) for t in range(levels))
    for r in range(rows):
        bits = sum(lanes >> (t + 1) for t in range(levels) if (r >> (levels - 1 - t)) & 1)
        for lane in range(32):
            segment_mask = 32 - 16  # the clamp operand's c[12:8]
            assert lane ^ ((lane & held) ^ bits) == (lane & segment_mask) | (r & ~segment_mask)


# --- GPU-free compile gate: the real kernels compiled for sm_90 ------------------------------

_COMPILE_SCRIPT = textwrap.dedent(
    """
    import re, sys
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    try:
        from cuda.core import Linker, LinkerOptions, ObjectCode
        from cuda.pathfinder import load_nvidia_dynamic_lib
        load_nvidia_dynamic_lib("nvvm")
        load_nvidia_dynamic_lib("nvJitLink")
    except Exception as exc:
        print("no NVVM/nvJitLink:", exc)
        sys.exit(3)

    class Device:  # kernels calling device functions ask for the current device
        compute_capability = (9, 0)
        id = 0

    dispatcher.get_current_device = lambda: Device()
    from engine.cuda import attention as A

    PART, PARTS = map(int, sys.argv[1:3])  # this process compiles every PARTS-th case
    CASES = iter(range(1 << 20))

    def link(kernel, args):  # (registers, spill stores, log) of kernel compiled for sm_90
        if next(CASES) % PARTS != PART:
            return "(another part)", "0", ""
        opts = kernel.targetoptions
        ltoir, _ = cuda.compile(
            kernel.py_func, "void(" + args + ")", cc=(9, 0), output="ltoir", device=False,
            abi="numba", fastmath=opts.get("fastmath", False),
            launch_bounds=opts.get("launch_bounds"),
        )
        linker = Linker(ObjectCode.from_ltoir(ltoir),
                        options=LinkerOptions(arch="sm_90", link_time_optimization=True,
                                              verbose=True))
        linker.link("cubin")
        log = linker.get_info_log()
        regs = re.search(r"Used (\\d+) registers", log).group(1)
        spills = re.search(r"(\\d+) bytes spill stores", log).group(1)
        return regs, spills, log

    PAGES = {0: "{dt}", 8: "int8", 4: "uint8"}
    ARGS = (  # (page arrays flat: kv_load.flat_pages)
        "{dt}[:, :, ::1], {kt}[::1], {vt}[::1], {ks}[::1], {vs}[::1], {dt}[:, :, ::1], "
        "float32[:, :, :, ::1], float32[:, :, :, ::1], int32[:, ::1], int32[::1], "
        "int32[::1], int32[:, ::1], float32, int64, int64, int64, {dt}[::1], {dt}[::1]"
    )
    # (run dtype, (D, page size, group, q tile, lanes), (K bits, V bits), spills accepted):
    # fp16 pages and the quantized formats (engine/cache/quant.py) at Llama-3-8B's head shape,
    # with the keys per step each tile takes (quantized word pages rotated in the kernel).
    # Four keys per step spill 8-12 bytes for q6 and sink-page decode under the 128-register
    # cap, as they did when measured faster than two keys on the H200 (bench/results/
    # attention_keys_per_step_h200_2026-11-27_rows.json): accepted there only. Float pages
    # take four keys too, except for groups of 8 (32 lanes), which spill 112 bytes with four
    # and keep two (the third case). The last two: quantized pages with sink pages (a first
    # page read from unquantized rows).
    for dt, (d, ps, g, qt, lt), (kb, vb), sinks, spills_ok in [
        ("float16", (128, 16, 4, 1, 16), (0, 0), False, False),
        ("float16", (128, 16, 4, 2, 32), (0, 0), False, False),
        ("float32", (128, 16, 8, 1, 32), (0, 0), False, False),
        ("float16", (128, 16, 4, 1, 16), (8, 8), False, False),
        ("float16", (128, 16, 4, 1, 16), (8, 4), False, True),
        ("float16", (128, 16, 4, 1, 16), (4, 4), False, False),
        ("float16", (128, 16, 4, 2, 32), (4, 4), False, False),
        ("float16", (128, 16, 4, 1, 16), (4, 4), True, True),
        ("float16", (128, 16, 4, 1, 16), (8, 8), True, True),
    ]:
        words = A.reads_words(kb, vb, d // lt)  # (quantized word pages: rotated, as by default)
        kernel = A._attention_kernel(d, ps, g, qt, lt, kb, vb, A._keys_per_step(qt, g, words),
                                     A._MIN_BLOCKS, True, A._transposed_sums(kb, vb, d // lt),
                                     sinks, words)
        scales = {b: ("float16" if b else PAGES[0]) for b in (kb, vb)}
        words = {4: "int32", 8: "int64"}[d // lt] if kb and vb else None  # kv_load words
        ARGS_NOW = ARGS.replace("{kt}", words or PAGES[kb]).replace("{vt}", words or PAGES[vb])
        ARGS_NOW = ARGS_NOW.replace("{ks}", scales[kb]).replace("{vs}", scales[vb])
        regs, spills, log = link(kernel, ARGS_NOW.replace("{dt}", dt))
        print(dt, d, ps, g, qt, lt, kb, vb, sinks, "registers", regs, "spill stores", spills)
        assert spills_ok or spills == "0", log

    # The tensor-core decode kernel (attention_mma.py) at the same shape with its default load
    # pipeline: q4, q6 and q8 pages with sink and recent pages and without, and fp16 pages.
    from engine.cuda import attention_mma as M

    MMA_ARGS = (
        "float16[:, :, ::1], int32[::1], int32[::1], float16[::1], int16[::1], "
        "float16[:, :, ::1], float32[:, :, :, ::1], float32[:, :, :, ::1], int32[:, ::1], "
        "int32[::1], float32, int64, int64[::1], int64[::1], int64, int64"
    )
    for (kb, vb), sinks, fp16 in [
        ((4, 4), False, False), ((4, 4), True, False), ((8, 4), True, False),
        ((8, 8), False, False), ((8, 8), True, False), ((4, 4), False, True),
    ]:
        kernel = M._decode_kernel(128, 16, 4, 8, not fp16, sinks, fp16, kb, vb, M._PIPELINE)
        regs, spills, log = link(kernel, MMA_ARGS)
        print("mma", kb, vb, sinks, fp16, "registers", regs, "spill stores", spills)
        assert spills == "0", log

    # The context gather of the prompt-chunk route (kv_gather.py): 4-bit pages with sink rows
    # rotated back, 8-bit ones without either; fp16 output (packed: an int64 view) and fp32.
    from engine.cuda import kv_gather

    for kb, rows, out in ((4, True, "int64"), (8, False, "float32")):
        signature = (  # (own rows of keys: rotary and the center, for 4 bits)
            "int32[:, :, :, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1], int64, "
            "int32[:, ::1], int64[::1], int64[::1], float16[:, :, ::1], float16[:, ::1], "
            f"float16[:, ::1], float32[:, ::1], {out}[:, :, :, ::1]"
        )
        kernel = kv_gather._gather_kernel(kb, rows, rows, out == "int64", 16, 8, 4, True, rows,
                                          rows)  # fmt: skip
        regs, spills, log = link(kernel, signature)
        print("gather", kb, rows, "registers", regs, "spill stores", spills)
        assert spills == "0", log

    # The quantized cache write (rotary, Hadamard, scale search, codes, sink rows) at
    # head_dim 128, 4- and 8-bit codes.
    import torch
    from engine.cuda import quant_kernels as Q

    for kb, page in ((4, "uint8"), (8, "int8")):
        kernel = Q._quant_write_kernel(torch.float16, 128, kb, kb, True, True, True)
        signature = (
            "float16[:, :, :], float16[:, :, :], float16[:, :, :], float16[:, ::1], "
            f"float16[:, ::1], {page}[:, :, :, ::1], {page}[:, :, :, ::1], "
            "float16[:, :, :, ::1], float16[:, :, :, ::1], float32[:, ::1], int64[::1], "
            "float16[:, :, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1]"
        )
        regs, spills, log = link(kernel, signature)
        print("cache write", kb, "registers", regs, "spill stores", spills)
        assert spills == "0", log
    """
)


def test_kernels_compile_for_sm90():
    """Compiles the real (non-simulator) kernels to sm_90 cubins with NVVM + nvJitLink, which
    needs no GPU, and checks for register spills; two processes take alternate cases, so
    both cores compile. Skipped where the NVVM/nvJitLink libraries are not installed (pip:
    nvidia-nvvm, nvidia-nvjitlink)."""
    procs = run_without_simulator_in_parts(_COMPILE_SCRIPT, parts=2)
    if any(proc.returncode == 3 for proc in procs):
        pytest.skip(procs[0].stdout.strip())
    for proc in procs:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = [[line for line in p.stdout.splitlines() if "registers" in line] for p in procs]
    compiled = [line for lines in cases for line in lines if "(another part)" not in line]
    assert len(compiled) == len(cases[0]) > 0, cases  # every case once, by one process


# --- real sizes, GPU only --------------------------------------------------------------------


def _llama8b_case(specs, seed=0):
    return make_case(specs, 32, 8, 128, torch.float16, page_size=16, seed=seed, device="cuda")


@pytest.mark.gpu
def test_gpu_decode_batch64_ctx4k():
    q, k, v, batch = _llama8b_case([(4095, 1)] * 64)
    scale = 128**-0.5
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, scale)
    for splits in (None, 1, 4):
        out = paged_attention_cuda(q, k, v, batch, scale, num_splits=splits)
        assert rel_error(out, ref) <= TOL[torch.float16], splits


@pytest.mark.gpu
def test_gpu_decode_ragged_long_contexts_auto_split():
    q, k, v, batch = _llama8b_case([(4000, 1), (17, 1), (2500, 1)], seed=1)
    out = paged_attention_cuda(q, k, v, batch, 0.1)
    plans = list(batch.attention.kernel.values())
    assert plans[0].num_splits > 1  # 3 x 8 blocks on 132 SMs: split
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, 0.1)
    assert rel_error(out, ref) <= TOL[torch.float16]


@pytest.mark.gpu
def test_gpu_prefill_2k_tokens():
    q, k, v, batch = _llama8b_case([(0, 2048)], seed=2)
    out = paged_attention_cuda(q, k, v, batch, 128**-0.5)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, 128**-0.5)
    assert rel_error(out, ref) <= TOL[torch.float16]


@pytest.mark.gpu
def test_gpu_mixed_chunked_prefill_window():
    q, k, v, batch = _llama8b_case([(700, 512), (3000, 1), (0, 33), (1500, 1)], seed=3)
    out = paged_attention_cuda(q, k, v, batch, 0.09, 1024)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, 0.09, 1024)
    assert rel_error(out, ref) <= TOL[torch.float16]


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    q, k, v, batch = _llama8b_case([(1000, 1)] * 8, seed=4)
    paged_attention_cuda(q, k, v, batch, 0.1)  # compile, load, build the per-forward plan
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_cuda(q, k, v, batch, 0.1)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_reference(q.float(), k.float(), v.float(), batch, 0.1)
    assert rel_error(out, ref) <= TOL[torch.float16]
