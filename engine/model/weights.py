"""Safetensors checkpoint loading, single file or sharded, one tensor at a time.

Each checkpoint tensor is read (memory-mapped), converted to the run dtype on the target
device and copied into its preallocated parameter (or a slice of a fused one), then dropped:
peak memory is the model plus one tensor, never a second full copy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoint entries that carry no weights we need (HF stores rotary caches in old exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: ``param[offset : offset + rows]`` along dim 0."""

    param: torch.Tensor
    offset: int | None = None  # None: the whole parameter


def find_weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a model folder, from the shard index when there is one."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"shards named in {index} are missing: {missing}")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in model folder {str(folder)!r}")
    return files


def iter_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) over all files; each tensor is loaded only when reached."""
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


def count_tensors(files: list[Path]) -> int:
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            total += len(list(handle.keys()))
    return total


def load_weights(
    targets: dict[str, WeightTarget],
    path: str | Path,
    ignore: tuple[str, ...] = (),
) -> None:
    """Copy every checkpoint tensor into its target; fail listing missing/unexpected names.

    ``ignore`` names checkpoint tensors that may be present but are not used (e.g. a stored
    ``lm_head.weight`` when the embeddings are tied).
    """
    files = find_weight_files(path)
    loaded: set[str] = set()
    unexpected: list[str] = []
    progress = tqdm(total=count_tensors(files), desc="Loading weights", unit="tensor", disable=None)
    with progress:
        for name, tensor in iter_checkpoint(files):
            progress.update(1)
            if name in targets:
                copy_into(name, tensor, targets[name])
                loaded.add(name)
            elif not (name in ignore or name.endswith(IGNORED_SUFFIXES)):
                unexpected.append(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {str(path)!r} does not match the model: "
            f"missing tensors {missing[:20]}{' ...' if len(missing) > 20 else ''}, "
            f"unexpected tensors {sorted(unexpected)[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}"
        )
    logger.info("loaded %d tensors from %d file(s) in %s", len(loaded), len(files), path)


def copy_into(name: str, tensor: torch.Tensor, target: WeightTarget) -> None:
    dest = target.param
    if target.offset is not None:
        if tensor.dim() == 0 or target.offset + tensor.shape[0] > dest.shape[0]:
            raise ValueError(
                f"tensor {name!r} of shape {tuple(tensor.shape)} does not fit rows "
                f"[{target.offset}:] of a {tuple(dest.shape)} parameter"
            )
        dest = dest.narrow(0, target.offset, tensor.shape[0])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(dest.shape)}"
        )
    with torch.no_grad():
        # Convert on the destination device: bf16 -> fp16 on GPU is one fused copy.
        dest.copy_(tensor.to(device=dest.device, non_blocking=True))
