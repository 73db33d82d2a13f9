"""Recording a module function's calls in tests, each call still made."""

from __future__ import annotations

from typing import Any


def record_calls(monkeypatch, module: Any, name: str, position: int) -> list[Any]:
    """The argument at ``position`` of each call of ``module.<name>`` from now on (the real
    function still runs): which way a kernel's work went, how much of it was shared."""
    seen: list[Any] = []
    real = getattr(module, name)

    def recorded(*args, **kwargs):
        seen.append(args[position])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return seen
