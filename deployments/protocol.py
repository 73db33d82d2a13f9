"""OpenAI requests: the HTTP body parsed and validated into the engine's ``GenerationRequest``
(what the ingress sends to an ``LLMServer`` replica). Response shapes are in ``responses``.

Every check a request can fail happens here, before it reaches a replica: a value that could
fail inside a replica's step would end the step for other people's requests too. Nothing here
touches Ray or the model, so every rule is unit-testable. Failures are ``OpenAIError``: the
ingress turns them into ``{"error": {...}}`` bodies with a 4xx status.

Limits (beyond the model's context and vocabulary):

=====================  =======================================================================
body                   at most ``MAX_BODY_BYTES`` (413 beyond), JSON nested at most
                       ``MAX_JSON_DEPTH`` deep, strings valid Unicode (no lone surrogates)
fields                 only the ones this server honours; an unsupported OpenAI feature
                       (``best_of``, ``suffix``, ...) set to anything but its neutral value is
                       refused by name, an unknown field likewise
``logprobs``           completions: 0 .. ``MAX_LOGPROBS``; chat: a boolean, with
                       ``top_logprobs`` 0 .. ``MAX_LOGPROBS`` (``deployments.logprobs``)
``response_format``    text, json_object, json_schema; chat ``tools`` with a forced
                       ``tool_choice``, "none", or "auto" when the deployment has a tool call
                       parser (``deployments.structured``, ``deployments.tool_parsers``)
chat_template_kwargs   chat: at most ``MAX_TEMPLATE_KWARGS`` variables the chat template reads
                       (checked against it by the ingress)
``include_reasoning``  chat: false only with a reasoning parser (``deployments.reasoning``)
``prompt``             a string or token ids, or a list of 1 .. ``MAX_PROMPTS`` of them
                       (choice ``p * n + i`` is prompt ``p``'s choice ``i``)
``n``                  1 .. ``MAX_CHOICES``
``top_k``              -1 or 0 (off) .. the vocabulary size
``seed``               a signed 64-bit integer
``stop``               at most ``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_CHARS``
``logit_bias``         at most ``MAX_LOGIT_BIAS`` entries, token ids in the vocabulary, [-100, 100]
``min_tokens``         0 .. ``MAX_TOKENS_FIELD`` (then capped by ``max_tokens``)
``messages``           1 .. ``MAX_MESSAGES``; roles system, developer, user, assistant, tool;
                       assistant ``tool_calls`` (and ``reasoning_content``) and tool results
                       (``deployments.messages``);
                       content parts: text, and ``input_embeds`` (``deployments.chat_embeds``);
                       text containing ``<$EMB_`` (embedding aliases) is refused
``cache_salt``         a non-empty string of at most ``MAX_CACHE_SALT_CHARS``
``cfg_scale``          [-10, 10], only with ``negative_prompt`` / ``negative_messages``, not with
                       logprobs or constrained output (``deployments.guidance``)
=====================  =======================================================================
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.constraints.spec import ConstraintSpec
from engine.request import MAX_CHOICES, GenerationRequest, SamplerSettings

if TYPE_CHECKING:
    from deployments.structured import ToolCalling
    from deployments.tool_parsers import CallSyntax

logger = logging.getLogger("ray.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_PROMPTS = 128  # prompts of one completion request (each its own request to a replica)
MAX_JSON_DEPTH = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024
MAX_CACHE_SALT_CHARS = 256
MAX_TEMPLATE_KWARGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_BANNED_STRINGS = 64
TEMPLATE_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_TOKENS_FIELD = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)

_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n",
        "ignore_eos", "min_tokens", "stream", "stream_options", "user", "cache_salt",
        "logprobs", "response_format", "cfg_scale", "skip_special_tokens", "structured_outputs",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "stop_token_ids",
        "banned_strings", "token_healing",
    }
)  # fmt: skip
_CHAT_FIELDS = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
_CHAT_FIELDS |= {"negative_messages", "chat_template_kwargs", "include_reasoning"}
FIELDS = {
    False: _COMMON_FIELDS | {"prompt", "prompt_embeds", "negative_prompt", "echo"},
    True: _COMMON_FIELDS | _CHAT_FIELDS | {"parallel_tool_calls"},
}
# OpenAI features this server does not implement, with the values that ask for nothing.
UNSUPPORTED = {
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
}


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
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_
        self.retry_after_s = retry_after_s  # a Retry-After header (the server is busy)

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self, body: dict[str, Any] | None = None) -> JSONResponse:
        """The error as an HTTP response: OpenAI's body, or ``body`` (another API's shape)."""
        headers = None
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}
        shown = self.body() if body is None else body
        return JSONResponse(shown, status_code=self.status, headers=headers)


def server_error(exc: BaseException, request_id: str | None = None) -> OpenAIError:
    """What a client sees of a failure on our side: a short message and an id to quote. The
    details (tracebacks, process and node ids) go to the server log under that id only."""
    request_id = request_id or uuid.uuid4().hex
    cause = getattr(exc, "cause", None) or exc  # a Ray task error wraps the replica's error
    if isinstance(cause, ValueError):  # a replica refused the request: the caller's to fix
        logger.warning("request %s refused by a replica: %s", request_id, cause)
        return OpenAIError(_first_line(cause), param=None)
    logger.error("request %s failed", request_id, exc_info=exc)
    message = f"the server failed to complete the request (request id {request_id})"
    return OpenAIError(message, status=500, type_="server_error")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__


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
    cache_salt: str | None = None  # only requests with the same salt share cached pages
    logprobs: int | None = None  # the model's logprobs and this many alternatives
    echo: bool = False  # completions: the prompt leads the text (and its tokens the logprobs)
    constraint: ConstraintSpec | None = None  # response_format, or the forced tool call's
    constraint_source: str | None = None  # the field that asked for it (errors name it)
    tools: ToolCalling | None = None  # the tools; a forced call: the output is read back as one
    skip_special_tokens: bool = True  # (vLLM's) false: the text shows special tokens too
    include_reasoning: bool = True  # (vLLM's) false: the thinking is not in the response
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # for the template
    stop_token_ids: tuple[int, ...] = ()  # (vLLM's) more tokens that end a choice
    banned_strings: tuple[str, ...] = ()  # (tabbyAPI's) never in the text, case-insensitive
    token_healing: bool = False  # (tabbyAPI's) the prompt's last token re-chosen with the output

    def generation(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        page_hashes: list[int],
        embeddings: tuple = (),
        negative_prompt_ids: list[int] | None = None,
        decode_special_tokens: bool = False,
    ) -> GenerationRequest:
        """The request a replica runs; ``negative_prompt_ids``: CFG's negative prompt (with
        ``settings.cfg_scale``); ``decode_special_tokens``: the text shows special tokens
        (``skip_special_tokens`` false, or calls written with special-token markers)."""
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
            cache_salt=self.cache_salt,
            constraint=self.constraint,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            embeddings=embeddings,
            negative_prompt_ids=None if negative_prompt_ids is None else tuple(negative_prompt_ids),
            decode_special_tokens=decode_special_tokens,
            stop_token_ids=self.stop_token_ids,
            banned_strings=self.banned_strings,
            token_healing=self.token_healing,
        )


def check_field_names(body: dict[str, Any], chat: bool) -> None:
    """Refuse what would otherwise be silently ignored: unsupported features and unknown
    fields (a field set to null counts as absent)."""
    for name, value in body.items():
        if name in FIELDS[chat] or value is None:
            continue
        if name in UNSUPPORTED:
            if any(
                value == neutral and type(value) is type(neutral) for neutral in UNSUPPORTED[name]
            ):
                continue
            raise OpenAIError(f"'{name}' is not supported by this server", param=name)
        raise OpenAIError(f"unknown field '{name}'", param=name)


def text_value(value: Any, param: str, what: str) -> str:
    """A string that can be encoded (JSON lets a lone surrogate such as "\\ud800" through)."""
    if not isinstance(value, str):
        raise OpenAIError(f"{what} must be a string, got {type(value).__name__}", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(f"{what} is not valid Unicode text", param=param) from None
    return value


def _int_field(
    body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{name}' must be an integer, got {_short(value)}", param=name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"'{name}' must be >= {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise OpenAIError(f"'{name}' must be <= {maximum}, got {_short(value)}", param=name)
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def number_field(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
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
        message = f"'{name}' must be a number in [{low}, {high}], got {_short(value)}"
        raise OpenAIError(message, param=name)
    return float(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    return _strings_field(body, "stop", MAX_STOP_STRINGS)


def _strings_field(body: dict[str, Any], name: str, most: int) -> tuple[str, ...]:
    """A string or a list of at most ``most`` strings of at most ``MAX_STOP_CHARS`` characters
    (``stop``, ``banned_strings``); empty strings are dropped."""
    value = body.get(name)
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise OpenAIError(f"'{name}' must be a string or a list of strings", param=name)
    if len(values) > most:
        raise OpenAIError(f"'{name}' has more than {most} strings", param=name)
    for s in values:
        text_value(s, name, f"each of '{name}'")
        if len(s) > MAX_STOP_CHARS:
            raise OpenAIError(f"a string of '{name}' is longer than {MAX_STOP_CHARS}", param=name)
    return tuple(s for s in values if s)


def _stop_token_ids(body: dict[str, Any], vocab_size: int) -> tuple[int, ...]:
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        message = f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"
        raise OpenAIError(message, param="stop_token_ids")
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            message = f"'stop_token_ids' has {_short(token)}, not a token id of this model"
            raise OpenAIError(message, param="stop_token_ids")
    return tuple(value)


def _bool_field(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"'{name}' must be a boolean, got {_short(value)}", param=name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpenAIError("'logit_bias' must be an object of token id -> bias", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        message = f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries"
        raise OpenAIError(message, param="logit_bias")
    bias: dict[int, float] = {}
    for key, amount in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12):
            message = f"logit_bias key {_short(key)} is not a token id"
            raise OpenAIError(message, param="logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise OpenAIError(f"logit_bias token {token} is out of range", param="logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, int | float):
            raise OpenAIError(f"logit_bias[{key}] must be a number", param="logit_bias")
        if not -100 <= amount <= 100:
            raise OpenAIError(f"logit_bias[{key}] must be in [-100, 100]", param="logit_bias")
        bias[token] = float(amount)
    return bias


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    max_tokens = _int_field(body, "max_tokens", minimum=1, maximum=MAX_TOKENS_FIELD)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int_field(body, "max_completion_tokens", 1, MAX_TOKENS_FIELD)
    return max_tokens


def parse_settings(body: dict[str, Any], vocab_size: int) -> SamplerSettings:
    """The sampler settings of a body; a field it leaves out keeps ``SamplerSettings``' own
    default (OpenAI's defaults are the same neutral ones)."""
    top_k = _int_field(body, "top_k", minimum=-1, maximum=vocab_size)
    values = {
        "temperature": number_field(body, "temperature", 0.0, 2.0),
        "top_p": number_field(body, "top_p", 1e-9, 1.0),
        "top_k": 0 if top_k == -1 else top_k,
        "min_p": number_field(body, "min_p", 0.0, 0.999),
        "presence_penalty": number_field(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": number_field(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": number_field(body, "repetition_penalty", 0.01, 10.0),
        "token_bias": _logit_bias(body, vocab_size) or None,
    }
    return SamplerSettings(**{k: v for k, v in values.items() if v is not None})


def _stream_options(body: dict[str, Any]) -> dict[str, Any]:
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    unknown = sorted(k for k, v in options.items() if k != "include_usage" and v is not None)
    if unknown:
        raise OpenAIError(f"unknown stream option {unknown[0]!r}", param="stream_options")
    return options


def parse_fields(
    body: dict[str, Any], chat: bool, vocab_size: int, call_syntax: CallSyntax | None = None
) -> RequestFields:
    """Validate the generation fields shared by both routes; ``call_syntax``: the syntax the
    deployment's model writes tool calls in (``tool_choice`` "auto" needs one)."""
    # (imported here: they raise OpenAIError, from this module)
    from deployments.guidance import check_guided_fields, parse_cfg_scale
    from deployments.logprobs import parse_logprobs
    from deployments.structured import (
        check_constraint,
        parse_guided,
        parse_response_format,
        parse_tools,
    )

    check_field_names(body, chat)
    n = _int_field(body, "n", minimum=1, maximum=MAX_CHOICES) or 1
    if body.get("user") is not None:
        text_value(body["user"], "user", "'user'")
    settings = parse_settings(body, vocab_size)
    settings.cfg_scale = parse_cfg_scale(body, chat)
    fields = RequestFields(
        settings=settings,
        max_tokens=_max_tokens(body, chat),
        min_tokens=_int_field(body, "min_tokens", minimum=0, maximum=MAX_TOKENS_FIELD) or 0,
        seed=_int_field(body, "seed", *SEED_RANGE),
        stop=_stop(body),
        n=n,
        ignore_eos=_bool_field(body, "ignore_eos"),
        stream=_bool_field(body, "stream"),
        include_usage=_bool_field(_stream_options(body), "include_usage"),
        cache_salt=_cache_salt(body),
        logprobs=parse_logprobs(body, chat),
        echo=_echo(body, chat),
        skip_special_tokens=_bool_field(body, "skip_special_tokens", default=True),
        include_reasoning=_bool_field(body, "include_reasoning", default=True),
        template_kwargs=_template_kwargs(body) if chat else {},
        stop_token_ids=_stop_token_ids(body, vocab_size),
        banned_strings=_strings_field(body, "banned_strings", MAX_BANNED_STRINGS),
        token_healing=_bool_field(body, "token_healing"),
        **_constraint_fields(
            parse_response_format(body), parse_tools(body, chat, call_syntax), parse_guided(body)
        ),
    )
    check_guided_fields(fields, chat)
    _check_token_healing(fields)
    if fields.constraint is not None:
        check_constraint(fields.constraint, fields.constraint_source or "response_format")
    return fields


def _check_token_healing(fields: RequestFields) -> None:
    """Token healing re-chooses the prompt's last token, which a grammar would have to start
    from and an echo would have to score: refused with either."""
    if not fields.token_healing:
        return
    if fields.constraint is not None:  # (a forced tool call's too)
        source = fields.constraint_source or "response_format"
        message = f"'token_healing' cannot be combined with '{source}' (constrained output)"
        raise OpenAIError(message, param="token_healing")
    if fields.echo:
        message = "'token_healing' cannot be combined with 'echo' (the prompt is scored as sent)"
        raise OpenAIError(message, param="token_healing")


def _echo(body: dict[str, Any], chat: bool) -> bool:
    """``echo`` (completions): the prompt comes back before the completion, its tokens'
    log-probabilities before the completion's (the first token has none)."""
    echo = not chat and _bool_field(body, "echo")
    if echo and body.get("prompt_embeds") is not None:
        message = "'echo' needs a prompt of text or token ids, not 'prompt_embeds'"
        raise OpenAIError(message, param="echo")
    return echo


def _constraint_fields(
    response_format: ConstraintSpec | None,
    tools: ToolCalling | None,
    guided: tuple[ConstraintSpec, str] | None,
) -> dict[str, Any]:
    """The output's constraint: from ``response_format``, vLLM's guided fields or a forced
    tool call (one of them), and the field that asked for it."""
    if response_format is not None and guided is not None:
        message = f"give either 'response_format' or '{guided[1]}', not both"
        raise OpenAIError(message, param=guided[1].split(".")[0])
    spec, source = (response_format, "response_format") if response_format else (None, None)
    if guided is not None:
        spec, source = guided
    if tools is None or not (tools.forced or tools.auto):
        return {"constraint": spec, "constraint_source": source, "tools": tools}
    if spec is not None:
        what = (
            "a forced tool call"
            if tools.forced
            else 'tool_choice "auto" (its grammar would forbid the calls)'
        )
        message = f"'{source}' cannot be combined with {what}"
        raise OpenAIError(message, param=source.split(".")[0])
    if tools.auto:
        return {"constraint": None, "tools": tools}
    return {"constraint": tools.constraint(), "constraint_source": "tool_choice", "tools": tools}


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` (vLLM's): variables for the chat template, such as Qwen3's
    ``enable_thinking``; names are checked against the template where it is known."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    param = "chat_template_kwargs"
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        message = f"'{param}' must be an object of at most {MAX_TEMPLATE_KWARGS} variables"
        raise OpenAIError(message, param=param)
    for name in value:
        if not TEMPLATE_VARIABLE.fullmatch(name):
            raise OpenAIError(f"{param}: {_short(name)} is not a variable name", param=param)
    return dict(value)


def _cache_salt(body: dict[str, Any]) -> str | None:
    value = body.get("cache_salt")
    if value is None:
        return None
    text_value(value, "cache_salt", "'cache_salt'")
    if not 0 < len(value) <= MAX_CACHE_SALT_CHARS:
        message = f"'cache_salt' must have 1 to {MAX_CACHE_SALT_CHARS} characters"
        raise OpenAIError(message, param="cache_salt")
    return value


# -- the body --------------------------------------------------------------------------------


async def read_body_bytes(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused with 413 past ``limit`` (checked before and while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        f"request body is larger than {limit} bytes", status=413, code="request_too_large"
    )


def parse_body(raw: bytes) -> dict[str, Any]:
    """JSON object from the raw body; nesting deeper than ``MAX_JSON_DEPTH`` is refused before
    parsing (Python's parser would recurse until it fails)."""
    if _nesting_depth(raw) > MAX_JSON_DEPTH:
        raise OpenAIError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise OpenAIError(f"request body is not valid JSON: {_first_line(e)}") from None
    if not isinstance(body, dict):
        raise OpenAIError("request body must be a JSON object")
    return body


def too_deep(text: str) -> bool:
    """Whether JSON ``text`` nests deeper than a request body may (``MAX_JSON_DEPTH``)."""
    return _nesting_depth(text.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH


def bounded_json(text: str) -> Any:
    """``json.loads`` under the body's depth limit (ValueError beyond it, or for text that is
    not JSON): JSON inside a body or a model's output must not exhaust the parser's recursion
    either."""
    if too_deep(text):
        raise ValueError(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:  # (guarded above; kept so no parse can end the request badly)
        raise ValueError("the JSON nests too deeply") from None


def _nesting_depth(raw: bytes) -> int:
    """The JSON nesting depth of ``raw``, counted on the brackets outside strings (vectorised:
    a 4 MB body takes milliseconds)."""
    brackets = raw.translate(None, _NOT_BRACKETS)
    if len(brackets) <= MAX_JSON_DEPTH:  # cannot be deeper than its bracket count
        return len(brackets)
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0))


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
