"""``/tokenize`` and ``/detokenize`` (``deployments.tokenization``): the ids are the ones a
completion or chat request sends to a replica, a prompt past the context is counted rather
than refused, and what cannot be honoured is a 400 naming the field. The demo model's
prompt builder; no Ray."""

from __future__ import annotations

import pytest

from deployments.protocol import OpenAIError
from deployments.tokenization import detokenize, tokenize

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def test_a_prompt_tokenizes_as_a_completion_does(builder, monkeypatch) -> None:
    out = tokenize(builder, {"prompt": "Once upon a time", "model": "demo"})
    (prepared,) = builder.requests({"prompt": "Once upon a time"}, chat=False)
    assert out["tokens"] == list(prepared.generation.prompt_ids)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == builder.context_length
    monkeypatch.setattr(builder, "add_bos", True)  # a tokenizer that adds a BOS token
    bos = builder.tokenizer.bos_token_id
    assert tokenize(builder, {"prompt": "x"})["tokens"][0] == bos
    plain = tokenize(builder, {"prompt": "x", "add_special_tokens": False})["tokens"]
    assert bos not in plain


def test_a_conversation_tokenizes_as_a_chat_request_does(builder) -> None:
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": "none"}
    out = tokenize(builder, {"messages": USER, "tools": [WEATHER]})
    assert out["tokens"] == list(builder.prepared(body, chat=True).generation.prompt_ids)
    bare = tokenize(builder, {"messages": USER, "add_generation_prompt": False})["tokens"]
    assert bare == builder.chat_ids({"messages": USER})[: len(bare)]
    assert len(bare) < len(builder.chat_ids({"messages": USER}))


def test_a_prompt_past_the_context_is_counted(builder) -> None:
    words = builder.context_length  # more tokens than the context, fewer characters than its cap
    out = tokenize(builder, {"prompt": "sea " * words})
    assert out["count"] > builder.context_length
    with pytest.raises(OpenAIError) as info:
        builder.requests({"prompt": "sea " * words}, chat=False)
    assert info.value.code == "context_length_exceeded"


def test_detokenize_shows_the_text_and_special_tokens(builder) -> None:
    ids = builder.chat_ids({"messages": USER})
    assert detokenize(builder, {"tokens": ids})["prompt"] == builder.tokenizer.decode(ids, True)
    assert "<|im_start|>" in detokenize(builder, {"tokens": ids})["prompt"]
    assert detokenize(builder, {"tokens": []})["prompt"] == ""


@pytest.mark.parametrize(
    ("action", "body", "param"),
    [
        (tokenize, {}, "prompt"),
        (tokenize, {"prompt": "x", "messages": USER}, "prompt"),
        (tokenize, {"prompt": 5}, "prompt"),
        (tokenize, {"prompt": "x", "tools": [WEATHER]}, "tools"),
        (tokenize, {"messages": USER, "add_special_tokens": True}, "add_special_tokens"),
        (tokenize, {"messages": USER, "chat_template_kwargs": {"nope": 1}},
         "chat_template_kwargs"),
        (tokenize, {"prompt": "x", "temperature": 0}, "temperature"),
        (tokenize, {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (detokenize, {"tokens": "abc"}, "tokens"),
        (detokenize, {"tokens": [1, -1]}, "tokens"),
        (detokenize, {"tokens": [1, True]}, "tokens"),
        (detokenize, {"tokens": [10**9]}, "tokens"),
        (detokenize, {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(builder, action, body, param) -> None:
    with pytest.raises(OpenAIError) as info:
        action(builder, body)
    assert info.value.param == param and info.value.status == 400
