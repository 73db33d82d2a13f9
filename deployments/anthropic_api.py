"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``), over
the chat path, for clients written against it (the ``anthropic`` SDK, Claude Code).

A request becomes the chat completions body it means: ``system`` a system message, content
blocks ``text``, ``tool_use`` (assistant) and ``tool_result`` (user) the OpenAI tool loop,
``thinking`` blocks an assistant message's ``reasoning_content``, ``tools`` (``input_schema``)
chat tools, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``, ``stop_sequences``
``stop``. It is validated, routed and run as chat is. The answer is content blocks:
``thinking`` (a reasoning deployment's thinking; no signature: nothing is signed here),
``text`` and ``tool_use``, with ``stop_reason`` ``end_turn``, ``max_tokens``,
``stop_sequence`` (and which one) or ``tool_use``. Streamed, it is Anthropic's event sequence
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.

``cache_control`` marks are accepted: this server caches every prompt's pages anyway, and
reports the prompt tokens read from the cache as ``cache_read_input_tokens``.
``disable_parallel_tool_use`` keeps one call. What cannot be honoured is refused by name:
images and documents, server tools, extended ``thinking`` budgets.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from deployments.protocol import OpenAIError, _short, bounded_json, text_value

PASSED = frozenset({"model", "temperature", "top_p", "top_k", "stream"})
HANDLED = frozenset(
    {"messages", "system", "max_tokens", "stop_sequences", "tools", "tool_choice", "metadata",
     "thinking", "service_tier"}
)  # fmt: skip
PARAMS_BACK = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
               "messages": "messages", "parallel_tool_calls": "tool_choice"}  # fmt: skip
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def translate(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body an Anthropic Messages body means (``OpenAIError`` naming its field)."""
    _check_fields(body)
    chat: dict[str, Any] = {k: v for k, v in body.items() if k in PASSED and v is not None}
    if body.get("max_tokens") is None:
        raise OpenAIError("'max_tokens' is required", param="max_tokens")
    chat["max_completion_tokens"] = body["max_tokens"]
    messages = _messages(body.get("messages"))
    if body.get("system") is not None:
        messages = [{"role": "system", "content": _text(body["system"], "system")}, *messages]
    chat["messages"] = messages
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(body["tools"])]
        chat |= _tool_choice(body.get("tool_choice"))
    elif body.get("tool_choice") is not None:
        raise OpenAIError("'tool_choice' needs 'tools'", param="tool_choice")
    return chat


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if value is not None and name not in PASSED and name not in HANDLED:
            raise OpenAIError(f"'{name[:64]}' is not supported by this server", param=name[:64])
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        message = (
            "'thinking' budgets are not supported by this server: a reasoning deployment "
            "thinks as its model does, and its thinking comes back as thinking blocks"
        )
        raise OpenAIError(message, param="thinking")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise OpenAIError("'service_tier' is not supported by this server", param="service_tier")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or set(metadata) - {"user_id"}):
        raise OpenAIError("'metadata' may only hold 'user_id'", param="metadata")


def _text(value: Any, param: str) -> str:
    """A string, or text blocks (their ``cache_control`` marks accepted), as one string."""
    if isinstance(value, str):
        return text_value(value, param, f"'{param}'")
    if isinstance(value, list):
        texts = []
        for block in value:
            if not isinstance(block, dict) or block.get("type") != "text":
                raise OpenAIError(f"'{param}' may only hold text blocks", param=param)
            _block_keys(block, {"type", "text", "cache_control", "citations"}, param)
            texts.append(text_value(block.get("text"), param, f"a text block of '{param}'"))
        return "".join(texts)
    raise OpenAIError(f"'{param}' must be a string or text blocks", param=param)


def _block_keys(block: dict[str, Any], keys: set[str], param: str) -> None:
    extra = sorted(k for k, v in block.items() if k not in keys and v is not None)
    if extra:
        message = f"{block.get('type')} blocks: {_short(extra[0])} is not supported"
        raise OpenAIError(message, param=param)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant") or set(message) - {"role", "content"}:
            message_text = f"messages[{i}] must be {{'role': 'user' | 'assistant', 'content'}}"
            raise OpenAIError(message_text, param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "assistant":
            out.append(_assistant(content, i))
        else:
            out += _user(content, i)
    return out


def _blocks(content: Any, i: int) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        message = f"messages[{i}].content must be a string or a list of content blocks"
        raise OpenAIError(message, param="messages")
    return content


def _assistant(content: Any, i: int) -> dict[str, Any]:
    texts, calls, thinking = [], [], []
    for block in _blocks(content, i):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text([block], "messages"))
        elif kind == "tool_use":
            _block_keys(block, {"type", "id", "name", "input", "cache_control"}, "messages")
            calls.append(_call(block, i))
        elif kind == "thinking":
            _block_keys(block, {"type", "thinking", "signature"}, "messages")
            thinking.append(text_value(block.get("thinking"), "messages", "a thinking block"))
        elif kind != "redacted_thinking":  # (opaque: nothing of it can reach a prompt)
            raise OpenAIError(f"messages[{i}]: {_short(kind)} blocks are not supported",
                              param="messages")  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _call(block: dict[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(block.get("input"), dict):
        raise OpenAIError(f"messages[{i}]: a tool_use block's input must be an object",
                          param="messages")  # fmt: skip
    arguments = json.dumps(block["input"], ensure_ascii=False)
    function = {"name": block.get("name"), "arguments": arguments}
    return {"id": block.get("id"), "type": "function", "function": function}


def _user(content: Any, i: int) -> list[dict[str, Any]]:
    """A user turn: its tool results (tool messages, first, as OpenAI's order wants), then
    its text."""
    results, texts = [], []
    for block in _blocks(content, i):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text([block], "messages"))
        elif kind == "tool_result":
            _block_keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"},
                        "messages")  # fmt: skip
            output = _text(block.get("content") or "", "messages")
            if block.get("is_error"):
                output = f"Error: {output}"
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": output})  # fmt: skip
        else:
            raise OpenAIError(f"messages[{i}]: {_short(kind)} blocks are not supported",
                              param="messages")  # fmt: skip
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        message = f"tools[{i}]: {_short(kind)} tools are not supported (custom tools only)"
        raise OpenAIError(message, param="tools")
    _block_keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, "tools")
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {"tool_choice": "auto"}
    if not isinstance(choice, dict) or set(choice) - {"type", "name", "disable_parallel_tool_use"}:
        raise OpenAIError("'tool_choice' must be an object with a 'type'", param="tool_choice")
    kind = choice.get("type")
    one = choice.get("disable_parallel_tool_use") is True
    if kind == "auto":
        return {"tool_choice": "auto", "parallel_tool_calls": not one}
    if kind == "none":
        return {"tool_choice": "none"}
    if kind == "any":
        return {"tool_choice": "required"}  # (exactly one call: parallel calls never happen)
    if kind == "tool":
        return {"tool_choice": {"type": "function", "function": {"name": choice.get("name")}}}
    raise OpenAIError(f"tool_choice type {_short(kind)} is not auto, any, tool or none",
                      param="tool_choice")  # fmt: skip


# -- the answer ------------------------------------------------------------------------------


def error_body(e: OpenAIError) -> dict[str, Any]:
    """An error as Anthropic's clients read it."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    message = e.message
    for chat_name, name in PARAMS_BACK.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'")
    return {"type": "error", "error": {"type": kind, "message": message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def content_blocks(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat choice (``full_body``'s) as content blocks: thinking, text, tool uses."""
    message = choice["message"]
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})  # fmt: skip
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    blocks += [tool_use(call) for call in message.get("tool_calls") or ()]
    return blocks


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        value = bounded_json(arguments)
    except ValueError:  # a forced call cut short: no object to give
        value = {}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": value}


def stop_of(choice: dict[str, Any], final: dict[str, Any]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a choice."""
    if final.get("eos_reason") == "stop_string":
        return "stop_sequence", final.get("stop_string")
    return STOP_REASONS.get(choice["finish_reason"], "end_turn"), None


def usage(final: dict[str, Any]) -> dict[str, Any]:
    cached = int(final.get("cached_tokens", 0))
    return {
        "input_tokens": int(final["prompt_tokens"]) - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,  # (nothing is written on request: pages just are)
        "output_tokens": int(final["new_tokens"]),
    }


def message_object(
    message_id: str, model: str, blocks: list[dict[str, Any]], stop: tuple, use: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": use,
    }


class MessageEvents:
    """Anthropic's stream for one choice: a block opens when its kind of text starts and closes
    when another kind follows; a tool use is sent whole (start, its input JSON, stop)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self.index = -1  # the open block's index
        self.open: str | None = None  # "thinking" or "text"

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def start(self, prompt_tokens: int) -> str:
        use = {"input_tokens": prompt_tokens, "output_tokens": 0}
        message = message_object(self.message_id, self.model, [], (None, None), use)
        return self.event("message_start", message=message)

    def piece(self, reasoning: str, content: str, calls: list[dict[str, Any]]) -> str:
        out = []
        if reasoning:
            out += self._text("thinking", reasoning)
        if content:
            out += self._text("text", content)
        for call in calls:
            out += self._close()
            block = tool_use(call)
            self.index += 1
            out += [
                self.event("content_block_start", index=self.index,
                           content_block={**block, "input": {}}),
                self.event("content_block_delta", index=self.index,
                           delta={"type": "input_json_delta",
                                  "partial_json": json.dumps(block["input"])}),
                self.event("content_block_stop", index=self.index),
            ]  # fmt: skip
        return "".join(out)

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = {"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {})
            out.append(self.event("content_block_start", index=self.index, content_block=block))
        delta = {"type": f"{kind}_delta", kind: text}
        out.append(self.event("content_block_delta", index=self.index, delta=delta))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # (clients wait for a signature before the stop)
            delta = {"type": "signature_delta", "signature": ""}
            out.append(self.event("content_block_delta", index=self.index, delta=delta))
        self.open = None
        return [*out, self.event("content_block_stop", index=self.index)]

    def finish(self, stop: tuple, use: dict[str, Any]) -> str:
        out = self._close()
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        out.append(self.event("message_delta", delta=delta, usage=use))
        out.append(self.event("message_stop"))
        return "".join(out)

    def failed(self, body: dict[str, Any]) -> str:
        return self.event("error", error=body["error"])
