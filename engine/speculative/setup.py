"""Building the speculator from the generator's seed-compatible arguments, with the checks."""

from __future__ import annotations

import logging

from engine.model.runner import ModelRunner
from engine.speculative.draft import DraftModelProposer
from engine.speculative.policy import AdaptiveK
from engine.speculative.speculator import Speculator

logger = logging.getLogger(__name__)

# Verification rows per step up to which a forward costs about as much as a one-row forward:
# on a GPU a decode forward is bound by reading the weights for far more rows than on a CPU,
# where every row soon is matmul work. bench/speculative.py (SmolLM2-135M, one CPU thread):
# batch 1 + up to 4 drafts pays (n-gram 1.9x), batch 8 + 8 drafts costs (0.85x), hence 8.
# The GPU figure is an estimate, not measured here.
MAX_STEP_TOKENS = {"cuda": 256, "cpu": 8}


def resolve_max_q_size(max_q_size: int | None, num_draft_tokens: int, speculating: bool) -> int:
    """Default: 1 + num_draft_tokens when speculating, else 1. The seed's check: the drafts and
    the pending token fit, num_draft_tokens < max_q_size."""
    if max_q_size is None:
        return 1 + num_draft_tokens if speculating else 1
    if speculating and not num_draft_tokens < max_q_size:
        raise ValueError(
            f"num_draft_tokens ({num_draft_tokens}) must be < max_q_size ({max_q_size}): a "
            "decoding sequence computes its pending token plus its drafts in one step"
        )
    return max_q_size


def check_speculation(
    draft_model, draft_cache, use_ngram_draft: bool, num_draft_tokens: int, max_ngram: int
) -> bool:
    """Raise ValueError on an impossible combination; True when speculation is on."""
    if (draft_model is None) != (draft_cache is None):
        raise ValueError("draft_model and draft_cache go together: give both or neither")
    if draft_model is not None and use_ngram_draft:
        raise ValueError("use_ngram_draft cannot be combined with a draft model")
    speculating = draft_model is not None or bool(use_ngram_draft)
    if speculating and (not isinstance(num_draft_tokens, int) or num_draft_tokens < 1):
        raise ValueError(f"num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if use_ngram_draft and (not isinstance(max_ngram, int) or max_ngram < 1):
        raise ValueError(f"max_ngram must be an int >= 1, got {max_ngram!r}")
    return speculating


def check_draft(model, cache, draft_model, draft_cache, max_seq_len: int) -> None:
    """The draft runs on the scheduler's page ids: its cache must mirror the target's."""
    if draft_cache.model is not draft_model:
        raise ValueError("draft_cache was built for a different model than draft_model")
    if draft_cache.page_size != cache.page_size or draft_cache.num_pages != cache.num_pages:
        raise ValueError(
            f"draft_cache ({draft_cache.num_pages} pages of {draft_cache.page_size}) must "
            f"match the cache ({cache.num_pages} pages of {cache.page_size}): both models "
            "use the same page ids"
        )
    if draft_cache.sink_pages not in (0, cache.sink_pages):
        raise ValueError(
            f"draft_cache has {draft_cache.sink_pages} sink pages; the cache has "
            f"{cache.sink_pages} (the draft's must be the same, or none)"
        )
    if draft_cache.recent_pages not in (0, cache.recent_pages):
        raise ValueError(
            f"draft_cache has {draft_cache.recent_pages} recent pages; the cache has "
            f"{cache.recent_pages} (the draft's must be the same, or none)"
        )
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"draft vocabulary ({draft_model.config.vocab_size}) differs from the model's "
            f"({model.config.vocab_size}): draft tokens must mean the same"
        )
    if draft_model.config.max_position_embeddings < max_seq_len:
        raise ValueError(
            f"draft model's max_position_embeddings ({draft_model.config.max_position_embeddings})"
            f" is below max_seq_len ({max_seq_len})"
        )


def build_speculator(
    generator,
    draft_model,
    draft_cache,
    num_draft_tokens: int,
    use_ngram_draft: bool,
    max_ngram: int,
    cuda_graphs: bool | None,
) -> Speculator:
    max_step_tokens = MAX_STEP_TOKENS.get(generator.model.device.type, 8)
    policy = AdaptiveK(num_draft_tokens, max_step_tokens)
    vocab = generator.tokenizer.vocab_size
    draft = None
    if draft_model is not None:
        check_draft(
            generator.model, generator.cache, draft_model, draft_cache, generator.max_seq_len
        )
        runner = ModelRunner(
            draft_model,
            draft_cache.kv,
            draft_cache.page_size,
            max_batch_size=generator.max_batch_size,
            max_seq_len=generator.max_seq_len,
            cuda_graphs=cuda_graphs,
        )
        draft = DraftModelProposer(runner, vocab)
    if generator.runner.decode_graphs is not None:
        logger.info(
            "speculative decoding: steps that verify drafts (1 + k rows per sequence) run "
            "eagerly; CUDA-graph buckets cover one-row decode steps only"
        )
    return Speculator(policy, vocab, max_ngram=max_ngram, draft=draft)
