"""Chat messages: the ``messages`` of a request validated, then shaped for the chat template.

Roles ``system``, ``developer``, ``user``, ``assistant`` and ``tool``; keys ``role`` and
``content`` (a string or text parts; ``input_embeds`` parts: ``deployments.chat_embeds``), plus
``tool_calls`` on assistant messages and ``tool_call_id`` on tool messages, so that a client can
send a function call back with its result (the OpenAI tool loop). Any other key set to
something other than null is refused by name (``name`` too: a participant's name is not
something chat templates render, so it would be silently dropped).

A tool message answers one of the calls of the assistant message before it (only other tool
messages may sit between them), as OpenAI requires: its ``tool_call_id`` must name one of
them. That is also how the function's name is known when the result is rendered.

Templates differ in what they know, so ``for_template`` adapts the conversation to the one it
renders (the template's source decides, as it names what it reads):

- one that reads ``tool_calls`` gets the calls as transformers passes them (``arguments`` as a
  JSON object when it parses as one; templates write it with ``tojson``) and tool messages
  with their ``tool_call_id`` and the function's ``name``;
- any other gets each call after the assistant's text, written in the deployment's call syntax
  when it has one (``deployments.tool_parsers``: what the model was told to write), else as a
  line of JSON, ``{"name": ..., "arguments": ...}`` (the shape this server's forced call with
  several functions produces), and
  each run of tool messages as one user message, ``<name> returned: <content>`` per result,
  so that user and assistant turns still alternate for templates that insist on it;
- ``developer`` (OpenAI's newer name for the system role) stays ``developer`` for a template
  that names it and becomes ``system`` for any other;
- an assistant message's ``reasoning_content`` (a reasoning model's thinking, as this server's
  responses carry it, so a client may send the message back as it came) reaches a template
  that reads it; others leave earlier thinking out of the prompt, as reasoning models'
  templates do themselves (Qwen3 keeps only the last turn's, DeepSeek-R1 none).
"""

from __future__ import annotations

import json
from typing import Any

from deployments.protocol import OpenAIError, _short, bounded_json, text_value
from deployments.structured import NAME
from deployments.tool_parsers import CallSyntax

MAX_MESSAGES = 1024
MAX_TOOL_CALLS = 128  # per assistant message
MAX_CALL_ID_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
BASE_KEYS = frozenset({"role", "content"})
KEYS = {
    "assistant": BASE_KEYS | {"tool_calls", "reasoning_content"},
    "tool": BASE_KEYS | {"tool_call_id"},
}
CALL_KEYS = frozenset({"id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})


def parse_messages(messages: Any, param: str = "messages") -> list[dict[str, Any]]:
    """A conversation as ``{"role", "content"}`` dicts with string (or None) contents, with
    ``tool_calls`` on assistant messages that made calls and ``tool_call_id`` and ``name`` on
    tool messages (``param``: the body field it came from, named in errors)."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(f"'{param}' must be a non-empty list", param=param)
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(f"'{param}' has more than {MAX_MESSAGES} entries", param=param)
    parsed: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OpenAIError(f"{where} must be an object with a 'role'", param=param)
        role = message["role"]
        if role not in ROLES:
            message_text = f"{where}.role {_short(role)} is not one of {list(ROLES)}"
            raise OpenAIError(message_text, param=param)
        keys = KEYS.get(role, BASE_KEYS)
        extra = sorted(k for k, v in message.items() if k not in keys and v is not None)
        if extra:
            raise OpenAIError(f"{where}.{extra[0]} is not supported by this server", param=param)
        entry = {"role": role, "content": _content(message.get("content"), where, param)}
        if message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], where, param)
        if message.get("reasoning_content") is not None:  # a response's message sent back
            what = f"{where}.reasoning_content"
            entry["reasoning_content"] = text_value(message["reasoning_content"], param, what)
        if role == "tool":
            entry |= _answered_call(message.get("tool_call_id"), parsed, where, param)
            if entry["content"] is None:
                raise OpenAIError(f"{where}.content must be a string or text parts", param=param)
        parsed.append(entry)
    return parsed


def _content(content: Any, where: str, param: str) -> str | None:
    what = f"{where}.content"
    if content is None or isinstance(content, str):
        return None if content is None else text_value(content, param, what)
    if isinstance(content, list):  # content parts: text (input_embeds: deployments.chat_embeds)
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(text_value(t, param, what) for t in texts)
    raise OpenAIError(f"{what} must be a string or text parts", param=param)


def _tool_calls(value: Any, where: str, param: str) -> list[dict[str, Any]]:
    what = f"{where}.tool_calls"
    if not isinstance(value, list) or not 0 < len(value) <= MAX_TOOL_CALLS:
        raise OpenAIError(f"{what} must be a list of 1 to {MAX_TOOL_CALLS} calls", param=param)
    calls = [_tool_call(call, f"{what}[{j}]", param) for j, call in enumerate(value)]
    ids = [call["id"] for call in calls]
    if len(set(ids)) < len(ids):
        raise OpenAIError(f"{what} has two calls with the same id", param=param)
    return calls


def _tool_call(call: Any, what: str, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise OpenAIError(f"{what} must be a function call", param=param)
    extra = sorted(set(call) - CALL_KEYS) + sorted(set(function) - FUNCTION_KEYS)
    if extra:
        raise OpenAIError(f"{what} has an unexpected key {extra[0][:40]!r}", param=param)
    call_id, name = call.get("id"), function.get("name")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
        message = f"{what}.id must be a string of 1 to {MAX_CALL_ID_CHARS} characters"
        raise OpenAIError(message, param=param)
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise OpenAIError(f"{what}.function.name must match [a-zA-Z0-9_-]{{1,64}}", param=param)
    arguments = text_value(function.get("arguments"), param, f"{what}.function.arguments")
    text_value(call_id, param, f"{what}.id")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _answered_call(
    call_id: Any, earlier: list[dict[str, Any]], where: str, param: str
) -> dict[str, str]:
    """The ``tool_call_id`` and function ``name`` of the call a tool message answers."""
    if not isinstance(call_id, str):
        raise OpenAIError(f"{where}.tool_call_id must be a string", param=param)
    before = next((m for m in reversed(earlier) if m["role"] != "tool"), None)
    calls = (before or {}).get("tool_calls", [])
    if not calls:
        message = f"{where} (role 'tool') must follow an assistant message with 'tool_calls'"
        raise OpenAIError(message, param=param)
    name = next((c["function"]["name"] for c in calls if c["id"] == call_id), None)
    if name is None:
        message = f"{where}.tool_call_id {_short(call_id)} names no call of the assistant message"
        raise OpenAIError(message, param=param)
    return {"tool_call_id": call_id, "name": name}


def text_length(messages: list[dict[str, Any]]) -> int:
    """Characters the template will render from the messages (contents and calls)."""
    length = 0
    for message in messages:
        length += len(message["content"] or "")
        for call in message.get("tool_calls", ()):
            length += len(call["function"]["name"]) + len(call["function"]["arguments"])
    return length


# -- shaped for a template -------------------------------------------------------------------


def for_template(
    messages: list[dict[str, Any]], template: str, syntax: CallSyntax | None = None
) -> list[dict[str, Any]]:
    """The conversation as the chat template ``template`` (its source) can render it;
    ``syntax``: how the model writes calls (earlier calls are written so, when the template
    cannot render them itself)."""
    knows_tools = "tool_calls" in template
    knows_developer = "developer" in template
    knows_reasoning = "reasoning_content" in template
    shaped: list[dict[str, Any]] = []
    results: dict[str, Any] | None = None  # the user message holding this turn's tool results
    for message in messages:
        if message["role"] == "developer" and not knows_developer:
            message = {**message, "role": "system"}
        if "reasoning_content" in message and not knows_reasoning:
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
        if not knows_tools and message["role"] == "tool":
            result = f"{message['name']} returned: {message['content']}"
            if results is None:
                results = {"role": "user", "content": result}
                shaped.append(results)
            else:
                results["content"] += "\n" + result
            continue
        results = None
        if "tool_calls" in message:
            message = _with_calls(message, knows_tools, syntax)
        shaped.append(message)
    return shaped


def _with_calls(
    message: dict[str, Any], knows_tools: bool, syntax: CallSyntax | None
) -> dict[str, Any]:
    if knows_tools:
        return {**message, "tool_calls": [_structured(call) for call in message["tool_calls"]]}
    lines = [message["content"]] if message["content"] else []
    for call in message["tool_calls"]:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        value = _arguments_value(arguments)
        if syntax is not None:
            lines.append(syntax.written(name, value))
        else:
            lines.append(json.dumps({"name": name, "arguments": value}, ensure_ascii=False))
    return {"role": message["role"], "content": "\n".join(lines)}


def _arguments_value(arguments: str) -> Any:
    """The arguments as a JSON value when they parse (a call cut by ``max_tokens`` does not:
    then the text as it is)."""
    try:
        return bounded_json(arguments)
    except ValueError:
        return arguments


def _structured(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = _arguments_value(function["arguments"])
    if not isinstance(arguments, dict):
        arguments = function["arguments"]
    return {**call, "function": {"name": function["name"], "arguments": arguments}}
