"""The ingress parses and tokenizes in a worker thread, never on its event loop: a big prompt
must not stall ``/health`` or the other streams of the same ingress. Checked structurally (which
thread ran the parse), not by timing."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from deployments import ingress as ingress_module
from deployments.preset import Preset


class _UnusedLLM:
    """Stands in for the replica handle; the request below is refused before it is used."""

    def options(self, **_: object) -> _UnusedLLM:
        return self

    def remote(self, *_: object) -> None:
        raise AssertionError("a refused request must not reach a replica")


def _plain_ingress() -> object:
    """The ``Ingress`` class as written, without Serve's ASGI wrapper (whose constructor is a
    coroutine that needs a running replica)."""
    wrapped = ingress_module.Ingress.func_or_class
    cls = next(c for c in wrapped.__mro__[1:] if c.__name__ == "Ingress")
    return cls(_UnusedLLM(), Preset.load("configs/demo.yaml"))


def _request(body: bytes):
    from starlette.requests import Request

    chunks = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-type", b"application/json")],
        "query_string": b"",
    }
    return Request(scope, receive)


@pytest.mark.parametrize("chat", [False, True])
def test_parsing_and_tokenizing_run_off_the_event_loop(monkeypatch, chat: bool) -> None:
    ingress = _plain_ingress()
    parse_threads: list[int] = []
    tokenize_threads: list[int] = []
    real_parse = ingress_module.parse_body
    real_request = ingress.prompts.request

    def parse(raw: bytes):
        parse_threads.append(threading.get_ident())
        return real_parse(raw)

    def build(body, is_chat):
        tokenize_threads.append(threading.get_ident())
        return real_request(body, is_chat)

    monkeypatch.setattr(ingress_module, "parse_body", parse)
    monkeypatch.setattr(ingress.prompts, "request", build)
    text = "word " * 50_000  # past the demo model's context: refused after tokenizing
    body = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    raw = json.dumps({**body, "max_tokens": 2}).encode()

    async def serve() -> tuple[int, int]:
        response = await ingress._serve(_request(raw), chat=chat)
        return threading.get_ident(), response.status_code

    loop_thread, status = asyncio.run(serve())
    assert status == 400
    assert len(parse_threads) == 1 and len(tokenize_threads) == 1
    assert parse_threads[0] != loop_thread and tokenize_threads[0] != loop_thread
