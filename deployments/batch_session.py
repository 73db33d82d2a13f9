"""The batch job's Ray and Serve side: connect to a cluster, find or deploy the app, and stream
requests to ``LLMServer`` through a deployment handle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedserve.batch")

DEFAULT_CONFIG = "configs/demo.yaml"
LLM_DEPLOYMENT = "LLMServer"

# One engine request dict in, its stream of LLMServer messages out (a handle, or a fake).
Generate = Callable[[dict[str, Any]], AsyncIterator[dict[str, Any]]]


class InfraError(Exception):
    """The cluster or the app is not usable: the job stops with EXIT_INFRA."""


# -- Ray and Serve ---------------------------------------------------------------------------


def connect_ray(address: str | None) -> None:
    """The running cluster, else a local one.

    ``ray.init()`` without an address does exactly that: RAY_ADDRESS (set inside a Ray job),
    else the cluster of the last ``ray start`` on this machine, else a new local cluster.
    ``address="auto"`` would also attach to *any* GCS process it finds (someone else's
    ``ray.init()`` cluster on a shared machine) and raises instead of starting one.
    """
    import ray

    ray.init(address=address)
    context = ray.get_runtime_context()
    logger.info("connected to Ray at %s (job %s)", context.gcs_address, context.get_job_id())


def serve_details() -> dict[str, Any] | None:
    """The controller's view of all apps, or None when Serve is not running.

    Private API (``ray.serve.context``): public ``serve.status()`` cannot tell "no controller"
    from "no apps" and hides the app args we compare presets with.
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else client.get_serve_details()


def app_state(details: dict[str, Any] | None, app_name: str) -> tuple[str | None, Any]:
    """(status, the ``config`` arg it was deployed with, if deployed from a config file)."""
    app = ((details or {}).get("applications") or {}).get(app_name)
    if app is None:
        return None, None
    args = (app.get("deployed_app_config") or {}).get("args") or {}
    status = app.get("status")
    return str(getattr(status, "value", status)), args.get("config")  # an ApplicationStatus


def wait_for_app(app_name: str, timeout_s: float) -> tuple[str | None, Any]:
    """Poll while someone else's deploy is in progress."""
    deadline = time.monotonic() + timeout_s
    status, config = app_state(serve_details(), app_name)
    while status in ("NOT_STARTED", "DEPLOYING") and time.monotonic() < deadline:
        time.sleep(2.0)
        status, config = app_state(serve_details(), app_name)
    return status, config


@dataclass(slots=True)
class AppSession:
    """What this job started, so it removes exactly that at the end."""

    app_name: str
    config: str
    started_app: bool = False
    started_serve: bool = False

    def close(self) -> None:
        from ray import serve

        if self.started_app:
            logger.info("removing app %r (started by this job)", self.app_name)
            serve.delete(self.app_name)
        if self.started_serve and not app_state_names():
            serve.shutdown()


def app_state_names() -> list[str]:
    details = serve_details()
    return list(((details or {}).get("applications") or {}).keys())


def open_app(app_name: str, config: str | None, timeout_s: float) -> AppSession:
    """Use the running app, or deploy it (handle only: no HTTP route, no proxy of our own)."""
    from ray import serve

    from deployments.app import build_app

    details = serve_details()
    status, app_config = (None, None) if details is None else wait_for_app(app_name, timeout_s)
    if status == "RUNNING":
        chosen = config or app_config or DEFAULT_CONFIG
        if config and app_config:
            warn_if_presets_differ(app_config, config)
        logger.info("using the running app %r (tokenizer preset %s)", app_name, chosen)
        return AppSession(app_name, chosen)
    if status is not None:
        raise InfraError(f"app {app_name!r} is {status}; fix or delete it first")
    session = AppSession(app_name, config or DEFAULT_CONFIG, started_serve=details is None)
    if session.started_serve:  # the proxy would take port 8000, which this job never uses
        serve.start(proxy_location="Disabled")
    logger.info("app %r is not running; deploying it from %s", app_name, session.config)
    try:
        serve.run(build_app({"config": session.config}), name=app_name, route_prefix=None)
    except Exception:
        session.started_app = True  # a half-deployed app is still ours to remove
        session.close()
        raise
    session.started_app = True
    return session


def warn_if_presets_differ(app_config: str, config: str) -> None:
    """Token ids and page hashes must match the replicas' model: compare model + engine."""
    from deployments.app import load_preset

    try:
        app_preset = load_preset(app_config)
    except ValueError:
        logger.warning("cannot read the app's preset %s to compare with %s", app_config, config)
        return
    ours = load_preset(config)
    if any(app_preset.get(s) != ours.get(s) for s in ("model", "engine")):
        logger.warning("the app runs preset %s; tokenizing with %s differs", app_config, config)


def handle_generate(app_name: str) -> Generate:
    from ray import serve

    handle = serve.get_deployment_handle(LLM_DEPLOYMENT, app_name=app_name)
    streaming = handle.options(method_name="generate", stream=True)

    async def generate(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        stream = streaming.remote(request)
        try:
            async for message in stream:
                yield message
        except (Exception, asyncio.CancelledError):  # stop the replica's job too
            stream.cancel()
            raise

    return generate
