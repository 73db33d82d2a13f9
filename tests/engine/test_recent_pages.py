"""Recent pages: each sequence's last RECENT_BLOCKS blocks kept unquantized in a quantized cache
(engine/cache/page_table.py), placed and settled by the scheduler, read by the attention."""

from __future__ import annotations

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, SamplerSettings
from engine.batch import SequenceInput, build_forward_batch
from engine.cache.kv_cache import PagedCache, kv_bytes_per_token, recent_pages_for
from engine.cache.page_table import RECENT_BLOCKS
from tests.engine import test_generator as gen_tests
from tests.engine.conftest import QuantTiny, assert_no_pages_in_use

PAGE = 4


def _with(tiny32: QuantTiny, quant: str, sinks: int = 0, recent: int = 0, **kw) -> QuantTiny:
    q = QuantTiny(tiny32.model, tiny32.tokenizer, tiny32.folder)
    q.quant, q.sink_pages, q.recent_pages = quant, sinks, recent
    q.exact_chunks = kw.get("exact_chunks")
    return q


def _greedy_logits(q: QuantTiny, prompt: list[int], new_tokens: int) -> torch.Tensor:
    generator = q.generator(page_size=PAGE)
    job = DynamicJob(prompt, new_tokens, stop_conditions=[], gen_settings=SamplerSettings.greedy())
    job.return_logits = True
    generator.enqueue(job)
    logits = []
    while generator.num_remaining_jobs():
        logits += [r["logits"] for r in generator.iterate() if "logits" in r]
    assert_no_pages_in_use(generator)
    return torch.cat([x.reshape(-1) for x in logits])


def test_a_context_on_sink_and_recent_pages_matches_the_unquantized_cache(tiny32):
    """A sink block and two recent blocks hold 12 tokens (pages of 4): every decode step up
    to position 11 reads every key exactly, through blocks that were placed one by one."""
    prompt = tiny32.tokenizer.encode("the cat sat")[0].tolist()[:3]
    new = 1 + RECENT_BLOCKS * PAGE + PAGE - len(prompt)  # (the last forward at position 11)
    exact = _greedy_logits(_with(tiny32, "fp16"), prompt, new)
    recent = _greedy_logits(_with(tiny32, "q4", sinks=2, recent=4), prompt, new)
    sinks_only = _greedy_logits(_with(tiny32, "q4", sinks=2), prompt, new)
    assert (recent - exact).abs().max() < 1e-4  # centering and rotation: rounding only
    assert (sinks_only - exact).abs().max() > 1e-3


def _check_placement(generator: DynamicGenerator) -> None:
    """Every running sequence's last RECENT_BLOCKS blocks (not its sink block) are on recent
    pages, with an ordinary page in reserve each; no other block is."""
    table = generator.cache.page_table
    unquantized = table.num_sink_pages + table.num_recent_pages
    for seq in generator.scheduler.running:
        first = 1 if table.num_sink_pages else 0
        expect = set(range(max(first, len(seq.pages) - RECENT_BLOCKS), len(seq.pages)))
        assert set(seq.spares) == expect
        for block, page in enumerate(seq.pages):
            assert table.is_recent(page) == (block in expect)
        assert all(spare >= unquantized for spare in seq.spares.values())
    table.check_invariants()


@pytest.mark.parametrize("sinks", [0, 3])
def test_settled_blocks_keep_their_codes(tiny32, sinks):
    """Blocks that leave the last RECENT_BLOCKS move to ordinary pages with their codes: the
    first layer's codes (its K/V depend on the token and position only) equal a plain cache's
    prefill of the same tokens, block by block, wherever the block lives now."""
    q = _with(tiny32, "q4", sinks=sinks, recent=RECENT_BLOCKS * 3)
    generator = q.generator(max_num_tokens=64 * PAGE, page_size=PAGE)
    prompt = gen_tests._prompts(q.tokenizer, count=1, seed=3)[0][:6]
    job = DynamicJob(prompt, 23, stop_conditions=[], gen_settings=SamplerSettings.greedy())
    generator.enqueue(job)
    seq = job.seq
    while seq.num_computed < len(prompt) + 20:
        generator.iterate()
        _check_placement(generator)
    tokens, pages = seq.tokens[: seq.num_computed], list(seq.pages)
    assert len(pages) > RECENT_BLOCKS + 2  # (blocks have settled)
    plain = generator.model.allocate_kv(len(pages), PAGE, "q4")
    row = SequenceInput(tokens, 0, list(range(len(pages))))
    with torch.inference_mode():
        generator.model.network(build_forward_batch([row], PAGE), plain, generator.runner.ops)
    got, want = generator.cache.kv[0][0], plain[0][0]
    for block, page in enumerate(pages):
        rows = min(PAGE, len(tokens) - block * PAGE)
        assert torch.equal(got.data[page, :rows], want.data[block, :rows]), block
        assert torch.equal(got.scales[page, :rows], want.scales[block, :rows]), block
    generator.cancel(job)
    assert_no_pages_in_use(generator)
    assert generator.stats()["recent_pages_free"] == RECENT_BLOCKS * 3


def test_engine_subset_on_q4_pages_with_recent_pages(tiny32):
    """Batching, prefix reuse and follow-ups with sink and recent pages: blocks are placed by
    each sequence's own length, so a job whose prompt is one chunk either way decodes the
    same tokens alone or in a batch. (Chunked differently, a prompt reads different blocks
    exactly, as with ``exact_chunks``: recent pages hold the chunk's last blocks.)"""
    q = _with(tiny32, "q4", sinks=12, recent=recent_pages_for(12), exact_chunks=False)
    prompts = gen_tests._prompts(q.tokenizer, count=12, seed=1)
    together = [gen_tests._tokens(r) for r in gen_tests._run(q.generator(), prompts)]
    for ids, batched in zip(prompts, together, strict=True):
        (alone,) = gen_tests._run(q.generator(), [ids])
        assert gen_tests._tokens(alone) == batched
    gen_tests.test_same_prompt_twice_hits_the_cache(q)
    gen_tests.test_follow_up_turn_reuses_generated_pages(q)


def test_preemption_with_recent_pages_returns_every_page(tiny32):
    q = _with(tiny32, "q4", sinks=3, recent=recent_pages_for(3))
    prompts = gen_tests._prompts(q.tokenizer, count=8, seed=5)
    small_gen = q.generator(max_num_tokens=40 * PAGE, page_size=PAGE, max_chunk_size=32)
    small = gen_tests._run(small_gen, prompts, max_new_tokens=12)
    assert small_gen.stats()["preemptions"] > 0
    assert all(len(gen_tests._tokens(r)) == 12 for r in small)
    assert_no_pages_in_use(small_gen)
    assert small_gen.stats()["recent_pages_free"] == recent_pages_for(3)


def test_recent_pages_are_refused_where_they_cannot_work(tiny32):
    model, tokenizer = tiny32.model, tiny32.tokenizer
    with pytest.raises(ValueError, match="recent_pages needs a quantized cache"):
        PagedCache(model, 64, PAGE, "fp16", recent_pages=2)
    with pytest.raises(ValueError, match=f"recent_pages must be 0 or at least {RECENT_BLOCKS}"):
        PagedCache(model, 64, PAGE, "q4", recent_pages=1)
    with pytest.raises(ValueError, match=r"recent_pages must be in \[0, 14\]"):
        PagedCache(model, 64, PAGE, "q4", sink_pages=2, recent_pages=15)
    one_row = PagedCache(model, 256, PAGE, "q4", recent_pages=RECENT_BLOCKS)
    generator = DynamicGenerator(model, one_row, tokenizer)
    assert generator.scheduler.max_running == 1
    pair = [tokenizer.encode("the cat")[0].tolist(), tokenizer.encode("a dog")[0].tolist()]
    guided = SamplerSettings(temperature=0.0, cfg_scale=1.5)
    with pytest.raises(ValueError, match="the CFG job's 2 rows run at once; the cache's 2"):
        generator.enqueue(DynamicJob(pair, 4, gen_settings=guided))
    with pytest.raises(ValueError, match="draft_cache has 4 recent pages; the cache has 2"):
        DynamicGenerator(
            model,
            PagedCache(model, 256, PAGE, "q4", recent_pages=2),
            tokenizer,
            draft_model=model,
            draft_cache=PagedCache(model, 256, PAGE, "q4", recent_pages=4),
        )


def test_recent_pages_count_in_the_bytes_and_the_budget(tiny32):
    model = tiny32.model
    plain = PagedCache(model, 64 * PAGE, PAGE, "q4")
    recent = PagedCache(model, 64 * PAGE, PAGE, "q4", recent_pages=6)
    fp = kv_bytes_per_token(model.config, model.dtype)
    assert recent.num_bytes() - plain.num_bytes() == 6 * PAGE * fp
    budget = PagedCache.from_budget(model, plain.num_bytes(), PAGE, "q4", recent_pages=6)
    assert budget.num_bytes() <= plain.num_bytes() and budget.recent_pages == 6
    assert recent.pages_for_rows(1) == 64 - 6


def test_a_draft_models_cache_follows_every_settle(tiny32):
    """A draft model's cache (fp16, on the scheduler's page ids) gets the same page copies:
    its first layer's rows of settled blocks equal a plain prefill of the same tokens."""
    model, tokenizer = tiny32.model, tiny32.tokenizer
    cache = PagedCache(model, 512, PAGE, "q4", sink_pages=2, recent_pages=4)
    draft_cache = PagedCache(model, 512, PAGE, "fp16")
    generator = DynamicGenerator(
        model, cache, tokenizer, draft_model=model, draft_cache=draft_cache, num_draft_tokens=3
    )
    job = DynamicJob(tokenizer.encode("one two three")[0].tolist(), 40, stop_conditions=[])
    generator.enqueue(job)
    seq = job.seq
    while seq.num_computed < 24:
        generator.iterate()
    assert generator.stats()["spec_draft_tokens_proposed"] > 0
    tokens, pages = seq.tokens[: seq.num_computed], list(seq.pages)
    plain = model.allocate_kv(len(pages), PAGE)
    row = SequenceInput(tokens, 0, list(range(len(pages))))
    with torch.inference_mode():
        model.network(build_forward_batch([row], PAGE), plain, generator.runner.ops)
    settled = [b for b in range(1, len(tokens) // PAGE) if b not in seq.spares]
    assert len(settled) >= 2
    for block in settled:
        got = draft_cache.kv[0][0][pages[block]]
        torch.testing.assert_close(got, plain[0][0][block], atol=1e-5, rtol=1e-5)
    generator.cancel(job)
    assert_no_pages_in_use(generator)


@pytest.mark.parametrize("quant", ["fp16", "q4", "q6"])
def test_move_pages_copies_each_page_in_every_layer(tiny32, quant):
    """A page copy is one op per stored tensor over all layers (their layers are views of one
    tensor), and copies codes and scales (rows, for fp16) page for page."""
    from engine.cache.kv_cache import _stored_tensors
    from engine.cache.quant import stacked_storage

    cache = PagedCache(tiny32.model, 16 * PAGE, PAGE, quant)
    kinds = _stored_tensors(cache.kv)
    assert all(stacked_storage(layers) is not None for layers in kinds)
    gen = torch.Generator().manual_seed(0)
    for layers in kinds:
        base = stacked_storage(layers)
        base.copy_(torch.randint(-100, 100, base.shape, generator=gen).to(base.dtype))
    before = [[t.clone() for t in layers] for layers in kinds]
    cache.move_pages([(3, 9), (5, 2)])
    for layers, old in zip(kinds, before, strict=True):
        for t, o in zip(layers, old, strict=True):
            want = o.clone()
            want[9], want[2] = o[3], o[5]
            assert torch.equal(t, want)


def test_bench_decode_perplexity_is_the_teacher_forced_perplexity(tiny32):
    """bench/kv_recent_pages.py's protocol (a prefill, then one decode step per token through
    the scheduler) on an unquantized cache scores what one forward over the text scores."""
    from bench import kv_recent_pages as bench

    model = tiny32.model
    ids = torch.randint(
        3, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.tolist()
    prefill = 20
    got = bench.decode_perplexity(model, ids, bench.MODES["fp32"], prefill)
    logits = model.logits(ids)[prefill:-1]
    want = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(ids[prefill + 1 :]))
    assert got == pytest.approx(want.exp().item(), rel=1e-4)
    # the q4 modes run the same steps (recent pages placed and settled on the way)
    assert bench.decode_perplexity(model, ids, bench.MODES["q4+rot+recent"], prefill) > 1
    # fp16 storage: the written rows rounded (a small change, not none), the ops put back
    ops = model.ops
    rounded = bench.decode_perplexity(model, ids, bench.MODES["fp16"], prefill)
    assert rounded != got and rounded == pytest.approx(got, rel=1e-2)
    assert model.ops is ops


def test_bench_compare_reports_agreement_with_fp16_and_divergence_margins():
    from bench import kv_recent_pages as bench

    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    fp16 = [[1, 2, 3, 4], [5, 6, 0, 0]]
    margins = [[0.5, 0.25, 0.125, 2.0], [3.0, 1.0, 0.01, 4.0]]
    row = {"mode": "q8"}
    bench.compare(row, [[1, 9, 9, 9], [5, 6, 0, 0]], reference, fp16, margins)
    assert row["agreement"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert row["agreement_vs_fp16"] == pytest.approx((1 / 4 + 1) / 2)
    assert row["exact_prompts"] == 0 and row["exact_prompts_vs_fp16"] == 1
    assert row["divergence_margins"] == [0.01, 0.25]


def test_a_finished_jobs_recent_blocks_are_cached_for_the_next_turn(tiny32):
    """Full blocks still on recent pages settle when their sequence ends, so a follow-up turn
    hits every full page of the first turn's context, as without recent pages."""
    prompt = gen_tests._prompts(tiny32.tokenizer, count=1, seed=4)[0][:9]
    hits = []
    for recent in (0, recent_pages_for(4)):
        q = _with(tiny32, "q4", sinks=4, recent=recent)
        generator = q.generator(max_num_tokens=128 * PAGE, page_size=PAGE, max_batch_size=4)
        first = DynamicJob(prompt, 15, stop_conditions=[], gen_settings=SamplerSettings.greedy())
        generator.enqueue(first)
        while generator.num_remaining_jobs():
            generator.iterate()
        # 24 tokens, the last never computed: 5 full pages, the 5th on a recent page at the end
        context = prompt + first.new_token_ids
        follow = DynamicJob([*context, 7], 2, stop_conditions=[])
        generator.enqueue(follow)
        while generator.num_remaining_jobs():
            generator.iterate()
        hits.append(follow.seq.cached_tokens)
        assert_no_pages_in_use(generator)
    assert hits[0] == hits[1] == 5 * PAGE


def test_ngram_speculation_on_recent_pages_returns_every_page(tiny32):
    """Verified drafts and rejected ones (truncations) on sink and recent pages: every page,
    recent pages included, comes back. (A verify step that crosses a block boundary settles
    a block before its earlier queries read it, so its tokens may differ from plain
    decoding's by the codes' rounding: not compared here.)"""
    q = _with(tiny32, "q4", sinks=4, recent=recent_pages_for(4))
    generator = q.generator(page_size=PAGE, max_batch_size=4, use_ngram_draft=True)
    generator.speculator.policy.max_step_tokens = 256
    ids = q.tokenizer.encode("a b c a b c a b c a")[0].tolist()
    greedy = SamplerSettings.greedy()
    jobs = [DynamicJob(ids, 24, stop_conditions=[], gen_settings=greedy) for _ in range(3)]
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
        _check_placement(generator)
    assert all(len(job.new_token_ids) == 24 for job in jobs)
    assert generator.stats()["spec_draft_tokens_proposed"] > 0
    assert_no_pages_in_use(generator)
    assert generator.stats()["recent_pages_free"] == recent_pages_for(4)
