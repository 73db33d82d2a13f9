"""Classifier-free guidance: a job of two prompts, ``input_ids=[positive, negative]``.

Both prompts run as two sequences of one job (the scheduler's CFG pair: admitted, preempted
and removed together, two against ``max_batch_size``); every sampled token is appended to
both. Before the rest of sampling (penalties on the positive row's context, bias,
temperature, truncation), the two rows' logits become

    cfg_scale * log_softmax(l_positive) + (1 - cfg_scale) * log_softmax(l_negative)

so ``cfg_scale=1`` samples the positive prompt, 0 the negative, and > 1 pushes away from the
negative.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.device_copy import upload
from engine.request import SamplerSettings
from engine.scheduler import SeqState, StepEntry


def split_prompt_rows(
    input_ids: Any, settings: SamplerSettings | None, as_ids
) -> tuple[list[int], list[int] | None]:
    """(positive ids, negative ids or None) of a job's ``input_ids``; ``as_ids`` turns one
    prompt into a list of ids. A pair needs ``cfg_scale`` and ``cfg_scale`` needs a pair."""
    pair = isinstance(input_ids, list | tuple) and any(
        isinstance(row, torch.Tensor | list | tuple) for row in input_ids
    )
    cfg_scale = None if settings is None else settings.cfg_scale
    if not pair:
        if cfg_scale is not None:
            raise ValueError(f"cfg_scale={cfg_scale} needs input_ids=[positive, negative]")
        return as_ids(input_ids), None
    if len(input_ids) != 2:
        raise ValueError(f"input_ids as rows must be [positive, negative], got {len(input_ids)}")
    if cfg_scale is None:
        raise ValueError("input_ids=[positive, negative] needs gen_settings.cfg_scale")
    return as_ids(input_ids[0]), as_ids(input_ids[1])


def attach_negative(seq: SeqState, negative: list[int]) -> SeqState:
    """Make ``seq`` (the positive row) the leader of a CFG pair with a row for ``negative``."""
    partner = SeqState(
        tokens=list(negative),
        owner=seq.owner,
        hash_root=seq.hash_root,
        embeddings=seq.embeddings,
        partner=seq,
        is_partner=True,
    )
    seq.partner = partner
    return partner


def merge_cfg_rows(
    entries: Sequence[StepEntry], logits: torch.Tensor
) -> tuple[list[Any], torch.Tensor]:
    """The jobs to sample and their logits, one row each: ``entries`` are a step's sampling
    entries in logits-row order; a CFG job's two rows become one guided row."""
    jobs: list[Any] = []
    rows: list[int] = []
    negative: dict[int, int] = {}  # id(job) -> its negative row
    for i, entry in enumerate(entries):
        if entry.seq.is_partner:
            negative[id(entry.seq.owner)] = i
        else:
            jobs.append(entry.seq.owner)
            rows.append(i)
    if not negative:
        return jobs, logits
    guided = [j for j, job in enumerate(jobs) if job.seq.partner is not None]
    if len(guided) != len(negative) or any(id(jobs[j]) not in negative for j in guided):
        raise RuntimeError("a CFG row was sampled without its partner (scheduler invariant)")
    device = logits.device
    pos = upload([rows[j] for j in guided], device)
    neg = upload([negative[id(jobs[j])] for j in guided], device)
    scale = upload([jobs[j].gen_settings.cfg_scale for j in guided], device)
    scale = scale[:, None].to(logits.dtype)
    mixed = scale * torch.log_softmax(logits[pos], -1)
    mixed += (1 - scale) * torch.log_softmax(logits[neg], -1)
    out = logits[upload(rows, device)]
    out[upload(guided, device)] = mixed
    return jobs, out
