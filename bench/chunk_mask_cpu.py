"""What a later prompt chunk's attention mask cost on the CPU, against the split the engine
now runs (``engine/cuda/attention.py`` ``prefix_then_chunk``).

Since stop 46 a prompt's first chunk runs SDPA's own causal rule; a later chunk, whose queries
start after a cached prefix, ran SDPA with an additive mask, which makes SDPA read and add a
mask value per score and score the chunk's keys above the diagonal too. The split attends
twice and merges by log-sum-exp: every query over the prefix with no mask, and over the chunk's
own keys with the causal rule. The engine takes it for a group whose every sequence brings a
chunk of 64 tokens or more after 1024 cached tokens or more (``SPLIT_MIN_PREFIX``,
``SPLIT_MIN_CHUNK``: where ``--grid`` finds it faster): in one batch when the sequences share
their lengths, else one sequence at a time (the mask pads every sequence to the group's
longest context and chunk), each call with 128 query rows or more (``SPLIT_MIN_ROWS``). Other
groups keep the mask.

Each case is one forward's attention through the torch reference (``paged_attention_reference``,
its gather from pages included) over SmolLM2's head shape (9 query heads, 3 KV heads, 64
dims): "masked" with the split turned off, "split" with its thresholds lifted, "engine" what
the engine runs. Schedules: 1 prompt of 4000 tokens and 8 of 1024, prefilled in chunks of
``--chunk`` (the serving preset's token budget is 512), every later chunk timed and the totals
scaled by the model's 30 layers. Ragged cases: prompts of other lengths prefilled together.
``--grid`` times masked / split over batches, chunk lengths and cached prefixes:

    python bench/chunk_mask_cpu.py --grid                # 1 x 4000, 8 x 1024 (chunks of 512), grid
    python bench/chunk_mask_cpu.py --ragged-grid \
        --output bench/results/chunk_mask_cpu_ragged_grid.json  # RAGGED_GRID's groups too
    python bench/chunk_mask_cpu.py --quick               # tiny shapes (the test's)

``--device cuda`` runs the same on a GPU (float16 unless ``--dtype``; ``--shape llama3-8b``
for the 8B model's heads), with ``ENGINE_CHUNK_SPLIT=on``: a GPU splits only when asked to,
untimed until this runs there (bench/gpu_session.sh, step ``chunk-split``).
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.record import write_record  # noqa: E402
from engine.batch import SequenceInput, build_forward_batch  # noqa: E402
from engine.cuda import attention  # noqa: E402
from engine.cuda.attention import attention_groups, paged_attention_reference  # noqa: E402

RESULTS = REPO / "bench" / "results" / "chunk_mask_cpu.json"
PAGE_SIZE = 16
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64, "layers": 30}
SHAPES = {
    "smollm2": SMOLLM2,
    "llama3-8b": {"heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 32},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Target:
    """Where the attention runs: the device, the dtype of q and the pages, the head shape."""

    device: str = "cpu"
    dtype: str = "float32"
    shape: str = "smollm2"

    @property
    def heads(self) -> dict[str, int]:
        return SHAPES[self.shape]


CPU = Target()
DEFAULT_DTYPES = {"cpu": "float32", "cuda": "float16"}


def machine(device: str) -> dict[str, object]:
    found: dict[str, object] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
    return found


GRID = {"batch": (1, 2, 8), "chunk": (16, 64, 128, 512), "prefix": (512, 1024, 2048, 3072)}
GRID_MAX_TOKENS = 24_000  # batch x context: the grid leaves out what would take minutes


# Groups of sequences of different lengths prefilled together, (cached prefix, chunk) each:
# one attention group (chunk lengths in one power-of-two bucket), split one by one
RAGGED_CASES = (
    ((1500, 300), (2600, 260)),
    ((1100, 300), (3000, 300), (2000, 256)),
    ((1024, 128), (1200, 130), (1500, 128), (4000, 128)),
    ((2000, 300), (3000, 500)),
    ((1024, 200), (1100, 200)),
    ((3000, 150), (3100, 150)),
)
QUICK_RAGGED_CASES = (((32, 16), (40, 20)),)
# --ragged-grid: 2 or 4 sequences whose cached prefixes spread upwards from a base by up to
# this fraction (chunks one token apart, so the group is ragged even at the least spread)
RAGGED_GRID = {
    "prefix": (1024, 1536, 2048, 3072),
    "sequences": (2, 4),
    "spread": (0.02, 0.1, 0.3),
    "chunk": (128, 200),
}


def ragged_grid_cases() -> list[tuple[tuple[int, int], ...]]:
    """RAGGED_GRID's groups: (cached prefix, chunk) per sequence, prefixes evenly spread."""
    cases = []
    for prefix, n, spread, chunk in itertools.product(*RAGGED_GRID.values()):
        steps = [i / (n - 1) for i in range(n)]
        cases.append(
            tuple((round(prefix * (1 + spread * f)), chunk + i) for i, f in enumerate(steps))
        )
    return cases


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
class GroupTiming:
    prefixes: list[int]  # each sequence's cached tokens
    chunks: list[int]  # each sequence's new tokens
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
    groups: list[GroupTiming]  # one per later chunk
    # every later chunk, every layer, in seconds
    masked_total_s: float
    split_total_s: float  # the split on every later chunk
    engine_total_s: float  # as the engine runs them (the split where its thresholds allow)


def group_batch(sequences: Sequence[tuple[int, int]], device: str = "cpu"):
    """A forward batch of sequences, (cached prefix, chunk) each, on pages of their own; and
    the number of pages."""
    seqs, first = [], 0
    for prefix, chunk in sequences:
        pages = -(-(prefix + chunk) // PAGE_SIZE)
        seqs.append(SequenceInput([0] * chunk, prefix, range(first, first + pages)))
        first += pages
    return build_forward_batch(seqs, PAGE_SIZE, device), first


@contextlib.contextmanager
def split_thresholds(prefix: int, chunk: int, rows: int):
    """The engine's split thresholds set to these for a while: the least values time the
    split everywhere, ``MASK_ONLY`` the mask everywhere."""
    names = ("SPLIT_MIN_PREFIX", "SPLIT_MIN_CHUNK", "SPLIT_MIN_ROWS")
    saved = [getattr(attention, name) for name in names]
    for name, value in zip(names, (prefix, chunk, rows), strict=True):
        setattr(attention, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(attention, name, value)


SPLIT_EVERYWHERE = (1, 2, 2)
MASK_ONLY = (sys.maxsize, sys.maxsize, sys.maxsize)


def best_ms(call, repeats: int, device: str = "cpu") -> float:
    def synchronize() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    call()  # warm
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        call()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def time_group(
    sequences: Sequence[tuple[int, int]], repeats: int, target: Target = CPU
) -> GroupTiming:
    """One forward's attention of these sequences through the torch reference, masked and
    split (thresholds lifted), and whether the engine splits it."""
    heads, kv, dim = (target.heads[name] for name in ("heads", "kv_heads", "head_dim"))
    batch, num_pages = group_batch(sequences, target.device)
    if len(attention_groups(batch)) != 1:
        raise ValueError(f"{sequences}: chunk lengths in more than one attention group")
    gen = torch.Generator(target.device).manual_seed(batch.num_tokens)
    dtype = DTYPES[target.dtype]

    def tensor(*shape: int) -> torch.Tensor:  # (made where they are used: 8B pages are big)
        return torch.randn(*shape, generator=gen, device=target.device).to(dtype)

    q = tensor(batch.num_tokens, heads, dim)
    k_pages = tensor(num_pages, PAGE_SIZE, kv, dim)
    v_pages = tensor(num_pages, PAGE_SIZE, kv, dim)
    scale = dim**-0.5

    def attend() -> torch.Tensor:
        return paged_attention_reference(q, k_pages, v_pages, batch, scale)

    engine_splits = attention._splits_at_prefix(attention_groups(batch)[0].layout, None, q)
    with split_thresholds(*MASK_ONLY):
        masked, masked_ms = attend(), best_ms(attend, repeats, target.device)
    with split_thresholds(*SPLIT_EVERYWHERE):
        split, split_ms = attend(), best_ms(attend, repeats, target.device)
    diff = (masked.float() - split.float()).abs().max().item()
    prefixes, chunks = (list(column) for column in zip(*sequences, strict=True))
    return GroupTiming(prefixes, chunks, masked_ms, split_ms, diff, engine_splits)


def run_schedule(schedule: Schedule, repeats: int, target: Target = CPU) -> ScheduleResult:
    chunks = schedule.later_chunks()
    groups = [time_group([c] * schedule.batch, repeats, target) for c in chunks]
    layers = target.heads["layers"] / 1e3

    def total(ms: Callable[[GroupTiming], float]) -> float:
        return sum(ms(g) for g in groups) * layers

    return ScheduleResult(
        *dataclasses.astuple(schedule),
        groups,
        total(lambda g: g.masked_ms),
        total(lambda g: g.split_ms),
        total(lambda g: g.engine_ms),
    )


def run_grid(repeats: int, target: Target = CPU) -> list[GroupTiming]:
    """masked / split over GRID's batches, chunks and cached prefixes (the thresholds' data)."""
    timings = []
    for batch, chunk, prefix in itertools.product(*GRID.values()):
        if batch * (prefix + chunk) <= GRID_MAX_TOKENS:
            timings.append(time_group([(prefix, chunk)] * batch, repeats, target))
    return timings


def print_schedules(results: list[ScheduleResult]) -> None:
    print("| prompts | chunk | later chunks | masked (s, all layers) | split | engine | gain |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.batch} x {r.prompt} | {r.chunk} | {len(r.groups)} | {r.masked_total_s:.3f} "
            f"| {r.split_total_s:.3f} | {r.engine_total_s:.3f} "
            f"| {r.masked_total_s / r.engine_total_s:.2f}x |"
        )


def print_grid(timings: list[GroupTiming]) -> None:
    prefixes = GRID["prefix"]
    print("masked / split time (> 1: the split is faster); * where the engine splits")
    print("| batch | chunk | " + " | ".join(f"{p} cached" for p in prefixes) + " |")
    print("|---|---|" + "---|" * len(prefixes))
    cells = {(len(t.chunks), t.chunks[0], t.prefixes[0]): t for t in timings}
    for batch, chunk in itertools.product(GRID["batch"], GRID["chunk"]):
        row = []
        for prefix in prefixes:
            t = cells.get((batch, chunk, prefix))
            mark = "*" if t is not None and t.engine_splits else ""
            row.append("-" if t is None else f"{t.masked_ms / t.split_ms:.2f}{mark}")
        print(f"| {batch} | {chunk} | " + " | ".join(row) + " |")


def print_ragged(timings: list[GroupTiming]) -> None:
    print("| (cached, chunk) per sequence | masked ms | split ms | masked / split |")
    print("|---|---|---|---|")
    for t in timings:
        sequences = ", ".join(f"({p}, {c})" for p, c in zip(t.prefixes, t.chunks, strict=True))
        mark = "*" if t.engine_splits else ""
        print(
            f"| {sequences} | {t.masked_ms:.1f} | {t.split_ms:.1f} "
            f"| {t.masked_ms / t.split_ms:.2f}{mark} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="best of this many per chunk")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="float32 on the CPU, float16 on a GPU"
    )
    parser.add_argument("--shape", choices=tuple(SHAPES), default="smollm2", help="head shape")
    parser.add_argument("--grid", action="store_true", help="also time the thresholds' grid")
    parser.add_argument(
        "--ragged-grid", action="store_true", help="also time RAGGED_GRID's ragged groups"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the test's)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = Target(args.device, args.dtype or DEFAULT_DTYPES[args.device], args.shape)
    if args.device == "cuda":  # (a GPU splits only when asked to: engine/cuda/attention.py)
        os.environ[attention.CHUNK_SPLIT_ENV] = "on"
        attention.chunk_split_devices.cache_clear()
    if args.quick:
        schedules = [Schedule(1, 96, 32), Schedule(2, 64, 32)]
        ragged_cases = QUICK_RAGGED_CASES
        args.repeats = 1
    else:
        schedules = [Schedule(1, 4000, args.chunk), Schedule(8, 1024, args.chunk)]
        ragged_cases = RAGGED_CASES
    results = [run_schedule(s, args.repeats, target) for s in schedules]
    print_schedules(results)
    if args.ragged_grid:
        ragged_cases = (*ragged_cases, *ragged_grid_cases())
    ragged = [time_group(case, args.repeats, target) for case in ragged_cases]
    print_ragged(ragged)
    grid = run_grid(args.repeats, target) if args.grid else []
    if grid:
        print_grid(grid)
    write_record(
        args.output,
        "chunk_mask_cpu",
        machine=machine(args.device),
        torch=torch.__version__,
        threads=args.threads,
        device=args.device,
        dtype=target.dtype,
        chunk_split=attention.chunk_split_devices(),
        shape=target.heads,
        page_size=PAGE_SIZE,
        thresholds={
            "prefix": attention.SPLIT_MIN_PREFIX,
            "chunk": attention.SPLIT_MIN_CHUNK,
            "rows": attention.SPLIT_MIN_ROWS,
        },
        how="best of --repeats per later chunk, gather from pages included; totals x layers",
        schedules=[asdict(r) for r in results],
        ragged=[asdict(t) for t in ragged],
        grid=[asdict(t) for t in grid],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
