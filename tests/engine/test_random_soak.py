"""A random soak of the generator: many small configurations, each driven by a random stream of
jobs that arrive between steps, some cancelled mid-way, on caches small enough to preempt.

Each trial draws a cache (fp16, q8, q6 or q4; sink and recent pages; exact chunks or not; page
size; tokens), a batch size, a chunk budget and speculation (none, n-gram, or a draft model on
its own cache), then jobs with shared prefixes and a mix of greedy and sampled settings, stop
tokens, banned strings, a regex filter, token healing and logprobs. Whatever the mix, every job
must end by itself (length, a stop, or its cancel) without an error result, the generator must
finish its queue, and afterwards no page may stay in use and the page table must be consistent.
The trials are seeded: a failure names its seed and configuration."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine import DynamicGenerator, DynamicJob, Model, PagedCache, SamplerSettings, Tokenizer
from engine.constraints import RegexFilter

TRIALS = 32
MAX_STEPS = 3000


@dataclass
class Trial:
    quant: str
    page_size: int
    tokens: int
    max_batch_size: int
    max_chunk_size: int
    cache_options: dict = field(default_factory=dict)
    speculation: str = "none"  # none | ngram | draft

    @classmethod
    def draw(cls, rng: random.Random) -> Trial:
        quant = rng.choice(["fp16", "q8", "q6", "q4"])
        batch = rng.choice([2, 4, 8])
        page_size = rng.choice([4, 8, 16])
        tokens = rng.choice([64, 160, 400, 1200])
        options: dict = {}
        pages = tokens // page_size
        if quant != "fp16":
            options["exact_chunks"] = rng.random() < 0.5
            if rng.random() < 0.5 and batch <= pages // 2:
                options["sink_pages"] = batch
            if rng.random() < 0.5 and 2 * batch <= pages // 2:
                options["recent_pages"] = 2 * batch
        speculation = rng.choice(["none", "none", "ngram", "draft"])
        chunk = rng.choice([8, 16, 64])
        return cls(quant, page_size, tokens, batch, chunk, options, speculation)

    def generator(self, model: Model, tokenizer: Tokenizer) -> DynamicGenerator:
        def cache() -> PagedCache:
            return PagedCache(model, self.tokens, self.page_size, self.quant, **self.cache_options)

        drafts: dict = {}
        if self.speculation == "ngram":
            drafts = {"use_ngram_draft": True, "num_draft_tokens": 3}
        elif self.speculation == "draft":
            drafts = {"draft_model": model, "draft_cache": cache(), "num_draft_tokens": 3}
        return DynamicGenerator(
            model,
            cache(),
            tokenizer,
            max_batch_size=self.max_batch_size,
            max_chunk_size=self.max_chunk_size,
            **drafts,
        )


def random_job(rng: random.Random, prefixes: list[list[int]], vocab: int, max_seq_len: int, i: int):
    prompt = list(rng.choice(prefixes)) + [
        rng.randrange(3, vocab) for _ in range(rng.randrange(20))
    ]
    prompt = prompt[: max(1, max_seq_len // 2)]
    if rng.random() < 0.5:
        settings = SamplerSettings.greedy()
    else:
        settings = SamplerSettings(
            temperature=rng.choice([0.7, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
        )
    extra: dict = {}
    kind = rng.random()
    if kind < 0.08:
        extra["banned_strings"] = ["ab"]
    elif kind < 0.15:
        extra["filters"] = [RegexFilter(rng.choice([r"[a-z ]{1,12}", r"(yes|no)", r"[0-9]+"]))]
    elif kind < 0.2:
        extra["token_healing"] = True
    elif kind < 0.3:
        extra["return_logprobs"] = 2
    elif kind < 0.4:
        extra["stop_conditions"] = [rng.randrange(3, vocab)]
    return DynamicJob(
        prompt,
        max_new_tokens=rng.randrange(1, min(24, max_seq_len - len(prompt)) + 1),
        gen_settings=settings,
        seed=rng.randrange(1000),
        identifier=i,
        **extra,
    )


def soak(model: Model, tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    trial = Trial.draw(rng)
    generator = trial.generator(model, tokenizer)
    vocab = tokenizer.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(3)]
    wanted, made, live = rng.randrange(3, 14), 0, []
    for _ in range(MAX_STEPS):
        if made == wanted and not generator.num_remaining_jobs():
            break
        if made < wanted and rng.random() < 0.4:
            job = random_job(rng, prefixes, vocab, generator.max_seq_len, made)
            generator.enqueue(job)
            made += 1
            live.append(job)
        if live and rng.random() < 0.05:
            generator.cancel(rng.choice(live))
        for result in generator.iterate():
            assert result.get("eos_reason") != "error", (seed, trial, result)
        live = [job for job in live if not job.finished]
    assert made == wanted and not generator.num_remaining_jobs(), (seed, trial)
    stats = generator.stats()
    assert stats["pages_in_use"] == stats["jobs_running"] == stats["jobs_waiting"] == 0, (
        seed,
        trial,
        stats,
    )
    generator.cache.page_table.check_invariants()


def test_random_jobs_on_random_caches_all_end_cleanly(tiny32) -> None:
    # (tiny32: two layers with heads of 32, one quantization group)
    for seed in range(TRIALS):
        soak(tiny32.model, tiny32.tokenizer, seed)
