"""``RouterSettings``: the prefix-aware router's tunables (``serving.router_kwargs``), validated.

Pure (no Ray): the preset validates router kwargs with it where ``build_app`` runs, and the
router (``deployments.routing``) and its policy (``deployments.prefix_index``) read it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RouterSettings:
    """Tunables; every field is a ``request_router_kwargs`` key (``serving.router_kwargs``)."""

    prefix_weight: float = 1.0  # cost of one uncached prompt page
    # A replica's load counts jobs: a request's n choices are n jobs (one for most requests).
    load_weight: float = 4.0  # cost of one in-flight job, in pages (16 tokens each)
    max_load: float = 32.0  # above this many in-flight jobs a replica spills to later ranks
    max_index_entries: int = 50_000  # page hashes remembered per replica (each part)
    routed_grace_s: float = 3.0  # how long a routed page counts without a report confirming it
    recent_half_life_s: float = 10.0  # decay of the recent-requests tie-breaker

    def __post_init__(self) -> None:
        def number(value: Any) -> bool:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            return ok and math.isfinite(value)

        checks = {
            "prefix_weight": (number(self.prefix_weight) and self.prefix_weight >= 0, ">= 0"),
            "load_weight": (number(self.load_weight) and self.load_weight >= 0, ">= 0"),
            "max_load": (number(self.max_load) and self.max_load >= 1, ">= 1"),
            "routed_grace_s": (number(self.routed_grace_s) and self.routed_grace_s >= 0, ">= 0"),
            "recent_half_life_s": (
                number(self.recent_half_life_s) and self.recent_half_life_s > 0,
                "> 0",
            ),
            "max_index_entries": (
                isinstance(self.max_index_entries, int) and self.max_index_entries >= 1,
                "an int >= 1",
            ),
        }
        for name, (ok, requirement) in checks.items():
            if not ok:
                value = getattr(self, name)
                raise ValueError(f"router kwarg {name} must be {requirement}, got {value!r}")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> RouterSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown router kwarg(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
