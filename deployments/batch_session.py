"""The batch job's Ray and Serve side: connect to a cluster, find or deploy the app, and stream
requests to ``LLMServer`` through a deployment handle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from deployments.preset import Preset
from engine.request import GenerationRequest

logger = logging.getLogger("pagedserve.batch")

DEFAULT_CONFIG = "configs/smollm2.yaml"
LLM_DEPLOYMENT = "LLMServer"

# One request in, its stream of LLMServer messages out (a handle, or a fake).
Generate = Callable[[GenerationRequest], AsyncIterator[dict[str, Any]]]


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

    # torch before Ray: as the first job on a cluster whose Serve app was running (seen with
    # two nodes, Ray 2.60, torch 2.13 CPU), a driver that imported torch only after
    # ``ray.init`` died in MKL's start-up ("Intel oneMKL FATAL ERROR: Cannot load
    # libtorch_cpu.so"); importing it first never failed. The job needs torch anyway.
    import torch  # noqa: F401

    ray.init(address=address)
    context = ray.get_runtime_context()
    logger.info("connected to Ray at %s (job %s)", context.gcs_address, context.get_job_id())


def serve_running() -> bool:
    """Whether a Serve controller runs on the cluster.

    Private API, Ray 2.60 (``ray.serve.context._get_global_client``): the public
    ``serve.status()`` answers an empty status both when no controller runs and when one runs
    with no apps, and the job must tell them apart to shut down only a Serve it started.
    """
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def app_status(app_name: str) -> str | None:
    """The app's status (``RUNNING``, ``DEPLOYING``, ...), None when it is not deployed."""
    from ray import serve

    app = serve.status().applications.get(app_name)
    return None if app is None else str(getattr(app.status, "value", app.status))


def wait_for_app(app_name: str, timeout_s: float) -> str | None:
    """Poll while someone else's deploy is in progress."""
    deadline = time.monotonic() + timeout_s
    status = app_status(app_name)
    while status in ("NOT_STARTED", "DEPLOYING") and time.monotonic() < deadline:
        time.sleep(2.0)
        status = app_status(app_name)
    return status


def running_preset(app_name: str) -> Preset:
    """The preset the running app's replicas serve, asked of a replica."""
    from ray import serve

    handle = serve.get_deployment_handle(LLM_DEPLOYMENT, app_name=app_name)
    return handle.options(method_name="get_preset").remote().result()


@dataclass(slots=True)
class AppSession:
    """The preset to tokenize with, and what this job started, to remove exactly that."""

    app_name: str
    preset: Preset
    started_app: bool = False
    started_serve: bool = False

    def close(self) -> None:
        from ray import serve

        if self.started_app:
            logger.info("removing app %r (started by this job)", self.app_name)
            serve.delete(self.app_name)
        if self.started_serve and not serve.status().applications:
            serve.shutdown()


def open_app(app_name: str, config: str | None, timeout_s: float) -> AppSession:
    """Use the running app, or deploy it (handle only: no HTTP route, no proxy of our own)."""
    from ray import serve

    from deployments.app import build_app

    running = serve_running()
    status = wait_for_app(app_name, timeout_s) if running else None
    if status == "RUNNING":
        preset = running_preset(app_name)
        if config is not None:
            preset = checked_against(preset, Preset.load(config))
        logger.info("using the running app %r (preset %s)", app_name, preset.source)
        return AppSession(app_name, preset)
    if status is not None:
        raise InfraError(f"app {app_name!r} is {status}; fix or delete it first")
    config = config or DEFAULT_CONFIG
    session = AppSession(app_name, Preset.load(config), started_serve=not running)
    if session.started_serve:  # the proxy would take port 8000, which this job never uses
        serve.start(proxy_location="Disabled")
    logger.info("app %r is not running; deploying it from %s", app_name, config)
    try:
        serve.run(build_app({"config": config}), name=app_name, route_prefix=None)
    except Exception:
        session.started_app = True  # a half-deployed app is still ours to remove
        session.close()
        raise
    session.started_app = True
    return session


def checked_against(app_preset: Preset, ours: Preset) -> Preset:
    """``--config`` for a running app: token ids and page hashes must match the replicas'
    model, so a preset whose model or engine differs is refused."""
    if (app_preset.model, app_preset.engine) != (ours.model, ours.engine):
        raise InfraError(
            f"the app runs preset {app_preset.source}, whose model or engine section differs "
            f"from --config {ours.source}; drop --config to use the app's"
        )
    return ours


def handle_generate(app_name: str) -> Generate:
    from ray import serve

    handle = serve.get_deployment_handle(LLM_DEPLOYMENT, app_name=app_name)
    streaming = handle.options(method_name="generate", stream=True)

    async def generate(request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
        stream = streaming.remote(request)
        try:
            async for message in stream:
                yield message
        except (Exception, asyncio.CancelledError):  # stop the replica's job too
            stream.cancel()
            raise

    return generate
