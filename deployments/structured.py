"""Structured output over HTTP: ``response_format`` and forced tool calls, parsed into the
``ConstraintSpec`` a replica enforces with a grammar, and the tool calls read back.

``response_format`` (both routes): ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``
(any JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}`` (``strict`` defaults to false, as OpenAI's; strict refuses schema features
the grammar cannot enforce, non-strict loosens them). OpenAI also requires the word "JSON" in
the messages for ``json_object``; this server does not: the grammar makes the output JSON
whatever the prompt says, and refusing would only break clients written for other servers.

Tools (chat): ``tools`` (``{"type": "function", "function": {"name", "description",
"parameters", "strict"}}``) with ``tool_choice`` ``"required"`` or ``{"type": "function",
"function": {"name"}}``. One function (named, or the only one): the output is its arguments,
constrained by its ``parameters`` schema. Several with ``"required"``: the output is
``{"name": ..., "arguments": {...}}`` under an ``anyOf`` over the functions. Either way exactly
one call is made (``parallel_tool_calls: true`` is refused with them). ``tool_choice``
``"none"``: the tools are in the prompt (as in the turns that called them, so their pages are
shared) and the output is a message, never a call. ``tool_choice`` ``"auto"`` (OpenAI's
default when tools are given): the model decides and writes its calls in its own syntax, read
back by the deployment's ``serving.tool_call_parser`` (``deployments.tool_parsers``; refused
when the preset names none); ``parallel_tool_calls: false`` keeps only its first call.
``response_format`` together with a forced call is refused. The tools reach the prompt
through the chat template's ``tools`` variable when the template uses one, else as a system
message listing them (with a call syntax: one that also says how to write a call). The calls
and results of earlier turns are in ``messages`` (``deployments.messages``).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from deployments.protocol import OpenAIError, _short, bounded_json
from deployments.tool_parsers import CallSyntax
from engine.constraints.spec import ConstraintSpec

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})
TYPES = ("text", "json_object", "json_schema")
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


# -- response_format -------------------------------------------------------------------------


def parse_response_format(body: dict[str, Any]) -> ConstraintSpec | None:
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _format_error("'response_format' must be an object with a 'type'")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and value.get("json_schema") is not None):
        raise _format_error(f"unexpected key in 'response_format': {(extra or ['json_schema'])[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec("json_object")
    if kind == "json_schema":
        return _json_schema(value.get("json_schema"))
    raise _format_error(
        f"response_format type {kind[:40]!r} is not text, json_object or json_schema"
    )


def _json_schema(spec: Any) -> ConstraintSpec:
    if not isinstance(spec, dict):
        raise _format_error("'response_format.json_schema' must be an object")
    extra = sorted(set(spec) - SCHEMA_KEYS)
    if extra:
        raise _format_error(f"unexpected key 'response_format.json_schema.{extra[0][:40]}'")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _format_error("'response_format.json_schema.name' must match [a-zA-Z0-9_-]{1,64}")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _format_error("'response_format.json_schema.schema' must be a JSON schema object")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _format_error("'response_format.json_schema.strict' must be a boolean")
    return _spec(schema, bool(strict), "response_format")


def _spec(schema: dict[str, Any], strict: bool, param: str) -> ConstraintSpec:
    try:
        return ConstraintSpec.json_schema(schema, strict=strict)
    except ValueError as e:
        raise OpenAIError(f"invalid schema: {e}", param=param) from None


def _format_error(message: str) -> OpenAIError:
    return OpenAIError(message, param="response_format")


# -- vLLM's guided decoding fields ----------------------------------------------------------

# vLLM's ``structured_outputs`` object (its keys) and its older top-level ``guided_*`` fields,
# each with the constraint kind it asks for.
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "lark", "json_object": "json_object"}  # fmt: skip
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip
MAX_GUIDED_CHOICES = 1024


def parse_guided(body: dict[str, Any]) -> tuple[ConstraintSpec, str] | None:
    """The constraint vLLM's fields ask for, and the field that asked (for errors):
    ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}`` or
    one of ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. A JSON
    schema is enforced strictly (what the grammar cannot enforce is refused, not loosened); a
    grammar is Lark in llguidance's dialect, or GBNF (llama.cpp's), converted."""
    asked = [(name, key) for name, key in GUIDED_FIELDS.items() if body.get(name) is not None]
    if body.get("structured_outputs") is not None:
        asked += _structured_outputs(body["structured_outputs"])
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise OpenAIError(f"give one structured output, got {names}", param=asked[1][0])
    ((param, key),) = asked
    return _guided_spec(key, _body_value(body, param), param), param


def _body_value(body: dict[str, Any], param: str) -> Any:
    """A field's value; ``structured_outputs.x`` names a key of that object."""
    if param.startswith("structured_outputs."):
        return body["structured_outputs"][param.split(".", 1)[1]]
    return body[param]


def _structured_outputs(value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, dict):
        raise OpenAIError("'structured_outputs' must be an object", param="structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS))
    if unknown:
        message = f"structured_outputs.{unknown[0][:40]} is not supported by this server"
        raise OpenAIError(message, param="structured_outputs")
    return [(f"structured_outputs.{key}", key) for key in given]


def _guided_spec(key: str, value: Any, param: str) -> ConstraintSpec:
    try:
        if key == "json_object":
            if value is not True:
                raise ValueError("'json_object' must be true")
            return ConstraintSpec("json_object")
        if key == "json":
            schema = bounded_json(value) if isinstance(value, str) else value
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object, or its JSON text")
            return ConstraintSpec.json_schema(schema, strict=True)
        if key == "choice":
            if not isinstance(value, list) or not 0 < len(value) <= MAX_GUIDED_CHOICES:
                raise ValueError(f"the choices must be a list of 1 to {MAX_GUIDED_CHOICES} strings")
            return ConstraintSpec("choice", choices=tuple(value))
        if not isinstance(value, str):
            raise ValueError("it must be a string")
        if key == "grammar":
            return ConstraintSpec("lark", _as_lark(value))
        return ConstraintSpec("regex", value)
    except ValueError as e:  # (json.JSONDecodeError is one)
        raise OpenAIError(f"invalid '{param}': {e}", param=param.split(".")[0]) from None


def _as_lark(grammar: str) -> str:
    """A grammar in llguidance's Lark dialect: GBNF (``root ::= ...``) is converted."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as e:  # the converter's own GbnfToLarkError and parse errors
        raise ValueError(f"the grammar does not parse: {e}") from None


def check_constraint(spec: ConstraintSpec, param: str) -> None:
    """Compile the grammar ``spec`` asks for, so a mistake in it is the client's 400 here and
    never a job that fails on a replica."""
    error = _grammar_error(spec)
    if error and not error.startswith("WARNING"):
        first = error.strip().splitlines()[0][:300]
        raise OpenAIError(f"invalid '{param}': {first}", param=param.split(".")[0])


@functools.lru_cache(maxsize=64)  # (specs of at most 256 KiB: a bounded cache)
def _grammar_error(spec: ConstraintSpec) -> str:
    """Why ``spec``'s grammar does not compile ("" when it does). Cached: clients send the same
    schema request after request, and compiling one takes 0.5-4 ms."""
    import llguidance

    from engine.constraints.filters import Filter

    try:
        return llguidance.LLMatcher.validate_grammar(Filter.from_spec(spec).grammar())
    except ValueError as e:
        return str(e)


# -- tools -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    parameters: dict[str, Any]
    strict: bool


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """The tools as given (for the chat template) and the functions the output must call
    (one: the output is its arguments; several: ``{"name", "arguments"}``; none: the output is
    a message, with calls read from it by ``syntax`` under ``tool_choice`` "auto")."""

    tools: tuple[dict[str, Any], ...]
    functions: tuple[Function, ...]
    syntax: CallSyntax | None = None  # the syntax the deployment's model writes calls in
    auto: bool = False  # tool_choice "auto": the model decides; its calls are read by syntax
    parallel: bool = True  # "auto": more than one call may be kept

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        """Whether the output is a call (read back as ``tool_calls``)."""
        return bool(self.functions)

    def constraint(self) -> ConstraintSpec:
        strict = any(f.strict for f in self.functions)
        if len(self.functions) == 1:
            return _spec(self.functions[0].parameters, strict, "tools")
        variants = [
            {
                "type": "object",
                "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        return _spec({"anyOf": variants}, strict, "tools")

    @property
    def single_name(self) -> str | None:
        """The function's name when it is known before the output (one function)."""
        return self.functions[0].name if len(self.functions) == 1 else None

    def call(self, text: str) -> dict[str, Any] | None:
        """The OpenAI ``tool_calls`` entry for an output; None when it does not parse (cut by
        ``max_tokens``) and the function is not known in advance."""
        if self.single_name is not None:
            return tool_call(self.single_name, text.strip())
        try:
            value = json.loads(text)
            name, arguments = value["name"], value["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        return tool_call(name, json.dumps(arguments, ensure_ascii=False))


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    call_id = call_id or f"call_{uuid.uuid4().hex[:24]}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tools(
    body: dict[str, Any], chat: bool, syntax: CallSyntax | None = None
) -> ToolCalling | None:
    """The request's tools and tool choice; ``syntax``: the deployment's call syntax (what
    makes ``tool_choice`` "auto" possible)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        message = "'parallel_tool_calls' must be a boolean"
        raise OpenAIError(message, param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise OpenAIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not chat:
        raise OpenAIError("'tools' is only supported for chat completions", param="tools")
    functions = _functions(tools)
    if choice in (None, "auto") and syntax is not None:
        return ToolCalling(tuple(tools), (), syntax, auto=True, parallel=parallel is not False)
    chosen = _chosen(functions, choice)
    if chosen and parallel:
        message = (
            "'parallel_tool_calls' must be false with a forced tool choice: the output is "
            "exactly one call"
        )
        raise OpenAIError(message, param="parallel_tool_calls")
    return ToolCalling(tuple(tools), chosen, syntax)


def _functions(tools: Any) -> list[Function]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise OpenAIError(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise OpenAIError(f"tools[{i}] must be a function tool", param="tools")
        extra = sorted(set(tool) - {"type", "function"}) + sorted(set(fn) - FUNCTION_KEYS)
        if extra:
            raise OpenAIError(f"tools[{i}] has an unexpected key {extra[0][:40]!r}", param="tools")
        name, parameters = fn.get("name"), fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(name, str) or not NAME.fullmatch(name):
            message = f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}"
            raise OpenAIError(message, param="tools")
        if name in {f.name for f in functions}:
            raise OpenAIError(f"two tools are named {name!r}", param="tools")
        if not isinstance(parameters, dict):
            raise OpenAIError(f"tools[{i}].function.parameters must be a schema", param="tools")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise OpenAIError(f"tools[{i}].function.strict must be a boolean", param="tools")
        functions.append(Function(name, parameters, bool(strict)))
    return functions


def _chosen(functions: list[Function], choice: Any) -> tuple[Function, ...]:
    if choice == "required":
        return tuple(functions)
    if choice == "none":
        return ()
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        match = [f for f in functions if f.name == name]
        if not match:
            message = f"tool_choice names no tool in 'tools': {_short(name)}"
            raise OpenAIError(message, param="tool_choice")
        return (match[0],)
    if choice in (None, "auto"):
        shown = "auto (the default with tools)" if choice is None else choice
        message = (
            f"tool_choice {shown} needs a tool call parser, and this deployment has none "
            '(serving.tool_call_parser): use "required", "none" or '
            '{"type": "function", "function": {"name": ...}}'
        )
        raise OpenAIError(message, param="tool_choice")
    raise OpenAIError("'tool_choice' is not a valid tool choice", param="tool_choice")


def tools_system_message(tools: ToolCalling) -> dict[str, str]:
    """For a chat template without a ``tools`` variable: the tools as a system message (with a
    call syntax, the same message whatever the tool choice, so turns share their pages)."""
    if tools.syntax is not None:
        return {"role": "system", "content": tools.syntax.instructions(list(tools.tools))}
    listing = json.dumps([t["function"] for t in tools.tools], ensure_ascii=False)
    return {"role": "system", "content": f"You call one of these functions: {listing}"}
