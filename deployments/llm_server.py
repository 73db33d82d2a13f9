"""``LLMServer``: the engine replica behind the ingress.

INTERIM ENGINE LOOP. This replica decodes ONE request at a time (an ``asyncio.Lock``), with a
naive loop: chunked prefill, then one forward per token, greedy or temperature sampling, pages
for the single sequence from a small local pool. It exists so ``serve run serve_config.yaml``
works today. It is replaced by ``engine.DynamicGeneratorAsync`` (continuous batching, paged
cache with prefix reuse); what stays is the replica's contract:

- ``generate(request)`` takes a plain dict (see ``GenerationRequest.from_dict``) of token ids
  and sampling settings, and is an async generator of plain dicts shaped like the generator's
  result contract (DESIGN.md section 5): every chunk has ``identifier``, ``stage``
  ("streaming"), ``eos``, ``text``, ``token_ids``; the last has ``eos=True``, ``eos_reason``
  ("stop_token", "stop_string", "max_new_tokens"), ``prompt_tokens``, ``new_tokens``,
  ``cached_tokens``, ``full_completion`` and timings.
- Chunks are coalesced (about ``STREAM_INTERVAL_S`` of decoding each) because Ray's per-chunk
  overhead, not the model, limits small-model throughput.
- Torch work never runs on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from ray import serve

from engine.batch import SequenceInput, build_forward_batch
from engine.demo import resolve_model_path
from engine.model.model import Model, resolve_device
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("ray.serve")

DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_NUM_TOKENS = 16384
DEFAULT_MAX_CHUNK_SIZE = 512
STREAM_INTERVAL_S = 0.02  # decode this long per yielded chunk (the first chunk: one token)
DETOKENIZER_CONTEXT = 8  # prompt tokens given to the detokenizer for leading-space context


def context_length(max_position_embeddings: int, engine: dict[str, Any]) -> int:
    """Longest sequence (prompt + completion) a replica can hold: the model's positions, or
    the whole KV cache if that is smaller. The ingress checks prompts against the same value."""
    return min(max_position_embeddings, int(engine.get("max_num_tokens", DEFAULT_MAX_NUM_TOKENS)))


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What the ingress sends: token ids and sampling settings, no text."""

    identifier: str
    token_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("token_ids must not be empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @classmethod
    def from_dict(cls, request: dict[str, Any]) -> GenerationRequest:
        seed = request.get("seed")
        return cls(
            identifier=str(request.get("identifier", "")),
            token_ids=tuple(int(t) for t in request["token_ids"]),
            max_new_tokens=int(request["max_new_tokens"]),
            temperature=float(request.get("temperature", 1.0)),
            seed=None if seed is None else int(seed),
            stop=tuple(str(s) for s in request.get("stop") or () if s),
        )


class StopStrings:
    """Holds back text that could be the start of a stop string; cuts at the first match."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found)."""
        if not self.stops:
            return text, False
        held = self._held + text
        hits = [i for s in self.stops if (i := held.find(s)) >= 0]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = self._partial_suffix(held)
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(len(text), longest), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stops):
                return k
        return 0


class PagePool:
    """Free list of KV page ids. INVARIANT: only touched from the step thread."""

    def __init__(self, num_pages: int) -> None:
        self._free = list(range(num_pages - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: need {n}, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()


@dataclass
class _Sequence:
    """Per-request decode state (lives in the step thread while a chunk runs)."""

    job: GenerationRequest
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    stops: StopStrings
    pending: list[int]  # tokens not yet in the KV cache: the prompt, then the last sample
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    eos_reason: str | None = None
    cancelled: bool = False
    time_prefill: float = 0.0


def sample_token(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def configure_torch_threads(option: Any, device: torch.device) -> None:
    """Cap intra-op threads: replicas share small machines (default 1 on CPU)."""
    if option is None and device.type != "cpu":
        return
    threads = 1 if option is None else int(option)
    if threads < 1:
        raise ValueError(f"serving.torch_threads must be >= 1, got {option!r}")
    torch.set_num_threads(threads)
    logger.info("torch threads capped at %d", threads)


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class LLMServer:
    """One model per replica; streams token ids and text for token-id requests."""

    def __init__(self, preset: dict[str, dict[str, Any]]) -> None:
        model_section, engine = preset["model"], preset.get("engine") or {}
        serving = preset.get("serving") or {}
        path = resolve_model_path(model_section)
        device = resolve_device(model_section.get("device"))
        configure_torch_threads(serving.get("torch_threads"), device)
        self.model = Model.from_pretrained(path, device=device, dtype=model_section.get("dtype"))
        self.tokenizer = Tokenizer.from_pretrained(path)
        self.page_size = int(engine.get("page_size", DEFAULT_PAGE_SIZE))
        self.max_chunk_size = int(engine.get("max_chunk_size", DEFAULT_MAX_CHUNK_SIZE))
        self.context_length = context_length(self.model.config.max_position_embeddings, engine)
        num_pages = -(-self.context_length // self.page_size)
        self.kv_pages = self.model.allocate_kv(num_pages, self.page_size)
        self.pool = PagePool(num_pages)
        self.eos_ids = self.tokenizer.eos_token_ids | set(self.model.config.eos_token_ids)
        # Ids past the tokenizer's vocabulary (padded embedding rows) decode to nothing; the
        # demo model's random weights would pick them, so sampling never considers them.
        self.sample_vocab = min(self.tokenizer.vocab_size, self.model.config.vocab_size)
        self._lock = asyncio.Lock()  # INTERIM: one request at a time
        # INVARIANT: one step thread, so the model, KV pages and page pool are never used
        # concurrently, even by a chunk still finishing after its request was cancelled.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llm-step")
        logger.info(
            "LLMServer ready: %s, context %d, %d pages of %d",
            path,
            self.context_length,
            num_pages,
            self.page_size,
        )

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream result dicts for one request (see the module docstring)."""
        job = GenerationRequest.from_dict(request)
        self._check_fits(job)
        time_enqueued = time.monotonic()
        async with self._lock:
            started = time.monotonic()
            seq = self._new_sequence(job)
            loop = asyncio.get_running_loop()
            try:
                while True:
                    chunk = await loop.run_in_executor(self._executor, self._run_chunk, seq)
                    if seq.eos_reason is not None:
                        break
                    if chunk["text"] or chunk["token_ids"]:
                        yield chunk
            finally:
                seq.cancelled = True
                self._executor.submit(self.pool.release, seq.pages)
            timings = {
                "time_enqueued": started - time_enqueued,
                "time_prefill": seq.time_prefill,
                "time_generate": time.monotonic() - started - seq.time_prefill,
            }
            yield {**chunk, **self._final_result(seq, timings)}

    def _check_fits(self, job: GenerationRequest) -> None:
        if len(job.token_ids) >= self.context_length:
            raise ValueError(
                f"prompt of {len(job.token_ids)} tokens leaves no room in the context of "
                f"{self.context_length} tokens"
            )
        bad = [t for t in job.token_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range: {bad[:8]}")

    def _new_sequence(self, job: GenerationRequest) -> _Sequence:
        generator = torch.Generator(device=self.model.device)
        if job.seed is None:
            generator.seed()
        else:
            generator.manual_seed(job.seed % 2**64)  # any int (OpenAI seeds may be negative)
        context = job.token_ids[-DETOKENIZER_CONTEXT:]
        return _Sequence(
            job=job,
            generator=generator,
            detokenizer=self.tokenizer.detokenizer(prefix_ids=context),
            stops=StopStrings(job.stop),
            pending=list(job.token_ids),
        )

    # -- step thread ------------------------------------------------------------------------

    def _run_chunk(self, seq: _Sequence) -> dict[str, Any]:
        """Decode until the stream interval passes or the sequence ends; return the delta."""
        deadline = time.monotonic() + STREAM_INTERVAL_S
        first = not seq.new_token_ids
        start_ids, start_text = len(seq.new_token_ids), len(seq.text)
        while seq.eos_reason is None and not seq.cancelled:
            self._step(seq)
            if first or time.monotonic() >= deadline:
                break
        if seq.eos_reason is not None:
            self._finish_text(seq)
        return {
            "identifier": seq.job.identifier,
            "stage": "streaming",
            "eos": False,
            "text": seq.text[start_text:],
            "token_ids": seq.new_token_ids[start_ids:],
        }

    def _step(self, seq: _Sequence) -> None:
        """One forward (the whole prefill, in chunks, on the first step) and one sample."""
        started = time.monotonic()
        logits = self._forward(seq)
        if seq.num_cached == len(seq.job.token_ids):
            seq.time_prefill = time.monotonic() - started
        token = sample_token(logits[0, : self.sample_vocab], seq.job.temperature, seq.generator)
        seq.new_token_ids.append(token)
        if token in self.eos_ids:
            seq.eos_reason = "stop_token"
            return
        seq.pending = [token]
        emitted, stopped = seq.stops.feed(seq.detokenizer.add(token))
        seq.text += emitted
        if stopped:
            seq.eos_reason = "stop_string"
        elif self._at_limit(seq):
            seq.eos_reason = "max_new_tokens"

    def _at_limit(self, seq: _Sequence) -> bool:
        total = len(seq.job.token_ids) + len(seq.new_token_ids)
        return len(seq.new_token_ids) >= seq.job.max_new_tokens or total >= self.context_length

    def _forward(self, seq: _Sequence) -> torch.Tensor:
        """Run ``seq.pending`` through the model in chunks; logits of the last token."""
        logits = None
        while seq.pending:
            chunk = seq.pending[: self.max_chunk_size]
            seq.pending = seq.pending[len(chunk) :]
            self._grow_pages(seq, seq.num_cached + len(chunk))
            inp = SequenceInput(chunk, seq.num_cached, seq.pages, want_logits=not seq.pending)
            batch = build_forward_batch([inp], self.page_size, self.model.device)
            out = self.model.forward(batch, self.kv_pages)
            seq.num_cached += len(chunk)
            logits = out if not seq.pending else logits
        assert logits is not None
        return logits

    def _grow_pages(self, seq: _Sequence, num_tokens: int) -> None:
        needed = -(-num_tokens // self.page_size) - len(seq.pages)
        if needed > 0:
            seq.pages.extend(self.pool.take(needed))

    def _finish_text(self, seq: _Sequence) -> None:
        # Held text (an incomplete character, a partial stop string) is emitted at the end
        # unless a stop string cut the stream.
        tail = seq.detokenizer.flush()
        if seq.eos_reason == "stop_string":
            return
        emitted, stopped = seq.stops.feed(tail)
        seq.text += emitted
        if stopped:
            seq.eos_reason = "stop_string"
        else:
            seq.text += seq.stops.flush()

    def _final_result(self, seq: _Sequence, timings: dict[str, float]) -> dict[str, Any]:
        return {
            "identifier": seq.job.identifier,
            "stage": "streaming",
            "eos": True,
            "eos_reason": seq.eos_reason,
            "full_completion": seq.text,
            "prompt_tokens": len(seq.job.token_ids),
            "new_tokens": len(seq.new_token_ids),
            "cached_tokens": 0,
            "cached_pages": 0,
            **timings,
        }
