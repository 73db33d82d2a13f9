"""``Ingress``: the HTTP front (starlette) with the OpenAI routes.

Routes: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /v1/stats``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or ``stream: true`` server-sent
events ending in ``data: [DONE]``), ``POST /v1/responses`` (OpenAI's Responses API over the
chat path), ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages
API, likewise), ``POST /tokenize`` and ``POST /detokenize``. The ingress
validates the request, applies the chat template, tokenizes once, computes the prompt's page
hashes (the engine's own ``prefix_hashes``) and sends token ids to an ``LLMServer`` replica
through a streaming handle whose request router places it by prefix; a completion with several
prompts sends one request per prompt and merges their streams. Errors are OpenAI error bodies
``{"error": {"message", "type", "param", "code"}}``; a request the replicas' full queues refuse
is a 503 with a Retry-After.

The starlette app is built per replica by ``__serve_build_asgi_app__`` (Ray Serve's hook for a
non-FastAPI ASGI app whose routes need the deployment instance).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.exceptions import TaskCancelledError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deployments import anthropic_api, routing_audit, tokenization
from deployments.chat_embeds import ChatEmbeds, check_tools_text
from deployments.choices import ChoiceState, Echo, OutputOptions, full_body
from deployments.cpu_affinity import pin_ingress
from deployments.guidance import NEGATIVE_FIELD
from deployments.messages import for_template, text_length
from deployments.output_reader import Reasoning
from deployments.preset import Preset
from deployments.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_PROMPTS,
    OpenAIError,
    RequestFields,
    parse_body,
    parse_fields,
    read_body_bytes,
    server_error,
    text_value,
)
from deployments.reasoning import opens_thinking
from deployments.responses import ResponseFormat, sse
from deployments.responses_api import (
    ResponseEvents,
    ResponseShape,
    ResponsesRequest,
    output_items,
    responses_error,
    responses_usage,
    status_of,
    translate,
)
from deployments.structured import ToolCalling, tools_system_message
from deployments.tool_parsers import CALL_SYNTAXES
from engine.cache.prefix_hash import prefix_hashes, salt_root
from engine.config import ModelConfig
from engine.embeddings import MMEmbedding
from engine.model.model import resolve_device, resolve_dtype
from engine.request import GenerationRequest
from engine.token_bytes import TokenBytes
from engine.tokenizer import Tokenizer

logger = logging.getLogger("ray.serve")
PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens, read for a thinking block it opened
BUSY_RETRY_AFTER_S = 1.0  # Retry-After when Serve's backpressure config names none

# What a request's handler sees when its client disconnected (Serve cancels the call).
CLIENT_GONE = (asyncio.CancelledError, TaskCancelledError, RequestCancelledError)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for it; never seen by the (gone) client


class PromptBuilder:
    """Tokenizes prompts and chats exactly as the replicas' model expects (also used by the
    batch job, so both paths agree token for token)."""

    def __init__(self, preset: Preset) -> None:
        folder = preset.model.resolve_path()
        self.tokenizer = Tokenizer.from_pretrained(folder)
        if preset.model.chat_template is not None:  # the preset's own template
            self.tokenizer.chat_template = preset.model.chat_template
        self.config = ModelConfig.from_pretrained(folder)
        self.context_length = preset.context_length(self.config.max_position_embeddings)
        self.page_size = preset.engine.page_size
        self.model_id = preset.model_id
        self.add_bos = self.tokenizer.add_bos_token
        self.trust_message_tokens = preset.serving.trust_message_special_tokens
        self.call_syntax = CALL_SYNTAXES.get(preset.serving.tool_call_parser or "")
        self.reasoning_parser = preset.serving.reasoning_parser
        # a call syntax whose markers are special tokens here: "auto" responses must show them
        self.call_markers_special = self.call_syntax is not None and any(
            _is_special_text(self.tokenizer, marker) for marker in self.call_syntax.markers
        )
        # No token covers more bytes of text than the longest one decodes to, so a text longer
        # than context x that cannot fit: refused before spending time tokenizing it.
        self.max_prompt_chars = self.context_length * _longest_token_bytes(self.tokenizer)
        self.token_bytes = TokenBytes(self.tokenizer)  # spells tokens in logprobs
        # the replicas' compute dtype: prompt_embeds rows are cast to it here, so the content
        # hash (page hashes, routing) is the one the replicas compute
        self.run_dtype = resolve_dtype(preset.model.dtype, resolve_device(preset.model.device))

    def completion_ids(self, body: dict[str, Any], param: str = "prompt") -> list[int]:
        """The ids of the body's ``param`` (``prompt``, or CFG's ``negative_prompt``): a
        string, or a list of token ids."""
        prompt = _one_prompt(body.get(param))
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            ids = list(prompt)  # pre-tokenized prompt
            if any(not 0 <= t < self.config.vocab_size for t in ids):
                raise OpenAIError(f"'{param}' has token ids outside the vocabulary", param=param)
        elif isinstance(prompt, str):
            self.check_text_length(len(text_value(prompt, param, f"'{param}'")), param)
            ids = self.tokenizer.encode(prompt, add_bos=self.add_bos)[0].tolist()
        else:
            raise OpenAIError(f"'{param}' must be a string or a list of token ids", param=param)
        return self.check_prompt(ids, param)

    def chat_ids(self, body: dict[str, Any], tools: ToolCalling | None = None) -> list[int]:
        return self.chat_prompt(body.get("messages"), tools)[0]

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Refuse ``chat_template_kwargs`` the template would not read (or that would replace
        what the server passes it): nothing a request sets is silently ignored."""
        template = self.tokenizer.chat_template or ""
        reserved = {"messages", "add_generation_prompt", "tools", "documents"}
        reserved |= set(self.tokenizer.special_tokens)
        for name in kwargs:
            if name in reserved:
                message = f"chat_template_kwargs: {name!r} is set by the server"
                raise OpenAIError(message, param="chat_template_kwargs")
            if not re.search(rf"\b{name}\b", template):
                message = f"chat_template_kwargs: this model's chat template does not use {name!r}"
                raise OpenAIError(message, param="chat_template_kwargs")

    def chat_prompt(
        self,
        value: Any,
        tools: ToolCalling | None = None,
        param: str = "messages",
        embeds: ChatEmbeds | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        checked: bool = True,
    ) -> tuple[list[int], tuple[MMEmbedding, ...]]:
        """The ids of the conversation ``value`` (the body's ``param``) and the containers of
        its ``input_embeds`` parts, whose placeholder ids sit where the template put them;
        ``template_kwargs``: the request's variables for the template (checked); ``checked``:
        refuse an empty prompt or one the context cannot hold (``/tokenize`` counts them)."""
        embeds = embeds or ChatEmbeds(self.config.hidden_size, self.run_dtype)
        messages, embeddings = embeds.messages(value, param)
        self.check_text_length(text_length(messages), param)
        template = self.tokenizer.chat_template or ""
        messages = for_template(messages, template, self.call_syntax)
        self.check_template_kwargs(template_kwargs or {})
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools is not None and embeddings:
            check_tools_text(tools.tools)
        if tools is not None and "tools" in template:
            extra["tools"] = list(tools.tools)  # the template renders them its own way
        elif tools is not None:
            messages = [tools_system_message(tools), *messages]
        try:
            ids = self.tokenizer.encode_chat(
                messages,
                add_generation_prompt,
                trusted=self.trust_message_tokens,
                embeddings=embeddings or None,
                **extra,
            )
        except Exception as e:  # jinja errors, the template's raise_exception, forged tokens
            raise OpenAIError(f"chat template failed: {e}", param=param) from None
        return (self.check_prompt(ids, param) if checked else ids), embeddings

    def prompt_embeddings(self, body: dict[str, Any]) -> tuple:
        """``prompt_embeds`` (completions) as one container in the replicas' run dtype, or ()."""
        value = body.get("prompt_embeds")
        if value is None:
            return ()
        if body.get("prompt") is not None:
            raise OpenAIError("give either 'prompt' or 'prompt_embeds', not both", param="prompt")
        from deployments.prompt_embeds import embedding_from_body

        return (embedding_from_body(value, self.config.hidden_size, self.run_dtype),)

    def negative_prompt(
        self, body: dict[str, Any], fields: RequestFields, chat: bool, embeds: ChatEmbeds
    ) -> tuple[list[int], tuple[MMEmbedding, ...]]:
        """CFG's negative prompt (``negative_messages`` or ``negative_prompt``), encoded as
        the positive one is (with its ``fields``' template variables), and the containers of
        its ``input_embeds`` parts."""
        param = NEGATIVE_FIELD[chat]
        if chat:
            kwargs = fields.template_kwargs
            return self.chat_prompt(body.get(param), None, param, embeds, kwargs)
        return self.completion_ids(body, param), ()

    def check_text_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise OpenAIError(
                f"the prompt has {chars} characters, more than this model's context of "
                f"{self.context_length} tokens can hold",
                param=param,
                code="context_length_exceeded",
            )

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
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

    def max_new_tokens(self, requested: int | None, prompt_len: int, chat: bool) -> int:
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

    def output_options(
        self,
        fields: RequestFields,
        generation: GenerationRequest | None = None,
        body: dict[str, Any] | None = None,
    ) -> OutputOptions:
        """What the response shows beyond text (logprobs, a tool call, the echoed prompt of
        ``generation``, as ``body`` gave it) for these fields."""
        tokens = self.token_bytes if fields.logprobs is not None else None
        tools = fields.tools
        if tools is not None and not (tools.forced or tools.auto):
            tools = None  # tool_choice "none": a message, never a call
        echo = None
        if fields.echo and generation is not None:
            prompt = _one_prompt(body.get("prompt")) if body is not None else None
            ids = list(generation.prompt_ids)
            text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            added_bos = isinstance(prompt, str) and self.add_bos  # (encode put it first)
            echo = Echo(text, ids[0], added_bos)
        reasoning = self.reasoning(fields, generation)
        return OutputOptions(tokens=tokens, tools=tools, echo=echo, reasoning=reasoning)

    def _thinking_first(self, fields: RequestFields, ids: list[int]) -> RequestFields:
        """With a reasoning parser, a chat's ``response_format`` or guided constraint holds
        for the answer after the model's thinking (``ConstraintSpec.thinking``); a forced
        tool call is constrained from the first token."""
        spec = fields.constraint
        if (
            self.reasoning_parser is None
            or spec is None
            or fields.constraint_source == "tool_choice"
        ):
            return fields
        thinking = "open" if self._opens_thinking(ids) else "optional"
        return dataclasses.replace(fields, constraint=dataclasses.replace(spec, thinking=thinking))

    def _opens_thinking(self, ids: Sequence[int]) -> bool:
        return opens_thinking(self.tokenizer.decode(list(ids[-PROMPT_TAIL_TOKENS:]), True))

    def reasoning(
        self, fields: RequestFields, generation: GenerationRequest | None
    ) -> Reasoning | None:
        """How the output's thinking is read (``serving.reasoning_parser``): an output
        constrained from its first token cannot think; a chat prompt may have opened the
        block already."""
        if self.reasoning_parser is None:
            if not fields.include_reasoning:
                message = (
                    "'include_reasoning' needs a reasoning parser, and this deployment has none "
                    "(serving.reasoning_parser)"
                )
                raise OpenAIError(message, param="include_reasoning")
            return None
        if generation is None:
            return None
        constraint = generation.constraint
        if constraint is None:
            return Reasoning(self._opens_thinking(generation.prompt_ids), fields.include_reasoning)
        if constraint.thinking is None:  # constrained from its first token: no room to think
            return None
        return Reasoning(constraint.thinking == "open", fields.include_reasoning)  # (decided)

    def requests(self, body: dict[str, Any], chat: bool) -> list[Prepared]:
        """One request per prompt: a completion's ``prompt`` may be a list of prompts (strings
        or token-id lists; OpenAI's batched form), each its own request to a replica."""
        prompts = None if chat else several_prompts(body)
        if prompts is None:
            return [self.prepared(body, chat)]
        prepared = []
        for i, prompt in enumerate(prompts):
            try:
                prepared.append(self.prepared({**body, "prompt": prompt}, chat))
            except OpenAIError as e:
                if e.param != "prompt":
                    raise
                message = f"prompt[{i}]: {e.message}"  # say which prompt
                raise OpenAIError(message, status=e.status, param=e.param, code=e.code) from None
        return prepared

    def prepared(self, body: dict[str, Any], chat: bool) -> Prepared:
        fields, generation = self.request(body, chat)
        return Prepared(fields, generation, self.output_options(fields, generation, body))

    def request(self, body: dict[str, Any], chat: bool) -> tuple[RequestFields, GenerationRequest]:
        """Validate a request body into the one request a replica runs (all ``n`` choices:
        one replica runs them, sharing the prompt's pages)."""
        fields = parse_fields(body, chat, self.config.vocab_size, self.call_syntax)
        embeds = ChatEmbeds(self.config.hidden_size, self.run_dtype)
        if chat:
            ids, embeddings = self.chat_prompt(
                body.get("messages"), fields.tools, embeds=embeds,
                template_kwargs=fields.template_kwargs,
            )  # fmt: skip
        elif embeddings := self.prompt_embeddings(body):
            ids = self.check_prompt(list(embeddings[0].placeholder_ids), "prompt_embeds")
        else:
            ids = self.completion_ids(body)
        if fields.token_healing and embeddings:  # the last token may be an embedding row
            message = "'token_healing' cannot be combined with embeddings in the prompt"
            raise OpenAIError(message, param="token_healing")
        negative: list[int] | None = None
        if fields.settings.cfg_scale is not None:  # classifier-free guidance (guidance.py)
            negative, more = self.negative_prompt(body, fields, chat, embeds)
            embeddings += more
        # a CFG job's two rows both grow by max_tokens: the longer prompt sets the room
        longest = max(len(ids), len(negative or ()))
        max_new = self.max_new_tokens(fields.max_tokens, longest, chat)
        if chat:
            fields = self._thinking_first(fields, ids)
        root = salt_root(fields.cache_salt)
        # the router's page hashes: the positive prompt's, over its rows' content
        hashes = prefix_hashes(ids, self.page_size, parent=root, embeddings=embeddings)
        auto_calls = fields.tools is not None and fields.tools.auto
        special = not fields.skip_special_tokens or (auto_calls and self.call_markers_special)
        try:
            generation = fields.generation(ids, max_new, hashes, embeddings, negative, special)
            return fields, generation
        except ValueError as e:  # a limit the field checks above did not foresee
            raise OpenAIError(f"invalid request: {e}") from None


@dataclass(frozen=True, slots=True)
class Prepared:
    """One prompt's request to a replica and what its response shows beyond text."""

    fields: RequestFields
    generation: GenerationRequest
    options: OutputOptions


def _is_special_text(tokenizer: Tokenizer, text: str) -> bool:
    """Whether ``text`` is one special token of ``tokenizer`` (skipped when decoding)."""
    return tokenizer.token_to_id(text) in tokenizer.special_ids


def _longest_token_bytes(tokenizer: Tokenizer) -> int:
    return max(len(tokenizer.decode([i], True).encode()) for i in range(tokenizer.vocab_size))


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_prompt(prompt: Any) -> Any:
    """A ``prompt`` field with a list holding one prompt (a string or token ids) unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return prompt[0]
    return prompt


def several_prompts(body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completion ``prompt`` that lists more than one (strings or token-id
    lists); None for one prompt (a string, token ids, or a list holding one of them)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or all(_is_token(t) for t in prompt):
        return None
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(f"'prompt' lists more than {MAX_PROMPTS} prompts", param="prompt")
    return prompt


def streaming_handle(llm: DeploymentHandle) -> DeploymentHandle:
    """The handle ``generate`` streams through: by value over the replicas' gRPC server rather
    than Ray object refs. Every streamed delta is one message, and this path costs less CPU
    per message (bench/serving_overhead.py, 2-core CPU, demo model: served tok/s 0.75-0.87 ->
    0.79-0.97 of the bare engine's, CPU per token 6-10% lower). Deltas are plain dicts, so
    pickle suffices. ``_by_reference`` is a private Serve option (Ray 2.60): a Ray without it
    gets the default path, with a warning."""
    try:
        return llm.options(
            method_name="generate",
            stream=True,
            _by_reference=False,
            request_serialization="pickle",
            response_serialization="pickle",
        )
    except (TypeError, ValueError) as e:
        logger.warning("streaming by value unavailable (%s); using object refs", e)
        return llm.options(method_name="generate", stream=True)


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """OpenAI HTTP surface; tokenizes and forwards token ids to ``LLMServer``."""

    def __init__(self, llm: DeploymentHandle, preset: Preset) -> None:
        pin_ingress(preset.serving.ingress_cpus)
        self.prompts = PromptBuilder(preset)
        self.model_id = self.prompts.model_id
        self.created = int(time.time())
        self._llm = llm
        self._generate = streaming_handle(llm)
        logger.info(
            "Ingress ready: model %r, context %d", self.model_id, self.prompts.context_length
        )

    def __serve_build_asgi_app__(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/stats", self.stats, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/messages", self.anthropic_messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.anthropic_count, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
        handlers = {HTTPException: _http_error, Exception: _internal_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "max_model_len": self.prompts.context_length,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's retrieve-model route (``client.models.retrieve``)."""
        if request.path_params["model"] != self.model_id:
            return _model_not_found(request.path_params["model"]).response()
        return JSONResponse(self._model_card())

    async def stats(self, request: Request) -> Response:
        """Per replica: the generator's stats plus requests served, and what this ingress's
        router predicted about its cache vs what the replica's cache really supplied."""
        replicas, unreachable = await _replica_stats(self._llm)
        audit = routing_audit.summary()
        for replica in replicas:
            replica["routing"] = audit.get(replica.get("replica_id"), None)
        body = {"object": "stats", "replicas": replicas, "replicas_unreachable": unreachable}
        return JSONResponse(body)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over the chat path (``deployments.responses_api``)."""
        try:
            raw = await read_body_bytes(request)
            wanted, prepared = await asyncio.to_thread(self._prepare_responses, raw)
        except OpenAIError as e:
            return e.response()
        shape = ResponseShape(wanted, self.model_id)
        fmt, state, messages = self._one_choice(prepared)
        try:
            if wanted.stream:
                events = self._response_events(await _started(messages), state, fmt, shape)
                return StreamingResponse(events, media_type="text/event-stream")
            await _added(messages, [state])
        except Exception as e:
            return _failure(e, shape.id).response()
        choice = full_body(fmt, [state])["choices"][0]
        output = output_items(choice, wanted.logprobs)
        usage = await asyncio.to_thread(self._usage, state, choice)
        return JSONResponse(shape.response(output, status_of(choice), usage))

    def _one_choice(
        self, prepared: Prepared
    ) -> tuple[ResponseFormat, ChoiceState, AsyncIterator[tuple[int, dict[str, Any]]]]:
        """A one-choice chat request's shapes, its choice and the replica's messages (the
        Responses and Messages APIs: neither has ``n``)."""
        fmt = ResponseFormat.new(True, self.model_id, prepared.generation.request_id)
        return fmt, ChoiceState(0, fmt, prepared.options), self._messages([prepared.generation], 1)

    def _prepare_responses(self, raw: bytes) -> tuple[ResponsesRequest, Prepared]:
        body = parse_body(raw)
        self._check_model(body)
        try:
            wanted = translate(body)
            return wanted, self.prompts.prepared(wanted.chat, chat=True)
        except OpenAIError as e:
            raise responses_error(e) from None

    def _usage(self, state: ChoiceState, choice: dict[str, Any]) -> dict[str, Any]:
        """Responses usage; thinking tokens counted by tokenizing the thinking again."""
        thinking = choice["message"].get("reasoning_content") or ""
        counted = len(self.prompts.tokenizer.encode(thinking)[0]) if thinking else 0
        return responses_usage(state.final, counted)

    async def _response_events(
        self,
        messages: AsyncIterator[tuple[int, dict[str, Any]]],
        state: ChoiceState,
        fmt: ResponseFormat,
        shape: ResponseShape,
    ) -> AsyncIterator[str]:
        events = ResponseEvents(shape)
        yield events.start()
        try:
            async for text in _streamed_pieces(events, messages, state):
                yield text
        except Exception as e:
            yield events.failed(_failure(e, shape.id))
            return
        choice = full_body(fmt, [state])["choices"][0]
        entries = (choice.get("logprobs") or {}).get("content") if shape.request.logprobs else None
        tail = events.piece(*state.unstreamed(choice))
        usage = await asyncio.to_thread(self._usage, state, choice)  # (tokenizes the thinking)
        yield tail + events.finish(choice, usage, entries)

    async def anthropic_messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the chat path (``deployments.anthropic_api``)."""
        try:
            raw = await read_body_bytes(request)
            chat, prepared = await asyncio.to_thread(self._prepare_anthropic, raw)
        except OpenAIError as e:
            return _anthropic_error(e)
        message_id = anthropic_api.new_id("msg")
        fmt, state, messages = self._one_choice(prepared)
        try:
            if chat.get("stream"):
                prompt_tokens = len(prepared.generation.prompt_ids)
                started = await _started(messages)
                events = self._anthropic_events(started, state, fmt, message_id, prompt_tokens)
                return StreamingResponse(events, media_type="text/event-stream")
            await _added(messages, [state])
        except Exception as e:
            return _anthropic_error(_failure(e, message_id))
        choice = full_body(fmt, [state])["choices"][0]
        stop = anthropic_api.stop_of(choice, state.final)
        blocks = anthropic_api.content_blocks(choice)
        use = anthropic_api.usage(state.final)
        return JSONResponse(
            anthropic_api.message_object(message_id, self.model_id, blocks, stop, use)
        )

    async def anthropic_count(self, request: Request) -> Response:
        """Anthropic's token count: the prompt's tokens as a request would send them."""
        try:
            raw = await read_body_bytes(request)
            count = await asyncio.to_thread(self._anthropic_count, raw)
        except OpenAIError as e:
            return _anthropic_error(e)
        return JSONResponse({"input_tokens": count})

    def _prepare_anthropic(self, raw: bytes) -> tuple[dict[str, Any], Prepared]:
        body = parse_body(raw)
        self._check_model(body)
        chat = anthropic_api.translate(body)
        return chat, self.prompts.prepared(chat, chat=True)

    def _anthropic_count(self, raw: bytes) -> int:
        body = parse_body(raw)
        self._check_model(body)
        chat = anthropic_api.translate({"max_tokens": 1, **body})  # (a count has no max_tokens)
        wanted = {"messages": chat["messages"], "tools": chat.get("tools")}
        return tokenization.tokenize(self.prompts, wanted)["count"]

    async def _anthropic_events(
        self,
        messages: AsyncIterator[tuple[int, dict[str, Any]]],
        state: ChoiceState,
        fmt: ResponseFormat,
        message_id: str,
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        events = anthropic_api.MessageEvents(message_id, self.model_id)
        yield events.start(prompt_tokens)
        try:
            async for text in _streamed_pieces(events, messages, state):
                yield text
        except Exception as e:
            yield events.failed(anthropic_api.error_body(_failure(e, message_id)))
            return
        choice = full_body(fmt, [state])["choices"][0]
        tail = events.piece(*state.unstreamed(choice))
        stop = anthropic_api.stop_of(choice, state.final)
        yield tail + events.finish(stop, anthropic_api.usage(state.final))

    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize`` (``deployments.tokenization``)."""
        return await self._tokenization(request, tokenization.tokenize)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize`` (``deployments.tokenization``)."""
        return await self._tokenization(request, tokenization.detokenize)

    async def _tokenization(self, request: Request, action: Any) -> Response:
        try:
            raw = await read_body_bytes(request)
            result = await asyncio.to_thread(self._tokenized, raw, action)
        except OpenAIError as e:
            return e.response()
        return JSONResponse(result)

    def _tokenized(self, raw: bytes, action: Any) -> dict[str, Any]:
        body = parse_body(raw)
        self._check_model(body)
        return action(self.prompts, body)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            raw = await read_body_bytes(request)
            # Parsing and tokenizing run in a worker thread: a big prompt must not stall the
            # event loop (and with it /health and every other stream of this ingress).
            prepared = await asyncio.to_thread(self._prepare, raw, chat)
        except OpenAIError as e:
            return e.response()
        fields = prepared[0].fields  # (every prompt's fields are the same)
        per_prompt = fields.n if len(prepared) > 1 else 0
        fmt = ResponseFormat.new(chat, self.model_id, prepared[0].generation.request_id, per_prompt)
        choices = [
            ChoiceState(p * fields.n + i, fmt, each.options)
            for p, each in enumerate(prepared)
            for i in range(fields.n)
        ]
        messages = self._messages([each.generation for each in prepared], fields.n)
        if fields.stream:
            try:
                started = await _started(messages)
            except Exception as e:
                return _failure(e, fmt.id).response()
            events = _events(started, choices, fmt, fields.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await _collect(messages, choices, fmt)

    def _prepare(self, raw: bytes, chat: bool) -> list[Prepared]:
        body = parse_body(raw)
        self._check_model(body)
        return self.prompts.requests(body, chat)

    def _messages(
        self, generations: list[GenerationRequest], n: int
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """The replicas' messages tagged with their choice's index in the response (prompt
        ``p``'s choice ``i`` is ``p * n + i``)."""
        if len(generations) == 1:
            return _indexed(self._generate.remote(generations[0]), generations[0].request_id)
        streams = [
            _indexed(_call_apart(self._generate, g), g.request_id, p * n)
            for p, g in enumerate(generations)
        ]
        return _merged(streams)

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None:
            text_value(model, "model", "'model'")
        if model not in (None, self.model_id):
            raise _model_not_found(model)


async def _streamed_pieces(
    events: ResponseEvents | anthropic_api.MessageEvents,
    messages: AsyncIterator[tuple[int, dict[str, Any]]],
    state: ChoiceState,
) -> AsyncIterator[str]:
    """The events of each replica message, for the Responses and Messages streams."""
    async for _, message in messages:
        state.add(message)
        text = events.piece(*state.streamed(message))
        if text:
            yield text


def _anthropic_error(e: OpenAIError) -> Response:
    return e.response(anthropic_api.error_body(e))


def _model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model[:100]}` does not exist.",
        status=404,
        param="model",
        code="model_not_found",
    )


STATS_TIMEOUT_S = 30.0


async def _replica_stats(llm: DeploymentHandle) -> tuple[list[dict[str, Any]], int]:
    """Ask every replica for its stats (a control-plane call, not the hot path): the answers,
    and how many replicas did not answer (one that died or is being replaced must not turn
    the whole stats call into an error)."""
    response = llm.broadcast("stats")
    answers = await response.results_async(timeout_s=STATS_TIMEOUT_S, return_exceptions=True)
    stats = [a for a in answers if isinstance(a, dict)]
    for failure in (a for a in answers if not isinstance(a, dict)):
        logger.warning("a replica did not answer its stats: %s", type(failure).__name__)
    return stats, len(answers) - len(stats)


async def _indexed(
    stream, request_id: str, first_index: int = 0
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The replica's messages tagged with their choice index (plus ``first_index``); a client
    that goes away (the generator is closed early) cancels the replica's work too. The first
    choice's cache use goes to the routing audit (the router's prediction for ``request_id``)."""
    completed = False
    try:
        async for message in stream:
            index = message.get("index", 0)
            if index == 0 and message["eos"] and "cached_pages" in message:
                routing_audit.observe(request_id, message["cached_pages"])
            yield first_index + index, message
        completed = True
    finally:
        if not completed:
            stream.cancel()


def _call_apart(handle: DeploymentHandle, generation: GenerationRequest):
    """``handle.remote(generation)`` as a call of its own. Serve gives every call made while
    serving one HTTP request that request's internal id, and two concurrent streams under one
    id stall each other (Ray 2.60: each delivered its first message after ~10 s, then nothing).
    So each call runs in a copy of the context whose Serve request context has a fresh id.
    Ray's cancellation of a parent's calls goes by that id; ``_indexed`` cancels these itself."""
    context = contextvars.copy_context()
    return context.run(_remote_with_own_id, handle, generation)


def _remote_with_own_id(handle: DeploymentHandle, generation: GenerationRequest):
    current = serve_context._get_serve_request_context()
    own = dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex)
    serve_context._serve_request_context.set(own)
    return handle.remote(generation)


async def _merged(
    streams: list[AsyncIterator[tuple[int, dict[str, Any]]]],
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """The streams' items as they come. The first failure ends it; ending it early (a failure,
    a client gone) cancels every stream, and with it its replica's work."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[tuple[int, dict[str, Any]]]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # (its stream's own ``finally`` cancels the replica's work)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _prepended(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``first`` (None: nothing), then the rest of ``rest``."""
    if first is None:
        return
    yield first
    async for item in rest:
        yield item


def _failure(exc: BaseException, request_id: str) -> OpenAIError:
    """What the client sees of a failure while its request ran: the server busy (every
    replica's queue full, ``serving.max_queued_requests``) as a 503 with a Retry-After, else
    ``server_error``'s short message."""
    if isinstance(exc, BackPressureError):
        message = "the server is busy: every replica's queue is full; retry later"
        retry = exc.retry_after_s if exc.retry_after_s is not None else BUSY_RETRY_AFTER_S
        return OpenAIError(
            message, status=exc.status_code or 503, code="server_busy", type_="server_error",
            retry_after_s=retry,
        )  # fmt: skip
    return server_error(exc, request_id)


async def _collect(
    messages: AsyncIterator[tuple[int, dict[str, Any]]],
    choices: list[ChoiceState],
    fmt: ResponseFormat,
) -> Response:
    try:
        await _added(messages, choices)
    except Exception as e:
        return _failure(e, fmt.id).response()
    return JSONResponse(full_body(fmt, choices))


async def _added(
    messages: AsyncIterator[tuple[int, dict[str, Any]]], choices: list[ChoiceState]
) -> None:
    """Every message added to its choice (raising what the stream raises)."""
    async for index, message in messages:
        choices[index].add(message)


async def _started(messages: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``messages`` with the first already received: the first message comes before a
    stream's headers, so a request the replicas' queues refuse (or one that fails at once)
    gets its status, not a 200 and an error event."""
    return _prepended(await anext(messages, None), messages)


async def _events(
    messages: AsyncIterator[tuple[int, dict[str, Any]]],
    choices: list[ChoiceState],
    fmt: ResponseFormat,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body: one write per replica message (all its chunks together: each write is a
    message on to Serve's proxy), the usage chunk and ``[DONE]`` in the last one."""
    if fmt.chat:
        yield "".join(
            sse(fmt.chunk({"role": "assistant", "content": ""}, index=index))
            for index in range(len(choices))
        )
    tail = []
    try:
        async for index, message in messages:
            events = "".join(sse(chunk) for chunk in choices[index].chunks(message))
            if events:
                yield events
        if include_usage:
            tail.append(sse(fmt.usage_chunk([c.final for c in choices])))
    except Exception as e:
        tail.append(sse(_failure(e, fmt.id).body()))
    tail.append(sse("[DONE]"))
    yield "".join(tail)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return OpenAIError(str(exc.detail), status=exc.status_code, code=code).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, CLIENT_GONE):  # nobody is left to answer; not a server failure
        logger.info("client went away before its response: %s", type(exc).__name__)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return server_error(exc).response()
