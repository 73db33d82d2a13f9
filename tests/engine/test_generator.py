"""DynamicGenerator end to end on a tiny random model: numerics, caching, preemption, job API."""

from __future__ import annotations

import random

import pytest
import torch

from engine import DynamicJob, SamplerSettings
from tests.engine.conftest import assert_no_pages_in_use, random_text

GREEDY = SamplerSettings.greedy()


def _prompts(tokenizer, count: int = 32, seed: int = 0) -> list[list[int]]:
    """Groups sharing long prefixes (several pages) plus unique suffixes of mixed length."""
    rng = random.Random(seed)
    prefixes = [random_text(rng, n) for n in (30, 18, 9, 0)]
    prompts = []
    for i in range(count):
        text = prefixes[i % len(prefixes)] + " " + random_text(rng, rng.randint(1, 12))
        prompts.append(tokenizer.encode(text.strip())[0].tolist())
    return prompts


def _run(generator, prompts, max_new_tokens=10, **job_kwargs) -> list[dict]:
    jobs = []
    for i, ids in enumerate(prompts):
        job_kwargs.setdefault("gen_settings", GREEDY)
        job_kwargs.setdefault("stop_conditions", [])
        jobs.append(DynamicJob(ids, max_new_tokens, identifier=i, **job_kwargs))
        generator.enqueue(jobs[-1])
    finals: dict[int, dict] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                finals[result["identifier"]] = result
    assert_no_pages_in_use(generator)
    return [finals[i] for i in range(len(prompts))]


def _tokens(result: dict) -> list[int]:
    return result["job"].new_token_ids


def test_32_concurrent_greedy_jobs_match_transformers(tiny):
    prompts = _prompts(tiny.tokenizer)
    generator = tiny.generator(max_chunk_size=24)
    finals = _run(generator, prompts, max_new_tokens=10)
    ref = tiny.reference()
    for ids, final in zip(prompts, finals, strict=True):
        out = _tokens(final)
        assert len(out) == 10
        with torch.no_grad():
            logits = ref(torch.tensor([ids + out])).logits[0].float()
        for step, token in enumerate(out):
            row = logits[len(ids) - 1 + step]
            # each pick is transformers' argmax, allowing only exact near-ties
            assert row[token] >= row.max() - 1e-4 * row.abs().max(), (step, token)
    assert generator.stats()["cached_tokens_total"] > 0  # shared prefixes were reused


def test_batched_equals_alone(tiny):
    prompts = _prompts(tiny.tokenizer, count=12, seed=1)
    together = [_tokens(r) for r in _run(tiny.generator(max_chunk_size=16), prompts)]
    for ids, batched in zip(prompts, together, strict=True):
        (alone,) = _run(tiny.generator(), [ids])
        assert _tokens(alone) == batched


def test_same_prompt_twice_hits_the_cache(tiny):
    generator = tiny.generator(page_size=4)
    ids = _prompts(tiny.tokenizer, count=1, seed=3)[0]
    while len(ids) < 40:
        ids = ids + ids
    (first,) = _run(generator, [ids])
    (second,) = _run(generator, [ids])
    full_page_tokens = (len(ids) // 4) * 4
    assert first["cached_tokens"] == 0
    assert second["cached_tokens"] >= 0.9 * full_page_tokens
    assert second["cached_pages"] == second["cached_tokens"] // 4
    assert _tokens(first) == _tokens(second)


def test_follow_up_turn_reuses_generated_pages(tiny):
    generator = tiny.generator(page_size=4)
    ids = _prompts(tiny.tokenizer, count=1, seed=4)[0]
    (first,) = _run(generator, [ids], max_new_tokens=12)
    follow_up = ids + _tokens(first) + tiny.tokenizer.encode(" then")[0].tolist()
    (second,) = _run(generator, [follow_up])
    # the cache covers the first prompt *and* the pages filled by its generated tokens
    assert second["cached_tokens"] > (len(ids) // 4) * 4


def test_tiny_cache_preempts_and_matches_large_cache(tiny):
    prompts = _prompts(tiny.tokenizer, count=8, seed=5)
    large = _run(tiny.generator(), prompts, max_new_tokens=12)
    small_gen = tiny.generator(max_num_tokens=26 * 4, page_size=4, max_chunk_size=32)
    small = _run(small_gen, prompts, max_new_tokens=12)
    assert small_gen.stats()["preemptions"] > 0
    assert [_tokens(r) for r in small] == [_tokens(r) for r in large]


def test_result_contract_and_identifier(tiny):
    generator = tiny.generator(max_chunk_size=8)
    ids = _prompts(tiny.tokenizer, count=1, seed=6)[0]
    job = DynamicJob(ids, 5, identifier={"req": 1}, stop_conditions=[], gen_settings=GREEDY)
    serial = generator.enqueue(job)
    results = []
    while generator.num_remaining_jobs():
        results += generator.iterate()
    for r in results:
        assert r["job"] is job and r["serial"] == serial and r["identifier"] == {"req": 1}
        assert {"job", "stage", "eos", "serial", "identifier"} <= set(r)
    stages = [r["stage"] for r in results]
    assert stages[0] == "started" and "prefill" in stages
    prefill = [r for r in results if r["stage"] == "prefill"]
    assert prefill[-1]["curr_progress"] == prefill[-1]["max_progress"] == len(ids)
    assert [r["curr_progress"] for r in prefill] == sorted(r["curr_progress"] for r in prefill)
    streaming = [r for r in results if r["stage"] == "streaming"]
    assert len(streaming) == 5 and [r["eos"] for r in streaming] == [False] * 4 + [True]
    final = streaming[-1]
    assert final["eos_reason"] == "max_new_tokens" and final["new_tokens"] == 5
    assert final["prompt_tokens"] == len(ids)
    assert final["full_completion"] == "".join(r.get("text", "") for r in streaming)
    for key in ("cached_tokens", "cached_pages", "time_enqueued", "time_prefill", "time_generate"):
        assert key in final
    assert torch.cat([r["token_ids"] for r in streaming], 1)[0].tolist() == job.new_token_ids


def test_stop_string_spanning_two_tokens(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=7)[0]
    (free,) = _run(tiny.generator(), [ids], max_new_tokens=16)
    pieces = [tiny.tokenizer.decode([t]) for t in _tokens(free)]
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and pieces[i + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    completion = "".join(pieces)
    expected = completion[: completion.find(stop)]
    generator = tiny.generator()
    job = DynamicJob(ids, 16, stop_conditions=[stop], gen_settings=GREEDY)
    generator.enqueue(job)
    texts = []
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            texts.append(r.get("text", ""))
            final = r
    assert final["eos_reason"] == "stop_string" and final["eos_triggering_string"] == stop
    assert "".join(texts) == final["full_completion"] == expected
    assert stop not in "".join(texts)
    assert_no_pages_in_use(generator)


def test_stop_token_min_and_max_new_tokens(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=8)[0]
    (free,) = _run(tiny.generator(), [ids], max_new_tokens=8)
    first = _tokens(free)[0]
    (stopped,) = _run(tiny.generator(), [ids], stop_conditions=[first])
    assert stopped["eos_reason"] == "stop_token" and stopped["new_tokens"] == 1
    assert stopped["eos_triggering_token_id"] == first
    (held,) = _run(tiny.generator(), [ids], stop_conditions=[first], min_new_tokens=4)
    assert first not in _tokens(held)[:4]
    assert held["new_tokens"] >= 4
    (exact,) = _run(tiny.generator(), [ids], max_new_tokens=3)
    assert exact["new_tokens"] == 3 and exact["eos_reason"] == "max_new_tokens"


def test_default_stop_conditions_are_the_eos_ids(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=9)[0]
    eos = tiny.tokenizer.eos_token_id
    bias = SamplerSettings(temperature=0.0, token_bias={eos: 1e4})
    (final,) = _run(tiny.generator(), [ids], stop_conditions=None, gen_settings=bias)
    assert final["eos_reason"] == "stop_token" and final["eos_triggering_token_id"] == eos
    (ignored,) = _run(tiny.generator(), [ids], stop_conditions=[], gen_settings=bias)
    assert ignored["eos_reason"] == "max_new_tokens"


def test_cancel_frees_pages_and_others_continue(tiny):
    generator = tiny.generator(max_chunk_size=16)
    prompts = _prompts(tiny.tokenizer, count=3, seed=10)
    jobs = [DynamicJob(p, 20, identifier=i, stop_conditions=[]) for i, p in enumerate(prompts)]
    for job in jobs:
        generator.enqueue(job)
    for _ in range(4):
        generator.iterate()
    assert generator.cancel(jobs[1])
    assert not generator.cancel(jobs[1])  # already gone
    finals = {}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                finals[r["identifier"]] = r
    assert finals[1]["eos_reason"] == "cancelled"
    assert finals[0]["new_tokens"] == finals[2]["new_tokens"] == 20
    assert_no_pages_in_use(generator)


def test_seeded_sampling_is_reproducible_in_any_batch(tiny):
    prompts = _prompts(tiny.tokenizer, count=6, seed=11)
    warm = SamplerSettings(temperature=1.0, top_p=0.95)
    (alone,) = _run(tiny.generator(), prompts[:1], gen_settings=warm, seed=1234)
    generator = tiny.generator()
    jobs = [DynamicJob(prompts[0], 10, gen_settings=warm, seed=1234, stop_conditions=[])]
    jobs += [DynamicJob(p, 10, gen_settings=warm, stop_conditions=[]) for p in prompts[1:]]
    for job in reversed(jobs):
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    assert jobs[0].new_token_ids == _tokens(alone)


def test_enqueue_validation(tiny):
    generator = tiny.generator(max_num_tokens=64, page_size=4)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_new_tokens \(10\)"):
        generator.enqueue(DynamicJob([1] * 60, 10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generator.enqueue(DynamicJob([10**6], 4))
    with pytest.raises(ValueError, match="empty"):
        DynamicJob([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        DynamicJob([1], 0)
    with pytest.raises(ValueError, match="neither a token id"):
        DynamicJob([1], 4, stop_conditions=[1.5])
    with pytest.raises(ValueError, match="min_new_tokens"):
        DynamicJob([1], 4, min_new_tokens=5)
    with pytest.raises(ValueError, match="max_skips must be None or an int >= 0, got -1"):
        DynamicJob([1], 4, max_skips=-1)
    job = DynamicJob([1, 2], 4)
    generator.enqueue(job)
    with pytest.raises(ValueError, match="already enqueued"):
        generator.enqueue(job)
    generator.cancel(job)
    generator.iterate()
    assert_no_pages_in_use(generator)


def test_generate_drives_only_its_own_jobs(tiny):
    generator = tiny.generator()
    prompts = _prompts(tiny.tokenizer, count=2, seed=12)
    foreign = DynamicJob(prompts[0], 6, identifier="foreign", stop_conditions=[])
    generator.enqueue(foreign)
    texts = generator.generate(["the cat sat", "a dog ran"], max_new_tokens=5, seed=3)
    assert len(texts) == 2 and texts[0].startswith("the cat sat")
    collected = []
    while generator.num_remaining_jobs():
        collected += generator.iterate()
    assert collected[0]["stage"] == "started"  # nothing of the foreign job was lost
    final = collected[-1]
    assert final["identifier"] == "foreign" and final["eos"]
    assert final["full_completion"] == "".join(r.get("text", "") for r in collected)
    completion, last = generator.generate(
        "the cat sat", max_new_tokens=4, completion_only=True, return_last_results=True
    )
    assert completion == last["full_completion"]
    assert_no_pages_in_use(generator)


@pytest.mark.parametrize(("own", "passed"), [(None, 2), (0, 0), (3, 3)])
def test_a_jobs_max_skips_is_honoured(tiny, own, passed):
    # A running job holds 3 of the 10 pages, so a 7-page prompt cannot start; small jobs
    # behind it start until it has been passed over max_skips times (its own, else the
    # generator's). Pages are enough for 3 of the small jobs.
    generator = tiny.generator(max_num_tokens=40, page_size=4, max_skips=2)
    running = DynamicJob(list(range(1, 9)), 20, stop_conditions=[])
    generator.enqueue(running)
    generator.iterate()
    blocked = DynamicJob(list(range(100, 128)), 1, max_skips=own, stop_conditions=[])
    generator.enqueue(blocked)
    small = [DynamicJob([50 + i, 1, 2], 1, stop_conditions=[]) for i in range(4)]
    for job in small:
        generator.enqueue(job)
    started = [r["job"] for r in generator.iterate() if r["stage"] == "started"]
    assert started == small[:passed]
    while generator.num_remaining_jobs():
        generator.iterate()
    assert_no_pages_in_use(generator)


def test_max_batch_size_is_honoured(tiny):
    generator = tiny.generator(max_batch_size=3)
    for ids in _prompts(tiny.tokenizer, count=8, seed=13):
        generator.enqueue(DynamicJob(ids, 4, stop_conditions=[]))
    while generator.num_remaining_jobs():
        generator.iterate()
        assert len(generator.scheduler.running) <= 3


MULTIBYTE = ["héllo wörld — 世界 🎉👩‍👩‍👧 ok", "日本語のテキスト", "🇫🇷🇯🇵 flags"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_stream_intact(tiny, text):
    """Tokens whose bytes split a character never yield a broken character, and nothing is
    lost: the streamed pieces join to the exact text (a job fed the text's own tokens)."""
    ids = tiny.tokenizer.encode(text)[0].tolist()
    job = DynamicJob([1, 2, 3], len(ids), stop_conditions=["<never>"])
    job.bind(0, tiny.tokenizer, default_stop_tokens=())
    pieces = [job.receive_token(token).get("text", "") for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text == job.full_completion
    assert any(piece == "" for piece in pieces)  # some bytes really were held back


def test_stop_string_after_multibyte_text(tiny):
    text = "世界 ends here STOP and more"
    ids = tiny.tokenizer.encode(text)[0].tolist()
    job = DynamicJob([1, 2, 3], len(ids), stop_conditions=["STOP"])
    job.bind(0, tiny.tokenizer, default_stop_tokens=())
    results = []
    for token in ids:
        results.append(job.receive_token(token))
        if results[-1]["eos"]:
            break
    assert results[-1]["eos_reason"] == "stop_string"
    assert "".join(r.get("text", "") for r in results) == "世界 ends here "


def test_probabilities_top_tokens_and_logits_on_request(tiny):
    ids = _prompts(tiny.tokenizer, count=1, seed=14)[0]
    generator = tiny.generator()
    job = DynamicJob(
        ids,
        3,
        stop_conditions=[],
        gen_settings=GREEDY,
        return_probs=True,
        return_top_tokens=4,
        return_logits=True,
    )
    generator.enqueue(job)
    streaming = []
    while generator.num_remaining_jobs():
        streaming += [r for r in generator.iterate() if r["stage"] == "streaming"]
    vocab = tiny.model.config.vocab_size
    for r in streaming:
        token = r["token_ids"][0, 0].item()
        assert r["token_probs"].shape == (1, 1) and 0 < r["token_probs"].item() <= 1
        assert r["top_k_tokens"].shape == r["top_k_probs"].shape == (1, 1, 4)
        assert r["top_k_tokens"][0, 0, 0].item() == token  # greedy picks the most likely
        probs = r["top_k_probs"][0, 0].tolist()
        assert probs == sorted(probs, reverse=True)
        assert r["logits"].shape == (1, 1, vocab)
        assert r["logits"][0, 0].argmax().item() == token
    plain = DynamicJob(ids, 2, stop_conditions=[])
    generator.enqueue(plain)
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            assert not {"token_probs", "top_k_tokens", "logits"} & set(r)
