"""Offline batch inference against the Serve app: JSONL in, JSONL out, resumable.

    python -m deployments.batch --input in.jsonl --output out.jsonl \
        [--config configs/demo.yaml] [--app-name pagedserve] [--concurrency 8]

Input: one JSON object per line, ``{"id": ..., "prompt": ...}`` (a completion) or
``{"id": ..., "messages": [...]}`` (a chat), plus any OpenAI sampling field (``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, penalties, ``logit_bias``,
``n``, ``ignore_eos``, ``logprobs``/``top_logprobs``, ``response_format``, ``tools`` with a
forced ``tool_choice``, ...). ``id`` is a non-empty string or an integer. Blank lines are
skipped. A line may instead be in OpenAI's Batch API file format (vLLM's ``run_batch`` reads
it too): ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``; its record is then ``{"id": "batch_req_...", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}``, ``body`` being the whole response
object the HTTP route would answer (or its error), and resuming keys on ``custom_id``.

Output: one line per input line, in completion order (not input order):

- ``{"id", "text", "finish_reason", "usage"}`` with OpenAI's usage (``prompt_tokens``,
  ``completion_tokens``, ``total_tokens``, ``prompt_tokens_details.cached_tokens``). With
  ``n`` > 1, ``text`` and ``finish_reason`` are lists (one entry per choice) and usage counts
  the prompt once, as the HTTP API does. With log-probabilities the record adds ``logprobs``
  (the route's OpenAI shape), with a forced tool call ``tool_calls`` (and ``finish_reason``
  ``"tool_calls"``); lists with ``n`` > 1 like ``text``.
- ``{"id", "line", "error": {"message", "type", "param", "code"}}`` for a bad line (not JSON,
  no usable id, no prompt/messages, a field the HTTP API would reject: ``type`` is
  ``invalid_request_error``) or a request that failed on the server (``server_error``). A line
  without a usable id (or repeating an earlier id) has ``"id": null`` and is known by ``line``.

Resume: ids (and, for id-less lines, line numbers) already in the output are skipped, so
rerunning the same command after a crash finishes the job; a half-written last line is cut
off first. ``server_error`` records are retried on the next run: when an id has several
records, the last one counts.

The job tokenizes with the same ``PromptBuilder`` as the HTTP ingress and streams token-id
requests straight to ``LLMServer`` through a deployment handle, so the app's request router (a
fresh instance in this process) places every request, prefix-aware, as for HTTP traffic.
If the app is not running, the job deploys it (no HTTP route) and removes it at the end.

Exit status: 0 when every line got its final record (bad lines included), 3 when some
requests failed on the server (rerun to retry them), 2 for a bad command line or input file,
1 for an infrastructure failure (no cluster, deploy failed), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from deployments.batch_records import (
    SERVER_ERROR,
    BadLine,
    Done,
    Id,
    Item,
    Record,
    bad_line_record,
    batch_api_record,
    count_pending,
    error_record,
    outcome,
    read_done,
    read_lines,
    result_record,
)
from deployments.batch_session import (
    DEFAULT_CONFIG,
    Generate,
    InfraError,
    connect_ray,
    handle_generate,
    open_app,
)
from deployments.choices import ChoiceState, OutputOptions, full_body
from deployments.preset import Preset
from deployments.protocol import OpenAIError
from deployments.responses import ResponseFormat
from engine.request import GenerationRequest

logger = logging.getLogger("pagedserve.batch")

DEFAULT_APP_NAME = "pagedserve"
BUSY_RETRY_S = 1.0  # wait before trying a line the busy replicas refused again
EXIT_OK, EXIT_INFRA, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


# -- running ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Summary:
    lines: int = 0
    ok: int = 0
    invalid: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0

    def line(self, output: Path) -> str:
        return (
            f"batch: {self.lines} lines: {self.ok} ok, {self.invalid} invalid, "
            f"{self.failed} failed, {self.skipped} already done; "
            f"{self.seconds:.1f} s -> {output}"
        )


class Validator:
    """The ingress's checks for one body (``PromptBuilder.request`` plus ``model``)."""

    def __init__(self, builder: Any) -> None:
        self.builder = builder

    def request(self, item: Item) -> GenerationRequest:
        return self.prepare(item)[0]

    def prepare(self, item: Item) -> tuple[GenerationRequest, OutputOptions]:
        """The request, and what its record shows beyond text (logprobs, a tool call)."""
        model = item.body.get("model")
        if model is not None and model != self.builder.model_id:
            raise OpenAIError(
                f"The model `{model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )
        fields, request = self.builder.request(item.body, item.chat)
        if fields.stream:  # a record is written whole, never streamed
            raise OpenAIError("a batch line cannot stream: 'stream' must be false", param="stream")
        return request, self.builder.output_options(fields, request, item.body)


async def collect(
    stream: AsyncIterator[dict[str, Any]], choices: list[ChoiceState]
) -> list[ChoiceState]:
    """Each choice's text, logprobs and final message (the one with ``eos``), by the messages'
    ``index``. Reads the stream to its end rather than stopping at the last ``eos``, so it is
    never closed early (which would cancel)."""
    async for message in stream:
        choices[message.get("index", 0)].add(message)
    missing = [c.index for c in choices if not c.final]
    if missing:
        raise RuntimeError(f"the stream ended without a final message for choices {missing}")
    return choices


async def generate_record(
    item: Item,
    request: GenerationRequest,
    generate: Generate,
    options: OutputOptions | None = None,
    model: str = "batch",
) -> Record:
    """All ``n`` choices of one line, from one call (one replica runs them together);
    ``model``: the id a Batch API record's response names."""
    fmt = ResponseFormat.new(item.chat, model, request.request_id)
    try:
        states = await _collect_when_admitted(item, request, generate, fmt, options)
    except Exception as e:  # recorded as retryable; the job goes on
        logger.warning("id %r (line %d) failed: %r", item.id, item.line, e)
        message = f"{type(e).__name__}: {e}"
        error = OpenAIError(message, status=500, type_=SERVER_ERROR)
        return error_record(item.id, item.line, error, item.batch_api)
    if item.batch_api:  # the whole response object, as the HTTP route answers
        return batch_api_record(item.id, 200, full_body(fmt, states), fmt.id)
    extras = [s.choice() for s in states]
    return result_record(item.id, [s.answer for s in states], [s.final for s in states], extras)


async def _collect_when_admitted(
    item: Item,
    request: GenerationRequest,
    generate: Generate,
    fmt: ResponseFormat,
    options: OutputOptions | None,
) -> list[ChoiceState]:
    """The line's choices; while the replicas' queues are full (``--concurrency`` above what
    ``serving.max_queued_requests`` lets wait) the line waits and tries again: a batch job
    wants throughput, not an error record."""
    # (imported here: with ray.serve imported at this module's import, before the job's
    # ray.init, the two-node test's batch driver took engine.model from the installed
    # checkout and failed to import engine.cache.key_centers; not understood further)
    from ray.serve.exceptions import BackPressureError

    while True:
        states = [ChoiceState(i, fmt, options or OutputOptions()) for i in range(request.n)]
        try:
            await collect(generate(request), states)
            return states
        except BackPressureError as e:
            delay = e.retry_after_s or BUSY_RETRY_S
            message = "id %r (line %d): replicas busy, retrying in %.1f s"
            logger.info(message, item.id, item.line, delay)
            await asyncio.sleep(delay)


class Runner:
    """Reads the input, writes records as they finish, at most ``concurrency`` lines in flight."""

    def __init__(
        self, validator: Validator, generate: Generate, out: TextIO, bar: tqdm, concurrency: int
    ) -> None:
        self.validator = validator
        self.generate = generate
        self.out = out
        self.bar = bar
        self.slots = asyncio.Semaphore(concurrency)
        self.tasks: set[asyncio.Task] = set()
        self.summary = Summary()
        self.seen: dict[Id, int] = {}  # id -> first line in this input
        self.failure: BaseException | None = None  # e.g. disk full while writing a record

    def write(self, record: Record) -> None:
        # One write + flush per record: a crash leaves at most one partial line (see
        # repair_tail), and another process can follow the file while the job runs.
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        kind = outcome(record)
        setattr(self.summary, kind, getattr(self.summary, kind) + 1)
        self.bar.update(1)

    def classify(self, item: Item | BadLine | None, done: Done) -> Item | BadLine | None:
        """None when the line needs no record (blank, or done in an earlier run)."""
        if item is None or done.has(item):
            self.summary.skipped += item is not None
            self.bar.update(1)
            return None
        if item.id is None:
            return item
        first = self.seen.setdefault(item.id, item.line)
        if first != item.line:  # a second record would make the id ambiguous
            message = f"duplicate id {item.id!r} (first on line {first})"
            return BadLine(item.line, None, message, batch_api=item.batch_api)
        return item

    async def submit(self, item: Item) -> None:
        try:
            request, options = self.validator.prepare(item)
        except OpenAIError as e:
            self.write(error_record(item.id, item.line, e, item.batch_api))
            return
        except Exception as e:  # a body no check foresaw: still only this line's problem
            logger.warning("id %r (line %d) is not a valid request", item.id, item.line, exc_info=e)
            error = OpenAIError(f"invalid request: {e}")
            self.write(error_record(item.id, item.line, error, item.batch_api))
            return
        await self.slots.acquire()  # bounded: the input is read only as fast as it runs
        task = asyncio.create_task(self.work(item, request, options))
        self.tasks.add(task)
        task.add_done_callback(self.finished)

    async def work(self, item: Item, request: GenerationRequest, options: OutputOptions) -> None:
        model = self.validator.builder.model_id
        self.write(await generate_record(item, request, self.generate, options, model))

    def finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.slots.release()
        if not task.cancelled() and task.exception() is not None:
            self.failure = self.failure or task.exception()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    async def run(self, lines: Iterator[tuple[int, Item | BadLine | None]], done: Done) -> Summary:
        start = time.monotonic()
        try:
            for number, parsed in lines:
                self.summary.lines = number
                item = self.classify(parsed, done)
                if isinstance(item, BadLine):
                    self.write(bad_line_record(item))
                elif item is not None:
                    await self.submit(item)
                self.check()
            while self.tasks:
                await asyncio.wait(set(self.tasks))
            self.check()
        finally:
            await self.cancel()
            self.summary.seconds = time.monotonic() - start
        return self.summary

    async def cancel(self) -> None:
        """Interrupted: stop in-flight streams (their replicas free the pages at once)."""
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks))


async def run_batch(
    input_path: Path,
    output_path: Path,
    validator: Validator,
    generate: Generate,
    concurrency: int = 8,
    done: Done | None = None,
) -> Summary:
    """Process every pending line of ``input_path``, appending records to ``output_path``."""
    done = read_done(output_path) if done is None else done
    total, _, _ = count_pending(input_path, done)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    interval = 0.1 if sys.stderr.isatty() else 5.0  # job logs: a line every few seconds
    with (
        output_path.open("a", encoding="utf-8") as out,
        tqdm(total=total, unit="line", desc="batch", mininterval=interval) as bar,
        logging_redirect_tqdm(),
    ):
        runner = Runner(validator, generate, out, bar, concurrency)
        return await runner.run(read_lines(input_path), done)


def make_validator(preset: Preset) -> Validator:
    from deployments.ingress import PromptBuilder

    return Validator(PromptBuilder(preset))


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deployments.batch",
        description="Batch inference (JSONL in, JSONL out, resumable) against the Serve app.",
    )
    parser.add_argument("--input", type=Path, required=True, help="JSONL requests")
    parser.add_argument("--output", type=Path, required=True, help="JSONL results (appended)")
    parser.add_argument(
        "--config",
        help="preset YAML for tokenizing and, if the app is not running, deploying it "
        f"(default: the running app's preset if known, else {DEFAULT_CONFIG})",
    )
    parser.add_argument("--app-name", default=DEFAULT_APP_NAME)
    parser.add_argument("--concurrency", type=int, default=8, help="lines in flight")
    parser.add_argument("--address", help="Ray address (default: the running cluster)")
    parser.add_argument(
        "--app-timeout", type=float, default=600.0, help="seconds to wait for a deploy"
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    return args


async def run_interruptible(coro) -> Summary:
    """SIGTERM (``ray job stop``) cancels like Ctrl-C, so in-flight streams get cancelled."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
    return await task


def check_paths(args: argparse.Namespace) -> str | None:
    if not args.input.is_file():
        return f"input file {args.input} not found"
    if args.output.exists() and args.output.resolve() == args.input.resolve():
        return "--output must not be the input file"
    return None


def check_config(config: str | None) -> str | None:
    """A bad --config is the caller's mistake: report it before touching the cluster."""
    if config is None:
        return None
    try:
        Preset.load(config)
    except ValueError as e:
        return str(e)
    return None


def run_job(args: argparse.Namespace, done: Done) -> Summary:
    """Connect, make sure the app runs, stream every pending line; cleans up what it started."""
    import ray

    connect_ray(args.address)
    try:
        session = open_app(args.app_name, args.config, args.app_timeout)
        try:
            validator = make_validator(session.preset)
            generate = handle_generate(args.app_name)
            job = run_batch(args.input, args.output, validator, generate, args.concurrency, done)
            return asyncio.run(run_interruptible(job))
        finally:
            session.close()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = parse_args(argv)
    problem = check_paths(args) or check_config(args.config)
    if problem:
        logger.error(problem)
        return EXIT_USAGE
    done = read_done(args.output)
    lines, pending, skipped = count_pending(args.input, done)
    if not pending:  # nothing to do: no need for a cluster at all
        print(Summary(lines=lines, skipped=skipped).line(args.output))
        return EXIT_OK
    logger.info("%d lines to do, %d done before", pending, skipped)
    try:
        summary = run_job(args, done)
    except (KeyboardInterrupt, asyncio.CancelledError):
        logger.error("interrupted; rerun the same command to resume")
        return EXIT_INTERRUPTED
    except (InfraError, OSError) as e:
        logger.error("%s", e)
        return EXIT_INFRA
    except Exception:
        logger.exception("the batch job failed")
        return EXIT_INFRA
    print(summary.line(args.output))
    return EXIT_FAILED if summary.failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
