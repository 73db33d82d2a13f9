"""Allowed-token masks for a whole step: one int32 bitmask [B, ceil(V/32)] filled on host
threads (llguidance's parallel executor), turned into an additive logit bias on the device
(``mask_bias``) and applied by the sampler in one add.

Row sources: a job's ``JobConstraint`` (its grammar) or a fixed token set (token healing's
first sample). Rows of jobs without either stay all ones: they are unaffected.

Background evaluation: ``launch`` is called before the step's forward and returns at once; the
masks are computed on a worker thread (llguidance drops the GIL) while the forward runs, and
``PendingMasks.result()`` waits for them before sampling. With ``background=False`` the work is
done in ``launch`` itself. The matchers' states cannot change in between: tokens are consumed
only after sampling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import numpy as np
import torch

from engine.constraints.filters import Filter
from engine.constraints.matcher import JobConstraint, validate

logger = logging.getLogger(__name__)

RowSource = JobConstraint | frozenset[int]  # a grammar, or a fixed set of allowed ids


@dataclass(slots=True)
class MaskTimings:
    """Seconds spent filling masks (on whatever thread), and seconds the step waited for them
    after its forward (with background evaluation, fill - wait is what the forward hid)."""

    fill_s: float = 0.0
    wait_s: float = 0.0
    steps: int = 0
    rows: int = 0


@dataclass(slots=True)
class PendingMasks:
    """The masks of one step, ready or being computed."""

    _future: Future | None = None
    _value: torch.Tensor | None = None
    timings: MaskTimings | None = field(default=None, repr=False)

    def result(self) -> torch.Tensor | None:
        """The step's additive logit bias [B, V] on the logits' device (``mask_bias``; None:
        no row is constrained this step)."""
        if self._future is None:
            return self._value
        start = time.perf_counter()
        value = self._future.result()
        if self.timings is not None:
            self.timings.wait_s += time.perf_counter() - start
        return value


class MaskEngine:
    """Per generator: the llguidance tokenizer, the executor and the background thread."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: Sequence[int],
        background: bool = True,
        num_threads: int | None = None,
        device: torch.device | str = "cpu",
    ):
        """``device``: where the logits are; the step's masks come back as ``mask_bias`` for
        it (on a CPU the whole conversion runs on the mask thread too)."""
        try:
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_ids)
            )
        except Exception as e:  # llguidance raises plain exceptions for unusable vocabularies
            raise ValueError(f"this tokenizer cannot be used for constrained decoding: {e}") from e
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.words = (vocab_size + 31) // 32
        self.executor = llguidance.LLExecutor(num_threads)
        self.background = background
        self._pool = ThreadPoolExecutor(1, "filter-masks") if background else None
        self.timings = MaskTimings()
        self._token_bytes: list[bytes] | None = None
        self._lock = threading.Lock()

    # -- jobs ----------------------------------------------------------------------------------

    def validate(self, filters: Sequence[Filter]) -> None:
        validate(filters, self.tokenizer)

    def constraint(self, filters: Sequence[Filter], prefer_eos: bool) -> JobConstraint:
        return JobConstraint(filters, self.tokenizer, prefer_eos)

    def healing_ids(self, prefix_token: int) -> frozenset[int]:
        """Ids whose bytes start with ``prefix_token``'s bytes (the prefix itself included)."""
        pieces = self.token_bytes()
        prefix = pieces[prefix_token]
        ids = frozenset(i for i, b in enumerate(pieces) if b.startswith(prefix))
        return ids if prefix else frozenset([prefix_token])

    def token_bytes(self) -> list[bytes]:
        with self._lock:  # built once, on first use (a pass over the vocabulary)
            if self._token_bytes is None:
                tok = self.tokenizer
                self._token_bytes = [
                    b"" if tok.is_special_token(i) else tok.decode_bytes([i])
                    for i in range(tok.vocab_size)
                ]
            return self._token_bytes

    # -- steps ---------------------------------------------------------------------------------

    def launch(self, rows: Sequence[RowSource | None]) -> PendingMasks:
        """Start computing the masks of a step's sampled rows (``rows[i]`` for logits row i)."""
        if all(r is None for r in rows):
            return PendingMasks()
        rows = list(rows)
        if self._pool is None:
            return PendingMasks(_value=self._fill(rows))
        return PendingMasks(_future=self._pool.submit(self._fill, rows), timings=self.timings)

    def _fill(self, rows: list[RowSource | None]) -> torch.Tensor:
        start = time.perf_counter()
        # Extra matchers of multi-filter jobs go to scratch rows after the batch, ANDed after.
        batch = len(rows)
        work: list[tuple[llguidance.LLMatcher, int]] = []
        extra: list[tuple[int, int]] = []  # (scratch row, target row)
        for i, source in enumerate(rows):
            if isinstance(source, JobConstraint):
                work.append((source.matchers[0], i))
                for m in source.matchers[1:]:
                    extra.append((batch + len(extra), i))
                    work.append((m, extra[-1][0]))
        bitmask = np.full((batch + len(extra), self.words), -1, dtype=np.int32)
        if work:
            self.executor.unsafe_compute_mask_ptr(
                work, bitmask.ctypes.data, self.words * 4, bitmask.shape[0]
            )
        for scratch, target in extra:
            bitmask[target] &= bitmask[scratch]
        for i, source in enumerate(rows):
            if isinstance(source, frozenset):
                bitmask[i] = pack_ids(source, self.words)
            elif isinstance(source, JobConstraint) and source.prefer_eos:
                _prefer_eos(bitmask[i], source.eos_ids)
        # INVARIANT: every row allows a token (the sampler relies on it: no all -inf row). A
        # grammar that allows nothing (its error state) leaves its row unmasked; the token
        # sampled there is refused and ends that job with an error.
        bitmask[:batch][~bitmask[:batch].any(axis=1)] = -1
        bias = mask_bias(torch.from_numpy(bitmask[:batch]), self.vocab_size, self.device)
        self.timings.fill_s += time.perf_counter() - start
        self.timings.steps += 1
        self.timings.rows += batch
        return bias

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def pack_ids(ids: frozenset[int], words: int) -> np.ndarray:
    """A bitmask row (int32 words, bit j of word w = id 32w + j) with only ``ids`` set."""
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[np.fromiter(ids, dtype=np.int64, count=len(ids))] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def _prefer_eos(row: np.ndarray, eos_ids: Sequence[int]) -> None:
    words = row.view(np.uint32)
    allowed = [t for t in eos_ids if t < 32 * len(words) and (words[t // 32] >> (t % 32)) & 1]
    if allowed:
        words[:] = 0
        words[allowed[0] // 32] = 1 << (allowed[0] % 32)


# byte value -> its 8 bits as additive logit biases (0: allowed, -inf: not), lowest bit first
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")
_BYTE_BIAS = np.where(_BYTE_BITS.astype(bool), 0.0, -np.inf).astype(np.float32)
_DEVICE_BIAS: dict[torch.device, torch.Tensor] = {}


def mask_bias(bitmask: torch.Tensor, vocab: int, device: torch.device | str) -> torch.Tensor:
    """The additive logit bias [B, vocab] (0 where allowed, -inf elsewhere) on ``device``, from
    an int32 bitmask [B, W] on the host: one table lookup per bitmask byte. (An add of this
    bias is several times faster on a CPU than a masked fill with a bool mask; an accelerator
    gets the 32x smaller bitmask and looks up there.)"""
    device = torch.device(device)
    if device.type != "cpu":
        return device_mask_bias(bitmask, vocab, device)
    data = bitmask.numpy().view(np.uint8)
    return torch.from_numpy(_BYTE_BIAS[data].reshape(len(data), -1))[:, :vocab]


def device_mask_bias(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """``mask_bias`` with the lookup done on ``device`` (an accelerator; any device works)."""
    device = torch.device(device)
    data = bitmask.numpy().view(np.uint8)
    table = _DEVICE_BIAS.get(device)
    if table is None:
        table = _DEVICE_BIAS[device] = torch.from_numpy(_BYTE_BIAS).to(device)
    index = torch.from_numpy(data).to(device, non_blocking=True).long()
    return table[index].reshape(len(data), -1)[:, :vocab]
