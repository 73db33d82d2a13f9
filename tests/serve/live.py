"""A live local Serve app for tests: Ray with 2 CPUs and no dashboard, Serve's HTTP proxy on a
free loopback port, the app built from a preset; all stopped when the fixture's scope ends."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest
import ray
from ray import serve

from deployments.app import build_app

# Below the kernel's ephemeral range (32768-60999 by default) and above Ray's worker ports
# (10002-19999): a port handed out by binding port 0 here could be taken by one of Ray's own
# processes (they bind port 0 too) before Serve's proxy binds it ("Failed to bind").
PORTS = range(20000, 32000)


def free_port() -> int:
    """A loopback port nothing listens on, from ``PORTS``."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {PORTS}")


def start_app(
    request: pytest.FixtureRequest,
    config: str | Path,
    app_name: str,
    cache_dir: Path | None = None,
) -> str:
    """Serve ``config`` as ``app_name`` at ``/``; returns the base URL. ``cache_dir`` becomes
    every Ray process's ``PAGEDSERVE_CACHE`` (set before Ray starts, so all inherit it)."""
    env = pytest.MonkeyPatch()
    env.setenv("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env = None
    if cache_dir is not None:
        env.setenv("PAGEDSERVE_CACHE", str(cache_dir))
        runtime_env = {"env_vars": {"PAGEDSERVE_CACHE": str(cache_dir)}}

    def shutdown() -> None:
        serve.shutdown()
        ray.shutdown()
        env.undo()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)
    request.addfinalizer(shutdown)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"config": str(config)}), name=app_name, route_prefix="/")
    return f"http://127.0.0.1:{port}"
