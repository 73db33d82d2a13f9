"""asyncio wrapper: DynamicGeneratorAsync and DynamicJobAsync.

One dedicated step thread owns the synchronous generator and calls ``iterate()``; the event
loop never blocks on a forward. Requests (enqueue, cancel, close) reach the thread through an
inbox drained between steps, so the generator is only ever touched by that thread. Results go
back to each job's asyncio queue with ``loop.call_soon_threadsafe``, so jobs may be created
from any task (or any loop).

Failure: a job that fails inside a step (its own data, sampling, detokenizing, or a forward
that fails) gets the exception and is removed, its pages freed; the other jobs go on. Should a
whole step still raise, the jobs that were running in it get the exception; waiting jobs are
untouched and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.generator import DynamicGenerator
from engine.job import DynamicJob

logger = logging.getLogger(__name__)


class GeneratorClosedError(RuntimeError):
    """The async generator was closed; no new jobs are accepted."""


class DynamicGeneratorAsync:
    def __init__(self, *args: Any, **kwargs: Any):
        self.generator = DynamicGenerator(*args, **kwargs)
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._jobs: dict[int, DynamicJobAsync] = {}  # serial -> async job (step thread only)
        self._closed = False
        self._views: dict[str, _View] = {}  # published by the step thread, read from anywhere
        self._thread = threading.Thread(target=self._run, name="generator-step", daemon=True)
        self._thread.start()

    # -- called from any thread / task ---------------------------------------------------------

    def enqueue(self, job: DynamicJobAsync) -> None:
        if self._closed:
            raise GeneratorClosedError("the generator is closed")
        self.generator.check_job(job.job)  # read-only: raises ValueError in the caller
        self._post("enqueue", job)

    async def cancel(self, job: DynamicJobAsync) -> None:
        """Cancel a job; returns once its pages are freed (no-op if it already finished)."""
        done = job.loop.create_future()
        self._post("cancel", (job, done))
        await done

    async def close(self) -> None:
        """Cancel every job (each gets its "cancelled" result) and stop the step thread."""
        if not self._closed:
            self._closed = True
            self._post("close", None)
        await asyncio.to_thread(self._thread.join)

    def stats(self) -> dict[str, int]:
        """A best-effort read from any thread; ``call`` gives a consistent snapshot."""
        return self.generator.stats()

    async def call(self, fn: Callable[[DynamicGenerator], Any]) -> Any:
        """Run ``fn(generator)`` on the step thread between two steps and return its value:
        the way to read engine state (stats, cached hashes) consistently."""
        if self._closed:
            raise GeneratorClosedError("the generator is closed")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post("call", (fn, loop, done))
        return await done

    def publish(self, name: str, fn: Callable[[DynamicGenerator], Any], period_s: float) -> None:
        """Have the step thread compute ``fn(generator)`` between steps, at most every
        ``period_s`` (and while idle), for ``published(name)`` to read without waiting for a
        step: for pollers with deadlines (a router's stats) that a long step must not miss."""
        self._views[name] = _View(fn, period_s)
        self._post("refresh", None)

    def published(self, name: str) -> Any:
        """The latest value of a published view (None before its first computation)."""
        view = self._views.get(name)
        return None if view is None else view.value

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _post(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    # -- the step thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._drain_inbox():
                return
            self._refresh_views()
            if self.generator.num_remaining_jobs() == 0:
                with self._wake:
                    self._wake.wait_for(lambda: bool(self._inbox), timeout=self._idle_wait())
                continue
            self._step()

    def _refresh_views(self) -> None:
        now = time.monotonic()
        for name, view in list(self._views.items()):
            if now - view.updated >= view.period_s:
                try:
                    view.value = view.fn(self.generator)
                except Exception:  # a broken view must not stop the engine
                    logger.exception("published view %r failed", name)
                view.updated = now

    def _idle_wait(self) -> float | None:
        return min((v.period_s for v in self._views.values()), default=None)

    def _on_refresh(self, payload: None) -> None:
        """A new view: computed at the next refresh (this only wakes the thread)."""

    def _step(self) -> None:
        before = self._running_jobs()
        try:
            results = self.generator.iterate()
        except Exception as error:  # any engine failure fails its jobs only
            touched = before + self._running_jobs()
            logger.exception("generator step failed; failing %d running jobs", len(touched))
            self._fail(touched, error)
            return
        self._deliver(results)

    def _running_jobs(self) -> list[DynamicJob]:
        return [seq.owner for seq in self.generator.scheduler.running]

    def _deliver(self, results: list[dict[str, Any]]) -> None:
        """Hand a step's results to their jobs: one wake-up per event loop per step (not one per
        result: with 64 streams that is 64 self-pipe writes a step, all holding the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DynamicJobAsync, Any]]] = {}
        for result in results:
            async_job = self._jobs.get(result["serial"])
            if async_job is None:
                continue
            item: Any = result
            if result["eos"]:
                del self._jobs[result["serial"]]
                if result["eos_reason"] == "error":  # the job failed alone: its consumer raises
                    item = result["error"]
            by_loop.setdefault(async_job.loop, []).append((async_job, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail(self, jobs: list[DynamicJob], error: Exception) -> None:
        for job in {id(j): j for j in jobs}.values():
            self.generator.cancel(job, emit_result=False)  # frees its pages
            async_job = self._jobs.pop(job.serial, None)
            if async_job is not None:
                async_job.deliver(error)

    def _drain_inbox(self) -> bool:
        """Apply queued requests; False once the generator is closing."""
        while True:
            with self._wake:
                if not self._inbox:
                    return True
                kind, payload = self._inbox.popleft()
            if kind == "close":
                self._cancel_all()
                return False
            handler: Callable[[Any], None] = getattr(self, f"_on_{kind}")
            handler(payload)

    def _on_enqueue(self, job: DynamicJobAsync) -> None:
        try:
            self.generator.enqueue(job.job)
        except Exception as error:  # reported to the job's consumer
            job.deliver(error)
            return
        self._jobs[job.job.serial] = job

    def _on_cancel(self, payload: tuple[DynamicJobAsync, asyncio.Future]) -> None:
        job, done = payload
        self.generator.cancel(job.job)
        self._deliver(self.generator.take_undelivered())
        job.loop.call_soon_threadsafe(_resolve, done)

    def _on_call(self, payload: tuple[Callable, asyncio.AbstractEventLoop, asyncio.Future]) -> None:
        fn, loop, done = payload
        try:
            value = fn(self.generator)
        except Exception as error:  # returned to the caller, never kills the step thread
            loop.call_soon_threadsafe(_settle, done, None, error)
            return
        loop.call_soon_threadsafe(_settle, done, value, None)

    def _cancel_all(self) -> None:
        for async_job in list(self._jobs.values()):
            self.generator.cancel(async_job.job)
        self._deliver(self.generator.take_undelivered())
        self._jobs.clear()


@dataclass(slots=True)
class _View:
    fn: Callable[[DynamicGenerator], Any]
    period_s: float
    value: Any = None
    updated: float = -math.inf


def _put_all(items: list[tuple[DynamicJobAsync, Any]]) -> None:
    """On a job's loop: queue each job's result (or error), in step order."""
    for job, item in items:
        job.queue.put_nowait(item)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future, value: Any, error: Exception | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class DynamicJobAsync:
    """``async for result in DynamicJobAsync(generator, input_ids=..., ...)``: enqueues itself
    at once and yields the job's results until the final one. ``job=`` takes a ready
    ``DynamicJob`` instead of its arguments (e.g. ``DynamicJob.from_request(request, i)``)."""

    def __init__(
        self,
        generator: DynamicGeneratorAsync,
        *args: Any,
        job: DynamicJob | None = None,
        **kwargs: Any,
    ):
        if job is not None and (args or kwargs):
            raise ValueError("pass either a DynamicJob (job=) or its arguments, not both")
        self.generator = generator
        self.job = job if job is not None else DynamicJob(*args, **kwargs)
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[dict[str, Any] | Exception] = asyncio.Queue()
        self.finished = False
        generator.enqueue(self)

    def deliver(self, item: dict[str, Any] | Exception) -> None:
        """Called from the step thread: hand a result (or an error) to the consumer."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.finished = True
                raise item
            if item["eos"]:
                self.finished = True
            yield item

    async def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Like ``async for``, but yields every result that is already waiting as one list,
        so a server can coalesce the tokens of several steps into one message."""
        while not self.finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, Exception):
                    self.finished = True
                    raise item
                batch.append(item)
                if item["eos"]:
                    self.finished = True
                    break
            yield batch

    async def cancel(self) -> None:
        await self.generator.cancel(self)
