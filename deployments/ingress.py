"""``Ingress``: the HTTP front (starlette) with the OpenAI routes.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or ``stream: true`` server-sent events ending in
``data: [DONE]``). The ingress validates the request, applies the chat template, tokenizes once
and sends token ids to an ``LLMServer`` replica through a streaming handle; replicas never see
HTTP. Errors are OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``.

The starlette app is built per replica by ``__serve_build_asgi_app__`` (Ray Serve's hook for a
non-FastAPI ASGI app whose routes need the deployment instance). Later work: request models move
to ``deployments/protocol.py``, and the handle gets the prefix-aware request router.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deployments.llm_server import context_length
from engine.config import ModelConfig
from engine.demo import resolve_model_path
from engine.tokenizer import Tokenizer

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
class SamplingFields:
    max_tokens: int | None
    temperature: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _int_field(body: dict[str, Any], name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{name}' must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    return value


def _temperature(body: dict[str, Any]) -> float:
    value = body.get("temperature")
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 2:
        raise OpenAIError(
            f"'temperature' must be a number in [0, 2], got {value!r}", param="temperature"
        )
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


def parse_sampling(body: dict[str, Any], chat: bool) -> SamplingFields:
    """Validate the generation fields shared by both routes."""
    if _int_field(body, "n", minimum=1) not in (None, 1):
        raise OpenAIError("only n=1 is supported", param="n")
    max_tokens = _int_field(body, "max_tokens", minimum=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int_field(body, "max_completion_tokens", minimum=1)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=_temperature(body),
        seed=_int_field(body, "seed"),
        stop=_stop(body),
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


def usage_of(final: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(final["prompt_tokens"]), int(final["new_tokens"])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(final.get("cached_tokens", 0))},
    }


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

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": 0,
            "text": delta.get("content", ""),
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, final: dict[str, Any]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage_of(final)}

    def full(self, text: str, final: dict[str, Any]) -> dict[str, Any]:
        finish = FINISH_REASONS.get(final.get("eos_reason"), "stop")
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage_of(final)}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def server_error(exc: BaseException) -> OpenAIError:
    logger.error("request failed", exc_info=exc)
    return OpenAIError(f"internal error: {exc}", status=500, type_="server_error")


# -- the deployment --------------------------------------------------------------------------


def model_id_of(preset: dict[str, dict[str, Any]], folder: Path) -> str:
    configured = (preset.get("serving") or {}).get("model_id")
    if configured:
        return str(configured)
    return "demo" if preset["model"].get("path") is None else folder.name


def wants_bos(tokenizer: Tokenizer, folder: Path) -> bool:
    """Whether a raw completion prompt starts with BOS, as HF tokenizers do it: the config's
    ``add_bos_token`` if set, else whenever a BOS token is declared (Llama 3 yes, Qwen no)."""
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    if "add_bos_token" in config:
        return bool(config["add_bos_token"]) and tokenizer.bos_token_id is not None
    return "bos_token" in tokenizer.special_tokens and tokenizer.bos_token_id is not None


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI HTTP surface; tokenizes and forwards token ids to ``LLMServer``."""

    def __init__(self, llm: DeploymentHandle, preset: dict[str, dict[str, Any]]) -> None:
        folder = resolve_model_path(preset["model"])
        self.tokenizer = Tokenizer.from_pretrained(folder)
        config = ModelConfig.from_pretrained(folder)
        self.context_length = context_length(
            config.max_position_embeddings, preset.get("engine") or {}
        )
        self.model_id = model_id_of(preset, folder)
        self.add_bos = wants_bos(self.tokenizer, folder)
        self.created = int(time.time())
        self._generate = llm.options(method_name="generate", stream=True)
        logger.info("Ingress ready: model %r, context %d", self.model_id, self.context_length)

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        handlers = {HTTPException: _http_error, Exception: _internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "max_model_len": self.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await read_body(request)
            self._check_model(body)
            fields = parse_sampling(body, chat)
            prompt_ids = self._chat_ids(body) if chat else self._completion_ids(body)
            max_new = self._max_new_tokens(fields.max_tokens, len(prompt_ids), chat)
        except OpenAIError as e:
            return e.response()
        job = {
            "identifier": uuid.uuid4().hex,
            "token_ids": prompt_ids,
            "max_new_tokens": max_new,
            "temperature": fields.temperature,
            "seed": fields.seed,
            "stop": list(fields.stop),
        }
        fmt = ResponseFormat.new(chat, self.model_id)
        gen = self._generate.remote(job)
        if fields.stream:
            events = self._events(gen, fmt, fields.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await self._collect(gen, fmt)

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise OpenAIError("'model' must be a string", param="model")
        if model not in (None, self.model_id):
            raise OpenAIError(
                f"The model `{model}` does not exist.",
                status=404,
                param="model",
                code="model_not_found",
            )

    def _completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise OpenAIError("'prompt' must be a string", param="prompt")
        ids = self.tokenizer.encode(prompt, add_bos=self.add_bos)[0].tolist()
        return self._check_prompt(ids, "prompt")

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        messages = parse_messages(body)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # jinja errors and the template's raise_exception
            raise OpenAIError(f"chat template failed: {e}", param="messages") from None
        ids = self.tokenizer.encode(text, encode_special_tokens=True)[0].tolist()
        return self._check_prompt(ids, "messages")

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise OpenAIError("the prompt is empty", param=param)
        if len(ids) >= self.context_length:
            raise OpenAIError(
                f"the prompt has {len(ids)} tokens; this model's context is "
                f"{self.context_length} tokens",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    def _max_new_tokens(self, requested: int | None, prompt_len: int, chat: bool) -> int:
        room = self.context_length - prompt_len
        if requested is None:
            return room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if requested > room:
            raise OpenAIError(
                f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds the "
                f"context of {self.context_length} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    async def _collect(self, gen: DeploymentResponseGenerator, fmt: ResponseFormat) -> Response:
        parts: list[str] = []
        final: dict[str, Any] = {}
        try:
            async for result in gen:
                parts.append(result["text"])
                final = result if result["eos"] else final
        except Exception as e:
            return server_error(e).response()
        return JSONResponse(fmt.full("".join(parts), final))

    async def _events(
        self, gen: DeploymentResponseGenerator, fmt: ResponseFormat, include_usage: bool
    ) -> AsyncIterator[str]:
        done = False
        try:
            async for event in _stream_events(gen, fmt, include_usage):
                yield event
            done = True
        except Exception as e:
            done = True
            error = server_error(e)
            yield sse(
                {
                    "error": {
                        "message": error.message,
                        "type": error.type,
                        "param": None,
                        "code": None,
                    }
                }
            )
        finally:
            if not done:  # the client went away: stop the replica's work too
                gen.cancel()
        yield sse("[DONE]")


async def _stream_events(
    gen: DeploymentResponseGenerator, fmt: ResponseFormat, include_usage: bool
) -> AsyncIterator[str]:
    if fmt.chat:
        yield sse(fmt.chunk({"role": "assistant", "content": ""}))
    final: dict[str, Any] = {}
    async for result in gen:
        if result["text"]:
            yield sse(fmt.chunk({"content": result["text"]}))
        if result["eos"]:
            final = result
    yield sse(fmt.chunk({}, FINISH_REASONS.get(final.get("eos_reason"), "stop")))
    if include_usage:
        yield sse(fmt.usage_chunk(final))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return OpenAIError(str(exc.detail), status=exc.status_code, code=code).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    return server_error(exc).response()
