"""Prompt log-probabilities (``return_prompt_logprobs``): every prompt token after the first
scored from the logits of the position before it, checked against a direct forward of the
whole prompt and against transformers; over several prompt chunks, beside other jobs (whose
tokens do not change), with the prompt's pages already cached (the job computes them
again), through a preemption, and refused where a feature would change the prompt."""

from __future__ import annotations

import pytest
import torch

from engine import DynamicJob, GenerationRequest, SamplerSettings
from engine.embeddings import MMEmbedding
from engine.model.runner import PERSISTENT_BATCH_ENV
from tests.engine.conftest import assert_no_pages_in_use

TEXT = "the quick brown fox jumps over the lazy dog and then the cat sat on the warm mat"


def _prompt(tiny, text: str = TEXT) -> list[int]:
    return tiny.tokenizer.encode(text)[0].tolist()


def _reference(tiny, ids: list[int], k: int) -> list[tuple[int, float, list[int], list[float]]]:
    """From one direct forward of the prompt: (token, logprob, top ids, top logprobs)."""
    logits = tiny.model.logits(ids)[:, : tiny.tokenizer.vocab_size].float()
    logprobs = torch.log_softmax(logits, -1)
    out = []
    for p in range(len(ids) - 1):
        top = logprobs[p].topk(k)
        token = ids[p + 1]
        out.append((token, logprobs[p, token].item(), top.indices.tolist(), top.values.tolist()))
    return out


def _run(generator, jobs) -> dict[object, dict]:
    """Each job's prompt logprobs (gathered over its prefill results) and new tokens."""
    for job in jobs:
        generator.enqueue(job)
    got = {job.identifier: {"prompt": [], "tokens": []} for job in jobs}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            got[r["identifier"]]["prompt"] += r.get("prompt_logprobs", [])
            if r["stage"] == "streaming" and "token_ids" in r:
                got[r["identifier"]]["tokens"] += r["token_ids"][0].tolist()
    assert_no_pages_in_use(generator)
    return got


def _assert_matches(got, expected) -> None:
    assert [e[0] for e in got] == [e[0] for e in expected]
    assert [e[1] for e in got] == pytest.approx([e[1] for e in expected], abs=1e-4)
    assert [e[2] for e in got] == [e[2] for e in expected]
    for g, e in zip(got, expected, strict=True):
        assert g[3] == pytest.approx(e[3], abs=1e-4)


@pytest.mark.parametrize("persistent", ["1", "0"])  # both batch builders
def test_prompt_logprobs_over_chunks_beside_other_jobs(tiny, monkeypatch, persistent) -> None:
    monkeypatch.setenv(PERSISTENT_BATCH_ENV, persistent)
    ids = _prompt(tiny)
    assert len(ids) > 20
    generator = tiny.generator(max_chunk_size=8)  # several prompt chunks, shared steps
    greedy = {"stop_conditions": [], "gen_settings": SamplerSettings.greedy()}
    scored = DynamicJob(ids, 5, identifier="scored", return_prompt_logprobs=3, **greedy)
    plain = DynamicJob(ids[:-3], 5, identifier="plain", **greedy)
    got = _run(generator, [scored, plain])
    _assert_matches(got["scored"]["prompt"], _reference(tiny, ids, 3))
    assert got["plain"]["prompt"] == []
    # the sampled rows are untouched: the same greedy tokens as jobs run without scoring
    alone = _run(tiny.generator(max_chunk_size=8), [
        DynamicJob(ids, 5, identifier="scored", **greedy),
        DynamicJob(ids[:-3], 5, identifier="plain", **greedy),
    ])  # fmt: skip
    assert got["scored"]["tokens"] == alone["scored"]["tokens"]
    assert got["plain"]["tokens"] == alone["plain"]["tokens"]


def test_prompt_logprobs_match_transformers(tiny) -> None:
    ids = _prompt(tiny, "a short prompt to score")
    got = _run(tiny.generator(), [DynamicJob(ids, 1, identifier="j", return_prompt_logprobs=0)])
    with torch.no_grad():
        hf = tiny.reference()(torch.tensor([ids])).logits[0, :, : tiny.tokenizer.vocab_size]
    expected = torch.log_softmax(hf.float(), -1)
    values = [expected[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    entries = got["j"]["prompt"]
    assert [e[1] for e in entries] == pytest.approx(values, abs=1e-4)
    assert all(e[2] == [] and e[3] == [] for e in entries)  # k = 0: no alternatives


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny) -> None:
    ids = _prompt(tiny)
    generator = tiny.generator()
    _run(generator, [DynamicJob(ids, 2, identifier="warm")])  # leaves the pages cached
    scored = DynamicJob(ids, 2, identifier="scored", return_prompt_logprobs=1)
    reused = DynamicJob(ids, 2, identifier="reused")
    got = _run(generator, [scored])
    _assert_matches(got["scored"]["prompt"], _reference(tiny, ids, 1))
    assert scored.seq.cached_tokens == 0
    _run(generator, [reused])
    assert reused.seq.cached_tokens > 0  # the others still share them


def test_prompt_logprobs_survive_preemptions(tiny) -> None:
    """A cache far too small for eight jobs: some are preempted and compute their prompts
    again; each prompt's logprobs come once, still right, and the tokens are those of a roomy
    cache."""
    ids = _prompt(tiny)
    prompts = [ids[i : i + n] for i, n in enumerate((20, 24, 16, 28, 9, 13, 22, 18))]

    def jobs():
        return [
            DynamicJob(p, 20, stop_conditions=[], identifier=i,
                       gen_settings=SamplerSettings.greedy(), return_prompt_logprobs=2)
            for i, p in enumerate(prompts)
        ]  # fmt: skip

    small = tiny.generator(max_num_tokens=64, page_size=4, max_chunk_size=8)
    got = _run(small, jobs())
    assert small.stats()["preemptions"] > 0
    roomy = _run(tiny.generator(max_chunk_size=8), jobs())
    for i, p in enumerate(prompts):
        _assert_matches(got[i]["prompt"], _reference(tiny, p, 2))
        assert got[i]["tokens"] == roomy[i]["tokens"]


def test_combinations_that_change_the_prompt_are_refused(tiny) -> None:
    with pytest.raises(ValueError, match="token_healing"):
        DynamicJob([1, 2, 3], 2, token_healing=True, return_prompt_logprobs=1)
    embedding = MMEmbedding(torch.zeros(2, tiny.model.config.hidden_size))
    with pytest.raises(ValueError, match="embeddings"):
        DynamicJob([1, *embedding.placeholder_ids], 2, embeddings=[embedding],
                   return_prompt_logprobs=1)  # fmt: skip
    with pytest.raises(ValueError, match="return_prompt_logprobs"):
        DynamicJob([[1, 2], [3]], 2, gen_settings=SamplerSettings(cfg_scale=2.0),
                   return_prompt_logprobs=0)  # fmt: skip
    with pytest.raises(ValueError, match="return_logprobs must be None or an int"):
        DynamicJob([1, 2], 2, return_prompt_logprobs=-1)
    one = DynamicJob([7], 1, return_prompt_logprobs=3)  # nothing to score
    assert not one.seq.prompt_logits
    request = GenerationRequest(prompt_ids=(1, 2, 3), max_new_tokens=2, prompt_logprobs=2)
    assert DynamicJob.from_request(request).return_prompt_logprobs == 2


def test_a_scored_prompt_computes_a_bounded_chunk_per_step(tiny, monkeypatch) -> None:
    """Every position of a scored chunk returns logits over the vocabulary: its chunks are
    capped (at 256 tokens; 5 here), the other jobs' are not."""
    monkeypatch.setattr("engine.scheduler.PROMPT_LOGITS_CHUNK", 5)
    ids = _prompt(tiny)
    generator = tiny.generator(max_chunk_size=64)
    scored = DynamicJob(ids, 1, identifier="scored", return_prompt_logprobs=0)
    plain = DynamicJob(ids[1:], 1, identifier="plain")
    sizes: dict[str, list[int]] = {"scored": [], "plain": []}
    generator.enqueue(scored)
    generator.enqueue(plain)
    collected = []
    while generator.num_remaining_jobs():
        plan_entries = []
        original = generator.runner.forward_plan

        def spy(plan, patch=None, original=original, seen=plan_entries):
            seen.extend(plan.entries)
            return original(plan, patch)

        generator.runner.forward_plan = spy
        for r in generator.iterate():
            collected += r.get("prompt_logprobs", []) if r["identifier"] == "scored" else []
        generator.runner.forward_plan = original
        for e in plan_entries:  # (one new token each: every entry is a prompt chunk)
            sizes[e.seq.owner.identifier].append(e.num_tokens)
    assert max(sizes["scored"]) == 5 and sum(sizes["scored"]) == len(ids)
    assert max(sizes["plain"]) > 5
    _assert_matches(collected, _reference(tiny, ids, 0))


def test_a_prompt_id_past_the_tokenizers_vocabulary_scores_minus_infinity(tiny) -> None:
    """A model's padded embedding rows take ids the tokenizer lacks: such a prompt token has
    no probability under the vocabulary's distribution (and no gather past its rows)."""
    ids = _prompt(tiny, "pad me")
    job = DynamicJob(ids, 1, identifier="j", return_prompt_logprobs=1)
    vocab = tiny.tokenizer.vocab_size
    logits = torch.randn(len(ids) - 1, vocab + 8)
    job.seq.tokens[2] = vocab + 3  # as if the prompt held a padded row's id
    job.receive_prompt_logits(0, logits, vocab)
    values = [e[1] for e in job.prompt_logprobs]
    assert values[1] == float("-inf") and all(
        v > float("-inf") for i, v in enumerate(values) if i != 1
    )
    assert all(e[2][0] < vocab for e in job.prompt_logprobs)
