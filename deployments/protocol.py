"""OpenAI request/response shapes: parsing and validation of the HTTP body into the engine's
``GenerationRequest`` (what the ingress sends to an ``LLMServer`` replica), and the response
objects.

Nothing here touches Ray or the model, so every rule is unit-testable. Validation failures are
``OpenAIError``: the ingress turns them into ``{"error": {...}}`` bodies with a 4xx status.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.request import MAX_CHOICES, GenerationRequest, SamplerSettings

logger = logging.getLogger("ray.serve")

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIError(Exception):
    """An error the client sees as ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)


# -- request fields --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestFields:
    """The generation fields of a request body, validated before its prompt is tokenized;
    ``generation`` then makes the one ``GenerationRequest`` that goes to a replica."""

    settings: SamplerSettings
    max_tokens: int | None
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False

    def generation(
        self, prompt_ids: list[int], max_new_tokens: int, page_hashes: list[int]
    ) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=max_new_tokens,
            settings=self.settings,
            min_new_tokens=min(self.min_tokens, max_new_tokens),
            seed=self.seed,
            n=self.n,
            stop_strings=self.stop,
            stop_on_eos=not self.ignore_eos,
            page_hashes=tuple(page_hashes),
        )


def _int_field(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{name}' must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """A float field in [low, high]; None when absent (the engine's default applies)."""
    value = body.get(name)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        message = f"'{name}' must be a number in [{low}, {high}], got {value!r}"
        raise OpenAIError(message, param=name)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise OpenAIError("'stop' must be a string or a list of strings", param="stop")
    return tuple(s for s in values if s)


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise OpenAIError(f"'{name}' must be a boolean, got {value!r}", param=name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpenAIError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise OpenAIError(
                f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < vocab_size:
            raise OpenAIError(f"logit_bias token {token} is out of range", param="logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise OpenAIError(f"logit_bias[{key}] must be a number", param="logit_bias")
        if not -100 <= amount <= 100:
            raise OpenAIError(f"logit_bias[{key}] must be in [-100, 100]", param="logit_bias")
        bias[token] = float(amount)
    return bias


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    max_tokens = _int_field(body, "max_tokens", minimum=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int_field(body, "max_completion_tokens", minimum=1)
    return max_tokens


def parse_settings(body: dict[str, Any], vocab_size: int) -> SamplerSettings:
    """The sampler settings of a body; a field it leaves out keeps ``SamplerSettings``' own
    default (OpenAI's defaults are the same neutral ones)."""
    top_k = _int_field(body, "top_k", minimum=-1)
    values = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 1e-9, 1.0),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": _number(body, "min_p", 0.0, 0.999),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.01, 10.0),
        "token_bias": _logit_bias(body, vocab_size) or None,
    }
    return SamplerSettings(**{k: v for k, v in values.items() if v is not None})


def parse_fields(body: dict[str, Any], chat: bool, vocab_size: int) -> RequestFields:
    """Validate the generation fields shared by both routes."""
    n = _int_field(body, "n", minimum=1) or 1
    if n > MAX_CHOICES:
        raise OpenAIError(f"'n' must be <= {MAX_CHOICES}, got {n}", param="n")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    return RequestFields(
        settings=parse_settings(body, vocab_size),
        max_tokens=_max_tokens(body, chat),
        min_tokens=_int_field(body, "min_tokens", minimum=0) or 0,
        seed=_int_field(body, "seed"),
        stop=_stop(body),
        n=n,
        ignore_eos=_bool_field(body, "ignore_eos"),
        stream=_bool_field(body, "stream"),
        include_usage=_bool_field(options, "include_usage"),
    )


def _message_content(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text is supported
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise OpenAIError(f"messages[{index}].content must be a string or text parts", param="messages")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(f"messages[{i}] must be an object with a 'role'", param="messages")
        parsed.append({**message, "content": _message_content(message.get("content"), i)})
    return parsed


async def read_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    return body


# -- response shapes -------------------------------------------------------------------------


def usage_of(finals: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI usage for one prompt and its choices: the prompt counts once."""
    prompt = int(finals[0]["prompt_tokens"])
    completion = sum(int(f["new_tokens"]) for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(finals[0].get("cached_tokens", 0))},
    }


def finish_reason(final: dict[str, Any]) -> str:
    return FINISH_REASONS.get(final.get("eos_reason"), "stop")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """OpenAI object shapes of one response (chat or text completion)."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> ResponseFormat:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": None}
            choice["finish_reason"] = finish_reason
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": index,
            "text": delta.get("content", ""),
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, finals: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage_of(finals)}

    def full(self, texts: list[str], finals: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for index, (text, final) in enumerate(zip(texts, finals, strict=True)):
            choice: dict[str, Any] = {"index": index, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["finish_reason"] = finish_reason(final)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, choices), "usage": usage_of(finals)}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def server_error(exc: BaseException) -> OpenAIError:
    logger.error("request failed", exc_info=exc)
    return OpenAIError(f"internal error: {exc}", status=500, type_="server_error")
