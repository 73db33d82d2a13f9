"""Live test modules marked ``shared_serve`` deploy their apps on one ``SharedServe``
(tests/serve/live.py); it is stopped as soon as the next test is not marked so (another
directory, a module that starts a cluster of its own, the end of the run), so no idle cluster
takes CPU from the tests after it."""

from __future__ import annotations

import pytest

from tests.serve.live import stop_shared_serve


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # (the item's finalizers ran: its module's app is deleted if it was the last)
    if nextitem is None or nextitem.get_closest_marker("shared_serve") is None:
        stop_shared_serve()
    return result
