"""Log-probabilities through the generator: every streamed token carries the model's logprob
(log_softmax of its raw logits, whatever the sampler settings) and top alternatives; a job
whose every token is banned ends alone with an error."""

from __future__ import annotations

import math

import pytest
import torch

from engine import DynamicJob, GenerationRequest, SamplerSettings


def _stream(generator, jobs) -> dict[object, list[dict]]:
    for job in jobs:
        generator.enqueue(job)
    results: dict[object, list[dict]] = {job.identifier: [] for job in jobs}
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["stage"] == "streaming":
                results[r["identifier"]].append(r)
    return results


@pytest.mark.parametrize(
    "settings", [SamplerSettings.greedy(), SamplerSettings(temperature=1.5, top_p=0.8)]
)
def test_token_logprobs_are_log_softmax_of_the_raw_logits(tiny, settings) -> None:
    ids = tiny.tokenizer.encode("the quick brown fox")[0].tolist()
    job = DynamicJob(
        ids,
        4,
        stop_conditions=[],
        gen_settings=settings,
        seed=3,
        identifier="a",
        return_logits=True,
        return_logprobs=3,
    )
    other = DynamicJob(ids, 4, stop_conditions=[], identifier="b")  # shares the batch
    results = _stream(tiny.generator(), [job, other])
    vocab = tiny.tokenizer.vocab_size
    assert len(results["a"]) == 4
    for r in results["a"]:
        token = r["token_ids"][0, 0].item()
        expected = torch.log_softmax(r["logits"][0, 0, :vocab].float(), -1)
        assert r["token_logprobs"].shape == (1, 1)
        assert r["token_logprobs"].item() == pytest.approx(expected[token].item(), abs=1e-4)
        top = expected.topk(3)
        assert r["top_logprob_ids"][0, 0].tolist() == top.indices.tolist()
        assert r["top_logprobs"][0, 0].tolist() == pytest.approx(top.values.tolist(), abs=1e-4)
        if settings.is_greedy:
            assert r["top_logprob_ids"][0, 0, 0].item() == token
    assert not any("token_logprobs" in r for r in results["b"])


def test_from_request_passes_logprobs(tiny) -> None:
    request = GenerationRequest(prompt_ids=(1, 2, 3), max_new_tokens=2, logprobs=0)
    job = DynamicJob.from_request(request)
    assert job.return_logprobs == 0
    assert DynamicJob.from_request(GenerationRequest((1,), 2)).return_logprobs is None
    with pytest.raises(ValueError, match="return_logprobs"):
        DynamicJob([1], 2, return_logprobs=-1)


def test_all_banned_job_fails_alone(tiny) -> None:
    ids = tiny.tokenizer.encode("hello there")[0].tolist()
    everything = dict.fromkeys(range(tiny.tokenizer.vocab_size), -math.inf)
    banned = DynamicJob(
        ids,
        3,
        gen_settings=SamplerSettings(token_bias=everything),
        identifier="banned",
        return_probs=True,
    )
    fine = DynamicJob(ids, 3, stop_conditions=[], identifier="fine", return_probs=True)
    generator = tiny.generator()
    results = _stream(generator, [banned, fine])
    assert [r["eos_reason"] for r in results["banned"]] == ["error"]
    assert "every token is banned" in str(results["banned"][0]["error"])
    assert len(results["fine"]) == 3 and results["fine"][-1]["eos_reason"] == "max_new_tokens"
    assert all(0 < r["token_probs"].item() <= 1 for r in results["fine"])
    assert generator.stats()["pages_in_use"] == 0


def test_logprobs_follow_tokens_held_and_rolled_back_by_banned_strings(tiny) -> None:
    """Banned strings hold tokens and release several in one result, or roll them back: each
    result's logprobs stay aligned with its token ids."""
    ids = tiny.tokenizer.encode("the quick brown fox")[0].tolist()
    greedy = SamplerSettings.greedy()
    plain = DynamicJob(ids, 12, stop_conditions=[], gen_settings=greedy, identifier="plain")
    text = "".join(r.get("text", "") for r in _stream(tiny.generator(), [plain])["plain"])
    banned = text[len(text) // 2 : len(text) // 2 + 3]
    assert banned.strip()
    job = DynamicJob(
        ids,
        12,
        stop_conditions=[],
        gen_settings=greedy,
        identifier="banned",
        banned_strings=[banned],
        return_logprobs=2,
    )
    results = _stream(tiny.generator(), [job])["banned"]
    assert banned.lower() not in job.full_completion.lower()
    counted = 0
    for r in results:
        if "token_ids" not in r:
            continue
        n = r["token_ids"].shape[1]
        counted += n
        assert r["token_logprobs"].shape == (1, n)
        assert r["top_logprob_ids"].shape == r["top_logprobs"].shape == (1, n, 2)
    assert counted == len(job.new_token_ids)
    assert any(r["token_ids"].shape[1] > 1 for r in results if "token_ids" in r)
