"""The streaming path between the engine and the client, without Ray: the replica's merge of its
choices' result batches (``_choice_batches``) and the ingress's SSE body (``_events``: one write
per replica message, usage and ``[DONE]`` last)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("ray")  # deployments import ray.serve (nothing is started here)

from deployments.choices import ChoiceState, OutputOptions
from deployments.ingress import _events, _indexed
from deployments.llm_server import _choice_batches
from deployments.responses import ResponseFormat


class FakeJob:
    """Yields the given batches (an exception instance is raised instead)."""

    def __init__(self, batches: list[Any]) -> None:
        self._batches = batches

    async def batches(self):
        for batch in self._batches:
            await asyncio.sleep(0)
            if isinstance(batch, BaseException):
                raise batch
            yield batch


async def _collect(jobs: list[FakeJob]) -> list[tuple[int, Any]]:
    out = []
    async for items in _choice_batches(jobs):
        out += items
        if sum(1 for _, b in out if isinstance(b, BaseException) or b[-1] == "end") == len(jobs):
            break
    return out


def test_one_choice_is_read_directly_in_order() -> None:
    got = asyncio.run(_collect([FakeJob([["a"], ["b", "end"]])]))
    assert got == [(0, ["a"]), (0, ["b", "end"])]


def test_several_choices_are_merged_with_their_index() -> None:
    got = asyncio.run(_collect([FakeJob([["a0"], ["end"]]), FakeJob([["a1", "end"]])]))
    assert sorted(got, key=lambda x: x[0])[0][0] == 0
    assert [b for i, b in got if i == 0] == [["a0"], ["end"]]
    assert [b for i, b in got if i == 1] == [["a1", "end"]]


@pytest.mark.parametrize("choices", [1, 2])
def test_a_failing_job_hands_its_error_on(choices: int) -> None:
    error = ValueError("bad")
    jobs = [FakeJob([["a"], error])] + [FakeJob([["end"]])] * (choices - 1)
    got = asyncio.run(_collect(jobs))
    assert (0, error) in got and (0, ["a"]) in got


class FakeStream:
    """A replica's message stream as the ingress's handle gives it."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = messages
        self.cancelled = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for m in self.messages:
            if isinstance(m, BaseException):
                raise m
            yield m

    def cancel(self) -> None:
        self.cancelled = True


FINAL = {"eos_reason": "max_new_tokens", "prompt_tokens": 3, "new_tokens": 2, "cached_tokens": 0}


def _events_of(messages: list[Any], chat: bool, usage: bool) -> list[str]:
    fmt = ResponseFormat.new(chat, "m", "rid")
    choices = [ChoiceState(0, fmt, OutputOptions())]

    async def go() -> list[str]:
        indexed = _indexed(FakeStream(messages), fmt.request_id)
        return [w async for w in _events(indexed, choices, fmt, usage)]

    return asyncio.run(go())


def _payloads(write: str) -> list[Any]:
    assert write.endswith("\n\n")
    out = []
    for event in write.split("\n\n")[:-1]:
        assert event.startswith("data: ")
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_one_write_per_message_and_the_tail_in_one() -> None:
    messages = [
        {"index": 0, "text": "He", "token_ids": [1], "eos": False},
        {"index": 0, "text": "llo", "token_ids": [2], "eos": True, **FINAL},
    ]
    writes = _events_of(messages, chat=False, usage=True)
    assert len(writes) == 3
    first, last, tail = (_payloads(w) for w in writes)
    assert [c["choices"][0]["text"] for c in first] == ["He"]
    # the final message: its text, then the finish reason, in one write
    assert [c["choices"][0]["text"] for c in last] == ["llo", ""]
    assert last[1]["choices"][0]["finish_reason"] == "length"
    assert tail[0]["usage"]["completion_tokens"] == 2 and tail[1] == "[DONE]"


def test_chat_role_first_and_no_usage_asked() -> None:
    messages = [{"index": 0, "text": "Hi", "token_ids": [1], "eos": True, **FINAL}]
    writes = _events_of(messages, chat=True, usage=False)
    role = _payloads(writes[0])
    assert role[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _payloads(writes[-1]) == ["[DONE]"]
    text = "".join(writes)
    assert text.count("data: ") == 4  # role, content, finish, [DONE]


def test_an_empty_message_writes_nothing() -> None:
    messages = [
        {"index": 0, "text": "", "token_ids": [], "eos": False},
        {"index": 0, "text": "x", "token_ids": [1], "eos": True, **FINAL},
    ]
    writes = _events_of(messages, chat=False, usage=False)
    assert len(writes) == 2 and _payloads(writes[-1]) == ["[DONE]"]


def test_a_failure_mid_stream_ends_with_an_error_event_and_done() -> None:
    messages = [{"index": 0, "text": "a", "token_ids": [1], "eos": False}, RuntimeError("x")]
    writes = _events_of(messages, chat=False, usage=True)
    tail = _payloads(writes[-1])
    assert "error" in tail[0] and tail[1] == "[DONE]"
    assert not any("usage" in p for w in writes for p in _payloads(w) if isinstance(p, dict))
