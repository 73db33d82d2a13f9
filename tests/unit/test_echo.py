"""Completions ``echo``: the field parsed into prompt log-probabilities on the request, the
prompt put before the text and its tokens before the log-probabilities (the first with
none), streamed and whole, for text and token-id prompts; refused where there is no prompt
text to echo. Without Ray or a model."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")  # deployments import ray.serve (nothing is started here)

from deployments.choices import ChoiceState, Echo, OutputOptions, full_body
from deployments.protocol import OpenAIError, parse_fields
from deployments.responses import ResponseFormat

VOCAB = 100


def _fields(body: dict[str, Any], chat: bool = False):
    return parse_fields({"prompt": "x", **body} if not chat else body, chat, VOCAB)


def test_echo_asks_the_replica_for_prompt_logprobs_only_with_logprobs() -> None:
    assert _fields({"echo": True, "logprobs": 2}).generation([1, 2], 3, []).prompt_logprobs == 2
    assert _fields({"echo": True}).generation([1, 2], 3, []).prompt_logprobs is None
    assert _fields({"logprobs": 2}).generation([1, 2], 3, []).prompt_logprobs is None
    assert not _fields({"echo": False}).echo


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ({"echo": "yes"}, False, "echo"),
        ({"echo": True, "prompt": None, "prompt_embeds": "AAAA"}, False, "echo"),
        ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, True, "echo"),
    ],
)
def test_echo_is_refused_where_it_cannot_be_honoured(body, chat, param) -> None:
    with pytest.raises(OpenAIError) as info:
        _fields(body, chat)
    assert info.value.param == param and info.value.status == 400


class Spelling:
    """TokenBytes' interface over a toy vocabulary: token i is spelled 'tI'."""

    def text_of(self, token: int) -> str:
        return f"t{token}"

    def bytes_of(self, token: int) -> bytes:
        return f"t{token}".encode()


def _messages() -> list[dict[str, Any]]:
    first = {"index": 0, "text": "t7", "token_ids": [7], "eos": False,
             "logprobs": [(7, -0.5, [7], [-0.5])],
             "prompt_logprobs": [(4, -2.0, [9], [-1.0]), (5, -3.0, [5], [-3.0])]}  # fmt: skip
    last = {"index": 0, "text": "", "token_ids": [], "eos": True, "eos_reason": "max_new_tokens",
            "prompt_tokens": 3, "new_tokens": 1, "cached_tokens": 0}  # fmt: skip
    return [first, last]


def _state(tokens: bool, echo: Echo | None = None) -> tuple[ChoiceState, ResponseFormat]:
    fmt = ResponseFormat.new(False, "m", "rid")
    echo = echo or Echo("t3t4t5", 3)
    options = OutputOptions(tokens=Spelling() if tokens else None, echo=echo)
    return ChoiceState(0, fmt, options), fmt


def test_the_prompt_leads_the_text_and_the_logprobs() -> None:
    state, fmt = _state(tokens=True)
    for message in _messages():
        state.add(message)
    choice = full_body(fmt, [state])["choices"][0]
    assert choice["text"] == "t3t4t5t7"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["t3", "t4", "t5", "t7"]
    assert logprobs["token_logprobs"] == [None, -2.0, -3.0, -0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"t9": -1.0, "t4": -2.0}  # the token itself added
    assert logprobs["text_offset"] == [0, 2, 4, 6]


def test_a_bos_the_server_added_takes_no_width_in_the_offsets() -> None:
    """The echoed text is the prompt as sent; a BOS token put before it is in the entries but
    not in the text, so the offsets of the tokens after it still index the text."""
    state, fmt = _state(tokens=True, echo=Echo("t4t5", 3, added_bos=True))
    for message in _messages():
        state.add(message)
    choice = full_body(fmt, [state])["choices"][0]
    assert choice["text"] == "t4t5t7"
    assert choice["logprobs"]["tokens"] == ["t3", "t4", "t5", "t7"]
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == [0, 0, 2, 4]
    assert [choice["text"][o : o + 2] for o in offsets[1:]] == ["t4", "t5", "t7"]


def test_a_stream_sends_the_prompt_first_and_once() -> None:
    state, _ = _state(tokens=False)
    chunks = [c for m in _messages() for c in state.chunks(m)]
    assert [c["choices"][0]["text"] for c in chunks] == ["t3t4t5t7", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[0]["choices"][0]["logprobs"] is None  # none were asked
    assert state.text == "t3t4t5t7"


def test_the_builder_echoes_the_prompt_as_given(builder, monkeypatch) -> None:
    body = {"prompt": "Once upon", "echo": True, "max_tokens": 2}
    (prepared,) = builder.requests(body, chat=False)
    echo = prepared.options.echo
    assert echo.text == "Once upon" and echo.first_token == prepared.generation.prompt_ids[0]
    assert not builder.add_bos and not echo.added_bos  # the demo tokenizer adds none
    monkeypatch.setattr(builder, "add_bos", True)  # as a Llama tokenizer's does
    (prepared,) = builder.requests(body, chat=False)
    echo = prepared.options.echo
    assert echo.added_bos and echo.first_token == builder.tokenizer.bos_token_id
    ids = [5, 6, 7]
    (prepared,) = builder.requests({**body, "prompt": ids}, chat=False)
    assert prepared.options.echo.text == builder.tokenizer.decode(ids)
    assert not prepared.options.echo.added_bos  # token ids are the prompt as sent
    (plain,) = builder.requests({"prompt": "x", "max_tokens": 2}, chat=False)
    assert plain.options.echo is None


def test_an_echo_keeps_the_stop_tokens_entry() -> None:
    """lm-eval slices an echo's entries by count (prompt, then the one new token): a new token
    that is the stop token keeps its entry there; elsewhere it has none (not in the text)."""
    import torch

    from deployments.llm_server import ChoiceStream

    result = {"stage": "streaming", "eos": True, "eos_reason": "stop_token", "text": "",
              "token_ids": torch.tensor([[2]]), "token_logprobs": torch.tensor([[-0.1]]),
              "top_logprob_ids": torch.tensor([[[2]]]), "top_logprobs": torch.tensor([[[-0.1]]]),
              "prompt_logprobs": [(4, -1.0, [], [])], "prompt_tokens": 2, "new_tokens": 1,
              "cached_tokens": 0, "cached_pages": 0}  # fmt: skip
    for keep, expected in ((True, [2]), (False, [])):
        stream = ChoiceStream(0, 0.0, keep_stop_entry=keep)
        stream.add([result])
        message = stream.delta.message()
        assert [e[0] for e in message.get("logprobs", [])] == expected
        assert message["prompt_logprobs"] == [(4, -1.0, [], [])]
