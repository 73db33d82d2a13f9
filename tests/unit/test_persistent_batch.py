"""``PersistentBatch`` builds exactly the reference batch (``plan_rows`` +
``build_forward_batch``) for every plan of a real scheduler driven through random loads:
jobs joining and leaving, prefix hits, chunked prefills, decodes, preemption under page
pressure, CFG pairs, draft rows (lookahead) with partial acceptance, truncation (rollbacks)
and per-job embedding placeholders."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine.batch import ForwardBatch, build_forward_batch
from engine.cache.page_table import RECENT_BLOCKS, PageTable
from engine.embeddings import MMEmbedding
from engine.model.runner import plan_rows
from engine.persistent_batch import PersistentBatch
from engine.scheduler import Scheduler, SchedulerConfig, SeqState, StepEntry, StepPlan

TENSORS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "logits_indices",
)


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    for name in TENSORS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a, b)
        assert torch.equal(a, b), (name, a, b)
    assert got.q_lens == want.q_lens
    assert got.prompt_chunks == want.prompt_chunks
    assert got.seq_lens_host == want.seq_lens_host
    assert got.page_size == want.page_size
    if want.embeddings is None:
        assert got.embeddings is None
    else:
        assert torch.equal(got.embeddings.positions, want.embeddings.positions)
        assert torch.equal(got.embeddings.rows, want.embeddings.rows)


class Load:
    """A scheduler over a small page table, stepped like the generator with random events."""

    def __init__(self, rng: random.Random, page_size: int, num_pages: int, max_q: int):
        self.rng = rng
        self.ps = page_size
        self.sched = Scheduler(
            SchedulerConfig(
                max_batch_size=rng.choice([3, 6, 12]),
                max_chunk_size=rng.choice([8, 24, 64]),
                max_q_size=max_q,
            ),
            PageTable(num_pages, page_size),
        )
        self.max_q = max_q
        self.prefixes = [[rng.randrange(1, 500) for _ in range(3 * page_size)] for _ in range(3)]
        self.left: dict[int, int] = {}  # id(leader) -> tokens still to generate
        self.counter = 1000
        self.hidden = 4

    def add(self) -> None:
        rng = self.rng
        prompt = rng.choice(self.prefixes)[: rng.randrange(0, 3 * self.ps)]
        prompt = prompt + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 2 * self.ps))]
        embeddings: tuple[MMEmbedding, ...] = ()
        if rng.random() < 0.15:  # placeholder ids of a container inside the prompt
            container = MMEmbedding(torch.randn(rng.randrange(1, 4), self.hidden))
            at = rng.randrange(len(prompt))
            prompt[at:at] = list(container.placeholder_ids)
            embeddings = (container,)
        seq = SeqState(prompt, embeddings=embeddings)
        if rng.random() < 0.2:  # a CFG pair
            negative = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 2 * self.ps))]
            seq.partner = SeqState(negative, partner=seq, is_partner=True)
        self.left[id(seq)] = rng.randrange(1, 30)
        self.sched.add(seq)

    def plan(self) -> StepPlan:
        rng = self.rng
        if self.max_q > 1:  # a speculator's wishes
            for seq in self.sched.running:
                seq.lookahead = rng.randrange(0, self.max_q)
        plan = self.sched.schedule()
        plan.entries = [self._drafts(e) for e in plan.entries]
        return plan

    def _drafts(self, e: StepEntry) -> StepEntry:
        e.seq.lookahead = 0
        if not e.lookahead:
            return e
        k = self.rng.randrange(0, e.lookahead + 1)
        return dataclasses.replace(e, drafts=tuple(self.rng.randrange(1, 500) for _ in range(k)))

    def finish_step(self, plan: StepPlan) -> None:
        rng, sched = self.rng, self.sched
        sched.commit(plan)
        for e in plan.entries:
            seq = e.seq
            if not e.samples or seq.leader.num_pending > 1 or id(seq.leader) not in self.left:
                continue
            accepted = rng.randrange(0, len(e.drafts) + 1)
            seq.tokens.extend(e.drafts[:accepted])
            sched.advance(seq, accepted)
            self.counter += 1
            seq.tokens.append(self.counter)
            if seq.is_partner:
                continue
            self.left[id(seq)] -= 1 + accepted
            if self.left[id(seq)] <= 0:
                self.remove(seq)
            elif rng.random() < 0.05 and seq.partner is None and len(seq.tokens) > 2:
                sched.truncate(seq, rng.randrange(1, len(seq.tokens)))  # a rollback
        if sched.running and rng.random() < 0.05:  # a cancellation
            self.remove(rng.choice(sched.running).leader)

    def remove(self, seq: SeqState) -> None:
        self.sched.remove(seq)
        del self.left[id(seq.leader)]


@pytest.mark.parametrize("seed", range(12))
def test_persistent_batch_equals_the_reference_over_random_loads(seed):
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 16])
    load = Load(rng, ps, num_pages=rng.choice([24, 48, 400]), max_q=rng.choice([1, 1, 4]))
    builder = PersistentBatch(ps, "cpu", pack=seed % 2 == 1)  # both upload layouts
    plans = 0
    for _ in range(150):
        for _ in range(rng.choice([0, 0, 0, 1, 3])):
            load.add()
        plan = load.plan()
        if plan.entries:
            want = build_forward_batch(plan_rows(plan), ps, "cpu")
            assert_same_batch(builder.build(plan), want)
            plans += 1
        load.finish_step(plan)
    assert plans > 50


def test_decode_steps_rewrite_only_the_block_table_tail():
    """Once decoding, a step writes a few table entries per row (the page that was not full
    at the last write and the RECENT_BLOCKS before it, and a new page), not every page of
    every row. (The first decode
    step rewrites whole rows: the prefill's commit may swap any of its pages for cached
    twins.)"""
    ps, n = 4, 8
    sched = Scheduler(SchedulerConfig(max_batch_size=n, max_chunk_size=512), PageTable(200, ps))
    seqs = [SeqState(list(range(100 * i + 1, 100 * i + 30))) for i in range(n)]
    for seq in seqs:
        sched.add(seq)
    builder = PersistentBatch(ps, "cpu")
    for step in range(6):
        plan = sched.schedule()
        before = builder.table_entries_written
        assert_same_batch(builder.build(plan), build_forward_batch(plan_rows(plan), ps, "cpu"))
        written = builder.table_entries_written - before
        if step > 1:
            assert n <= written <= (2 + RECENT_BLOCKS) * n < n * len(seqs[0].pages)
        sched.commit(plan)
        for seq in seqs:
            seq.tokens.append(7)


def test_bad_plans_raise_like_the_reference():
    builder = PersistentBatch(4, "cpu")
    with pytest.raises(ValueError, match="at least one sequence"):
        builder.build(StepPlan())
    good = SeqState(list(range(1, 6)), pages=[5, 6])
    builder.build(StepPlan(entries=[StepEntry(good, 0, 4)]))
    good.tokens.append(9)
    good.pages = [7, 8]  # (a new list: a readmission elsewhere)
    short = SeqState(list(range(1, 10)), pages=[3])  # 9 tokens need 3 pages of 4
    plan = StepPlan(entries=[StepEntry(good, 4, 2), StepEntry(short, 0, 9)])
    with pytest.raises(ValueError, match="needs 3 pages of 4, got 1"):
        builder.build(plan)
    # the failed build left no half-written row behind
    plan = StepPlan(entries=[StepEntry(good, 4, 2)])
    assert_same_batch(builder.build(plan), build_forward_batch(plan_rows(plan), 4, "cpu"))
    with pytest.raises(ValueError, match="page_size"):
        PersistentBatch(0, "cpu")
