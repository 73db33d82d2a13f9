"""Live test modules marked ``shared_serve`` deploy their apps on one ``SharedServe``
(tests/serve/live.py). They run first among tests/serve's modules (in their order), so one
cluster serves them all; it is stopped as soon as the next test is not marked so (a module that
starts a cluster of its own, another directory, the end of the run), so no idle cluster takes
CPU from the tests after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve.live import stop_shared_serve


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    serve_dir = Path(__file__).parent
    at = [i for i, item in enumerate(items) if serve_dir in item.path.parents]
    if not at:
        return
    ours = sorted(
        (items[i] for i in at), key=lambda item: not item.get_closest_marker("shared_serve")
    )
    for i, item in zip(at, ours, strict=True):  # (a stable sort: modules stay whole)
        items[i] = item


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # (the item's finalizers ran: its module's app is deleted if it was the last)
    if nextitem is None or nextitem.get_closest_marker("shared_serve") is None:
        stop_shared_serve()
    return result
