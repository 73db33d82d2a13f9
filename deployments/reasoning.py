"""Reasoning models' thinking, split from their answer (``serving.reasoning_parser: think``).

Models such as Qwen3, QwQ and the DeepSeek-R1 family think inside ``<think> ... </think>``
before they answer. With a reasoning parser the chat response carries the thinking as
``message.reasoning_content`` (``delta.reasoning_content`` when streamed, vLLM's and DeepSeek's
field) and only the answer as ``content``, so a client shows or hides it and never sends it back
as part of the answer.

The block opens either in the output (Qwen3 writes ``<think>`` itself) or already in the
prompt (DeepSeek-R1's template ends the prompt with ``<think>``): the prompt's last tokens
decide. A prompt that closed the block (Qwen3 with ``enable_thinking`` false renders an empty
one) leaves the output all answer. Thinking cut by ``max_tokens`` stays thinking, with no
answer. Whitespace between the block and the answer goes.

A chat's ``response_format`` or guided constraint then holds for the answer after the
thinking (``ConstraintSpec.thinking``: the grammar lets the thinking run free up to
``</think>``); a forced tool call is constrained from its first token, so it does not think.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.tool_parsers import HeldSpace, held_prefix

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("think",)


@dataclass(frozen=True, slots=True)
class Split:
    """A piece of output: its thinking and its answer text."""

    reasoning: str = ""
    content: str = ""


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` (its last tokens' text, special tokens
    shown) leaves a ``<think>`` block open for the output to continue."""
    return prompt_tail.rstrip().endswith(OPEN)


class ThinkReader:
    """Splits one choice's output as it streams: ``feed`` each text delta, then ``finish``.
    Text that could still be the start of a tag is held back, and so is whitespace that may
    end the thinking, so any chunking splits alike."""

    def __init__(self, opened_in_prompt: bool) -> None:
        self.opened = opened_in_prompt
        self.state = "start"  # the output may (re)open a block; then "thinking" or "answer"
        self.pending = ""
        self.lead = True  # leading whitespace of the thinking, or of an answer after it, goes
        self.space = HeldSpace()  # whitespace ending the thinking so far

    def feed(self, text: str) -> Split:
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(OPEN):
                    self.pending, self.state = stripped[len(OPEN) :], "thinking"
                    continue
                if not stripped or OPEN.startswith(stripped):
                    break  # may still become "<think>"
                self.state = "thinking" if self.opened else "answer"
                self.lead = self.opened  # no thinking: the answer exactly as written
                continue
            if self.state == "thinking":
                end = self.pending.find(CLOSE)
                cut = end if end >= 0 else len(self.pending) - held_prefix(self.pending, CLOSE)
                reasoning.append(self._thought(self.pending[:cut]))
                if end < 0:
                    self.pending = self.pending[cut:]
                    break
                self.pending = self.pending[end + len(CLOSE) :]
                self.state, self.lead = "answer", True
                self.space.text = ""  # (whitespace ending the thinking goes with the tag)
                continue
            content.append(self._answer(self.pending))
            self.pending = ""
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        text, self.pending = self.pending, ""
        if self.state == "thinking":  # cut short while thinking (max_tokens)
            return Split(self._thought(text), "")
        if self.state == "start" and self.opened:  # only whitespace, or a partial "<think>"
            return Split(self._thought(text), "")
        return Split("", text if self.state == "start" else self._answer(text))

    def _thought(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            if not text:
                return ""
            self.lead = False
        return self.space.take(text)

    def _answer(self, text: str) -> str:
        if self.lead:
            text = text.lstrip()
            self.lead = not text
        return text
