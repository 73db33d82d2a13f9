"""Serve application builder: ``serve_config.yaml`` points its ``import_path`` here.

``build_app({"config": "configs/demo.yaml"})`` reads the preset (model + engine + serving
sections), validates it and binds ``LLMServer`` into ``Ingress``. The preset travels to the
replicas as a plain dict; each replica resolves the model folder itself (the demo model is
built on first use, atomically, so replicas racing to build it is safe).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml
from ray import serve
from ray.serve.config import RequestRouterConfig

from deployments.ingress import Ingress
from deployments.llm_server import LLMServer
from deployments.prefix_index import RouterSettings

logger = logging.getLogger("ray.serve")

REPO_ROOT = Path(__file__).resolve().parents[1]

APP_ARGS = frozenset({"config"})
# Known keys per preset section; later work (cache quantisation, scheduler knobs, routing)
# extends these sets rather than loosening the check.
PRESET_SECTIONS: dict[str, frozenset[str]] = {
    "model": frozenset({"demo", "path", "dtype", "device"}),
    "engine": frozenset(
        {
            "max_num_tokens",
            "page_size",
            "max_chunk_size",
            "max_batch_size",
            "cache_quant",
            "cuda_graphs",
        }
    ),
    "serving": frozenset(
        {
            "model_id",
            "torch_threads",
            "stream_interval_s",
            "router",
            "router_kwargs",
            "num_replicas",
        }
    ),
}
# serving.router: how the ingress's handle places requests on LLM replicas.
ROUTERS = {
    "prefix": "deployments.routing:PrefixAwareRouter",  # cached pages first, load second
    "pow2": None,  # Ray Serve's default power-of-two-choices (for comparison)
}
ROUTING_STATS_PERIOD_S = 1.0
REQUIRED_SECTIONS = ("model",)


def resolve_config_path(value: Any) -> Path:
    """An absolute path as is; a relative one against the repo root, then the cwd."""
    if not isinstance(value, str | Path) or not str(value):
        raise ValueError(f"app arg 'config' must be a path to a preset YAML, got {value!r}")
    path = Path(value).expanduser()
    candidates = [path] if path.is_absolute() else [REPO_ROOT / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise ValueError(f"app arg 'config': preset {str(value)!r} not found (tried {tried})")


def validate_preset(preset: Any, source: str = "preset") -> dict[str, dict[str, Any]]:
    """Check section and key names; raise ``ValueError`` naming every unknown one."""
    if not isinstance(preset, dict):
        raise ValueError(f"{source}: top level must be a mapping, got {type(preset).__name__}")
    unknown = sorted(set(preset) - set(PRESET_SECTIONS))
    if unknown:
        raise ValueError(
            f"{source}: unknown section(s) {unknown}; known: {sorted(PRESET_SECTIONS)}"
        )
    for name in REQUIRED_SECTIONS:
        if name not in preset:
            raise ValueError(f"{source}: missing required section {name!r}")
    checked: dict[str, dict[str, Any]] = {}
    for name, keys in PRESET_SECTIONS.items():
        section = preset.get(name) or {}
        if not isinstance(section, dict):
            raise ValueError(f"{source}: section {name!r} must be a mapping, got {section!r}")
        bad = sorted(set(section) - keys)
        if bad:
            raise ValueError(f"{source}: unknown key(s) {bad} in {name!r}; known: {sorted(keys)}")
        checked[name] = dict(section)
    return checked


def load_preset(config: Any) -> dict[str, dict[str, Any]]:
    """Read and validate a preset YAML (see ``configs/demo.yaml``)."""
    path = resolve_config_path(config)
    with path.open(encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    return validate_preset(raw, source=str(path))


def build_app(args: dict[str, Any]) -> serve.Application:
    """``serve_config.yaml`` builder: ``args = {"config": "configs/demo.yaml"}``."""
    if not isinstance(args, dict):
        raise ValueError(f"app args must be a mapping, got {args!r}")
    unknown = sorted(set(args) - APP_ARGS)
    if unknown:
        raise ValueError(f"unknown app arg(s) {unknown}; known: {sorted(APP_ARGS)}")
    if "config" not in args:
        raise ValueError("app args need 'config': a preset YAML such as configs/demo.yaml")
    preset = load_preset(args["config"])
    logger.info("building app from preset %s", args["config"])
    return Ingress.bind(llm_deployment(preset).bind(preset), preset)


def llm_deployment(preset: dict[str, dict[str, Any]]) -> serve.Deployment:
    """``LLMServer`` with the request router that ``serving.router`` names."""
    serving = preset.get("serving") or {}
    router = serving.get("router", "prefix")
    if router not in ROUTERS:
        raise ValueError(f"serving.router {router!r} is not one of {sorted(ROUTERS)}")
    kwargs = serving.get("router_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"serving.router_kwargs must be a mapping, got {kwargs!r}")
    # Checked here: a router that fails in initialize_state would leave Serve's handle waiting.
    RouterSettings.from_kwargs(kwargs)
    options: dict[str, Any] = {"num_replicas": int(serving.get("num_replicas", 1))}
    if ROUTERS[router] is not None:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=ROUTERS[router],
            request_router_kwargs=kwargs,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_PERIOD_S,
        )
    return LLMServer.options(**options)
