"""Chat templates: transformers-compatible rendering in jinja2's sandbox.

The helpers templates expect (``raise_exception``, ``tojson`` as plain ``json.dumps``,
``strftime_now``, the ``{% generation %}`` tag) and the message normalisation transformers does
before rendering.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template refused the conversation (its ``raise_exception`` was called)."""


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # As transformers: keys set to None are dropped (OpenAI clients send content=None), and
    # reasoning given under any common name is visible under all of them.
    normalised = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalised.append(message)
    return normalised


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; templates expect plain json.dumps
    # (indent, separators, sort_keys pass through, as in transformers)
    return json.dumps(value, ensure_ascii=ensure_ascii, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's declared class attribute)

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
