"""OpenAI request/response shapes: parsing and validation of the HTTP body, the plain dict the
ingress sends to an ``LLMServer`` replica, and the response objects.

Nothing here touches Ray or the model, so every rule is unit-testable. Validation failures are
``OpenAIError``: the ingress turns them into ``{"error": {...}}`` bodies with a 4xx status.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger("ray.serve")

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16


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
class SamplingFields:
    """The generation fields of a request, validated."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    include_usage: bool = False

    def engine_request(
        self, token_ids: list[int], max_new_tokens: int, page_hashes: list[int], n: int = 1
    ) -> dict[str, Any]:
        """The plain dict an ``LLMServer`` replica takes (see ``job_arguments``): ``n`` choices
        of one prompt, choice ``i`` seeded with ``seed + i``."""
        return {
            "identifier": uuid.uuid4().hex,
            "token_ids": token_ids,
            "page_hashes": page_hashes,
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min(self.min_tokens, max_new_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": dict(self.logit_bias),
            "seed": self.seed,
            "n": n,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
        }

    def single_choice(self, choice: int) -> SamplingFields:
        """These fields for choice ``choice`` alone (n=1, its own seed)."""
        seed = None if self.seed is None else self.seed + choice
        return dataclasses.replace(self, n=1, seed=seed)


def _int_field(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{name}' must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    """A float field in [low, high] (None means the default)."""
    value = body.get(name)
    if value is None:
        return default
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


def parse_sampling(body: dict[str, Any], chat: bool, vocab_size: int) -> SamplingFields:
    """Validate the generation fields shared by both routes."""
    n = _int_field(body, "n", minimum=1) or 1
    if n > MAX_CHOICES:
        raise OpenAIError(f"'n' must be <= {MAX_CHOICES}, got {n}", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    top_k = _int_field(body, "top_k", minimum=-1)
    return SamplingFields(
        max_tokens=_max_tokens(body, chat),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 0.999),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 10.0),
        logit_bias=_logit_bias(body, vocab_size),
        seed=_int_field(body, "seed"),
        stop=_stop(body),
        n=n,
        ignore_eos=_bool_field(body, "ignore_eos"),
        min_tokens=_int_field(body, "min_tokens", minimum=0) or 0,
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


# -- the replica side ------------------------------------------------------------------------


def job_arguments(
    request: dict[str, Any], eos_token_ids: frozenset[int], choice: int = 0
) -> dict[str, Any]:
    """DynamicJob keyword arguments for choice ``choice`` of an engine request dict (from
    ``engine_request``).

    Raises ValueError (naming the value) for anything the engine cannot run.
    """
    from engine.sampling import SamplerSettings

    token_ids = [int(t) for t in request["token_ids"]]
    settings = SamplerSettings(
        temperature=float(request.get("temperature", 1.0)),
        top_p=float(request.get("top_p", 1.0)),
        top_k=int(request.get("top_k", 0)),
        min_p=float(request.get("min_p", 0.0)),
        presence_penalty=float(request.get("presence_penalty", 0.0)),
        frequency_penalty=float(request.get("frequency_penalty", 0.0)),
        repetition_penalty=float(request.get("repetition_penalty", 1.0)),
        token_bias={int(k): float(v) for k, v in (request.get("logit_bias") or {}).items()},
    )
    stops: list[int | str] = [] if request.get("ignore_eos") else sorted(eos_token_ids)
    stops += [str(s) for s in request.get("stop") or () if s]
    seed = request.get("seed")
    identifier = request.get("identifier")
    return {
        "input_ids": token_ids,
        "max_new_tokens": int(request["max_new_tokens"]),
        "min_new_tokens": int(request.get("min_new_tokens", 0)),
        "stop_conditions": stops,
        "gen_settings": settings,
        "seed": None if seed is None else int(seed) + choice,
        "identifier": identifier if choice == 0 else f"{identifier}/{choice}",
    }


def choice_count(request: dict[str, Any]) -> int:
    n = request.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n must be an int in [1, {MAX_CHOICES}], got {n!r}")
    return n
