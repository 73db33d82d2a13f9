"""A tiny random-weight model with a real byte-level BPE tokenizer, shared by engine tests."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass

import pytest

from engine import DynamicGenerator, Model, PagedCache, Tokenizer
from tests.hf_models import build_model, reference_model
from tests.tokenizer_builders import build_byte_level_bpe


@dataclass
class Tiny:
    model: Model
    tokenizer: Tokenizer
    folder: object

    def generator(self, max_num_tokens: int = 4096, page_size: int = 4, **kwargs):
        cache = PagedCache(self.model, max_num_tokens, page_size=page_size)
        return DynamicGenerator(self.model, cache, self.tokenizer, **kwargs)

    def reference(self):
        return reference_model(self.folder)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    tok_dir = build_byte_level_bpe(tmp_path_factory.mktemp("tok"), vocab_size=600)
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    folder = tmp_path_factory.mktemp("tiny")
    build_model(
        folder,
        "llama_gqa",
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        num_hidden_layers=3,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    return Tiny(Model.from_pretrained(folder), Tokenizer.from_pretrained(folder), folder)


def assert_no_pages_in_use(generator: DynamicGenerator) -> None:
    stats = generator.stats()
    assert stats["pages_in_use"] == 0, stats
    assert stats["jobs_running"] == stats["jobs_waiting"] == 0, stats
    generator.cache.page_table.check_invariants()


def run_to_end(generator: DynamicGenerator, jobs: list) -> list[list[int]]:
    """Enqueue ``jobs``, iterate until every one finished, check that nothing stays
    referenced; the jobs' new token ids."""
    for job in jobs:
        generator.enqueue(job)
    while generator.num_remaining_jobs():
        generator.iterate()
    assert_no_pages_in_use(generator)
    return [job.new_token_ids for job in jobs]


def simulator_model_folder(tiny: Tiny, folder, hidden_size: int = 32):
    """A 1-layer model over the tiny tokenizer, small enough for the CUDA simulator (every GPU
    thread runs as a Python thread); ``hidden_size`` 64 gives heads of 32 (one quantization
    group)."""
    return build_model(
        folder,
        "llama_gqa",
        vocab_size=tiny.tokenizer.vocab_size,
        num_hidden_layers=1,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


class QuantTiny(Tiny):
    """``Tiny`` whose generators get a quantized cache."""

    quant: str = "fp16"
    rotate: bool | None = None
    sink_pages: int = 0
    exact_chunks: bool | None = None
    recent_pages: int = 0

    def generator(self, max_num_tokens: int = 4096, page_size: int = 4, **kwargs):
        cache = PagedCache(
            self.model,
            max_num_tokens,
            page_size,
            self.quant,
            self.rotate,
            sink_pages=self.sink_pages,
            exact_chunks=self.exact_chunks,
            recent_pages=self.recent_pages,
        )
        return DynamicGenerator(self.model, cache, self.tokenizer, **kwargs)


@pytest.fixture(scope="module")
def tiny32(tiny, tmp_path_factory) -> QuantTiny:
    folder = tmp_path_factory.mktemp("tiny32")
    build_model(
        folder,
        "llama_gqa",
        vocab_size=tiny.tokenizer.vocab_size,
        eos_token_id=tiny.tokenizer.eos_token_id,
        bos_token_id=tiny.tokenizer.bos_token_id,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny.folder / name, folder / name)
    return QuantTiny(Model.from_pretrained(folder), tiny.tokenizer, folder)


# plain words that the tiny tokenizers encode in a few tokens each, for random prompts
WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "tree",
    "red",
    "blue",
    "quick",
    "slow",
    "river",
    "stone",
    "light",
    "over",
    "when",
    "then",
    "because",
    "seven",
    "twelve",
    "apple",
    "window",
    "story",
    "night",
    "morning",
]


def random_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
