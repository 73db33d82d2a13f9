"""A completion with several prompts (OpenAI's batched ``prompt``), without Ray: the prompts
become one request each, errors name the prompt, usage counts every prompt once, and the
ingress merges the replicas' streams (``_merged``), cancelling all of them when one fails or
the client goes away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")  # deployments import ray.serve (nothing is started here)

from deployments.ingress import _call_apart, _indexed, _merged, several_prompts
from deployments.protocol import MAX_PROMPTS, OpenAIError
from deployments.responses import usage_of


@pytest.mark.parametrize(
    ("prompt", "several"),
    [
        ("one", None),
        ([1, 2, 3], None),  # token ids of one prompt
        (["one"], None),  # one prompt in a list: completion_ids unwraps it
        ([[1, 2]], None),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", [4]], ["a", [4]]),
    ],
)
def test_several_prompts_are_told_from_one(prompt: Any, several: Any) -> None:
    assert several_prompts({"prompt": prompt}) == several


def test_too_many_prompts_are_refused() -> None:
    with pytest.raises(OpenAIError, match=f"more than {MAX_PROMPTS} prompts") as info:
        several_prompts({"prompt": ["x"] * (MAX_PROMPTS + 1)})
    assert info.value.param == "prompt" and info.value.status == 400


def test_each_prompt_is_its_own_request(builder) -> None:
    body = {"prompt": ["Once upon", [5, 6, 7]], "max_tokens": 3, "n": 2, "seed": 4}
    a, b = (each.generation for each in builder.requests(body, chat=False))
    assert a.prompt_ids == tuple(builder.tokenizer.encode("Once upon")[0].tolist())
    assert b.prompt_ids == (5, 6, 7)
    assert a.n == b.n == 2 and a.max_new_tokens == b.max_new_tokens == 3
    assert a.request_id != b.request_id  # each routed and audited on its own
    assert len(builder.requests({"prompt": ["one"], "max_tokens": 2}, chat=False)) == 1
    # the chat route has no prompts to split
    assert len(builder.requests({"messages": [{"role": "user", "content": "x"}]}, True)) == 1


def test_a_bad_prompt_is_named_by_its_place(builder) -> None:
    body = {"prompt": ["fine", [1, 10**9]], "max_tokens": 2}
    with pytest.raises(OpenAIError) as info:
        builder.requests(body, chat=False)
    assert info.value.param == "prompt"
    assert info.value.message.startswith("prompt[1]: 'prompt' has token ids outside")
    with pytest.raises(OpenAIError, match=r"prompt\[0\]: 'prompt' must be a string"):
        builder.requests({"prompt": [{"x": 1}, "b"], "max_tokens": 2}, chat=False)


def _final(prompt: int, new: int, cached: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "new_tokens": new, "cached_tokens": cached}


def test_usage_counts_each_prompt_once() -> None:
    finals = [_final(5, 2, 4), _final(5, 3, 4), _final(7, 1), _final(7, 4)]
    usage = usage_of(finals, per_prompt=2)
    assert usage["prompt_tokens"] == 12 and usage["completion_tokens"] == 10
    assert usage["total_tokens"] == 22 and usage["prompt_tokens_details"]["cached_tokens"] == 4
    one = usage_of(finals[:2])
    assert one["prompt_tokens"] == 5 and one["completion_tokens"] == 5


class FakeStream:
    """A replica's stream: the messages (an exception instance is raised), then the end;
    ``cancel`` records that the ingress gave up on it."""

    def __init__(self, items: list[Any], hang: bool = False) -> None:
        self.items = items
        self.hang = hang
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.items:
            await asyncio.sleep(0)
            if isinstance(item, BaseException):
                raise item
            yield item
        if self.hang:
            await asyncio.Event().wait()


def _message(index: int, text: str) -> dict[str, Any]:
    return {"index": index, "text": text, "eos": False}


def test_merged_streams_keep_each_prompts_indexes() -> None:
    streams = [FakeStream([_message(0, "a"), _message(1, "b")]), FakeStream([_message(1, "c")])]

    async def run() -> list[tuple[int, str]]:
        merged = _merged([_indexed(s, f"r{p}", p * 2) for p, s in enumerate(streams)])
        return [(index, message["text"]) async for index, message in merged]

    assert sorted(asyncio.run(run())) == [(0, "a"), (1, "b"), (3, "c")]
    assert not any(s.cancelled for s in streams)  # both ended by themselves


def test_a_failing_stream_ends_the_merge_and_cancels_the_others() -> None:
    healthy = FakeStream([_message(0, "a")], hang=True)
    failing = FakeStream([RuntimeError("replica died")])

    async def run() -> None:
        merged = _merged([_indexed(healthy, "r0"), _indexed(failing, "r1", 1)])
        async for _ in merged:
            pass

    with pytest.raises(RuntimeError, match="replica died"):
        asyncio.run(run())
    assert healthy.cancelled and failing.cancelled


def test_closing_the_merge_early_cancels_every_stream() -> None:
    """A client that goes away closes the response's generator: every replica stops."""
    streams = [FakeStream([_message(0, "a")], hang=True) for _ in range(3)]

    async def run() -> None:
        merged = _merged([_indexed(s, f"r{p}", p) for p, s in enumerate(streams)])
        await anext(merged)
        await merged.aclose()

    asyncio.run(run())
    assert all(s.cancelled for s in streams)


def test_each_prompt_is_a_serve_call_of_its_own() -> None:
    """Serve gives every call made while serving one HTTP request that request's internal
    id; two streams under one id stall each other, so each prompt's call gets its own."""
    from ray.serve import context as serve_context

    class Handle:
        def __init__(self) -> None:
            self.ids: list[str] = []

        def remote(self, generation: Any) -> str:
            self.ids.append(serve_context._get_serve_request_context()._internal_request_id)
            return generation

    serve_context._set_request_context(request_id="http-1", _internal_request_id="parent")
    handle = Handle()
    assert [_call_apart(handle, g) for g in ("a", "b")] == ["a", "b"]
    assert len(set(handle.ids)) == 2 and "parent" not in handle.ids
    assert serve_context._get_serve_request_context()._internal_request_id == "parent"
    serve_context._unset_request_context()


def test_a_batch_line_the_busy_replicas_refuse_waits_and_tries_again(monkeypatch) -> None:
    """The batch job wants throughput: a line refused for backpressure is tried again (after
    the Retry-After Serve names, else a second) rather than recorded as an error."""
    from ray.serve.exceptions import BackPressureError

    import deployments.batch as batch
    from deployments.batch_records import Item
    from engine.request import GenerationRequest

    monkeypatch.setattr(batch, "BUSY_RETRY_S", 0.01)
    calls = []

    async def generate(_request):
        calls.append(1)
        if len(calls) < 3:
            raise BackPressureError(num_queued_requests=9, max_queued_requests=9)
        yield {"index": 0, "text": "ok", "token_ids": [5], "eos": True, "eos_reason": "stop_token",
               "prompt_tokens": 2, "new_tokens": 1, "cached_tokens": 0}  # fmt: skip

    item = Item(1, "x", {"prompt": "hi"}, chat=False)
    request = GenerationRequest(prompt_ids=(1, 2), max_new_tokens=1)
    record = asyncio.run(batch.generate_record(item, request, generate))
    assert len(calls) == 3 and "error" not in record
    assert record["text"] == "ok"
