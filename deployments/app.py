"""Serve application builder: ``serve_config.yaml`` points its ``import_path`` here.

``build_app({"config": "configs/demo.yaml"})`` reads and validates the preset
(``deployments.preset``), then binds ``LLMServer`` (with the request router that
``serving.router`` names) into ``Ingress``. The typed preset travels to the ingress and the
replicas; each replica resolves the model itself (the demo model is built on first use,
atomically, so replicas racing to build it is safe).
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.preset import ROUTERS, Preset

logger = logging.getLogger("ray.serve")

APP_ARGS = frozenset({"config"})
ROUTING_STATS_PERIOD_S = 1.0


def build_app(args: dict[str, Any]) -> serve.Application:
    """``serve_config.yaml`` builder: ``args = {"config": "configs/demo.yaml"}``."""
    if not isinstance(args, dict):
        raise ValueError(f"app args must be a mapping, got {args!r}")
    unknown = sorted(set(args) - APP_ARGS)
    if unknown:
        raise ValueError(f"unknown app arg(s) {unknown}; known: {sorted(APP_ARGS)}")
    if "config" not in args:
        raise ValueError("app args need 'config': a preset YAML such as configs/demo.yaml")
    preset = Preset.load(args["config"])
    logger.info("building app from preset %s", preset.source)
    return Ingress.bind(llm_deployment(preset).bind(preset), preset)


def llm_deployment(preset: Preset) -> serve.Deployment:
    """``LLMServer`` with the replica count (or autoscaling) and request router the preset
    names. A deployment entry in serve_config.yaml overrides these options."""
    serving = preset.serving
    options: dict[str, Any] = {"num_replicas": serving.num_replicas}
    if serving.autoscaling is not None:
        options = {
            "autoscaling_config": serving.autoscaling.serve_config(preset.batch_size_estimate)
        }
    options["max_ongoing_requests"] = serving.max_ongoing_requests
    options["max_queued_requests"] = serving.max_queued_requests or -1  # (-1: Serve's no bound)
    if ROUTERS[serving.router] is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTERS[serving.router],
            request_router_kwargs=serving.router_kwargs,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S,
        )
    return LLMServer.options(**options)
