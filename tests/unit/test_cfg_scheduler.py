"""The scheduler's CFG pairs (engine.cfg): two sequences admitted, preempted and removed as
one, counted two against max_batch_size, and sampling in the same step, under random loads
with the invariant checks of the scheduler simulation."""

from __future__ import annotations

import random

import pytest

from engine.scheduler import SeqState, StepPlan
from tests.unit.test_scheduler import Sim


def _add_pair(sim: Sim, positive: list[int], negative: list[int], generate: int) -> SeqState:
    lead = sim.add(positive, generate)
    partner = SeqState(list(negative), partner=lead, is_partner=True)
    lead.partner = partner
    sim.target[id(partner)] = 10**9  # the pair ends with its leader
    sim.prompt_len[id(partner)] = len(negative)
    sim.produced[id(partner)] = 0
    return lead


def _pair_sim(**config) -> Sim:
    """A Sim that checks pairs sample together and records every entry's page content right
    after commit (its loop records an entry's pages when it reaches it, and a leader that
    finishes first removes its partner)."""
    sim = Sim(**config)
    sim.on_plan = _check_pairs_sample_together
    commit = sim.sched.commit

    def commit_and_record(plan: StepPlan) -> None:
        commit(plan)
        for e in plan.entries:
            for i, h in enumerate(e.seq.page_hashes):
                sim.page_content.setdefault(h, list(e.seq.tokens[i * sim.ps : (i + 1) * sim.ps]))

    sim.sched.commit = commit_and_record
    return sim


def _check_pairs_sample_together(plan: StepPlan) -> None:
    sampling = {id(e.seq) for e in plan.entries if e.samples}
    for e in plan.entries:
        if e.seq.partner is not None:
            other = id(e.seq.partner)
            assert (id(e.seq) in sampling) == (other in sampling), "a CFG row sampled alone"


@pytest.mark.parametrize("seed", range(6))
def test_random_pairs_and_singles_under_pressure(seed):
    _simulate(seed)


def _simulate(seed: int) -> int:
    """A random mix of pairs and single sequences run to the end; returns the preemptions."""
    rng = random.Random(seed)
    sim = _pair_sim(
        num_pages=rng.choice([14, 16]),  # a pair alone always fits (13 pages at most)
        page_size=4,
        max_batch_size=rng.choice([4, 6]),
        max_chunk_size=rng.choice([6, 16, 64]),
    )
    shared = [rng.randrange(1, 50) for _ in range(9)]
    pairs, singles = [], []
    for _ in range(10):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(1, 50) for _ in range(rng.randint(1, 8))
        ]
        if rng.random() < 0.5:
            negative = [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
            pairs.append(_add_pair(sim, prompt, negative, rng.randint(8, 12)))
        else:
            singles.append(sim.add(prompt, rng.randint(8, 12)))
        if rng.random() < 0.2:
            sim.step()
    sim.run()
    assert {id(s) for s in sim.finished} >= {id(s) for s in pairs + singles}
    for lead in pairs:
        assert not lead.partner.pages and lead.partner.num_computed == 0  # freed with it
    assert sim.table.num_referenced == 0
    return sim.sched.preemptions


def test_random_loads_preempt():
    """The loads above do reach preemption (else they would not test it)."""
    assert sum(_simulate(seed) for seed in range(6)) > 0


def test_pair_preempts_and_cancels_as_one():
    sim = _pair_sim(num_pages=8, page_size=4, max_batch_size=4, max_chunk_size=64)
    single = sim.add(list(range(1, 9)), generate=12)
    sim.step()
    pair = _add_pair(sim, list(range(20, 26)), list(range(30, 34)), generate=12)
    for _ in range(12):
        plan = sim.step()
        if plan.preempted:
            preempted = {id(s) for s in plan.preempted}
            assert (id(pair) in preempted) == (id(pair.partner) in preempted)
            assert id(single) not in preempted  # the newest (the pair) makes room
            break
    else:
        raise AssertionError("no preemption")
    # queued as one (the leader), or already back in as one
    assert pair.partner not in sim.sched.waiting
    assert (pair in sim.sched.running) == (pair.partner in sim.sched.running)
    sim.step()
    sim.cancel(pair)
    assert not pair.partner.pages and pair.partner not in sim.sched.running
    sim.run()
