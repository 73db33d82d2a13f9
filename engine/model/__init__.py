"""Model loading and the Llama-family forward."""

from engine.model.model import Model

__all__ = ["Model"]
