"""One choice of a response as the replica's messages arrive: its text, its log-probabilities
and its tool calls: a forced call read back from the constrained output, or (chat) the
model's thinking, answer and the calls it wrote under ``tool_choice`` "auto", read as the text
streams (``deployments.output_reader``). Used by the ingress (streamed chunks or one JSON
body) and the batch job (records), so both agree.

A replica message is ``{"index", "text", "token_ids", "eos", ["logprobs"], [final keys]}``
(``deployments.llm_server``); ``logprobs`` holds one ``LogprobEntry`` per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.logprobs import LogprobsFormatter
from deployments.output_reader import OutputReader, Read, Reasoning
from deployments.responses import ResponseFormat, finish_reason
from deployments.structured import ToolCalling, tool_call
from engine.token_bytes import TokenBytes


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's ``echo``: the prompt as the client gave it, and its first token (the
    one without a log-probability; the others' come from the replica)."""

    text: str
    first_token: int
    added_bos: bool = False  # the first token is a BOS the server put before a text prompt


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """What a response shows beyond text: ``tokens`` when log-probabilities were asked (to
    spell each token), ``tools`` for a forced tool call or calls the model may write (``auto``),
    ``echo`` the prompt before it, ``reasoning`` the thinking split from the answer (chat)."""

    tokens: TokenBytes | None = None
    tools: ToolCalling | None = None
    echo: Echo | None = None
    reasoning: Reasoning | None = None


class ChoiceState:
    """Accumulates one choice; ``chunks`` turns a message into stream chunks."""

    def __init__(self, index: int, fmt: ResponseFormat, options: OutputOptions) -> None:
        self.index = index
        self.fmt = fmt
        self.tools = options.tools if fmt.chat else None
        self.logprobs = None
        if options.tokens is not None:
            unseen = options.echo is not None and options.echo.added_bos
            self.logprobs = LogprobsFormatter(options.tokens, fmt.chat, unseen)
        self.texts: list[str] = []
        self.entries: list[Any] = []
        self.final: dict[str, Any] = {}
        self.call_id = f"call_{fmt.id[-24:]}_{index}"
        self._call_started = False
        self._echo = options.echo  # (None once the prompt is in: the first message only)
        # thinking or tool_choice "auto": the text read as thinking, answer and calls
        auto = self.tools is not None and self.tools.auto
        reasoning = options.reasoning if fmt.chat else None
        self.reader = OutputReader(reasoning, self.tools) if auto or reasoning else None
        self._read = Read()  # what the last message turned out to be

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def answer(self) -> str:
        """The text a record shows: the answer alone when thinking or calls were read from it
        (they have fields of their own), else the whole text."""
        return "".join(self.reader.content) if self.reader is not None else self.text

    def add(self, message: dict[str, Any]) -> None:
        message = self._echoed(message)
        self.texts.append(message["text"])
        self.entries += message.get("logprobs", ())
        if message["eos"]:
            self.final = message
        if self.reader is not None:
            self._read = self.reader.read(message["text"], message["eos"])

    def streamed(self, message: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
        """What ``message`` (just ``add``-ed) adds, as thinking, answer text and whole calls
        (OpenAI's call objects), for the event streams of other APIs. A forced call is whole
        only at the end (``unstreamed``)."""
        if self.reader is not None:
            read = self._read
            return read.reasoning, read.content, [c.openai() for c in read.calls]
        if self.tools is not None:
            return "", "", []
        return "", message["text"], []

    def unstreamed(self, choice: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
        """What only the whole ``choice`` shows: a forced call (or its text, when cut short)."""
        if self.reader is not None or self.tools is None:
            return "", "", []
        calls = choice["message"].get("tool_calls") or []
        return "", "" if calls else choice["message"].get("content") or "", calls

    # -- one body --------------------------------------------------------------------------

    def choice(self) -> dict[str, Any]:
        """The choice's fields beyond ``fmt.full``'s: logprobs, tool calls, finish reason."""
        out: dict[str, Any] = {}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs.format(self.entries)
        if self.reader is not None:
            out["message"] = self.reader.message()
            if self.reader.calls:
                out["finish_reason"] = self.tool_finish_reason()
            return out
        call = self.tools.call(self.text) if self.tools is not None else None
        if call is not None:
            call["id"] = self.call_id
            out["message"] = {"role": "assistant", "content": None, "tool_calls": [call]}
            out["finish_reason"] = self.tool_finish_reason()
        return out

    def tool_finish_reason(self) -> str:
        reason = finish_reason(self.final)
        return "tool_calls" if reason == "stop" else reason

    # -- streaming -------------------------------------------------------------------------

    def _echoed(self, message: dict[str, Any]) -> dict[str, Any]:
        """The first message with the echoed prompt before its text and the prompt's tokens
        before its log-probabilities; any other as it is."""
        echo, self._echo = self._echo, None
        if echo is None:
            return message
        prompt = [(echo.first_token, None, [], []), *message.get("prompt_logprobs", ())]
        entries = [*prompt, *message.get("logprobs", ())]
        return {**message, "text": echo.text + message["text"], "logprobs": entries}

    def chunks(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Stream chunks for one replica message (after ``add``-ing it)."""
        message = self._echoed(message)
        self.add(message)
        out = []
        entries = message.get("logprobs", ())
        delta = self._delta(message)
        if delta is not None or entries:
            chunk = self.fmt.chunk(delta or {}, index=self.index)
            if self.logprobs is not None and entries:
                chunk["choices"][0]["logprobs"] = self.logprobs.format(list(entries))
            out.append(chunk)
        if message["eos"]:
            out += self._last_chunks()
        return out

    def _delta(self, message: dict[str, Any]) -> dict[str, Any] | None:
        text = message["text"]
        if self.reader is not None:
            return self.reader.delta(self._read)
        if self.tools is None:
            return {"content": text} if text else None
        name = self.tools.single_name
        if name is None or not text:  # several functions: the call is sent whole at the end
            return None
        part: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if not self._call_started:
            self._call_started = True
            part = {**tool_call(name, text, self.call_id), "index": 0}
        return {"tool_calls": [part]}

    def _last_chunks(self) -> list[dict[str, Any]]:
        if self.reader is not None:
            reason = self.tool_finish_reason() if self.reader.calls else finish_reason(self.final)
            return [self.fmt.chunk({}, reason, index=self.index)]
        if self.tools is None:
            return [self.fmt.chunk({}, finish_reason(self.final), index=self.index)]
        out = []
        if self.tools.single_name is None:
            call = self.tools.call(self.text)
            delta = (
                {"tool_calls": [{**call, "id": self.call_id, "index": 0}]}
                if call is not None
                else {"content": self.text}  # cut short: not a call, shown as it came
            )
            out.append(self.fmt.chunk(delta, index=self.index))
            if call is None:
                return [*out, self.fmt.chunk({}, finish_reason(self.final), index=self.index)]
        return [*out, self.fmt.chunk({}, self.tool_finish_reason(), index=self.index)]


def full_body(fmt: ResponseFormat, choices: list[ChoiceState]) -> dict[str, Any]:
    """The non-streaming response: ``fmt.full`` plus each choice's extras."""
    body = fmt.full([c.text for c in choices], [c.final for c in choices])
    for shown, state in zip(body["choices"], choices, strict=True):
        shown.update(state.choice())
    return body
