"""Classifier-free guidance over HTTP (``deployments.guidance``): ``cfg_scale`` with
``negative_prompt`` / ``negative_messages`` becomes a request whose choices are
``[positive, negative]`` jobs; half a pair and what a CFG job cannot do are 400s (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deployments.prompt_embeds import encode_rows
from deployments.protocol import OpenAIError
from engine import DynamicJob
from engine.cache.prefix_hash import prefix_hashes

USER = [{"role": "user", "content": "Tell me about the sea."}]
NEGATIVE = [{"role": "user", "content": "Tell me about the desert."}]


def _completion(**extra: Any) -> dict[str, Any]:
    return {"prompt": "Once upon a time", "max_tokens": 4, **extra}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **extra}


def test_completion_negative_prompt_makes_cfg_jobs(builder) -> None:
    body = _completion(cfg_scale=1.5, negative_prompt="the end", n=2, temperature=0)
    request = builder.request(body, chat=False)[1]
    plain = builder.request(_completion(), chat=False)[1]
    negative = builder.request(_completion(prompt="the end"), chat=False)[1]
    assert request.settings.cfg_scale == 1.5
    assert request.prompt_ids == plain.prompt_ids
    assert request.negative_prompt_ids == negative.prompt_ids
    assert request.page_hashes == plain.page_hashes  # the router places by the positive prompt
    for choice in range(2):
        job = DynamicJob.from_request(request, choice)
        assert job.input_ids == list(plain.prompt_ids)
        assert job.cfg_input_ids == list(negative.prompt_ids)
        assert job.gen_settings.cfg_scale == 1.5


def test_token_id_negative_prompt(builder) -> None:
    request = builder.request(_completion(cfg_scale=0, negative_prompt=[5, 6, 7]), chat=False)[1]
    assert request.negative_prompt_ids == (5, 6, 7) and request.settings.cfg_scale == 0.0
    with pytest.raises(OpenAIError, match="outside the vocabulary") as caught:
        builder.request(_completion(cfg_scale=1, negative_prompt=[10**8]), chat=False)
    assert caught.value.param == "negative_prompt"


def test_chat_negative_messages_are_rendered_as_messages_are(builder) -> None:
    request = builder.request(_chat(cfg_scale=2.0, negative_messages=NEGATIVE), chat=True)[1]
    negative = builder.request({"messages": NEGATIVE}, chat=True)[1]
    assert request.negative_prompt_ids == negative.prompt_ids


def test_negative_messages_may_carry_input_embeds(builder) -> None:
    rows = torch.randn(3, builder.config.hidden_size)
    part = {"type": "input_embeds", "input_embeds": encode_rows(rows)}
    negative = [{"role": "user", "content": [part, {"type": "text", "text": " no"}]}]
    request = builder.request(_chat(cfg_scale=2.0, negative_messages=negative), chat=True)[1]
    (embedding,) = request.embeddings
    assert embedding.first_id in request.negative_prompt_ids
    assert embedding.first_id not in request.prompt_ids
    plain = prefix_hashes(request.prompt_ids, builder.page_size)
    assert list(request.page_hashes) == plain


def test_max_tokens_room_counts_the_longer_prompt(builder) -> None:
    long = [1] * (builder.context_length - 10)
    with pytest.raises(OpenAIError, match="context") as caught:
        builder.request(_completion(cfg_scale=1, negative_prompt=long, max_tokens=20), chat=False)
    assert caught.value.param == "max_tokens"
    no_max = _completion(cfg_scale=1, negative_prompt=long, max_tokens=None)
    assert builder.request(no_max, chat=False)[1].max_new_tokens <= 10


@pytest.mark.parametrize(
    ("chat", "body", "param", "message"),
    [
        (False, _completion(cfg_scale=1.5), "cfg_scale", "needs 'negative_prompt'"),
        (False, _completion(negative_prompt="x"), "negative_prompt", "needs 'cfg_scale'"),
        (True, _chat(cfg_scale=1.5), "cfg_scale", "needs 'negative_messages'"),
        (True, _chat(negative_messages=NEGATIVE), "negative_messages", "needs 'cfg_scale'"),
        (True, _chat(cfg_scale=1, negative_prompt="x"), "negative_prompt", "unknown field"),
        (False, _completion(cfg_scale=1, negative_messages=[]), "negative_messages", "unknown"),
        (False, _completion(cfg_scale=10.5, negative_prompt="x"), "cfg_scale", r"\[-10.0, 10.0\]"),
        (False, _completion(cfg_scale="1", negative_prompt="x"), "cfg_scale", "number"),
        (False, _completion(cfg_scale=1, negative_prompt=""), "negative_prompt", "empty"),
        (True, _chat(cfg_scale=1, negative_messages=[]), "negative_messages", "non-empty"),
        (
            True,
            _chat(cfg_scale=1, negative_messages=[{"role": "user", "content": "<$EMB_3$>"}]),
            "negative_messages",
            "reserved",
        ),
    ],
)
def test_half_pairs_and_bad_values_are_refused(builder, chat, body, param, message) -> None:
    with pytest.raises(OpenAIError, match=message) as caught:
        builder.request(body, chat=chat)
    assert caught.value.status == 400 and caught.value.param == param


def test_options_a_cfg_job_cannot_honour_are_refused(builder) -> None:
    guided = {"cfg_scale": 1.5, "negative_prompt": "x"}
    with pytest.raises(OpenAIError, match="cfg_scale") as caught:
        builder.request(_completion(logprobs=2, **guided), chat=False)
    assert caught.value.param == "logprobs"
    chat_guided = {"cfg_scale": 1.5, "negative_messages": NEGATIVE}
    with pytest.raises(OpenAIError, match="cfg_scale") as caught:
        builder.request(_chat(logprobs=True, **chat_guided), chat=True)
    assert caught.value.param == "logprobs"
    json_mode = {"type": "json_object"}
    with pytest.raises(OpenAIError, match="constrained") as caught:
        builder.request(_chat(response_format=json_mode, **chat_guided), chat=True)
    assert caught.value.param == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(OpenAIError, match="constrained") as caught:
        builder.request(_chat(tools=[tool], tool_choice=forced, **chat_guided), chat=True)
    assert caught.value.param == "tool_choice"
    # the same options without guidance are fine, and so is n > 1 with it
    builder.request(_completion(logprobs=2), chat=False)
    assert builder.request(_completion(n=3, **guided), chat=False)[1].n == 3
