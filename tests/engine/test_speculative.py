"""Speculative decoding end to end: greedy output equals non-speculative greedy output with
n-gram drafts and with draft models (a perfect one, a truncated one, a random one), under
shared prefixes, preemption mid-speculation, and stops that land inside an accepted run."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings
from tests.engine.conftest import assert_no_pages_in_use, simulator_model_folder
from tests.hf_models import build_model

GREEDY = SamplerSettings.greedy()
TEXT = "the cat sat on a mat and the dog ran under the red tree by the river"
WORDS = TEXT.split()


def _prompts(tokenizer, count: int = 32, seed: int = 0) -> list[list[int]]:
    """Groups sharing long prefixes; repetitive text so n-gram drafts find matches."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (30, 18, 9, 0)]
    out = []
    for i in range(count):
        tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        out.append(tokenizer.encode((prefixes[i % 4] + " " + tail).strip())[0].tolist())
    return out


def _run(generator, prompts, max_new_tokens=16, **job_kwargs) -> list[dict]:
    job_kwargs.setdefault("gen_settings", GREEDY)
    job_kwargs.setdefault("stop_conditions", [])
    for i, ids in enumerate(prompts):
        generator.enqueue(DynamicJob(ids, max_new_tokens, identifier=i, **job_kwargs))
    finals, streamed = {}, {i: [] for i in range(len(prompts))}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming":
                streamed[result["identifier"]].append(result)
            if result["eos"]:
                finals[result["identifier"]] = result
    assert_no_pages_in_use(generator)
    for i, final in finals.items():  # the streamed pieces add up to the final result
        pieces = streamed[i]
        assert "".join(r["text"] for r in pieces) == final["full_completion"]
        assert torch.cat([r["token_ids"] for r in pieces], 1)[0].tolist() == (
            final["job"].new_token_ids
        )
    return [finals[i] for i in range(len(prompts))]


def _tokens(results) -> list[list[int]]:
    return [r["job"].new_token_ids for r in results]


@pytest.fixture(scope="module")
def shapes(tiny, tmp_path_factory):
    """Two target shapes with the tiny tokenizer, and draft models for each: the target
    itself (every draft right), a 1-layer truncation, an unrelated random model."""
    tok = tiny.tokenizer
    common = {"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_token_id}

    def load(variant, seed=0, **kw):
        folder = tmp_path_factory.mktemp(variant)
        build_model(folder, variant, seed=seed, **{**common, **kw})
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny.folder / name, folder / name)
        return Model.from_pretrained(folder)

    return {
        "llama": (
            tiny.model,
            Model.from_pretrained(tiny.folder),
            load("llama_gqa", 0, num_hidden_layers=1),
        ),
        "qwen2": (
            load("qwen2_tied", 3),
            load("qwen2_tied", 3),
            load("qwen2_tied", 9, num_hidden_layers=1),
        ),
        "odd_vocab": load("llama_gqa", 0, num_hidden_layers=1, vocab_size=tok.vocab_size + 8),
    }


def _generator(model, tokenizer, max_num_tokens=4096, page_size=4, draft=None, **kwargs):
    cache = PagedCache(model, max_num_tokens, page_size=page_size)
    if draft is not None:
        kwargs["draft_model"] = draft
        kwargs["draft_cache"] = PagedCache(draft, max_num_tokens, page_size=page_size)
    return DynamicGenerator(model, cache, tokenizer, **kwargs)


def test_ngram_greedy_equals_plain_32_jobs(tiny):
    prompts = _prompts(tiny.tokenizer)
    plain = _run(tiny.generator(max_chunk_size=48), prompts)
    gen = tiny.generator(max_chunk_size=48, use_ngram_draft=True)
    gen.speculator.policy.max_step_tokens = 256  # every job drafts: the most verification
    spec = _run(gen, prompts)
    assert _tokens(spec) == _tokens(plain)
    stats = gen.stats()
    assert stats["spec_draft_tokens_accepted"] > 0 and stats["cached_tokens_total"] > 0
    assert sum(r["accepted_draft_tokens"] for r in spec) == stats["spec_draft_tokens_accepted"]
    assert any(r["rejected_draft_tokens"] for r in spec)


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
@pytest.mark.parametrize("which", [1, 2])  # the target itself, a 1-layer model
def test_draft_model_greedy_equals_plain(tiny, shapes, shape, which):
    target, draft = shapes[shape][0], shapes[shape][which]
    prompts = _prompts(tiny.tokenizer, count=32, seed=1)
    plain = _run(_generator(target, tiny.tokenizer, max_chunk_size=48), prompts)
    gen = _generator(target, tiny.tokenizer, max_chunk_size=48, draft=draft, num_draft_tokens=3)
    gen.speculator.policy.max_step_tokens = 256
    spec = _run(gen, prompts)
    assert _tokens(spec) == _tokens(plain)
    stats = gen.stats()
    assert stats["spec_draft_tokens_proposed"] > 0
    if which == 1:  # the target as its own draft: (nearly) every draft is right
        assert stats["spec_acceptance_rate"] > 0.9


def test_preemption_mid_speculation_matches_plain(tiny, shapes):
    prompts = _prompts(tiny.tokenizer, count=8, seed=5)
    plain = _run(tiny.generator(), prompts, max_new_tokens=20)
    for kwargs in ({"use_ngram_draft": True}, {"draft": shapes["llama"][1]}):
        gen = _generator(tiny.model, tiny.tokenizer, 26 * 4, max_chunk_size=32, **kwargs)
        gen.speculator.policy.max_step_tokens = 256
        spec = _run(gen, prompts, max_new_tokens=20)
        assert gen.stats()["preemptions"] > 0, kwargs
        assert gen.stats()["spec_draft_tokens_accepted"] > 0, kwargs
        assert _tokens(spec) == _tokens(plain), kwargs
        gen.cache.page_table.check_invariants()


def _accepted_runs(tiny, draft, prompt, max_new_tokens):
    """Per streaming result of a perfect-draft run: the tokens it brought (runs of several)."""
    gen = _generator(tiny.model, tiny.tokenizer, draft=draft, num_draft_tokens=4)
    gen.enqueue(DynamicJob(prompt, max_new_tokens, stop_conditions=[], gen_settings=GREEDY))
    runs = []
    while gen.num_remaining_jobs():
        runs += [r["token_ids"][0].tolist() for r in gen.iterate() if r["stage"] == "streaming"]
    return runs


def test_stops_inside_an_accepted_run(tiny, shapes):
    """Stop strings, stop tokens and max_new_tokens that fall in the middle of a run of
    accepted drafts end the job exactly where the plain generator ends it."""
    draft = shapes["llama"][1]
    prompt = _prompts(tiny.tokenizer, count=1, seed=7)[0]
    runs = _accepted_runs(tiny, draft, prompt, 24)
    index = next(i for i, r in enumerate(runs) if len(r) >= 3 and i > 0)
    before = sum(len(r) for r in runs[:index])
    middle = runs[index][1]  # a token inside the run
    text = tiny.tokenizer.decode(runs[index][:2])
    cases = [
        {"stop_conditions": [middle]},
        {"max_new_tokens": before + 2},
        {"stop_conditions": [text[-2:] if len(text) >= 2 else text]},
    ]
    for case in cases:
        kw = {"max_new_tokens": 24, **case}
        n = kw.pop("max_new_tokens")
        (plain,) = _run(tiny.generator(), [prompt], n, **kw)
        gen = _generator(tiny.model, tiny.tokenizer, draft=draft, num_draft_tokens=4)
        (spec,) = _run(gen, [prompt], n, **kw)
        assert spec["accepted_draft_tokens"] > 0
        for key in ("full_completion", "new_tokens", "eos_reason"):
            assert spec[key] == plain[key], (case, key)
        assert spec["job"].new_token_ids == plain["job"].new_token_ids


def test_seeded_sampling_with_ngrams_is_the_plain_stream(tiny):
    """n-gram drafts are deterministic: a seeded job emits the very tokens it emits without
    speculation (one uniform per emitted token), whatever is accepted."""
    settings = SamplerSettings(temperature=0.3, top_k=5, repetition_penalty=1.05)
    prompts = _prompts(tiny.tokenizer, count=6, seed=2)
    kw = {"gen_settings": settings, "seed": 11}
    plain = _run(tiny.generator(), prompts, 24, **kw)
    gen = tiny.generator(use_ngram_draft=True)
    gen.speculator.policy.max_step_tokens = 256
    spec = _run(gen, prompts, 24, **kw)
    assert _tokens(spec) == _tokens(plain)
    assert gen.stats()["spec_draft_tokens_accepted"] > 0


def test_constructor_checks(tiny, shapes):
    model, tok = tiny.model, tiny.tokenizer
    cache = PagedCache(model, 256, page_size=4)
    draft = shapes["llama"][2]
    with pytest.raises(ValueError, match="paged"):
        DynamicGenerator(model, cache, tok, paged=False)
    with pytest.raises(ValueError, match="sampling_threads"):
        DynamicGenerator(model, cache, tok, max_sampling_threads=4)
    with pytest.raises(ValueError, match="together"):
        DynamicGenerator(model, cache, tok, draft_model=draft)
    with pytest.raises(ValueError, match="ngram"):
        DynamicGenerator(
            model,
            cache,
            tok,
            draft_model=draft,
            draft_cache=PagedCache(draft, 256, page_size=4),
            use_ngram_draft=True,
        )
    with pytest.raises(ValueError, match="match the cache"):
        DynamicGenerator(
            model, cache, tok, draft_model=draft, draft_cache=PagedCache(draft, 128, page_size=4)
        )
    with pytest.raises(ValueError, match="different model"):
        DynamicGenerator(
            model, cache, tok, draft_model=draft, draft_cache=PagedCache(model, 256, page_size=4)
        )
    with pytest.raises(ValueError, match="max_q_size"):
        DynamicGenerator(model, cache, tok, use_ngram_draft=True, num_draft_tokens=4, max_q_size=4)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        DynamicGenerator(model, cache, tok, use_ngram_draft=True, num_draft_tokens=0)
    odd = shapes["odd_vocab"]
    with pytest.raises(ValueError, match="vocabulary"):
        DynamicGenerator(
            model, cache, tok, draft_model=odd, draft_cache=PagedCache(odd, 256, page_size=4)
        )
    gen = DynamicGenerator(model, cache, tok, use_ngram_draft=True, num_draft_tokens=3)
    assert gen.scheduler.config.max_q_size == 4 and gen.num_draft_tokens == 3
    assert DynamicGenerator(model, cache, tok).num_draft_tokens == 0


def _repeating_prompts(generator, tokenizer) -> list[list[int]]:
    """A prompt, its continuation by ``generator``, the prompt again (n-grams propose that
    continuation), and a short unrelated prompt beside it."""
    base = tokenizer.encode("the cat sat on the mat")[0].tolist()
    (first,) = _tokens(_run(generator, [base], 4))
    return [base + first + base, [200, 7]]


def test_speculation_through_cuda_kernels_matches_plain(tiny, tmp_path_factory, monkeypatch):
    """Kernel path (simulator on CPU): 1 + k verification rows through the Numba attention
    and cache-write kernels give the plain greedy tokens, with n-grams and a draft model."""
    from engine.ops import OPS_ENV

    folder = simulator_model_folder(tiny, tmp_path_factory.mktemp("sim_spec"))
    monkeypatch.setenv(OPS_ENV, "torch")  # (a quick continuation to build the prompt from)
    reference = Model.from_pretrained(folder)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model, draft = Model.from_pretrained(folder), Model.from_pretrained(folder)
    assert model.ops.name == "cuda"
    prompts = _repeating_prompts(_generator(reference, tiny.tokenizer, 256), tiny.tokenizer)
    plain = _tokens(_run(_generator(model, tiny.tokenizer, 256), prompts, 4))
    for kwargs in ({"use_ngram_draft": True}, {"draft": draft}):
        gen = _generator(model, tiny.tokenizer, 256, num_draft_tokens=2, **kwargs)
        gen.speculator.policy.adaptive = False
        assert _tokens(_run(gen, prompts, 4)) == plain, kwargs
        assert gen.stats()["spec_draft_tokens_proposed"] > 0, kwargs


def test_speculation_on_q4_pages_through_cuda_kernels_matches_plain(
    tiny, tmp_path_factory, monkeypatch
):
    """q4 pages through the CUDA op set (simulator): n-gram speculation gives the plain
    greedy tokens, and its verify steps' rows take the decode kernel (engine/ops.py
    ``CUDA_VERIFY_ROWS``), each token a row (the gather route gave the same tokens: both are
    exact up to rounding)."""
    from engine import ops
    from engine.ops import OPS_ENV

    folder = simulator_model_folder(tiny, tmp_path_factory.mktemp("sim_q4"), hidden_size=64)
    monkeypatch.setenv(OPS_ENV, "torch")  # (a quick continuation to build the prompt from)
    reference = Model.from_pretrained(folder)
    monkeypatch.setenv(OPS_ENV, "cuda")
    model = Model.from_pretrained(folder)
    all_on_kernel = []

    def split(batch, short=1):
        found = ops_split(batch, short)
        all_on_kernel.append(found is not None and found.rest is None)
        return found

    ops_split = ops.decode_split
    monkeypatch.setattr(ops, "decode_split", split)

    def generator(model=model, **kwargs) -> DynamicGenerator:
        return DynamicGenerator(model, PagedCache(model, 256, 4, "q4"), tiny.tokenizer, **kwargs)

    prompts = _repeating_prompts(generator(reference), tiny.tokenizer)
    plain = _tokens(_run(generator(), prompts, 4))
    gen = generator(use_ngram_draft=True, num_draft_tokens=2)
    gen.speculator.policy.adaptive = False
    assert _tokens(_run(gen, prompts, 4)) == plain
    assert gen.stats()["spec_draft_tokens_proposed"] > 0
    assert any(all_on_kernel)  # (a step of verifying rows only, every row on the kernel)


def test_jobs_with_per_token_extras_or_banned_strings_decode_plainly(tiny):
    """Probabilities, logprobs and banned strings are per-token mechanisms: those jobs get no
    drafts (and the same tokens), while a plain job beside them speculates."""
    prompt = _prompts(tiny.tokenizer, count=1, seed=3)[0]
    (plain,) = _run(tiny.generator(), [prompt], 12)
    gen = tiny.generator(use_ngram_draft=True)
    gen.speculator.policy.max_step_tokens = 256
    cases = [{"return_probs": True}, {"return_logprobs": 2}, {"banned_strings": ["zzzz"]}, {}]
    jobs = [DynamicJob(prompt, 12, stop_conditions=[], gen_settings=GREEDY, **c) for c in cases]
    for job in jobs:
        gen.enqueue(job)
    finals = {}
    while gen.num_remaining_jobs():
        finals.update({id(r["job"]): r for r in gen.iterate() if r["eos"]})
    for job, case in zip(jobs, cases, strict=True):
        final = finals[id(job)]
        assert job.new_token_ids == plain["job"].new_token_ids, case
        drafted = final["accepted_draft_tokens"] + final["rejected_draft_tokens"]
        assert (drafted > 0) == (not case), case
