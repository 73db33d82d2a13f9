"""The batch job's JSONL records: parsing input lines, the output records, and resuming.

Pure file and dict handling (no Ray): see ``deployments.batch`` for the format and the job.
"""

from __future__ import annotations

import json
import logging
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
    """A parsed input line: an OpenAI-style body still to be validated."""

    line: int
    id: Id
    body: dict[str, Any]
    chat: bool


@dataclass(frozen=True, slots=True)
class BadLine:
    """A line that gets an error record without reaching the model."""

    line: int
    id: Id | None
    message: str
    param: str | None = None


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
    if not usable_id(obj.get("id")):
        message = f"line {line}: 'id' must be a non-empty string or an integer"
        return BadLine(line, None, message, "id")
    body = {k: v for k, v in obj.items() if k != "id"}
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        message = "exactly one of 'prompt' or 'messages' is required"
        return BadLine(line, obj["id"], message, "messages" if has_prompt else "prompt")
    return Item(line, obj["id"], body, chat=has_messages)


def error_record(id_: Id | None, line: int, error: OpenAIError) -> Record:
    body = {"message": error.message, "type": error.type, "param": error.param, "code": error.code}
    return {"id": id_, "line": line, "error": body}


def bad_line_record(bad: BadLine) -> Record:
    return error_record(bad.id, bad.line, OpenAIError(bad.message, param=bad.param))


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
        error = record.get("error")
        if isinstance(error, dict) and error.get("type") == SERVER_ERROR:
            return  # retried on the next run
        if usable_id(record.get("id")):
            self.ids.add(record["id"])
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
