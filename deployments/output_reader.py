"""A chat choice's text read as it streams into what the response shows: the model's thinking
(``reasoning_content``, ``deployments.reasoning``), its answer (``content``) and the tool calls
it wrote (``tool_calls`` under ``tool_choice`` "auto", ``deployments.tool_parsers``).

The thinking is split off first; the answer after it is what the call syntax reads. A whole
response is the same reading fed at once, so streamed and whole responses agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.reasoning import Split, ThinkReader
from deployments.structured import ToolCalling
from deployments.tool_parsers import Parsed, ParsedCall


@dataclass(frozen=True, slots=True)
class Reasoning:
    """A request whose output may think first: ``opened``: its prompt left a ``<think>``
    block open; ``shown``: the thinking is in the response (vLLM's ``include_reasoning``)."""

    opened: bool
    shown: bool = True


@dataclass(frozen=True, slots=True)
class Read:
    """What one piece of output turned out to be."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[ParsedCall, ...] = ()


class OutputReader:
    """Reads one chat choice; ``read`` each replica message's text, then build the message."""

    def __init__(self, reasoning: Reasoning | None, tools: ToolCalling | None) -> None:
        self.think = ThinkReader(reasoning.opened) if reasoning is not None else None
        self.show_reasoning = reasoning is not None and reasoning.shown
        auto = tools is not None and tools.auto
        self.call_reader = tools.syntax.reader(tools.names) if auto else None
        self.parallel = tools.parallel if auto else True
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ParsedCall] = []

    def read(self, text: str, last: bool) -> Read:
        """``text``, the next piece of the output (``last``: the output ends with it)."""
        split = self._split(text, last)
        parsed = self._parse(split.content, last)
        calls = parsed.calls
        if not self.parallel:  # parallel_tool_calls false: the first call only
            calls = calls[: max(0, 1 - len(self.calls))]
        reasoning = split.reasoning if self.show_reasoning else ""
        self.reasoning.append(reasoning)
        self.content.append(parsed.content)
        self.calls += calls
        return Read(reasoning, parsed.content, calls)

    def _split(self, text: str, last: bool) -> Split:
        if self.think is None:
            return Split("", text)
        split = self.think.feed(text)
        if last:
            end = self.think.finish()
            split = Split(split.reasoning + end.reasoning, split.content + end.content)
        return split

    def _parse(self, text: str, last: bool) -> Parsed:
        if self.call_reader is None:
            return Parsed(text)
        parsed = self.call_reader.feed(text)
        if last:
            end = self.call_reader.finish()
            parsed = Parsed(parsed.content + end.content, parsed.calls + end.calls)
        return parsed

    def message(self) -> dict[str, Any]:
        """The response's ``message`` for everything read."""
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.show_reasoning:
            message["reasoning_content"] = "".join(self.reasoning) or None
        if self.calls:
            message["content"] = content or None
            message["tool_calls"] = [call.openai() for call in self.calls]
        return message

    def delta(self, read: Read) -> dict[str, Any] | None:
        """A stream chunk's ``delta`` for one piece; each call goes whole in one delta."""
        delta: dict[str, Any] = {}
        if read.reasoning:
            delta["reasoning_content"] = read.reasoning
        if read.content:
            delta["content"] = read.content
        if read.calls:
            first = len(self.calls) - len(read.calls)
            calls = enumerate(read.calls, start=first)
            delta["tool_calls"] = [{"index": k, **call.openai()} for k, call in calls]
        return delta or None
