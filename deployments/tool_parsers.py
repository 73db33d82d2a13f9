"""Tool calls the model writes itself (``tool_choice: "auto"``), read back out of its text.

With ``tool_choice: "auto"`` the model decides whether to call a function, and writes the call
in the syntax its chat template taught it. A deployment names that syntax in its preset
(``serving.tool_call_parser``, as vLLM's ``--tool-call-parser``); without one, ``"auto"`` is
refused, since nobody could tell a call from text.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (Hermes 2/3, Qwen 2.5, Qwen 3, SmolLM3 and other templates written after Hermes).
- ``llama3_json``: the whole output is one JSON object ``{"name": ..., "parameters": {...}}``
  (``"arguments"`` is read too), or several separated by ``;`` (Llama 3.1-3.3's JSON tool
  calling; its ``<|python_tag|>`` prefix, a special token, is skipped when it shows).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name", "arguments"}]`` (Mistral 7B v0.3,
  Nemo, Small 2409-2501), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (Small 3.1 and later);
  its markers are special tokens, so these responses show special tokens, and call ids are
  nine letters or digits, as Mistral's templates require.

A call is only a call when its JSON parses, names one of the request's tools and its arguments
are an object; anything else stays in the message's content exactly as the model wrote it, so
nothing the model says is lost. The same reader serves streamed and whole responses (a whole
response is the stream fed at once), so both give the same content and calls, whatever the
chunking: text that could still be the start of a call is held back, and so is whitespace that
only separates calls.

Each syntax also writes calls (earlier turns' ``tool_calls`` for a template that does not read
them, so the model sees its own syntax) and describes itself and the tools in a system message
for a template without a ``tools`` variable.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import bounded_json, too_deep


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a piece of output turned out to be: text for ``content`` and calls (in order)."""

    content: str = ""
    calls: tuple[ParsedCall, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def read_call(
    value: Any, tool_names: frozenset[str], keys: tuple[str, ...], call_id: str | None = None
) -> ParsedCall | None:
    """A call from a decoded JSON value ``{"name", <one of keys>: {...}}``; None when it is not
    a call of one of ``tool_names`` with object arguments (a string holding an object counts:
    some models write the arguments as JSON text). ``call_id``: the call's id (default: a new
    ``call_...`` one)."""
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    present = [k for k in keys if k in value]
    if len(present) != 1 or set(value) != {"name", present[0]}:
        return None
    arguments = value[present[0]]
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    if call_id is None:
        return ParsedCall(value["name"], text)
    return ParsedCall(value["name"], text, call_id)


def _loads(text: str) -> Any:
    """The JSON value of ``text`` under the body's depth limit; None for anything else."""
    try:
        return bounded_json(text)
    except ValueError:
        return None


def held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HeldSpace:
    """Whitespace ending the text given out so far, held until more text follows it: it may
    only separate what comes next (a call, the end of a thinking block) from what came before."""

    def __init__(self) -> None:
        self.text = ""

    def take(self, text: str) -> str:
        """``text`` after the held whitespace, less its own trailing whitespace (now held)."""
        text = self.text + text
        shown = text.rstrip()
        self.text = text[len(shown) :]
        return shown


class CallReader:
    """Reads one choice's output as it streams: ``feed`` each text delta, then ``finish``."""

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


class HermesReader(CallReader):
    """Content streams as it comes; a ``<tool_call>`` block is held until its end tag and is a
    call if its JSON is one. Whitespace around calls only separates them: whitespace ending the
    content so far is held until more text follows (after a call, that text's own leading
    whitespace goes), and at the end it is given out only when there were no calls. So
    ``"A\n<tool_call>...</tool_call>\nB"`` has the content ``"A\nB"``."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.pending = ""  # text not yet read
        self.in_call = False
        self.made_calls = False
        self.space = HeldSpace()  # whitespace ending the content given out so far
        self.after_call = False  # a call just ended: the next text's leading space goes

    def feed(self, text: str) -> Parsed:
        self.pending += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self.in_call:
                end = self.pending.find(self.END)
                if end < 0:
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(self.END) :]
                self.in_call = False
                self._close(body, True, content, calls)
                continue
            start = self.pending.find(self.START)
            if start >= 0:
                self._text(self.pending[:start], content)
                self.pending = self.pending[start + len(self.START) :]
                self.in_call = True
                continue
            cut = len(self.pending) - held_prefix(self.pending, self.START)
            self._text(self.pending[:cut], content)
            self.pending = self.pending[cut:]
            break
        return Parsed("".join(content), tuple(calls))

    def finish(self) -> Parsed:
        content: list[str] = []
        calls: list[ParsedCall] = []
        if self.in_call:  # an unclosed last call (a stop string, max_tokens) counts if whole
            self._close(self.pending, False, content, calls)
        else:
            self._text(self.pending, content)
        if not self.made_calls:  # no calls: the text is the model's, whitespace and all
            content.append(self.space.text)
        self.pending, self.space.text = "", ""
        return Parsed("".join(content), tuple(calls))

    def _text(self, text: str, out: list[str]) -> None:
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        shown = self.space.take(text)
        if shown:
            out.append(shown)

    def _close(self, body: str, closed: bool, content: list[str], calls: list[ParsedCall]) -> None:
        call = read_call(_loads(body.strip()), self.tool_names, ("arguments", "parameters"))
        if call is None:  # not a call after all: the model's text as it wrote it
            self._text(self.START + body + (self.END if closed else ""), content)
            return
        calls.append(call)
        self.made_calls = self.after_call = True


class Llama3JsonReader(CallReader):
    """Output whose first non-space character is ``{`` is held whole and read at the end as
    calls separated by ``;``; if any part is not a call, it is all content."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.held = ""
        self.mode: str | None = None  # None until the first non-space text: "json" or "text"

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(text)
        self.held += text
        if self.mode is None:
            start = self.held.lstrip()
            if not start or self.PYTHON_TAG.startswith(start):
                return Parsed()
            self.mode = "json" if start.startswith(("{", self.PYTHON_TAG)) else "text"
        if self.mode == "text":
            text, self.held = self.held, ""
            return Parsed(text)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.held = self.held, ""
        calls = self._calls(text) if self.mode == "json" else None
        return Parsed("", tuple(calls)) if calls else Parsed(text)

    def _calls(self, text: str) -> list[ParsedCall] | None:
        text = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if too_deep(text):
            return None
        decoder = json.JSONDecoder()
        calls: list[ParsedCall] = []
        position = 0
        while position < len(text):
            try:
                value, position = decoder.raw_decode(text, position)
            except (ValueError, RecursionError):
                return None
            call = read_call(value, self.tool_names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = text[position:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return None
            position = len(text) - len(rest[1:].lstrip())
        return calls or None


class MistralReader(CallReader):
    """Content until ``[TOOL_CALLS]``; everything after it is held and read at the end: a JSON
    list of ``{"name", "arguments"[, "id"]}`` (Mistral v3 and v7 tokenizers), or
    ``name[ARGS]{...}`` per call, each after its own ``[TOOL_CALLS]`` (v11 and later). If it
    does not read as calls, it is all content, marker included. Ids are Mistral's: nine
    letters or digits (its templates refuse others), the model's own when it wrote them."""

    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    ID = re.compile(r"[a-zA-Z0-9]{9}")

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self.pending = ""
        self.calling = False
        self.space = HeldSpace()  # whitespace ending the content so far (dropped before calls)

    def feed(self, text: str) -> Parsed:
        self.pending += text
        if self.calling:
            return Parsed()
        mark = self.pending.find(self.MARK)
        cut = mark if mark >= 0 else len(self.pending) - held_prefix(self.pending, self.MARK)
        content = self.space.take(self.pending[:cut])
        self.pending = self.pending[cut:]
        if mark >= 0:
            self.calling, self.pending = True, self.pending[len(self.MARK) :]
        return Parsed(content)

    def finish(self) -> Parsed:
        text, self.pending = self.pending, ""
        calls = self._calls(text) if self.calling else None
        if calls:
            return Parsed("", tuple(calls))
        marker = self.MARK if self.calling else ""
        return Parsed(self.space.text + marker + text)

    def _calls(self, text: str) -> list[ParsedCall] | None:
        text = text.strip()
        if text.startswith("["):  # [{"name", "arguments"}, ...]
            values = _loads(text)
            if not isinstance(values, list) or not values:
                return None
            calls = [self._call(v) for v in values]
        else:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            calls = [self._written(part) for part in text.split(self.MARK)]
        return calls if calls and all(calls) else None

    def _call(self, value: Any) -> ParsedCall | None:
        call_id = value.pop("id", None) if isinstance(value, dict) else None
        if call_id is not None and not (isinstance(call_id, str) and self.ID.fullmatch(call_id)):
            return None
        return read_call(value, self.tool_names, ("arguments",), call_id or mistral_call_id())

    def _written(self, part: str) -> ParsedCall | None:
        name, args, arguments = part.strip().partition(self.ARGS)
        if not args:
            return None
        value = {"name": name.strip(), "arguments": _loads(arguments.strip())}
        return read_call(value, self.tool_names, ("arguments",), mistral_call_id())


def mistral_call_id() -> str:
    """Nine letters or digits, as Mistral's chat templates require of tool call ids."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class CallSyntax:
    """How one family of models writes calls: read (``reader``), written back for a template
    that cannot render ``tool_calls`` (``written``), described for one without ``tools``."""

    name = ""

    def reader(self, tool_names: frozenset[str]) -> CallReader:
        raise NotImplementedError

    def written(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    how_to_call = ""  # the instructions' last part: how this syntax writes a call

    def instructions(self, tools: list[dict[str, Any]]) -> str:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You may call functions to help answer. The functions, one JSON schema per line:\n"
            f"{listing}\n{self.how_to_call}"
        )

    @property
    def markers(self) -> tuple[str, ...]:
        """Texts of the syntax that tokenizers often make special tokens (which a response
        must then show: ``decode_special_tokens``)."""
        return ()


class Hermes(CallSyntax):
    name = "hermes"

    def reader(self, tool_names: frozenset[str]) -> CallReader:
        return HermesReader(tool_names)

    def written(self, name: str, arguments: Any) -> str:
        value = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{HermesReader.START}\n{value}\n{HermesReader.END}"

    how_to_call = (
        "To call one, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call>, for example:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n'
        "</tool_call>\nWrite one such block per call."
    )

    @property
    def markers(self) -> tuple[str, ...]:
        return (HermesReader.START, HermesReader.END)


class Llama3Json(CallSyntax):
    name = "llama3_json"

    def reader(self, tool_names: frozenset[str]) -> CallReader:
        return Llama3JsonReader(tool_names)

    def written(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    how_to_call = (
        "To call one, answer with only a JSON object of the form "
        '{"name": function name, "parameters": {argument name: value}}; '
        "separate several calls with ';'. Otherwise answer in text."
    )


class Mistral(CallSyntax):
    name = "mistral"
    how_to_call = (
        "To call functions, answer with [TOOL_CALLS] followed by a JSON list of calls, "
        '[{"name": function name, "arguments": {argument name: value}}, ...]. Otherwise '
        "answer in text."
    )

    def reader(self, tool_names: frozenset[str]) -> CallReader:
        return MistralReader(tool_names)

    def written(self, name: str, arguments: Any) -> str:
        value = json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
        return f"{MistralReader.MARK}{value}"

    @property
    def markers(self) -> tuple[str, ...]:
        return (MistralReader.MARK, MistralReader.ARGS)


CALL_SYNTAXES: dict[str, CallSyntax] = {s.name: s for s in (Hermes(), Llama3Json(), Mistral())}
