"""Speculative sampling is lossless: with speculation, sampled tokens follow exactly the
distribution non-speculative sampling gives (chi-square tests at a fixed significance, fixed
seeds), for a draft model whose distribution differs on purpose and for n-gram drafts.

Each test also checks its power: with its sample count it would reject, with probability
>= 90%, a distribution with 2% of the probability moved between the two likeliest outcomes.
The draft-model run through the generator is marked slow (minutes on two cores); the batched
rejection sampler's own test covers sampled drafts in the default selection."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chi2, ncx2

from engine import DynamicJob, Model, PagedCache, SamplerSettings
from engine.generator import DynamicGenerator
from engine.sampling import SampleRequest
from engine.speculative.rejection import DraftRows, verify
from tests.hf_models import build_model, reference_model

ALPHA = 0.01  # significance of every test here (fixed seeds: the outcome is deterministic)
SHIFT = 0.02


def _pooled(counts: Counter, expected: dict, n: int) -> tuple[list[int], list[float]]:
    """Observed and expected counts per outcome; outcomes expected < 5 times pooled."""
    unexpected = n - sum(counts.get(o, 0) for o in expected)
    assert unexpected == 0, f"{unexpected} samples outside the support"
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, p in expected.items():
        if p * n < 5:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += p * n
        else:
            obs.append(counts.get(outcome, 0))
            exp.append(p * n)
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    return obs, exp


def _assert_matches(counts: Counter, expected: dict, n: int) -> None:
    """Chi-square goodness of fit at ALPHA, and the test's power: the chance that it rejects
    a distribution with 2% of the mass moved between the two likeliest outcomes (the hardest
    such shift to see) is at least 90% with ``n`` samples."""
    obs, exp = _pooled(counts, expected, n)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(exp) - 1
    assert chi2.sf(stat, dof) > ALPHA, (stat, dof)
    first, second = sorted(expected.values(), reverse=True)[:2]
    noncentrality = n * SHIFT**2 * (1 / first + 1 / second)
    assert ncx2.sf(chi2.isf(ALPHA, dof), dof, noncentrality) >= 0.9, (n, noncentrality)


# -- the rejection sampler alone: many rows in one batched call -----------------------------


class _FakeJob:
    def __init__(self, seed: int, settings: SamplerSettings):
        self.rng = random.Random(seed)
        self.settings = settings

    def sample_request(self, ahead=()) -> SampleRequest:
        return SampleRequest(settings=self.settings, rng=self.rng)


@pytest.mark.parametrize("kind", ["sampled_draft", "deterministic_draft"])
def test_rejection_sampler_first_two_tokens_follow_p(kind):
    n, k = 30000, 2
    p = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05])
    q = torch.tensor([0.10, 0.15, 0.30, 0.40, 0.05])  # deliberately unlike p
    logits = p.log().expand(n * (k + 1), -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        job = _FakeJob(i, SamplerSettings())
        if kind == "sampled_draft":
            drafts = torch.multinomial(q, k, replacement=True, generator=gen).tolist()
            rows.append(DraftRows(job, tuple(drafts), q.expand(k, -1)))
        else:
            rows.append(DraftRows(job, (0, 3)))  # an n-gram guess: no q
    out = verify(rows, logits)
    expected = {t: float(p[t]) for t in range(5)}
    _assert_matches(Counter(v.tokens[0] for v in out), expected, n)
    second = [v.tokens[1] for v in out if len(v.tokens) > 1]  # after an accepted first draft
    _assert_matches(Counter(second), expected, len(second))


# -- through the generator: the first 3 tokens of seeded jobs -------------------------------

SETTINGS = SamplerSettings(temperature=1.0, top_k=3)


@dataclass
class Pair:
    target: Model
    draft: Model
    reference: torch.nn.Module


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory) -> Pair:
    """A 3-layer target and its 1-layer truncation (same seed, tied embeddings: the same
    embedding, first layer and head), whose distribution differs from the target's."""
    folders = []
    for layers in (3, 1):
        folder = tmp_path_factory.mktemp(f"qwen{layers}")
        tok = tiny.tokenizer
        build_model(folder, "qwen2_tied", vocab_size=tok.vocab_size, num_hidden_layers=layers)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny.folder / name, folder / name)
        folders.append(folder)
    target, draft = (Model.from_pretrained(f) for f in folders)
    return Pair(target, draft, reference_model(folders[0]))


def _expected_first_three(reference, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The exact joint distribution of 3 tokens under top-k 3 sampling (transformers)."""
    dist = {(): 1.0}
    for _ in range(3):
        grown = {}
        for prefix, mass in dist.items():
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + list(prefix)])).logits[0, -1].float()
            values, ids = logits.topk(3)
            for prob, token in zip(values.softmax(-1).tolist(), ids.tolist(), strict=True):
                grown[(*prefix, token)] = mass * prob
        dist = grown
    return dist


def _looping_prompt(pair: Pair, tokenizer) -> list[int]:
    """A prompt followed by the target's own greedy continuation: sampled tokens then often
    recur in it, so n-gram drafts are proposed (and sometimes right)."""
    base = tokenizer.encode("the cat sat on the mat")[0].tolist()
    gen = DynamicGenerator(pair.target, PagedCache(pair.target, 512, page_size=4), tokenizer)
    job = DynamicJob(base, 40, stop_conditions=[], gen_settings=SamplerSettings.greedy())
    gen.enqueue(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    return base + job.new_token_ids


def _sample_first_three(generator, prompt: list[int], n: int) -> Counter:
    for seed in range(n):
        job = DynamicJob(prompt, 3, stop_conditions=[], gen_settings=SETTINGS, seed=seed)
        generator.enqueue(job)
    counts = Counter()
    while generator.num_remaining_jobs():
        for r in generator.iterate():
            if r["eos"]:
                counts[tuple(r["job"].new_token_ids)] += 1
    return counts


@pytest.mark.parametrize("method", [pytest.param("draft_model", marks=pytest.mark.slow), "ngram"])
def test_first_three_tokens_follow_plain_sampling(tiny, pair, method):
    prompt = _looping_prompt(pair, tiny.tokenizer)
    kwargs = {"use_ngram_draft": True}
    if method == "draft_model":
        kwargs = {"draft_model": pair.draft, "draft_cache": PagedCache(pair.draft, 8192, 4)}
    cache = PagedCache(pair.target, 8192, page_size=4)
    gen = DynamicGenerator(
        pair.target,
        cache,
        tiny.tokenizer,
        max_batch_size=256,
        max_chunk_size=4096,
        num_draft_tokens=2,
        **kwargs,
    )
    gen.speculator.policy.adaptive = False  # always k = 2: every draft path is exercised
    n = 4000
    counts = _sample_first_three(gen, prompt, n)
    stats = gen.stats()
    assert stats["spec_draft_tokens_accepted"] > 0.1 * n, stats
    assert stats["spec_draft_tokens_proposed"] > 2 * stats["spec_draft_tokens_accepted"], stats
    _assert_matches(counts, _expected_first_three(pair.reference, prompt), n)
