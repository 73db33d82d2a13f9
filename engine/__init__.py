"""Public API of the engine: a paged, prefix-caching dynamic generator.

Data flow: Tokenizer -> DynamicJob -> DynamicGenerator.iterate(): scheduler (pages) ->
ragged batch -> Model.forward (ops: cuda | torch) -> on-device sampling -> job results.
"""

from engine.cache.kv_cache import PagedCache
from engine.config import ModelConfig
from engine.generator import DynamicGenerator
from engine.generator_async import DynamicGeneratorAsync, DynamicJobAsync
from engine.job import DynamicJob
from engine.model import Model
from engine.sampling import SamplerSettings
from engine.tokenizer import Tokenizer

__all__ = [
    "DynamicGenerator",
    "DynamicGeneratorAsync",
    "DynamicJob",
    "DynamicJobAsync",
    "Model",
    "ModelConfig",
    "PagedCache",
    "SamplerSettings",
    "Tokenizer",
]
