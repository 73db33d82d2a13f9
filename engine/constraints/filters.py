"""Filters: what a job's output must match, as an llguidance grammar.

A filter is an immutable description (a schema, a pattern, a grammar): the same object may be
given to many jobs, and each job compiles its own matcher from it when it is enqueued
(``engine.constraints.matcher.JobConstraint``). Build one directly::

    JSONSchemaFilter({"type": "object", ...})   # JSON Schema (dict, bool or JSON text)
    JSONObjectFilter()                          # any JSON object ("JSON mode")
    RegexFilter(r"\\d{3}-\\d{4}")                 # the whole output matches the regex
    ChoiceFilter(["yes", "no"])                 # exactly one of the strings
    GrammarFilter('start: "a"+ "b"')            # a Lark grammar (llguidance's dialect)

or from a request's ``ConstraintSpec`` with ``Filter.from_spec(spec)``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import llguidance

from engine.constraints.spec import ConstraintSpec

# JSON is generated with fixed separators (json.dumps' own: what models see most) and no other
# whitespace: with free whitespace a weak or random model can pad forever inside an object.
JSON_ITEM_SEPARATOR = ", "
JSON_KEY_SEPARATOR = ": "


class Filter:
    """Base class: ``grammar()`` is the llguidance grammar text of the constraint."""

    kind: ClassVar[str]

    def grammar(self) -> str:
        raise NotImplementedError

    @staticmethod
    def from_spec(spec: ConstraintSpec) -> Filter:
        """The filter enforcing a request's ``ConstraintSpec``."""
        if not isinstance(spec, ConstraintSpec):
            raise ValueError(f"from_spec takes a ConstraintSpec, got {spec!r}")
        if spec.thinking is not None:
            inner = Filter.from_spec(dataclasses.replace(spec, thinking=None))
            return AfterThinkingFilter(inner, opened=spec.thinking == "open")
        if spec.kind == "json_object":
            return JSONObjectFilter()
        if spec.kind == "json_schema":
            return JSONSchemaFilter(spec.value, strict=spec.strict)
        if spec.kind == "regex":
            return RegexFilter(spec.value)
        if spec.kind == "choice":
            return ChoiceFilter(spec.choices)
        return GrammarFilter(spec.value)


@dataclass(frozen=True)
class JSONSchemaFilter(Filter):
    """Output is one JSON value valid against ``schema`` (a dict, a bool, or its JSON text).

    ``strict``: refuse (at enqueue, ValueError) schema keywords llguidance cannot enforce; with
    ``strict=False`` they are ignored (the output may then violate them). ``whitespace_flexible``:
    let the model choose JSON whitespace (default: fixed ``", "`` / ``": "`` separators)."""

    schema: Any
    strict: bool = True
    whitespace_flexible: bool = False
    kind: ClassVar[str] = "json_schema"
    _text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        text = self.schema if isinstance(self.schema, str) else json.dumps(self.schema)
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(parsed, dict | bool):
            raise ValueError(f"a JSON schema must be an object or a boolean, got {parsed!r}")
        object.__setattr__(self, "_text", text)

    def grammar(self) -> str:
        options: dict[str, Any] = {"lenient": not self.strict}
        if self.whitespace_flexible:
            options["whitespace_flexible"] = True
        else:
            options.update(
                whitespace_flexible=False,
                item_separator=JSON_ITEM_SEPARATOR,
                key_separator=JSON_KEY_SEPARATOR,
            )
        return llguidance.LLMatcher.grammar_from_json_schema(self._text, overrides=options)


class JSONObjectFilter(JSONSchemaFilter):
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""

    kind: ClassVar[str] = "json_object"

    def __init__(self, whitespace_flexible: bool = False):
        super().__init__({"type": "object"}, strict=True, whitespace_flexible=whitespace_flexible)


@dataclass(frozen=True)
class RegexFilter(Filter):
    """The whole output matches ``pattern`` (Rust ``regex`` syntax, anchored at both ends)."""

    pattern: str
    kind: ClassVar[str] = "regex"

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"a regex filter needs a non-empty pattern, got {self.pattern!r}")

    def grammar(self) -> str:
        return llguidance.LLMatcher.grammar_from_regex(self.pattern)


@dataclass(frozen=True)
class ChoiceFilter(Filter):
    """The output is exactly one of ``choices``."""

    choices: tuple[str, ...]
    kind: ClassVar[str] = "choice"

    def __post_init__(self) -> None:
        choices = (self.choices,) if isinstance(self.choices, str) else tuple(self.choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"a choice filter needs non-empty strings, got {self.choices!r}")
        object.__setattr__(self, "choices", choices)

    def grammar(self) -> str:
        # json.dumps quotes and escapes each choice as a Lark string literal
        lark = "start: " + " | ".join(json.dumps(c) for c in self.choices)
        return llguidance.LLMatcher.grammar_from_lark(lark)


@dataclass(frozen=True)
class GrammarFilter(Filter):
    """A Lark grammar in llguidance's dialect (``start`` is the top rule; it may embed
    ``%json {...}`` schemas and ``/regex/`` terminals)."""

    lark: str
    kind: ClassVar[str] = "lark"

    def __post_init__(self) -> None:
        if not isinstance(self.lark, str) or not self.lark.strip():
            raise ValueError(f"a grammar filter needs a non-empty grammar, got {self.lark!r}")

    def grammar(self) -> str:
        return llguidance.LLMatcher.grammar_from_lark(self.lark)


@dataclass(frozen=True)
class AfterThinkingFilter(Filter):
    """``inner`` holds for the output after a reasoning model's ``<think> ... </think>`` block:
    the thinking itself is free text up to the closing tag. ``opened``: the prompt opened the
    block (the output starts inside it); else a block may come first, or none. Whitespace
    between the block and the answer is allowed (models write a blank line there)."""

    inner: Filter
    opened: bool = False
    kind: ClassVar[str] = "after_thinking"

    def __post_init__(self) -> None:
        if not isinstance(self.inner, Filter) or isinstance(self.inner, AfterThinkingFilter):
            raise ValueError(f"an after-thinking filter wraps one plain filter, got {self.inner!r}")

    def grammar(self) -> str:
        head = (
            "start: think_text gap answer\n"
            if self.opened
            else 'start: (think gap)? answer\nthink: "<think>" think_text\n'
        )
        outer = head + THINK_RULES
        return json.dumps({"grammars": [{"lark_grammar": outer}, _named_answer(self.inner)]})


# the thinking runs to the closing tag (llguidance's ``stop``: it is consumed); ``answer``
# refers to the inner grammar by name
THINK_RULES = 'think_text[stop="</think>"]: /(.|\\n)*/\ngap: /[ \\t\\r\\n]*/\nanswer: @answer\n'


def _named_answer(inner: Filter) -> dict[str, Any]:
    """``inner``'s grammar as one named entry of a grammar list: the JSON grammar list the
    ``grammar_from_*`` builders return, or plain Lark text."""
    text = inner.grammar()
    try:
        (entry,) = json.loads(text)["grammars"]
    except (ValueError, KeyError, TypeError):
        entry = {"lark_grammar": text}
    return {**entry, "name": "answer"}


def check_filters(filters: Any) -> tuple[Filter, ...]:
    """A job's ``filters`` argument as a tuple of ``Filter`` (ValueError otherwise)."""
    if filters is None:
        return ()
    if isinstance(filters, Filter):
        raise ValueError("filters must be a list of Filter objects, got a single Filter")
    filters = tuple(filters)
    bad = [f for f in filters if not isinstance(f, Filter)]
    if bad:
        raise ValueError(f"filters must be Filter objects, got {bad[0]!r}")
    return filters
