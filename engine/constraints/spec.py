"""``ConstraintSpec``: what a request asks its output to match, as a plain value.

A spec travels inside a ``GenerationRequest`` (across Ray, into the batch job), so it holds only
text: the filter objects that enforce it (llguidance matchers, per job) are built from it on the
replica. Nothing here imports torch or llguidance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

ConstraintKind = Literal["json_object", "json_schema", "regex", "choice", "lark"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "choice", "lark")
THINKING = (None, "optional", "open")
MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar larger than this is refused


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """``kind``: ``json_object`` (any JSON object; ``value`` is None), ``json_schema`` (``value``
    is the schema as JSON text), ``regex`` (the pattern), ``choice`` (``choices``: the allowed
    outputs), ``lark`` (a Lark grammar, llguidance's dialect). ``strict``: for JSON schemas, refuse
    schema features the grammar cannot enforce instead of loosening them. ``thinking``: the
    output may first think, ``<think> ... </think>`` (``"optional"``), or starts inside such a
    block its prompt opened (``"open"``); the constraint holds for what follows the block."""

    kind: ConstraintKind
    value: str | None = None
    choices: tuple[str, ...] = ()
    strict: bool = True
    thinking: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError(
                    f"a choice constraint needs non-empty strings, got {self.choices!r}"
                )
            size = sum(len(c) for c in self.choices)
        elif self.kind == "json_object":
            if self.value is not None:
                raise ValueError("a json_object constraint takes no value")
            size = 0
        else:
            if not isinstance(self.value, str) or not self.value:
                raise ValueError(f"a {self.kind} constraint needs a non-empty string value")
            size = len(self.value)
        if size > MAX_SPEC_CHARS:
            raise ValueError(
                f"the {self.kind} constraint is {size} characters (at most {MAX_SPEC_CHARS})"
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the json_schema constraint is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object or a boolean")
        self._check_options()

    def _check_options(self) -> None:
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")
        if self.thinking not in THINKING:
            raise ValueError(f"thinking must be one of {THINKING}, got {self.thinking!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool, strict: bool = True) -> ConstraintSpec:
        return cls("json_schema", json.dumps(schema), strict=strict)
