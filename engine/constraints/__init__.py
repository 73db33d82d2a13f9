"""Constrained decoding: what a request asks for (``ConstraintSpec``, torch-free) and the
filters that enforce it on a job.

Filters describe a grammar (``JSONSchemaFilter(schema)``, ``RegexFilter(pattern)``,
``ChoiceFilter([...])``, ``GrammarFilter(lark)``, or ``Filter.from_spec(spec)``); each job that
carries them gets its own llguidance matchers (``JobConstraint``) when it is enqueued. The
generator computes every constrained row's allowed-token bitmask on host threads while the
forward runs and applies them on the device as one additive logit bias.

Only ``ConstraintSpec`` is imported eagerly: the ingress imports this package, and the rest
needs llguidance (and torch). The other names load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.constraints.spec import ConstraintSpec

_EXPORTS = {
    "ChoiceFilter": "engine.constraints.filters",
    "Filter": "engine.constraints.filters",
    "GrammarFilter": "engine.constraints.filters",
    "JSONObjectFilter": "engine.constraints.filters",
    "JSONSchemaFilter": "engine.constraints.filters",
    "RegexFilter": "engine.constraints.filters",
    "JobConstraint": "engine.constraints.matcher",
    "BannedStrings": "engine.constraints.banned",
}

__all__ = [
    "BannedStrings",
    "ChoiceFilter",
    "ConstraintSpec",
    "Filter",
    "GrammarFilter",
    "JSONObjectFilter",
    "JSONSchemaFilter",
    "JobConstraint",
    "RegexFilter",
]
assert sorted(__all__) == sorted([*_EXPORTS, "ConstraintSpec"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.constraints' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from engine.constraints.banned import BannedStrings
    from engine.constraints.filters import (
        ChoiceFilter,
        Filter,
        GrammarFilter,
        JSONObjectFilter,
        JSONSchemaFilter,
        RegexFilter,
    )
    from engine.constraints.matcher import JobConstraint
