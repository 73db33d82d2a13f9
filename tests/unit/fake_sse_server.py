"""A tiny OpenAI-style SSE server for the load generator's tests (aiohttp, in process).

The prompt (a completion's, or a chat's last turn) names the stream to play: ``mode:ok`` (the
default), ``mode:error`` (an error event), ``mode:http503``, ``mode:reset`` (the connection drops
mid-body), ``mode:truncated`` (no ``[DONE]``), ``mode:nousage``, ``mode:badjson``, ``mode:slow``
(3 s before anything) or ``mode:hangup`` (10 chunks, for a client that hangs up early).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

FIRST_TOKEN_S = 0.1  # before the first content chunk
GAP_S = 0.05  # between content chunks


class FakeServer:
    """Canned OpenAI streams; the prompt (or the user turn) names what to do."""

    def __init__(self) -> None:
        self.hung_up = 0  # streams whose client went away mid-write
        self.stats = {"pages_in_use": 0, "jobs_running": 0, "jobs_waiting": 0}
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self.complete)
        self.app.router.add_post("/v1/chat/completions", self.complete)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/v1/stats", self.replica_stats)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def replica_stats(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "stats", "replicas": [self.stats]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = "messages" in body
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        mode = text.removeprefix("mode:") if text.startswith("mode:") else "ok"
        if mode == "http503":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if mode == "slow":
            await asyncio.sleep(3)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await self._stream(request, response, mode, chat, body.get("max_tokens", 3))
        except ConnectionResetError:  # a write after the client went away
            self.hung_up += 1
        except asyncio.CancelledError:  # or aiohttp cancels the handler when it goes
            self.hung_up += 1
            raise
        return response

    async def _stream(self, request, response, mode: str, chat: bool, tokens: int) -> None:
        def chunk(content: str) -> dict[str, Any]:
            if chat:
                return {"choices": [{"index": 0, "delta": {"content": content}}]}
            return {"choices": [{"index": 0, "text": content}]}

        async def send(data: Any) -> None:
            await response.write(
                f"data: {json.dumps(data) if isinstance(data, dict) else data}\n\n".encode()
            )

        if chat:
            await send(chunk(""))  # the role chunk: no content, not the first token
        await asyncio.sleep(FIRST_TOKEN_S)
        count = 10 if mode == "hangup" else tokens
        for i in range(count):
            if i:
                await asyncio.sleep(GAP_S)
            await send(chunk(f"t{i} "))
            if mode == "error":
                await send({"error": {"message": "boom", "type": "server_error"}})
                break
            if mode == "reset":
                request.transport.close()  # the connection drops mid-body
                return
            if mode == "badjson":
                await send("{not json")
                break
        if mode == "truncated":
            return
        if mode != "nousage":
            usage = {"prompt_tokens": 7, "completion_tokens": count, "total_tokens": 7 + count}
            await send({"choices": [], "usage": usage})
        await send("[DONE]")
