"""OpenAI's Responses API (``POST /v1/responses``), over the chat path.

A request is translated into the chat completions body it means (``input`` items become
``messages``, ``instructions`` a system message, flat function ``tools`` the chat shape,
``text.format`` a ``response_format``, ``max_output_tokens`` ``max_completion_tokens``), so it is
validated, tokenized, routed and run exactly as a chat request is; errors name the Responses
field. The answer is the chat choice read back as output items: ``reasoning`` (a reasoning
deployment's thinking), ``message`` (``output_text``, with logprobs when ``include`` asks) and
``function_call`` items, with ``status: "incomplete"`` when ``max_output_tokens`` cut it.
Streamed, it is OpenAI's event sequence (``response.created`` ... ``response.completed``).

Stateless: this server stores nothing, so ``store: true``, ``previous_response_id``,
``conversation``, ``background`` and item references are refused; a client sends the whole
conversation (earlier output items included: ``function_call``, ``function_call_output``,
``reasoning``, assistant ``message``). Hosted tools (web search, files, ...) are refused by
name, as is every option this server cannot honour.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import OpenAIError, _short, text_value

# Responses fields -> the chat field they become (sampling fields keep their names).
RENAMED = {"max_output_tokens": "max_completion_tokens", "input": "messages"}
PASSED = frozenset(
    {"model", "temperature", "top_p", "stream", "parallel_tool_calls", "tool_choice",
     "top_logprobs", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
     "repetition_penalty", "cache_salt", "chat_template_kwargs", "user"}
)  # fmt: skip
HANDLED = frozenset(
    {"input", "instructions", "max_output_tokens", "tools", "text", "include", "metadata",
     "store", "reasoning", "truncation", "service_tier", "safety_identifier"}
)  # fmt: skip
NEUTRAL = {  # fields accepted only at the value that asks for nothing
    "store": (False,),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "background": (False,),
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA = 16
# A chat error's param (and the field named in its message) as the Responses field.
PARAMS_BACK = {"messages": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text"}  # fmt: skip


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request: the chat body it means and what its answer echoes back."""

    chat: dict[str, Any]
    echo: dict[str, Any] = field(default_factory=dict)  # fields the response object repeats
    logprobs: bool = False
    stream: bool = False


def translate(body: dict[str, Any]) -> ResponsesRequest:
    """The chat body a Responses body means (``OpenAIError`` naming the Responses field)."""
    _check_fields(body)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k in PASSED and v is not None}
    messages = input_messages(body.get("input"))
    if body.get("instructions") is not None:
        instructions = text_value(body["instructions"], "instructions", "'instructions'")
        messages = [{"role": "system", "content": instructions}, *messages]
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _chat_tools(body["tools"])
    if isinstance(chat.get("tool_choice"), dict):
        chat["tool_choice"] = _chat_tool_choice(chat["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    logprobs = _include(body.get("include"))
    if logprobs:
        chat["logprobs"] = True
    elif chat.get("top_logprobs"):
        message = f"'top_logprobs' needs 'include': ['{LOGPROBS_INCLUDE}']"
        raise OpenAIError(message, param="top_logprobs")
    else:
        chat.pop("top_logprobs", None)  # 0 alternatives of no logprobs: nothing asked
    return ResponsesRequest(chat, _echoed(body), logprobs, bool(chat.get("stream")))


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if value is None:
            continue
        if name in NEUTRAL:
            if value in NEUTRAL[name] and type(value) is type(NEUTRAL[name][0]):
                continue
            why = " (it stores no responses)" if name in ("store", "background") else ""
            message = f"'{name}' {_short(value)} is not supported by this server{why}"
            raise OpenAIError(message, param=name)
        if name in ("previous_response_id", "conversation"):
            message = (
                f"'{name}' is not supported: this server stores no responses; send the whole "
                "conversation in 'input'"
            )
            raise OpenAIError(message, param=name)
        if name not in PASSED and name not in HANDLED:
            raise OpenAIError(f"unknown field '{name[:64]}'", param=name[:64])
    if body.get("safety_identifier") is not None:
        text_value(body["safety_identifier"], "safety_identifier", "'safety_identifier'")
    reasoning = body.get("reasoning")
    if reasoning is not None and any(v is not None for v in _mapping(reasoning, "reasoning")):
        message = "'reasoning' options (effort, summary) are not supported by this server"
        raise OpenAIError(message, param="reasoning")


def _mapping(value: Any, param: str) -> list[Any]:
    if not isinstance(value, dict):
        raise OpenAIError(f"'{param}' must be an object", param=param)
    return list(value.values())


# -- input items -> messages -----------------------------------------------------------------


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise OpenAIError("'input' must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    thinking: str | None = None  # a reasoning item's text, for the assistant turn after it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "reasoning":
            thinking = _reasoning_text(item, where)
            continue
        if kind == "message":
            message = _message(item, where)
        elif kind == "function_call":
            message = _function_call(item, where, messages)
        elif kind == "function_call_output":
            message = _function_output(item, where)
        else:
            message_text = f"{where}: items of type {_short(kind)} are not supported"
            raise OpenAIError(message_text, param="input")
        if message is None:  # a call merged into the assistant message before it
            continue
        if message["role"] == "assistant" and thinking is not None:
            message["reasoning_content"], thinking = thinking, None
        messages.append(message)
    return messages


ITEM_KEYS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
    "reasoning": {"type", "id", "summary", "content", "status"},
}
TEXT_PARTS = {"input_text", "output_text"}


def _keys(item: dict[str, Any], kind: str, where: str) -> None:
    extra = sorted(k for k, v in item.items() if k not in ITEM_KEYS[kind] and v is not None)
    if extra:
        raise OpenAIError(f"{where}.{extra[0][:40]} is not supported by this server", param="input")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, "message", where)
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise OpenAIError(f"{where}.role {_short(role)} is not a message role", param="input")
    return {"role": role, "content": _text_content(item.get("content"), f"{where}.content")}


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                message = f"{where}[{j}]: only text parts are supported, got {_short(kind)}"
                raise OpenAIError(message, param="input")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where} must be a string or a list of text parts", param="input")


def _function_call(
    item: dict[str, Any], where: str, messages: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """A call as the assistant message's ``tool_calls`` entry (joining the assistant message
    just before it, so that parallel calls are one turn)."""
    _keys(item, "function_call", where)
    call = {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": item.get("arguments")},
    }
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _function_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, "function_call_output", where)
    output = _text_content(item.get("output"), f"{where}.output")
    return {"role": "tool", "tool_call_id": item.get("call_id"), "content": output}


def _reasoning_text(item: dict[str, Any], where: str) -> str | None:
    _keys(item, "reasoning", where)
    parts = [*(item.get("content") or ()), *(item.get("summary") or ())]
    texts = [p.get("text") for p in parts if isinstance(p, dict)]
    if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise OpenAIError(f"{where}: reasoning parts must have text", param="input")
    return "".join(texts) or None


# -- tools, format, include ------------------------------------------------------------------


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise OpenAIError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            message = f"tools[{i}]: {_short(kind)} tools are not supported (function tools only)"
            raise OpenAIError(message, param="tools")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    if choice.get("type") != "function" or set(choice) - {"type", "name"}:
        message = "'tool_choice' must be auto, none, required or {'type': 'function', 'name'}"
        raise OpenAIError(message, param="tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise OpenAIError("'text' must be an object with a 'format'", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise OpenAIError("'text.verbosity' is not supported by this server", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise OpenAIError("'text.format' must be an object", param="text")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type"), **{k: v for k, v in fmt.items() if k != "type"}}
    schema = {k: v for k, v in fmt.items() if k != "type"}
    return {"type": "json_schema", "json_schema": schema}


def _include(include: Any) -> bool:
    """Whether ``include`` asks for the output text's logprobs (the only inclusion there is)."""
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise OpenAIError("'include' must be a list of strings", param="include")
    other = sorted(set(include) - {LOGPROBS_INCLUDE})
    if other:
        raise OpenAIError(f"include {_short(other[0])} is not supported", param="include")
    return bool(include)


def _echoed(body: dict[str, Any]) -> dict[str, Any]:
    """The request's fields the response object repeats."""
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA:
        message = f"'metadata' must be an object of at most {MAX_METADATA} string values"
        raise OpenAIError(message, param="metadata")
    for key, value in metadata.items():
        text_value(value, "metadata", f"metadata[{_short(key)}]")
    text = body.get("text") or {}
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_logprobs": body.get("top_logprobs"),
        "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
        "tools": body.get("tools") or [],
        "text": {"format": text.get("format") or {"type": "text"}},
        "user": body.get("user"),
    }


def responses_error(e: OpenAIError) -> OpenAIError:
    """A chat path error with the Responses field it is about."""
    param = PARAMS_BACK.get(e.param or "", e.param)
    message = e.message
    for chat_name, name in PARAMS_BACK.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'")
    return OpenAIError(message, status=e.status, param=param, code=e.code, type_=e.type)


# -- the answer ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponseShape:
    """One response's ids and echoed fields; builds the response object around its output."""

    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "truncation": "disabled",
            "usage": usage,
            **self.request.echo,
        }


def output_items(choice: dict[str, Any], logprobs: bool) -> list[dict[str, Any]]:
    """A whole chat choice (``full_body``'s) as output items: thinking, text, calls."""
    message = choice["message"]
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        entries = (choice.get("logprobs") or {}).get("content") if logprobs else None
        items.append(message_item(new_id("msg"), message.get("content") or "", entries))
    items += [call_item(new_id("fc"), call) for call in calls]
    return items


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def text_part(text: str, entries: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if entries is not None:
        part["logprobs"] = entries
    return part


def message_item(
    item_id: str, text: str, entries: list[dict[str, Any]] | None, status: str = "completed"
) -> dict[str, Any]:
    content = [text_part(text, entries)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def call_item(item_id: str, call: dict[str, Any], arguments: str | None = None) -> dict[str, Any]:
    function = call["function"]
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if arguments is None else arguments,
        "status": "completed" if arguments is None else "in_progress",
    }


def responses_usage(final: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    prompt, completion = int(final["prompt_tokens"]), int(final["new_tokens"])
    return {
        "input_tokens": prompt,
        # every prompt page enters the prefix cache as it is computed: no writes to report
        "input_tokens_details": {
            "cached_tokens": int(final.get("cached_tokens", 0)),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
        "total_tokens": prompt + completion,
    }


def status_of(choice: dict[str, Any]) -> str:
    return "incomplete" if choice.get("finish_reason") == "length" else "completed"


# -- streaming -------------------------------------------------------------------------------


class ResponseEvents:
    """OpenAI's Responses event sequence for one choice, message by message: items open as
    their text starts (thinking, then the answer) and close when something else follows; a
    call is sent whole (added, its arguments, done)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # {"kind", "id", "text", "index"}

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def start(self) -> str:
        response = self.shape.response([], "in_progress")
        return self.event("response.created", response=response) + self.event(
            "response.in_progress", response=response
        )

    def piece(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> str:
        out = []
        if reasoning:
            out += self._text("reasoning", reasoning)
        if content:
            out += self._text("message", content)
        for call in calls:
            out += self._close()
            out += self._call(call)
        return "".join(out)

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["kind"] != kind:
            out += self._close()
            out += self._open(kind)
        self.open["text"] += text
        where = self._where()
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **where, delta=text))
        else:
            out.append(self.event("response.output_text.delta", **where, delta=text, logprobs=[]))
        return out

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": self.open["index"], "content_index": 0}

    def _open(self, kind: str) -> list[str]:
        item_id = new_id("rs" if kind == "reasoning" else "msg")
        self.open = {"kind": kind, "id": item_id, "text": "", "index": len(self.output)}
        if kind == "reasoning":
            item = {"type": "reasoning", "id": item_id, "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(item_id, "", None, "in_progress"), text_part("", None)
        index = self.open["index"]
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **self._where(), part=part),
        ]

    def _close(self, entries: list[dict[str, Any]] | None = None) -> list[str]:
        if self.open is None:
            return []
        kind, text, where = self.open["kind"], self.open["text"], self._where()
        if kind == "reasoning":
            item = reasoning_item(self.open["id"], text)
            part = item["content"][0]
            done = self.event("response.reasoning_text.done", **where, text=text)
        else:
            item = message_item(self.open["id"], text, entries)
            part = item["content"][0]
            done = self.event("response.output_text.done", **where, text=text,
                              logprobs=entries or [])  # fmt: skip
        self.open = None
        self.output.append(item)
        return [
            done,
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    def _call(self, call: dict[str, Any]) -> list[str]:
        item_id, index = new_id("fc"), len(self.output)
        item = call_item(item_id, call)
        self.output.append(item)
        where = {"item_id": item_id, "output_index": index}
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=call_item(item_id, call, arguments=""),
            ),
            self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self.event(
                "response.function_call_arguments.done", **where, arguments=item["arguments"]
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def finish(
        self, choice: dict[str, Any], usage: dict[str, Any], entries: list[dict[str, Any]] | None
    ) -> str:
        """The last events: open items closed, a message for an empty answer, the response."""
        out = self._close(entries)
        if not any(i["type"] in ("message", "function_call") for i in self.output):
            out += self._open("message") + self._close(entries)
        status = status_of(choice)
        response = self.shape.response(self.output, status, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return "".join(out) + self.event(kind, response=response)

    def failed(self, error: OpenAIError) -> str:
        response = self.shape.response(self.output, "failed")
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return self.event("response.failed", response=response)
