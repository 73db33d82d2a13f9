"""The ingress streams from the replicas by value (gRPC) where Serve offers it, and falls back to
object refs on a Ray without the option instead of failing to start."""

from __future__ import annotations

import inspect

from ray.serve.handle import DeploymentHandle

from deployments import ingress
from deployments.ingress import streaming_handle


class FakeHandle:
    def __init__(self, knows_by_value: bool) -> None:
        self.knows_by_value = knows_by_value

    def options(self, **kwargs):
        if "_by_reference" in kwargs and not self.knows_by_value:
            raise TypeError("options() got an unexpected keyword argument '_by_reference'")
        return kwargs


def test_by_value_with_pickle_where_serve_offers_it():
    options = streaming_handle(FakeHandle(knows_by_value=True))
    assert options == {
        "method_name": "generate",
        "stream": True,
        "_by_reference": False,
        "request_serialization": "pickle",
        "response_serialization": "pickle",
    }


def test_falls_back_to_object_refs_without_the_option(monkeypatch):
    warnings = []
    monkeypatch.setattr(ingress.logger, "warning", lambda *args: warnings.append(args))
    options = streaming_handle(FakeHandle(knows_by_value=False))
    assert options == {"method_name": "generate", "stream": True}
    assert len(warnings) == 1 and "by value unavailable" in warnings[0][0]


def test_the_installed_serve_takes_the_options():
    parameters = inspect.signature(DeploymentHandle.options).parameters
    assert {"_by_reference", "request_serialization", "response_serialization"} <= set(parameters)
