"""The ragged, paged forward gives the same logits as one whole sequence at a time.

Sequences are scattered over shuffled, non-contiguous pages of a small page size so that page
boundaries fall inside prompts and chunks.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.batch import SequenceInput, build_forward_batch
from engine.model import Model
from tests.hf_models import build_model, reference_logits, reference_model, relative_error

PAGE = 4
TOLERANCE = 1e-4


class PagePool:
    """Hands out shuffled page ids so no sequence gets contiguous storage."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        return taken


class Seq:
    """A sequence whose tokens are fixed in advance (teacher forcing) and fed step by step."""

    def __init__(self, ids: list[int], pool: PagePool):
        self.ids, self.pool, self.pages, self.done = ids, pool, [], 0

    def step(self, n: int) -> SequenceInput:
        new = self.ids[self.done : self.done + n]
        need = -(-(self.done + len(new)) // PAGE) - len(self.pages)
        self.pages += self.pool.take(need)
        seq = SequenceInput(new, num_cached=self.done, pages=list(self.pages))
        self.done += len(new)
        return seq


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: Model, kv, parts: list[tuple[Seq, int]]) -> list[torch.Tensor]:
    """One forward over the given (sequence, new token count) parts; logits of every row,
    split per part."""
    seq_inputs = [seq.step(n) for seq, n in parts]
    batch = build_forward_batch(seq_inputs, PAGE, model.device)
    batch.logits_indices = torch.arange(batch.num_tokens)
    logits = model.forward(batch, kv)
    return list(logits.split([n for _, n in parts]))


@pytest.fixture(scope="module", params=["llama_gqa", "mistral", "qwen3"])
def models(request, tmp_path_factory):
    folder = build_model(tmp_path_factory.mktemp(request.param), request.param)
    return Model.from_pretrained(folder), reference_model(folder)


def test_mixed_prefill_chunked_prefill_and_decode(models):
    model, ref = models
    pool = PagePool(128)
    kv = model.allocate_kv(128, PAGE)
    a, b, c = Seq(_ids(40, 1), pool), Seq(_ids(41, 2), pool), Seq(_ids(23, 3), pool)
    # b is prefilled in 3 chunks while a and c prefill whole and then decode
    schedule = [
        [(a, 37), (b, 10), (c, 20)],
        [(b, 15), (c, 1), (a, 1)],
        [(c, 1), (b, 16), (a, 1)],
        [(a, 1), (c, 1)],
    ]
    got: dict[int, list[torch.Tensor]] = {id(s): [] for s in (a, b, c)}
    for parts in schedule:
        for (seq, _), logits in zip(parts, _run(model, kv, parts), strict=True):
            got[id(seq)].append(logits)
    for seq in (a, b, c):
        assert seq.done == len(seq.ids)
        whole = reference_logits(ref, seq.ids)
        assert relative_error(torch.cat(got[id(seq)]), whole) <= TOLERANCE


def test_batch_equals_one_at_a_time(models):
    model, _ = models
    lengths = [1, 3, 4, 5, 16, 31]
    seqs = [_ids(n, 10 + n) for n in lengths]
    alone = [model.logits(ids)[-1] for ids in seqs]
    pool = PagePool(64, seed=1)
    kv = model.allocate_kv(64, PAGE)
    together = _run(model, kv, [(Seq(ids, pool), len(ids)) for ids in seqs])
    for one, batched in zip(alone, together, strict=True):
        assert relative_error(batched[-1], one) <= TOLERANCE


def test_shared_prefix_pages_are_reused(models):
    """A second sequence that points at the first one's full prefix pages only computes its
    own suffix, and still matches the reference."""
    model, ref = models
    prefix = _ids(4 * PAGE, 7)
    first, second = prefix + _ids(5, 8), prefix + _ids(9, 9)
    pool = PagePool(32, seed=2)
    kv = model.allocate_kv(32, PAGE)
    s1 = Seq(first, pool)
    _run(model, kv, [(s1, len(first))])
    s2 = Seq(second, pool)
    s2.pages, s2.done = s1.pages[:4], len(prefix)  # share the cached prefix pages
    (suffix_logits,) = _run(model, kv, [(s2, len(second) - len(prefix))])
    whole = reference_logits(ref, second)
    assert relative_error(suffix_logits, whole[len(prefix) :]) <= TOLERANCE


def test_logits_rows_selects_rows(models):
    model, _ = models
    pool = PagePool(16)
    kv = model.allocate_kv(16, PAGE)
    s1, s2 = Seq(_ids(6, 1), pool), Seq(_ids(5, 2), pool)
    inputs = [s1.step(6), s2.step(5)]
    inputs[0] = SequenceInput(inputs[0].token_ids, 0, inputs[0].pages, logits_rows=0)
    logits = model.forward(build_forward_batch(inputs, PAGE), kv)
    assert logits.shape == (1, model.config.vocab_size)
    assert relative_error(logits[0], model.logits(s2.ids)[-1]) <= TOLERANCE


def test_multi_token_rows_return_trailing_logits(models):
    # Verification rows of speculative decoding: 1 + k new tokens after a cached prefix, the
    # logits of all k + 1 wanted; rows of other sequences keep their own counts, in order.
    model, _ = models
    pool = PagePool(16)
    kv = model.allocate_kv(16, PAGE)
    s1, s2 = Seq(_ids(9, 3), pool), Seq(_ids(8, 4), pool)
    _run(model, kv, [(s1, 5), (s2, 7)])
    verify, decode = s1.step(4), s2.step(1)
    verify = SequenceInput(verify.token_ids, verify.num_cached, verify.pages, logits_rows=3)
    logits = model.forward(build_forward_batch([verify, decode], PAGE), kv)
    assert logits.shape == (4, model.config.vocab_size)
    assert relative_error(logits[:3], model.logits(s1.ids)[-3:]) <= TOLERANCE
    assert relative_error(logits[3], model.logits(s2.ids)[-1]) <= TOLERANCE


def test_batch_validation():
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_forward_batch([SequenceInput([1, 2, 3], num_cached=2, pages=[0])], PAGE)
    with pytest.raises(ValueError, match="at least one new token"):
        SequenceInput([], num_cached=0, pages=[0])
    with pytest.raises(ValueError, match=r"logits_rows must be in \[0, 2\].*got 3"):
        SequenceInput([1, 2], num_cached=0, pages=[0], logits_rows=3)
    with pytest.raises(ValueError, match="at least one sequence"):
        build_forward_batch([], PAGE)
