"""Recent pages: each sequence's last RECENT_BLOCKS blocks kept unquantized in a quantized cache
(engine/cache/page_table.py), placed and settled by the scheduler, read by the attention."""

from __future__ import annotations

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, SamplerSettings
from engine.batch import SequenceInput, build_forward_batch
from engine.cache.kv_cache import recent_pages_for
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
