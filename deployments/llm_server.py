"""``LLMServer``: one model and one ``DynamicGeneratorAsync`` per replica.

The ingress sends one ``engine.request.GenerationRequest`` (token ids, sampling settings, stops,
``n`` choices); ``generate`` streams coalesced deltas back: the first token at once
(time to first token), then everything produced in each ``stream_interval_s`` as one Ray chunk,
because Ray's per-chunk overhead, not the engine, is the bottleneck otherwise. Requests share the
replica's paged cache and run batched; a client that goes away cancels its job, which frees its
pages at once.

``record_routing_stats`` tells the prefix-aware router how loaded the replica is and which page
hashes it holds (a bounded summary).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray import serve
from ray.serve import metrics

from deployments.cpu_affinity import pin_engine
from deployments.load_report import ActiveRequests
from deployments.prefix_index import REPORTED_HASH_LIMIT
from deployments.preset import Preset
from engine import (
    DynamicGeneratorAsync,
    DynamicJob,
    DynamicJobAsync,
    GenerationRequest,
    Model,
    PagedCache,
    Tokenizer,
)
from engine.model.model import resolve_device

logger = logging.getLogger("ray.serve")

ROUTING_HASH_LIMIT = REPORTED_HASH_LIMIT  # page hashes reported to the router per replica
ROUTING_VIEW = "routing"
ROUTING_VIEW_PERIOD_S = 0.5  # half the router's stats period: a report is at most this old


def _routing_view(generator) -> tuple[dict[str, int], list[int]]:
    return generator.stats(), generator.cache.page_table.recent_hashes(ROUTING_HASH_LIMIT)


def configure_torch_threads(option: int | None, device: torch.device) -> None:
    """Cap intra-op threads: replicas share small machines (default 1 on CPU)."""
    if option is None and device.type != "cpu":
        return
    threads = 1 if option is None else option
    torch.set_num_threads(threads)
    logger.info("torch threads capped at %d", threads)


def _cache_mode(cache: PagedCache) -> str:
    """'q4+rotate+center' and the like, for the log."""
    flags = ("+rotate" if cache.rotate else "") + ("+center" if cache.center_keys else "")
    flags += "+exact chunks" if cache.exact_chunks else ""
    sinks = f"+{cache.sink_pages} sink pages" if cache.sink_pages else ""
    recent = f"+{cache.recent_pages} recent pages" if cache.recent_pages else ""
    return cache.quant + flags + sinks + recent


def _build_cache(model: Model, preset: Preset) -> PagedCache:
    """The replica's paged cache: ``engine.max_num_tokens`` tokens, or as many whole pages as
    ``engine.cache_bytes`` holds in ``engine.cache_quant`` (a quantized mode gets more)."""
    engine = preset.engine
    layout = (engine.page_size, engine.cache_quant, engine.cache_rotate, engine.cache_center_keys)
    extra = {
        "sink_pages": engine.cache_sink_pages,
        "exact_chunks": engine.cache_exact_chunks,
        "recent_pages": engine.cache_recent_pages,
    }
    if engine.cache_bytes is None:
        return PagedCache(model, int(engine.max_num_tokens or 0), *layout, **extra)
    cache = PagedCache.from_budget(model, engine.cache_bytes, *layout, **extra)
    logger.info(
        "engine.cache_bytes %d: %d tokens at %d bytes per token",
        engine.cache_bytes,
        cache.max_num_tokens,
        cache.bytes_per_token(),
    )
    expected = preset.cache_tokens()
    if cache.max_num_tokens != expected:  # e.g. the ops ran the model in another dtype
        logger.warning(
            "the cache holds %d tokens but the preset expected %d (the ingress's context "
            "length follows the preset)",
            cache.max_num_tokens,
            expected,
        )
    return cache


def build_generator(preset: Preset) -> DynamicGeneratorAsync:
    """The preset's model, cache and async generator, as one replica runs them (torch threads
    capped and the process moved to its ``serving.engine_cpus`` first): also what
    ``bench/serving_overhead.py`` measures bare, so both paths run the same engine."""
    path = preset.model.resolve_path()
    device = resolve_device(preset.model.device)
    configure_torch_threads(preset.serving.torch_threads, device)
    cores = pin_engine(preset.serving.engine_cpus, preset.serving.torch_threads or 1)
    if cores is not None and torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))  # more threads than cores would only take turns
    model = Model.from_pretrained(path, device=device, dtype=preset.model.dtype)
    tokenizer = Tokenizer.from_pretrained(path)
    engine = preset.engine
    cache = _build_cache(model, preset)
    return DynamicGeneratorAsync(
        model,
        cache,
        tokenizer,
        max_batch_size=engine.max_batch_size,
        max_seq_len=preset.context_length(model.config.max_position_embeddings),
        max_chunk_size=engine.max_chunk_size,
        cuda_graphs=engine.cuda_graphs,
        async_scheduling=engine.async_scheduling,
        **(engine.speculative.generator_kwargs() if engine.speculative else {}),
    )


@dataclass
class Delta:
    """Results of one job merged into one message for the ingress."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    final: dict[str, Any] | None = None
    logprobs: list[tuple] = field(default_factory=list)  # deployments.logprobs.LogprobEntry
    prompt_logprobs: list[tuple] = field(default_factory=list)  # (prefill results)
    # an echo's entries are the prompt's and every generated token's, the stop token's too
    # (clients such as lm-eval slice them by count)
    keep_stop_entry: bool = False

    def add(self, result: dict[str, Any]) -> None:
        self.prompt_logprobs += result.get("prompt_logprobs", ())
        if result["stage"] != "streaming":
            return
        self.text.append(result.get("text", ""))
        if "token_ids" in result:  # a "cancelled" final result carries no token
            self.token_ids.extend(result["token_ids"][0].tolist())
        if "token_logprobs" in result:
            self.logprobs += _logprob_entries(result, self.keep_stop_entry)
        if result["eos"]:
            self.final = result

    @property
    def empty(self) -> bool:
        return not self.token_ids and self.final is None

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "text": "".join(self.text),
            "token_ids": self.token_ids,
            "eos": self.final is not None,
        }
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.final is not None:
            keys = ("eos_reason", "prompt_tokens", "new_tokens", "cached_tokens", "cached_pages")
            out.update({k: self.final[k] for k in keys})
            if "eos_triggering_string" in self.final:  # which stop string ended it
                out["stop_string"] = self.final["eos_triggering_string"]
            out.update({k: self.final[k] for k in self.final if k.startswith("time_")})
        return out


def _logprob_entries(
    result: dict[str, Any], keep_stop_entry: bool = False
) -> list[tuple[int, float, list[int], list[float]]]:
    """One ``deployments.logprobs.LogprobEntry`` per token of a result (a result can hold
    several: text released after a banned-string check); the stop token ending a choice is not
    part of its text and has none, unless ``keep_stop_entry``."""
    ids, values = result["token_ids"][0].tolist(), result["token_logprobs"][0].tolist()
    top_ids, top_values = result["top_logprob_ids"][0].tolist(), result["top_logprobs"][0].tolist()
    entries = list(zip(ids, values, top_ids, top_values, strict=True))
    if result.get("eos_reason") == "stop_token" and not keep_stop_entry:
        entries = entries[:-1]
    return entries


class ChoiceStream:
    """One choice's pending delta and when it was last sent (coalescing per choice)."""

    def __init__(self, index: int, start: float, keep_stop_entry: bool = False) -> None:
        self.index = index
        self.keep_stop_entry = keep_stop_entry
        self.delta = Delta(keep_stop_entry=keep_stop_entry)
        self.last_sent = start
        self.sent = 0
        self.done = False

    def add(self, batch: list[dict[str, Any]] | BaseException) -> None:
        if isinstance(batch, BaseException):
            raise batch
        for result in batch:
            self.delta.add(result)

    def take_if_due(self, now: float, interval: float) -> dict[str, Any] | None:
        """The pending delta as a message when it is worth a Ray chunk: the first token at
        once, the final one at once, otherwise at most one message per ``interval``."""
        delta = self.delta
        if delta.empty:
            return None
        due = self.sent == 0 or now - self.last_sent >= interval
        if not (due or delta.final is not None):
            return None
        self.delta, self.last_sent = Delta(keep_stop_entry=self.keep_stop_entry), now
        self.sent += 1
        self.done = delta.final is not None
        return {"index": self.index, **delta.message()}


async def _choice_batches(jobs: list[DynamicJobAsync]) -> AsyncIterator[list[tuple[int, Any]]]:
    """The jobs' result batches as ``(choice index, batch or error)`` lists, as they arrive. One
    job (``n`` = 1, the common case) is read directly; several are merged through a queue fed by
    one task per job."""
    if len(jobs) == 1:
        try:
            async for batch in jobs[0].batches():
                yield [(0, batch)]
        except Exception as error:  # raised by the consumer, as from the merged queue
            yield [(0, error)]
        return
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, job, queue)) for i, job in enumerate(jobs)]
    try:
        while True:
            yield await _drain(queue)
    finally:
        for pump in pumps:
            pump.cancel()


async def _pump(index: int, job: DynamicJobAsync, queue: asyncio.Queue) -> None:
    """Forward a job's result batches (or its error) to the shared queue."""
    try:
        async for batch in job.batches():
            queue.put_nowait((index, batch))
    except Exception as error:  # delivered to the consumer, which raises it
        queue.put_nowait((index, error))


async def _drain(queue: asyncio.Queue) -> list[tuple[int, Any]]:
    """Wait for one item, then take everything already queued."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def current_rss_bytes() -> int:
    """This process's resident memory now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ServerMetrics:
    """Ray metrics of one replica (exported through Ray's Prometheus endpoint)."""

    def __init__(self) -> None:
        boundaries = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
        self.ttft = metrics.Histogram(
            "llm_time_to_first_token_s", "Time to first token", boundaries=boundaries
        )
        self.itl = metrics.Histogram(
            "llm_inter_token_latency_s", "Time per output token after the first", boundaries
        )
        self.tokens_in = metrics.Counter("llm_prompt_tokens", "Prompt tokens received")
        self.tokens_out = metrics.Counter("llm_generated_tokens", "Tokens generated")
        self.cached = metrics.Counter("llm_cached_prompt_tokens", "Prompt tokens from the cache")
        self.pages_in_use = metrics.Gauge("llm_kv_pages_in_use", "KV pages referenced by jobs")
        self.queue = metrics.Gauge("llm_queue_length", "Jobs waiting for admission")

    def finished(self, message: dict[str, Any]) -> None:
        self.tokens_in.inc(message["prompt_tokens"])
        self.tokens_out.inc(message["new_tokens"])
        if message["cached_tokens"]:
            self.cached.inc(message["cached_tokens"])
        if message["new_tokens"] > 1:
            self.itl.observe(message["time_generate"] / (message["new_tokens"] - 1))

    def engine_state(self, stats: dict[str, int]) -> None:
        self.pages_in_use.set(stats["pages_in_use"])
        self.queue.set(stats["jobs_waiting"])


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class LLMServer:
    """One model per replica; streams coalesced deltas for token-id requests."""

    def __init__(self, preset: Preset) -> None:
        self.preset = preset
        self.generator = build_generator(preset)
        cache = self.generator.generator.cache
        self.generator.publish(ROUTING_VIEW, _routing_view, ROUTING_VIEW_PERIOD_S)
        self.stream_interval_s = preset.serving.stream_interval_s
        self.metrics = ServerMetrics()
        self.requests_served = 0
        self.requests_active = 0
        self.active = ActiveRequests()  # what the routing reports count, by request id
        logger.info(
            "LLMServer ready: %s, context %d, %s cache of %d tokens (%d pages of %d): "
            "%d bytes per token, %d bytes",
            preset.model.resolve_path(),
            self.generator.generator.max_seq_len,
            _cache_mode(cache),
            cache.max_num_tokens,
            cache.num_pages,
            cache.page_size,
            cache.bytes_per_token(),
            cache.num_bytes(),
        )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        """Stream deltas ``{"index", "text", "token_ids", "eos"}`` for the request's ``n``
        choices (``index``: which choice); a choice's last delta (``eos`` True) adds
        ``eos_reason``, ``prompt_tokens``, ``new_tokens``, ``cached_tokens`` and timings.
        Raises ValueError (naming the value) for a request this replica cannot run."""
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"generate takes a GenerationRequest, got {type(request).__name__}")
        start = time.monotonic()
        echo = request.prompt_logprobs is not None
        streams = [ChoiceStream(i, start, keep_stop_entry=echo) for i in range(request.n)]
        jobs: list[DynamicJobAsync] = []
        self.requests_active += 1
        self.active.start(request.request_id, request.n)
        try:
            for i in range(request.n):  # a choice refused at enqueue leaves none behind
                jobs.append(
                    DynamicJobAsync(self.generator, job=DynamicJob.from_request(request, i))
                )
            batches = _choice_batches(jobs)
            try:
                async for items in batches:
                    for index, batch in items:
                        streams[index].add(batch)
                    now = time.monotonic()
                    for stream in streams:
                        message = stream.take_if_due(now, self.stream_interval_s)
                        if message is not None:
                            self._observe(stream, message, start)
                            yield message
                    if all(s.done for s in streams):
                        break
            finally:
                await batches.aclose()
        finally:
            self.requests_active -= 1
            self.active.end(request.request_id, request.n)
            self.requests_served += 1
            for job in jobs:
                if not job.finished:  # the caller went away: free the pages now
                    await asyncio.shield(job.cancel())

    def _observe(self, stream: ChoiceStream, message: dict[str, Any], start: float) -> None:
        if stream.sent == 1:
            self.metrics.ttft.observe(time.monotonic() - start)
        if message["eos"]:
            self.metrics.finished(message)

    async def stats(self) -> dict[str, Any]:
        stats = await self.generator.call(lambda g: g.stats())
        self.metrics.engine_state(stats)
        return {
            **stats,
            "requests_served": self.requests_served,
            "requests_active": self.requests_active,
            "rss_bytes": current_rss_bytes(),
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the Serve controller for the prefix-aware router (with a 1 s deadline).
        Pages come from the step thread's published view, so a long step (a big prefill on a
        CPU) never makes the router fall back to stale reports. ``load`` (the choices of the
        ``generate`` calls held now) and ``active_requests`` (those calls by request id, so
        the router can take off the ones it has seen end since) are read fresh here: the
        view's job counts can be half a period old."""
        view = self.generator.published(ROUTING_VIEW)
        if view is None:  # before the step thread's first refresh
            view = await self.generator.call(_routing_view)
        stats, hashes = view
        self.metrics.engine_state(stats)
        return {
            **self.active.report(),
            "pages_free": stats["pages_free"] + stats["pages_cached"],
            "pages_total": stats["pages_total"],
            "page_size": stats["page_size"],
            "page_hashes": hashes,
        }

    def get_preset(self) -> Preset:
        """The preset this replica runs (the batch job tokenizes with the same model)."""
        return self.preset

    def check_health(self) -> None:
        if not self.generator.is_alive:
            raise RuntimeError("the generator's step thread has stopped")
