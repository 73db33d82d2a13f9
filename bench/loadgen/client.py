"""Streaming clients: one request with per-chunk timing, and N clients sharing a request list.

Timing is taken on the client's event loop when each server-sent event's line arrives
(``time.perf_counter``): time to first token is the first chunk with non-empty content (a chat's
opening role chunk has none), inter-token latency the gap between consecutive content chunks.
A server that coalesces tokens into one chunk shows that as fewer, longer gaps.

Every failure becomes an ``error_kind``: ``http_<status>``, ``sse_error`` (an ``{"error": ...}``
event in the stream), ``timeout``, ``connection_refused``, ``connection_reset`` (the connection
dropped mid-response), ``truncated`` (the stream ended without ``data: [DONE]``), ``no_usage``
(no usage chunk although ``stream_options.include_usage`` asked for one) or ``protocol`` (an
event that is not JSON). A planned hang-up is ``outcome="disconnected"``, not an error.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .workload import LoadRequest

LOOPBACK_NAMES = frozenset({"localhost"})
ERROR_DETAIL_CHARS = 300


def check_loopback_url(url: str) -> str:
    """The URL without a trailing slash, if its host is loopback (127.0.0.0/8, ::1, localhost);
    ``ValueError`` otherwise. Names other than ``localhost`` are refused, not resolved."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http(s)://..., got {url!r}")
    host = parts.hostname
    if host is None:
        raise ValueError(f"--url has no host: {url!r}")
    if host.lower() not in LOOPBACK_NAMES:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(
                f"--url host {host!r} is not loopback; this load generator only sends traffic "
                "to 127.0.0.0/8, ::1 or localhost"
            )
    return url.rstrip("/")


@dataclass
class RequestResult:
    """What one request saw. Times in seconds: ``start_s``/``end_s`` since the run started,
    ``chunk_s`` (content chunk arrivals) and ``ttft_s`` since this request was sent."""

    index: int
    kind: str
    shared: bool
    start_s: float
    end_s: float = 0.0
    outcome: str = "ok"  # "ok" | "disconnected" | "error"
    error_kind: str | None = None
    error_detail: str | None = None
    chunk_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""  # the content of choice 0 (to compare two servers' outputs)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    def fail(self, kind: str, detail: Any) -> None:
        self.outcome, self.error_kind = "error", kind
        self.error_detail = str(detail)[:ERROR_DETAIL_CHARS]


class StreamProtocolError(Exception):
    """An event the client cannot read."""


@dataclass
class _Stream:
    """Flags of one stream read."""

    done: bool = False
    hung_up: bool = False
    error: Any = None
    usage: dict[str, Any] | None = None


def _has_content(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _content(event: dict[str, Any]) -> str:
    for choice in event.get("choices") or ():
        if choice.get("index", 0) == 0:
            return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return ""


def _event(line: bytes) -> dict[str, Any] | str | None:
    """The payload of one SSE ``data:`` line; None for other lines (blank, comments)."""
    text = line.decode("utf-8", errors="replace").rstrip("\r\n")
    if not text.startswith("data:"):
        return None
    data = text[5:].strip()
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamProtocolError(f"event is not JSON: {data[:80]!r} ({e})") from None
    if not isinstance(event, dict):
        raise StreamProtocolError(f"event is not an object: {data[:80]!r}")
    return event


async def _read_stream(
    response: aiohttp.ClientResponse, request: LoadRequest, result: RequestResult, sent: float
) -> _Stream:
    stream = _Stream()
    async for line in response.content:
        event = _event(line)
        if event is None:
            continue
        if event == "[DONE]":
            stream.done = True
            break
        if "error" in event:  # the server sends [DONE] after it; keep reading
            stream.error = event["error"]
        if event.get("usage"):
            stream.usage = event["usage"]
        if _has_content(event):
            result.chunk_s.append(time.perf_counter() - sent)
            result.text += _content(event)
            if request.disconnect_after is not None and (
                len(result.chunk_s) >= request.disconnect_after
            ):
                stream.hung_up = True
                response.close()  # drop the connection: the server should cancel the job
                break
    return stream


def _record(result: RequestResult, stream: _Stream) -> None:
    if stream.usage:
        result.prompt_tokens = stream.usage.get("prompt_tokens")
        result.completion_tokens = stream.usage.get("completion_tokens")
        details = stream.usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")
    if stream.error is not None:
        result.fail("sse_error", stream.error)
    elif stream.hung_up:
        result.outcome = "disconnected"
    elif not stream.done:
        result.fail("truncated", "the stream ended without data: [DONE]")
    elif stream.usage is None:
        result.fail("no_usage", "no usage chunk although include_usage was asked for")


async def _send(
    session: aiohttp.ClientSession, url: str, request: LoadRequest, result: RequestResult
) -> None:
    sent = time.perf_counter()
    async with session.post(url, json=request.body) as response:
        if response.status != 200:
            body = await response.content.read(ERROR_DETAIL_CHARS * 4)
            result.fail(f"http_{response.status}", body.decode("utf-8", errors="replace"))
            return
        _record(result, await _read_stream(response, request, result, sent))


async def run_request(
    session: aiohttp.ClientSession,
    base_url: str,
    request: LoadRequest,
    timeout_s: float,
    run_start: float,
) -> RequestResult:
    """Send one streaming request and time it; never raises for a failed request."""
    result = RequestResult(
        request.index, request.kind, request.shared, time.perf_counter() - run_start
    )
    try:
        async with asyncio.timeout(timeout_s):
            await _send(session, base_url + request.path, request, result)
    except TimeoutError:  # also aiohttp's ServerTimeoutError
        result.fail("timeout", f"no complete response within {timeout_s} s")
    except aiohttp.ClientConnectorError as e:
        result.fail("connection_refused", e)
    except (aiohttp.ClientError, ConnectionError) as e:  # dropped, payload cut, reset by peer
        result.fail("connection_reset", f"{type(e).__name__}: {e}")
    except StreamProtocolError as e:
        result.fail("protocol", e)
    result.end_s = time.perf_counter() - run_start
    return result


@dataclass
class LoadRun:
    """All requests that ran, by index, and the wall time from the first send to the last end."""

    results: list[RequestResult]
    seconds: float


async def run_load(
    base_url: str,
    requests: Sequence[LoadRequest],
    clients: int,
    duration_s: float,
    request_timeout_s: float,
) -> LoadRun:
    """``clients`` concurrent clients take requests in order until the list is used up or
    ``duration_s`` has passed (no new request starts after it). Each request is bounded by
    ``request_timeout_s``, so the run ends within ``duration_s + request_timeout_s``."""
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    pending = iter(requests)  # shared: each client takes the next one (one event loop)
    results: list[RequestResult] = []
    start = time.perf_counter()
    deadline = start + duration_s
    connector = aiohttp.TCPConnector(limit=clients)
    no_limit = aiohttp.ClientTimeout(total=None)  # run_request's timeout bounds each request
    async with aiohttp.ClientSession(connector=connector, timeout=no_limit) as session:

        async def client() -> None:
            for request in pending:
                if time.perf_counter() >= deadline:
                    return
                results.append(
                    await run_request(session, base_url, request, request_timeout_s, start)
                )

        await asyncio.gather(*(client() for _ in range(clients)))
    seconds = time.perf_counter() - start
    return LoadRun(sorted(results, key=lambda r: r.index), seconds)
