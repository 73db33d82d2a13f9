"""Public API of the engine: a paged, prefix-caching dynamic generator.

Data flow: Tokenizer -> DynamicJob -> DynamicGenerator.iterate(): scheduler (pages) ->
ragged batch -> Model.forward (ops: cuda | torch) -> on-device sampling -> job results.

The names below are imported on first use, so the torch-free parts (``engine.request``,
``engine.cache.prefix_hash``, ``engine.scheduler``) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.cpu.spin import bound_spinning

bound_spinning()  # (before anything imports torch: libgomp reads it when torch loads)

_EXPORTS = {
    "DynamicGenerator": "engine.generator",
    "DynamicGeneratorAsync": "engine.generator_async",
    "DynamicJob": "engine.job",
    "DynamicJobAsync": "engine.generator_async",
    "GenerationRequest": "engine.request",
    "MMEmbedding": "engine.embeddings",
    "MODEL_EOS": "engine.job",
    "Model": "engine.model",
    "ModelConfig": "engine.config",
    "PagedCache": "engine.cache.kv_cache",
    "SamplerSettings": "engine.request",
    "Tokenizer": "engine.tokenizer",
}

__all__ = [
    "MODEL_EOS",
    "DynamicGenerator",
    "DynamicGeneratorAsync",
    "DynamicJob",
    "DynamicJobAsync",
    "GenerationRequest",
    "MMEmbedding",
    "Model",
    "ModelConfig",
    "PagedCache",
    "SamplerSettings",
    "Tokenizer",
]
assert sorted(__all__) == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from engine.cache.kv_cache import PagedCache
    from engine.config import ModelConfig
    from engine.embeddings import MMEmbedding
    from engine.generator import DynamicGenerator
    from engine.generator_async import DynamicGeneratorAsync, DynamicJobAsync
    from engine.job import MODEL_EOS, DynamicJob
    from engine.model import Model
    from engine.request import GenerationRequest, SamplerSettings
    from engine.tokenizer import Tokenizer
