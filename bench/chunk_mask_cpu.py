"""What a later prompt chunk's attention mask cost on the CPU, against the split the engine
now runs (``engine/cuda/attention.py`` ``prefix_then_chunk``).

Since stop 46 a prompt's first chunk runs SDPA's own causal rule; a later chunk, whose queries
start after a cached prefix, ran SDPA with an additive mask, which makes SDPA read and add a
mask value per score and score the chunk's keys above the diagonal too. The split attends
twice and merges by log-sum-exp: every query over the prefix with no mask, and over the chunk's
own keys with the causal rule. The engine takes it for a group whose sequences share one prefix
length and one chunk length (every single long prompt) from 1024 cached tokens, 64-token
chunks and 256 query rows on (``SPLIT_MIN_PREFIX``, ``SPLIT_MIN_CHUNK``, ``SPLIT_MIN_ROWS``:
where ``--grid`` finds it faster); other groups keep the mask.

Schedules: 1 prompt of 4000 tokens and 8 of 1024, prefilled in chunks of ``--chunk`` (the
serving preset's token budget is 512). Each later chunk is timed both ways through the torch
reference (``paged_attention_reference``, its gather from pages included; "masked" is the same
group with the split turned off, "split" the split without the thresholds, "engine" what the
engine runs) over SmolLM2's head shape (9 query heads, 3 KV heads, 64 dims), and the totals
are scaled by the model's 30 layers. ``--grid`` times masked / split over batches, chunk
lengths and cached prefixes:

    python bench/chunk_mask_cpu.py --grid                # 1 x 4000, 8 x 1024 (chunks of 512), grid
    python bench/chunk_mask_cpu.py --quick               # tiny shapes (the test's)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import write_record  # noqa: E402
from engine.batch import AttentionPlan, SequenceInput, build_forward_batch  # noqa: E402
from engine.cuda import attention  # noqa: E402
from engine.cuda.attention import attention_groups, paged_attention_reference  # noqa: E402

RESULTS = REPO / "bench" / "results" / "chunk_mask_cpu.json"
PAGE_SIZE = 16
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30}
GRID = {"batch": (1, 2, 8), "chunk": (16, 64, 128, 512), "prefix": (512, 1024, 2048, 3072)}
GRID_MAX_TOKENS = 24_000  # batch x context: the grid leaves out what would take minutes


@dataclass(frozen=True)
class Schedule:
    batch: int
    prompt: int
    chunk: int

    def later_chunks(self) -> list[tuple[int, int]]:
        """(cached prefix, chunk length) of every chunk after the first."""
        starts = range(self.chunk, self.prompt, self.chunk)
        return [(p, min(self.chunk, self.prompt - p)) for p in starts]


@dataclass
class ChunkTiming:
    batch: int
    prefix: int
    chunk: int
    masked_ms: float
    split_ms: float
    max_abs_diff: float
    engine_splits: bool  # whether the engine, with its thresholds, takes the split here

    @property
    def engine_ms(self) -> float:
        return self.split_ms if self.engine_splits else self.masked_ms


@dataclass
class ScheduleResult:
    batch: int
    prompt: int
    chunk: int
    chunks: list[ChunkTiming]
    # every later chunk, every layer, in seconds
    masked_total_s: float
    split_total_s: float  # the split on every later chunk
    engine_total_s: float  # as the engine runs them (the split where its thresholds allow)


def chunk_batch(schedule: Schedule, prefix: int, chunk: int):
    """A forward batch of ``schedule.batch`` sequences, each bringing ``chunk`` tokens after
    ``prefix`` cached ones, on pages of their own; and the number of pages."""
    pages_each = -(-(prefix + chunk) // PAGE_SIZE)
    seqs = [
        SequenceInput([0] * chunk, prefix, range(i * pages_each, (i + 1) * pages_each))
        for i in range(schedule.batch)
    ]
    return build_forward_batch(seqs, PAGE_SIZE), schedule.batch * pages_each


def masked_batch(batch):
    """The same batch with the split turned off: its one group keeps the mask."""
    (group,) = attention_groups(batch)
    layout = dataclasses.replace(group.layout, chunk_after_prefix=False)
    masked = dataclasses.replace(group, layout=layout, masks={})
    return dataclasses.replace(batch, attention=AttentionPlan(groups=[masked]))


@contextlib.contextmanager
def split_everywhere():
    """The engine's split without its thresholds, to time it where the engine keeps the mask."""
    names = ("SPLIT_MIN_PREFIX", "SPLIT_MIN_CHUNK", "SPLIT_MIN_ROWS")
    saved = [getattr(attention, name) for name in names]
    for name, lowest in zip(names, (1, 2, 2), strict=True):
        setattr(attention, name, lowest)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(attention, name, value)


def best_ms(call, repeats: int) -> float:
    call()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def time_chunk(schedule: Schedule, prefix: int, chunk: int, repeats: int) -> ChunkTiming:
    heads, kv, dim = SMOLLM2["heads"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"]
    batch, num_pages = chunk_batch(schedule, prefix, chunk)
    gen = torch.Generator().manual_seed(prefix + chunk)
    q = torch.randn(schedule.batch * chunk, heads, dim, generator=gen)
    k_pages = torch.randn(num_pages, PAGE_SIZE, kv, dim, generator=gen)
    v_pages = torch.randn(num_pages, PAGE_SIZE, kv, dim, generator=gen)
    scale = dim**-0.5
    with_mask = masked_batch(batch)

    def masked() -> torch.Tensor:
        return paged_attention_reference(q, k_pages, v_pages, with_mask, scale)

    def split() -> torch.Tensor:
        return paged_attention_reference(q, k_pages, v_pages, batch, scale)

    engine_splits = attention._splits_at_prefix(attention_groups(batch)[0].layout, chunk, None, q)
    with split_everywhere():
        diff = (masked() - split()).abs().max().item()
        split_ms = best_ms(split, repeats)
    return ChunkTiming(
        schedule.batch, prefix, chunk, best_ms(masked, repeats), split_ms, diff, engine_splits
    )


def run_schedule(schedule: Schedule, repeats: int) -> ScheduleResult:
    chunks = [time_chunk(schedule, p, c, repeats) for p, c in schedule.later_chunks()]
    layers = SMOLLM2["layers"] / 1e3

    def total(ms: Callable[[ChunkTiming], float]) -> float:
        return sum(ms(c) for c in chunks) * layers

    return ScheduleResult(
        *dataclasses.astuple(schedule),
        chunks,
        total(lambda c: c.masked_ms),
        total(lambda c: c.split_ms),
        total(lambda c: c.engine_ms),
    )


def run_grid(repeats: int) -> list[ChunkTiming]:
    """masked / split over GRID's batches, chunks and cached prefixes (the thresholds' data)."""
    timings = []
    for batch, chunk, prefix in itertools.product(*GRID.values()):
        if batch * (prefix + chunk) <= GRID_MAX_TOKENS:
            timings.append(
                time_chunk(Schedule(batch, prefix + chunk, chunk), prefix, chunk, repeats)
            )
    return timings


def print_schedules(results: list[ScheduleResult]) -> None:
    print("| prompts | chunk | later chunks | masked (s, 30 layers) | split | engine | gain |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.batch} x {r.prompt} | {r.chunk} | {len(r.chunks)} | {r.masked_total_s:.3f} "
            f"| {r.split_total_s:.3f} | {r.engine_total_s:.3f} "
            f"| {r.masked_total_s / r.engine_total_s:.2f}x |"
        )


def print_grid(timings: list[ChunkTiming]) -> None:
    prefixes = GRID["prefix"]
    print("masked / split time (> 1: the split is faster); * where the engine splits")
    print("| batch | chunk | " + " | ".join(f"{p} cached" for p in prefixes) + " |")
    print("|---|---|" + "---|" * len(prefixes))
    cells = {(t.batch, t.chunk, t.prefix): t for t in timings}
    for batch, chunk in itertools.product(GRID["batch"], GRID["chunk"]):
        row = []
        for prefix in prefixes:
            t = cells.get((batch, chunk, prefix))
            mark = "*" if t is not None and t.engine_splits else ""
            row.append("-" if t is None else f"{t.masked_ms / t.split_ms:.2f}{mark}")
        print(f"| {batch} | {chunk} | " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many per chunk")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--grid", action="store_true", help="also time the thresholds' grid")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the test's)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        schedules = [Schedule(1, 96, 32), Schedule(2, 64, 32)]
        args.repeats = 1
    else:
        schedules = [Schedule(1, 4000, args.chunk), Schedule(8, 1024, args.chunk)]
    results = [run_schedule(s, args.repeats) for s in schedules]
    print_schedules(results)
    grid = run_grid(args.repeats) if args.grid else []
    if grid:
        print_grid(grid)
    write_record(
        args.output,
        "chunk_mask_cpu",
        machine={"platform": platform.platform(), "cpus": os.cpu_count()},
        torch=torch.__version__,
        threads=args.threads,
        shape=SMOLLM2,
        page_size=PAGE_SIZE,
        thresholds={
            "prefix": attention.SPLIT_MIN_PREFIX,
            "chunk": attention.SPLIT_MIN_CHUNK,
            "rows": attention.SPLIT_MIN_ROWS,
        },
        how="best of --repeats per later chunk, gather from pages included; totals x layers",
        schedules=[asdict(r) for r in results],
        grid=[asdict(t) for t in grid],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
