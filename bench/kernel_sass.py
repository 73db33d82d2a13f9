"""The decode-attention kernel's SASS without a GPU: instructions in its key loop, per key.

Compiles the real (non-simulator) attention kernel for sm_90 with NVVM + nvJitLink (the dev
extras) at Llama-3-8B's head shape (head_dim 128, page 16, 4 query heads per KV head, one
query per sequence), as each cache mode's decode tile runs it (keys per step, rotation, sink
pages), disassembles the cubin with ``cuobjdump -sass`` and finds the loop over keys: the
longest innermost loop that reads global memory (a sink variant's code tiles, not its exact
ones). Prints, per mode, registers, spill bytes, the loop's instruction count, instructions
per key (the loop body covers keys_per_step keys per key group) and the loop's most frequent
opcodes; writes JSON to --output.

With ``--gather`` (default on) it also compiles the prompt-chunk route's context gather
(engine/cuda/kv_gather.py) at that shape and counts its global loads and stores by width
(a thread's whole program: the gather has no loop over keys).

A kernel bound by instructions, as this one was on the H200 (ncu, 2026-11-27), runs about as
fast as its loop is short, so this is a cheap proxy for a change when no GPU is lent; it is
no substitute for timing one (bench/attention_keys_per_step.py).

Needs ``cuobjdump`` and ``nvdisasm`` on PATH, or the wheels that carry them:
``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``.

    python bench/kernel_sass.py [--modes fp16,q8,q6,q4,q4+sinks,q4-mma]  # (q4-codes: 4-bit
                                     # words unpacked by permute and add; *-mma: tensor
                                     # cores, engine/cuda/attention_mma.py)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from record import write_record

RESULTS = Path(__file__).parent / "results" / "kernel_sass.json"
BITS = {"fp16": (0, 0), "q8": (8, 8), "q6": (8, 4), "q4": (4, 4)}
HEAD_DIM, PAGE, GROUP_HEADS, LANES = 128, 16, 4, 16  # decode tiles at the 8B shape
ARGS = (  # the kernel's signature (page arrays flat: kv_load.flat_pages)
    "float16[:, :, ::1], {kt}[::1], {vt}[::1], {ks}[::1], {vs}[::1], float16[:, :, ::1], "
    "float32[:, :, :, ::1], float32[:, :, :, ::1], int32[:, ::1], int32[::1], int32[::1], "
    "int32[:, ::1], float32, int64, int64, int64, float16[::1], float16[::1]"
)
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
BRANCH = re.compile(r"BRA\s+0x([0-9a-f]+)")


@dataclass(frozen=True)
class KernelSass:
    mode: str
    keys_per_step: int
    registers: int
    spill_bytes: int
    instructions: int  # the whole kernel
    loop_instructions: int  # the key loop's body
    per_key: float  # loop_instructions / keys_per_step (one key group's keys per iteration)
    # the loop's instructions per key a warp covers: 32 / LANES key groups per warp in the
    # CUDA-core kernel, one 16-key tile per warp on tensor cores (q4-mma)
    per_key_per_warp: float
    top_opcodes: dict[str, int]


@dataclass(frozen=True)
class GatherSass:
    mode: str  # q4+rows+unrotate: 4-bit codes, sink/recent rows, rotated back; fp16 output
    values_per_thread: int
    registers: int
    spill_bytes: int
    instructions: int  # a thread's program, all paths (codes, rows, own rows, padding)
    memory_opcodes: dict[str, int]  # LDG / STG / SHFL by width, in the program


GATHER_MODES = {"q4+rows+unrotate": (4, True, True), "q8": (8, False, False)}


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:  # the nvidia-cuda-* wheels put their binaries under nvidia/cu*/bin
        for candidate in Path(entry).glob(f"nvidia/cu*/bin/{name}"):
            return str(candidate)
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


MMA_ARGS = (  # attention_mma's decode kernel
    "float16[:, :, ::1], int32[::1], int32[::1], float16[::1], int16[::1], float16[:, :, ::1], "
    "float32[:, :, :, ::1], float32[:, :, :, ::1], int32[:, ::1], int32[::1], float32, int64, "
    "int64[::1], int64[::1], int64, int64"
)


def compile_kernel(mode: str, out_dir: Path) -> tuple[Path, int, int, int]:
    """(cubin path, keys per step and key group, registers, spill bytes) of ``mode``'s
    decode kernel."""
    import numba.cuda.dispatcher as dispatcher

    class Device:  # kernels calling device functions ask for the current device
        compute_capability = (9, 0)
        id = 0

    dispatcher.get_current_device = lambda: Device()
    from engine.cuda import attention as A

    if "-mma" in mode:  # tensor cores: a warp takes 16 keys per step
        from engine.cuda import attention_mma as M

        base, _, pipe = mode.partition("-pipe")  # q4-mma-pipe2: that load pipeline
        fp16 = base == "fp16-mma"
        kb, vb = (4, 4) if fp16 else BITS[base.split("-")[0]]
        kernel = M._decode_kernel(HEAD_DIM, PAGE, GROUP_HEADS, 8, not fp16,
                                  base.endswith("+sinks"), fp16, kb, vb,
                                  int(pipe) if pipe else M._PIPELINE)  # fmt: skip
        path = out_dir / f"attention_{mode.replace('-', '_').replace('+', '_')}.cubin"
        return (path, M.TILE, *_link(kernel, MMA_ARGS, path))

    affine = not mode.endswith("-codes")  # -codes: 4-bit words unpacked by permute and add
    base = mode.removesuffix("-codes")
    kb, vb = BITS[base.removesuffix("+sinks")]
    dpl = HEAD_DIM // LANES
    words = A.reads_words(kb, vb, dpl)
    keys = A._keys_per_step(1, GROUP_HEADS, words)
    kernel = A._attention_kernel(
        HEAD_DIM, PAGE, GROUP_HEADS, 1, LANES, kb, vb, keys, A._MIN_BLOCKS, True,
        A._transposed_sums(kb, vb, dpl), base.endswith("+sinks"), words, affine,
    )  # fmt: skip
    pages = {0: "float16", 8: "int8", 4: "uint8"}
    word = {4: "int32", 8: "int64"}[dpl] if words else None
    signature = ARGS.format(
        kt=word or pages[kb], vt=word or pages[vb],
        ks="float16", vs="float16",
    )  # fmt: skip
    path = out_dir / f"attention_{mode.replace('+', '_')}.cubin"
    return (path, keys, *_link(kernel, signature, path))


def _link(kernel, signature: str, path: Path) -> tuple[int, int]:
    """Compile ``kernel`` for sm_90 into ``path``; (registers, spill bytes)."""
    from cuda.core import Linker, LinkerOptions, ObjectCode
    from numba import cuda

    options = kernel.targetoptions
    ltoir, _ = cuda.compile(
        kernel.py_func, f"void({signature})", cc=(9, 0), output="ltoir", device=False,
        abi="numba", fastmath=options.get("fastmath", False),
        launch_bounds=options.get("launch_bounds"),
    )  # fmt: skip
    linker = Linker(
        ObjectCode.from_ltoir(ltoir),
        options=LinkerOptions(arch="sm_90", link_time_optimization=True, verbose=True),
    )
    cubin = linker.link("cubin")
    log = linker.get_info_log()
    path.write_bytes(bytes(cubin.code))
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


def _sass(cubin: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(_tool('nvdisasm')).parent}:{os.environ['PATH']}"}
    return subprocess.run(
        [_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True, env=env,
        check=True,
    ).stdout  # fmt: skip


def key_loop(cubin: Path) -> tuple[int, list[str]]:
    """(instructions in the kernel, the key loop's opcodes)."""
    return longest_loading_loop(_sass(cubin))


def memory_opcodes(sass: str) -> tuple[int, dict[str, int]]:
    """(instructions in ``sass``, its global loads, stores and shuffles by full opcode, as
    LDG.E.64: the width says how many bytes one thread moves per instruction)."""
    ops = [_full_opcode(m.group(2)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    memory = collections.Counter(o for o in ops if o.startswith(("LDG", "STG", "SHFL")))
    return len(ops), dict(sorted(memory.items()))


def measure_gather(mode: str, out_dir: Path) -> GatherSass:
    from engine.cuda import kv_gather

    bits, rows, unrotate = GATHER_MODES[mode]
    # (K pages of exact chunks: own rows take rotary and the center)
    kernel = kv_gather._gather_kernel(bits, rows, unrotate, True, PAGE, 8, HEAD_DIM // 32,
                                      unrotate, True, True)  # fmt: skip
    signature = (  # (page bytes as int32 words, fp16 output as an int64 view)
        "int32[:, :, :, ::1], float16[:, :, :, ::1], float16[:, :, :, ::1], int64, "
        "int64[:, ::1], int64[::1], int64[::1], float16[:, :, ::1], float16[:, ::1], "
        "float16[:, ::1], float32[:, ::1], int64[:, :, :, ::1]"
    )
    path = out_dir / f"gather_{mode.replace('+', '_')}.cubin"
    registers, spills = _link(kernel, signature, path)
    total, memory = memory_opcodes(_sass(path))
    return GatherSass(mode, kv_gather.PER_LANE, registers, spills, total, memory)


def longest_loading_loop(sass: str) -> tuple[int, list[str]]:
    """(instructions in ``sass``, the opcodes of the key loop): of the innermost loops (a
    backward branch and the code from its target to it, holding no other) that read global
    memory, the longest. (Sink variants also loop over their unquantized tiles, exactly: a
    shorter loop, and not always one with fewer loads, so the most loads is the wrong test.)
    """
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match,
            sass.splitlines()) if m]  # fmt: skip
    spans = []
    for addr, op in code:
        branch = BRANCH.search(op)
        if branch and int(branch.group(1), 16) < addr:
            spans.append((int(branch.group(1), 16), addr))
    innermost = [
        (lo, hi)
        for lo, hi in spans
        if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
    ]
    loops = [[o for a, o in code if lo <= a <= hi] for lo, hi in innermost]
    body = max((ops for ops in loops if any("LDG" in o for o in ops)), key=len)
    return len(code), [_opcode(o) for o in body]


def _full_opcode(instruction: str) -> str:
    """The opcode with its modifiers (LDG.E.64), without a predicate."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction.strip()).split()[0]


def _opcode(instruction: str) -> str:
    return _full_opcode(instruction).split(".")[0]


def measure(mode: str, out_dir: Path) -> KernelSass:
    cubin, keys, registers, spills = compile_kernel(mode, out_dir)
    total, body = key_loop(cubin)
    counts = collections.Counter(body)
    warp_keys = keys if "-mma" in mode else keys * (32 // LANES)
    return KernelSass(mode, keys, registers, spills, total, len(body),
                      round(len(body) / keys, 1), round(len(body) / warp_keys, 1),
                      dict(counts.most_common(12)))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes", default="fp16,q8,q6,q4,q4+sinks,q4-mma,q4-mma+sinks,q6-mma,q8-mma,fp16-mma"
    )
    parser.add_argument("--gather", default=",".join(GATHER_MODES), help="'': none")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise SystemExit("kernel_sass compiles the real kernels: unset NUMBA_ENABLE_CUDASIM")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(mode, Path(tmp)) for mode in args.modes.split(",")]
        gathers = [measure_gather(m, Path(tmp)) for m in args.gather.split(",") if m]
    print(f"{'mode':<18} {'keys':>4} {'regs':>4} {'spill':>5} {'kernel':>6} {'loop':>5} "
          f"{'per key':>7} {'/warp':>6}  top opcodes")  # fmt: skip
    for r in rows:
        top = " ".join(f"{k}:{v}" for k, v in list(r.top_opcodes.items())[:8])
        print(f"{r.mode:<18} {r.keys_per_step:>4} {r.registers:>4} {r.spill_bytes:>5} "
              f"{r.instructions:>6} {r.loop_instructions:>5} {r.per_key:>7} "
              f"{r.per_key_per_warp:>6}  {top}")  # fmt: skip
    if gathers:
        print(f"\n{'gather':<18} {'vals':>4} {'regs':>4} {'spill':>5} {'kernel':>6}  memory")
    for g in gathers:
        memory = " ".join(f"{k}:{v}" for k, v in g.memory_opcodes.items())
        print(f"{g.mode:<18} {g.values_per_thread:>4} {g.registers:>4} {g.spill_bytes:>5} "
              f"{g.instructions:>6}  {memory}")  # fmt: skip
    write_record(
        args.output,
        "kernel_sass",
        target="sm_90 (compiled here, no GPU)",
        shape={"head_dim": HEAD_DIM, "page_size": PAGE, "group": GROUP_HEADS, "lanes": LANES},
        rows=[asdict(r) for r in rows],
        gather_rows=[asdict(g) for g in gathers],
    )


if __name__ == "__main__":
    main()
