"""Log-probabilities over HTTP: the request fields and OpenAI's response shapes.

Requests: completions take ``logprobs: k`` (an integer, 0 .. ``MAX_LOGPROBS``; OpenAI's legacy
API stops at 5); chat takes ``logprobs: true`` with ``top_logprobs: k`` (0 .. ``MAX_LOGPROBS``,
only with ``logprobs: true``). Either becomes ``GenerationRequest.logprobs = k``.

Values: the model's log-probabilities, ``log_softmax`` of the raw logits, before temperature,
penalties, bias or constraints (as OpenAI and vLLM's default report them), for greedy and
sampled requests alike. A token is shown as its own bytes (``engine.token_bytes``): as text
when they are valid UTF-8, else as ``bytes:\\xNN...``; chat entries also give ``bytes``. The stop
token that ends a choice is not part of its text and has no entry; tokens that a stop string
cuts from the text keep theirs. ``text_offset`` counts characters from the start of the
completion, or of the prompt with ``echo`` (whose first token has no log-probability: null
``token_logprobs`` and ``top_logprobs`` entries, as OpenAI's).

Replicas send each token as ``[token_id, logprob, top_ids, top_logprobs]`` (``LogprobEntry``).
"""

from __future__ import annotations

import codecs
import math
from typing import Any

from deployments.protocol import OpenAIError
from engine.request import MAX_LOGPROBS
from engine.token_bytes import TokenBytes

LogprobEntry = tuple[int, float | None, list[int], list[float]]  # None: an echo's first
FLOOR = -9999.0  # what -inf (and a NaN from a broken model) reads as: JSON has no infinities


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """``GenerationRequest.logprobs`` of a body: None when no log-probabilities are asked."""
    if chat:
        return _chat_logprobs(body)
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(
            f"'logprobs' must be an integer (0 .. {MAX_LOGPROBS}) for completions", param="logprobs"
        )
    _check_range(value, "logprobs")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise OpenAIError("'logprobs' must be a boolean for chat completions", param="logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise OpenAIError("'top_logprobs' must be an integer", param="top_logprobs")
        _check_range(top, "top_logprobs")
        if not wanted:
            message = "'top_logprobs' requires 'logprobs' to be true"
            raise OpenAIError(message, param="top_logprobs")
    return (top or 0) if wanted else None


def _check_range(value: int, name: str) -> None:
    if not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(f"'{name}' must be in [0, {MAX_LOGPROBS}], got {value}", param=name)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class LogprobsFormatter:
    """Builds one choice's ``logprobs`` objects, chunk by chunk (streaming) or all at once;
    keeps the running ``text_offset`` of a completion."""

    def __init__(self, tokens: TokenBytes, chat: bool, unseen_first: bool = False) -> None:
        """``unseen_first``: the first token is not in the text (the BOS token the server put
        before an echoed text prompt): it takes no width in ``text_offset``."""
        self.tokens = tokens
        self.chat = chat
        self.offset = 0
        self._unseen = unseen_first
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def format(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _chat(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        content = []
        for token, logprob, top_ids, top_values in entries:
            item = self._chat_item(token, logprob)
            item["top_logprobs"] = [
                self._chat_item(i, v) for i, v in zip(top_ids, top_values, strict=True)
            ]
            content.append(item)
        return {"content": content, "refusal": None}

    def _chat_item(self, token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.tokens.text_of(token),
            "logprob": _finite(logprob),
            "bytes": list(self.tokens.bytes_of(token)),
        }

    def _completion(self, entries: list[LogprobEntry]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        out["text_offset"] = []
        for token, logprob, top_ids, top_values in entries:
            text = self.tokens.text_of(token)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            if self._unseen:
                self._unseen = False
            else:
                self.offset += len(self._utf8.decode(self.tokens.bytes_of(token)))
            if logprob is None:  # an echoed prompt's first token: nothing before it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(logprob))
            # OpenAI: the k most likely tokens, and always the sampled one (up to k + 1)
            pairs = zip(top_ids, top_values, strict=True)
            top = {self.tokens.text_of(i): _finite(v) for i, v in pairs}
            top.setdefault(text, _finite(logprob))
            out["top_logprobs"].append(top)
        return out
