"""Features built separately meet in one generator: a CFG pair beside n-gram speculation,
quantized pages under n-gram and draft-model speculation and under constrained decoding, and
the combinations that are refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import DynamicGenerator, DynamicJob, MMEmbedding, PagedCache, SamplerSettings
from engine.constraints import JSONSchemaFilter
from tests.engine.conftest import assert_no_pages_in_use, run_to_end
from tests.engine.test_constraints import WORD_AND_NUMBER_SCHEMA as SCHEMA

PROMPTS = ["the quick red fox jumps over the quick red fox jumps over", "a b c a b c a b c a"]


def _ids(tiny, text: str) -> list[int]:
    return tiny.tokenizer.encode(text)[0].tolist()


def _jobs(tiny) -> list[DynamicJob]:
    greedy = SamplerSettings.greedy()
    guided = SamplerSettings(temperature=0.0, cfg_scale=1.5)
    pair = [_ids(tiny, PROMPTS[0]), _ids(tiny, "blue window")]
    return [
        DynamicJob(pair, 12, stop_conditions=[], gen_settings=guided),
        *(DynamicJob(_ids(tiny, p), 12, stop_conditions=[], gen_settings=greedy) for p in PROMPTS),
    ]


def test_cfg_pair_beside_ngram_speculation_matches_plain(tiny) -> None:
    plain = run_to_end(tiny.generator(), _jobs(tiny))
    speculating = tiny.generator(use_ngram_draft=True)
    speculating.speculator.policy.max_step_tokens = 256  # every eligible job drafts
    assert run_to_end(speculating, _jobs(tiny)) == plain
    assert speculating.stats()["spec_draft_tokens_proposed"] > 0  # the plain jobs did draft


def test_ngram_speculation_on_quantized_pages_matches_plain_on_the_same_pages(tiny, tiny32) -> None:
    def generator(**kwargs) -> DynamicGenerator:
        cache = PagedCache(tiny32.model, 4096, page_size=4, quant="q8")
        return DynamicGenerator(tiny32.model, cache, tiny32.tokenizer, **kwargs)

    def jobs() -> list[DynamicJob]:
        greedy = SamplerSettings.greedy()
        return [
            DynamicJob(_ids(tiny, p), 12, stop_conditions=[], gen_settings=greedy) for p in PROMPTS
        ]

    speculating = generator(use_ngram_draft=True)
    speculating.speculator.policy.max_step_tokens = 256
    assert run_to_end(speculating, jobs()) == run_to_end(generator(), jobs())


def _q4_cache(model, sink_pages: int = 0) -> PagedCache:
    return PagedCache(model, 4096, page_size=4, quant="q4", sink_pages=sink_pages)


@pytest.mark.parametrize("sink_pages", [0, 4])
def test_draft_model_speculation_on_q4_pages_matches_plain_on_the_same_pages(
    tiny, tiny32, sink_pages
) -> None:
    """Target and draft both read 4-bit pages (with sink pages: first pages unquantized in
    both): the verified tokens are the target's own greedy tokens on those pages, whatever
    the draft proposed."""

    def jobs() -> list[DynamicJob]:
        greedy = SamplerSettings.greedy()
        return [
            DynamicJob(_ids(tiny, p), 12, stop_conditions=[], gen_settings=greedy) for p in PROMPTS
        ]

    model = tiny32.model
    plain_cache = _q4_cache(model, sink_pages)
    plain = run_to_end(DynamicGenerator(model, plain_cache, tiny32.tokenizer), jobs())
    speculating = DynamicGenerator(
        model,
        _q4_cache(model, sink_pages),
        tiny32.tokenizer,
        draft_model=model,
        draft_cache=_q4_cache(model, sink_pages),
        num_draft_tokens=3,
    )
    speculating.speculator.policy.max_step_tokens = 256  # every job drafts
    assert run_to_end(speculating, jobs()) == plain
    stats = speculating.stats()
    assert stats["spec_draft_tokens_proposed"] > 0
    # the draft is the target on identically quantized pages: nearly every guess is right
    assert stats["spec_draft_tokens_accepted"] > stats["spec_draft_tokens_proposed"] // 2


def _schema_job(tiny, seed: int) -> DynamicJob:
    ids = tiny.tokenizer.encode("The quick brown fox")[0]
    filters = [JSONSchemaFilter(SCHEMA)]
    return DynamicJob(ids, 48, filters=filters, seed=seed, identifier=seed)


def test_constrained_decoding_on_q4_pages_is_valid_and_batch_independent(tiny, tiny32) -> None:
    model = tiny32.model

    def completions(seeds: list[int]) -> dict[int, str]:
        generator = DynamicGenerator(model, _q4_cache(model), tiny32.tokenizer)
        for seed in seeds:
            generator.enqueue(_schema_job(tiny, seed))
        finals = {}
        while generator.num_remaining_jobs():
            for r in generator.iterate():
                if r["eos"]:
                    finals[r["identifier"]] = r
        assert_no_pages_in_use(generator)
        for r in finals.values():
            assert r["eos_reason"] in ("end_filter", "stop_token"), r["full_completion"]
            jsonschema.validate(json.loads(r["full_completion"]), SCHEMA)
        return {seed: r["full_completion"] for seed, r in finals.items()}

    batched = completions(list(range(4)))
    alone = {}
    for seed in range(4):
        alone |= completions([seed])
    assert batched == alone


def test_refused_combinations_name_what_is_refused(tiny) -> None:
    guided = SamplerSettings(temperature=0.0, cfg_scale=1.5)
    pair = [_ids(tiny, PROMPTS[0]), _ids(tiny, "blue window")]
    with pytest.raises(ValueError, match=r"CFG job .* cannot use \['banned_strings'\]"):
        DynamicJob(pair, 4, gen_settings=guided, banned_strings=["fox"])
    with pytest.raises(ValueError, match="return_logprobs"):
        DynamicJob(pair, 4, gen_settings=guided, return_logprobs=2)
    rows = torch.zeros(2, tiny.model.config.hidden_size, dtype=tiny.model.dtype)
    embedding = MMEmbedding(rows)
    ids = tiny.tokenizer.encode(f"look {embedding.text_alias} here", embeddings=[embedding])
    job = DynamicJob(ids, 4, embeddings=[embedding])
    draft = tiny.model
    generator = tiny.generator(draft_model=draft, draft_cache=PagedCache(draft, 4096, page_size=4))
    with pytest.raises(ValueError, match="embeddings cannot run on a generator with a draft"):
        generator.enqueue(job)
