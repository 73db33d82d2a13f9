"""Constrained decoding: what a request asks for (``ConstraintSpec``, torch-free) and the
filters that enforce it on a job."""

from engine.constraints.spec import ConstraintSpec

__all__ = ["ConstraintSpec"]
