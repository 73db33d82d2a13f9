"""Live local Serve apps for tests: one Ray with 2 CPUs and no dashboard and one Serve HTTP proxy
on a free loopback port (``SharedServe``), shared by consecutive test modules; each module's app
is built from a preset and deleted when the module ends."""

from __future__ import annotations

import random
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from ray import serve

from deployments.app import build_app

# Below the kernel's ephemeral range (32768-60999 by default) and above Ray's worker ports
# (10002-19999): a port handed out by binding port 0 here could be taken by one of Ray's own
# processes (they bind port 0 too) before Serve's proxy binds it ("Failed to bind").
PORTS = range(20000, 32000)


# Ports free_port has handed out in this process: a port nothing listens on yet is still taken
# once given to a process about to start. (Two of the ports one `ray start` was given, its
# dashboard's and its runtime-env agent's, were once the same, and it exited.)
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, from ``PORTS``, and not handed out before by this
    process."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(PORTS)
        if port in _HANDED_OUT:
            continue
        _HANDED_OUT.add(port)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORTS}")


class SharedServe:
    """One Ray (2 CPUs, no dashboard) and one Serve HTTP proxy for consecutive live test
    modules: each deploys its app and deletes it when done, instead of starting and stopping
    a cluster of its own (~7 s each on a 2-core box, and ~2 s more per shutdown). Every Ray
    process sees ``PAGEDSERVE_CACHE`` = ``cache_dir``, a folder of this cluster's own.
    ``tests/serve/conftest.py`` stops it after the last test that used it, before any test
    outside tests/serve and before a module that starts a cluster of its own."""

    def __init__(self) -> None:
        self.env = pytest.MonkeyPatch()
        self.cache_dir = Path(tempfile.mkdtemp(prefix="pagedserve-cache-"))
        # (in os.environ before Ray starts, so the raylet and every worker inherit them)
        self.env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        self.env.setenv("PAGEDSERVE_CACHE", str(self.cache_dir))
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            self.port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            self.stop()
            raise
        self.base_url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        try:
            serve.shutdown()
            ray.shutdown()
        finally:
            self.env.undo()
            shutil.rmtree(self.cache_dir, ignore_errors=True)


_shared: SharedServe | None = None


def shared_serve() -> SharedServe:
    """The running ``SharedServe``, started on first use."""
    global _shared
    if _shared is None:
        _shared = SharedServe()
    return _shared


def stop_shared_serve() -> None:
    """Stop the ``SharedServe`` if one runs (the next ``shared_serve`` starts another)."""
    global _shared
    if _shared is not None:
        shared, _shared = _shared, None
        shared.stop()


def start_app(request: pytest.FixtureRequest, config: str | Path, app_name: str) -> str:
    """Serve ``config`` as ``app_name`` at ``/`` on the ``SharedServe``; returns the base URL.
    The app is deleted when the fixture's scope ends."""
    shared = shared_serve()
    request.addfinalizer(lambda: serve.delete(app_name))
    serve.run(build_app({"config": str(config)}), name=app_name, route_prefix="/")
    return shared.base_url


def start_preset_app(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    preset: dict[str, Any],
    app_name: str,
) -> str:
    """``start_app`` for a preset given as a dict (written to a temporary YAML file)."""
    config = Path(tmp_path_factory.mktemp("preset")) / f"{app_name}.yaml"
    config.write_text(yaml.safe_dump(preset))
    return start_app(request, config, app_name)
