"""Speculative decoding: n-gram and draft-model proposals verified in the ragged batch."""

from engine.speculative.setup import build_speculator

__all__ = ["build_speculator"]
