"""Shared unit-test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def builder(tmp_path_factory: pytest.TempPathFactory):
    """The ingress's ``PromptBuilder`` for the demo preset (its model built in a tmp cache)."""
    from deployments.ingress import PromptBuilder
    from deployments.preset import Preset

    with pytest.MonkeyPatch.context() as env:
        env.setenv("PAGEDSERVE_CACHE", str(tmp_path_factory.mktemp("pagedserve-cache")))
        yield PromptBuilder(Preset.load("configs/demo.yaml"))
