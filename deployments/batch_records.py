"""The batch job's JSONL records: parsing input lines, the output records, and resuming.

Pure file and dict handling (no Ray): see ``deployments.batch`` for the format and the job.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deployments.protocol import OpenAIError
from deployments.responses import finish_reason, usage_of

logger = logging.getLogger("pagedserve.batch")

INVALID, SERVER_ERROR = "invalid_request_error", "server_error"

Id = str | int
Record = dict[str, Any]


# -- input lines -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Item:
    """A parsed input line: an OpenAI-style body still to be validated. ``batch_api``: the
    line is in OpenAI's Batch API file format (its record is too)."""

    line: int
    id: Id
    body: dict[str, Any]
    chat: bool
    batch_api: bool = False


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that gets an error record without reaching the model."""

    line: int
    id: Id | None
    message: str
    param: str | None = None
    batch_api: bool = False


# OpenAI's Batch API file format: {"custom_id", "method": "POST", "url", "body"} per line.
BATCH_API_URLS = {"/v1/chat/completions": True, "/v1/completions": False}
BATCH_API_KEYS = frozenset({"custom_id", "method", "url", "body"})


def usable_id(value: Any) -> bool:
    if isinstance(value, bool):  # JSON true is not an id (and would equal 1 in a set)
        return False
    return isinstance(value, int) or (isinstance(value, str) and value != "")


def parse_line(text: str, line: int) -> Item | BadLine | None:
    """One input line; None for a blank line."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(line, None, f"line {line} is not valid JSON: {e}")
    if not isinstance(obj, dict):
        return BadLine(line, None, f"line {line} must be a JSON object")
    if "custom_id" in obj:
        return _batch_api_line(obj, line)
    if not usable_id(obj.get("id")):
        message = f"line {line}: 'id' must be a non-empty string or an integer"
        return BadLine(line, None, message, "id")
    body = {k: v for k, v in obj.items() if k != "id"}
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        message = "exactly one of 'prompt' or 'messages' is required"
        return BadLine(line, obj["id"], message, "messages" if has_prompt else "prompt")
    return Item(line, obj["id"], body, chat=has_messages)


def _batch_api_line(obj: dict[str, Any], line: int) -> Item | BadLine:
    """A line in OpenAI's Batch API format (what vLLM's ``run_batch`` reads too)."""
    custom_id = obj.get("custom_id")
    known = custom_id if isinstance(custom_id, str) and custom_id else None

    def bad(message: str, param: str) -> BadLine:
        return BadLine(line, known, f"line {line}: {message}", param, batch_api=True)

    if known is None:
        return bad("'custom_id' must be a non-empty string", "custom_id")
    extra = sorted(set(obj) - BATCH_API_KEYS)
    if extra:
        return bad(f"unknown key {extra[0][:40]!r}", extra[0][:40])
    if obj.get("method", "POST") != "POST":
        return bad("'method' must be POST", "method")
    if obj.get("url") not in BATCH_API_URLS:
        return bad(f"'url' must be one of {sorted(BATCH_API_URLS)}", "url")
    if not isinstance(obj.get("body"), dict):
        return bad("'body' must be an object", "body")
    return Item(line, known, obj["body"], BATCH_API_URLS[obj["url"]], batch_api=True)


def error_record(id_: Id | None, line: int, error: OpenAIError, batch_api: bool = False) -> Record:
    if batch_api:
        record = batch_api_record(id_, error.status, error.body(), None)
        return record if id_ is not None else {**record, "line": line}
    body = {"message": error.message, "type": error.type, "param": error.param, "code": error.code}
    return {"id": id_, "line": line, "error": body}


def batch_api_record(
    custom_id: Id | None, status: int, body: dict[str, Any], request_id: str | None
) -> Record:
    """A record of OpenAI's Batch API output format: the HTTP response the line would have
    had (its status and body: the whole completion object, or an error)."""
    response = {"status_code": status, "request_id": request_id, "body": body}
    record_id = f"batch_req_{uuid.uuid4().hex}"
    return {"id": record_id, "custom_id": custom_id, "response": response, "error": None}


def bad_line_record(bad: BadLine) -> Record:
    return error_record(bad.id, bad.line, OpenAIError(bad.message, param=bad.param), bad.batch_api)


def outcome(record: Record) -> str:
    """``ok``, ``failed`` (on the server: retried by the next run) or ``invalid``."""
    if "custom_id" in record:
        status = record["response"]["status_code"]
        return "ok" if status == 200 else "failed" if status >= 500 else "invalid"
    error = record.get("error")
    if not isinstance(error, dict):
        return "ok"
    return "failed" if error.get("type") == SERVER_ERROR else "invalid"


def result_record(
    id_: Id,
    texts: list[str],
    finals: list[dict[str, Any]],
    extras: list[dict[str, Any]] | None = None,
) -> Record:
    """``extras``: per choice, the response's fields beyond text (``ChoiceState.choice``)."""
    extras = extras or [{} for _ in texts]
    pairs = zip(extras, finals, strict=True)
    reasons = [e.get("finish_reason", finish_reason(f)) for e, f in pairs]
    single = len(texts) == 1  # n > 1: one list entry per choice
    record = {
        "id": id_,
        "text": texts[0] if single else texts,
        "finish_reason": reasons[0] if single else reasons,
        "usage": usage_of(finals),
    }
    if any("logprobs" in e for e in extras):
        values = [e.get("logprobs") for e in extras]
        record["logprobs"] = values[0] if single else values
    messages = [e.get("message", {}) for e in extras]
    for key in ("reasoning_content", "tool_calls"):  # thinking; calls (forced or the model's)
        if any(key in m for m in messages):
            values = [m.get(key) for m in messages]
            record[key] = values[0] if single else values
    return record


# -- resume ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Done:
    """What earlier runs finished: ids, and line numbers of id-less lines."""

    ids: set[Id] = field(default_factory=set)
    lines: set[int] = field(default_factory=set)

    def add(self, record: Record) -> None:
        if "custom_id" in record and not isinstance(record.get("response"), dict):
            return  # not a record of ours
        if outcome(record) == "failed":
            return  # retried on the next run
        key = record.get("custom_id") if "custom_id" in record else record.get("id")
        if usable_id(key):
            self.ids.add(key)
        elif isinstance(record.get("line"), int):
            self.lines.add(record["line"])

    def has(self, item: Item | BadLine) -> bool:
        if item.id is not None and item.id in self.ids:
            return True
        return item.id is None and item.line in self.lines


def repair_tail(path: Path) -> None:
    """Cut a half-written last line (a crash mid-write) so appends start on a fresh line."""
    with path.open("rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            json.loads(data[start:])
        except ValueError:
            logger.warning("dropping a half-written last line in %s", path)
            f.truncate(start)
        else:  # a whole record that only lacks its newline
            f.write(b"\n")


def read_done(path: Path) -> Done:
    done = Done()
    if not path.exists():
        return done
    repair_tail(path)
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                logger.warning("%s line %d is not JSON; ignored for resuming", path, number)
                continue
            if isinstance(record, dict):
                done.add(record)
    return done


def read_lines(path: Path) -> Iterator[tuple[int, Item | BadLine | None]]:
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, 1):
            yield number, parse_line(text, number)


def count_pending(path: Path, done: Done) -> tuple[int, int, int]:
    """(lines, lines still to do, lines done before): the progress bar's total, and whether
    to start at all."""
    lines = pending = skipped = 0
    for lines, item in read_lines(path):  # noqa: B007 (the last number is the count)
        if item is not None:
            skipped += done.has(item)
            pending += not done.has(item)
    return lines, pending, skipped
