"""vLLM's ``stop_token_ids`` and tabbyAPI's ``banned_strings`` and ``token_healing`` over HTTP:
parsed into the ``GenerationRequest``, handed to the job, and refused with a 400 naming the
field where the engine cannot honour them. No Ray."""

from __future__ import annotations

from typing import Any

import pytest

from deployments.protocol import OpenAIError, parse_fields
from engine.job import MODEL_EOS, DynamicJob

VOCAB = 100


def fields(body: dict[str, Any]):
    return parse_fields({"prompt": "x", **body}, False, VOCAB)


def test_the_fields_reach_the_job() -> None:
    body = {"stop_token_ids": [7, 9], "banned_strings": ["Foo", "bar baz"], "token_healing": True}
    request = fields(body).generation([1, 2, 3], 8, [])
    assert request.stop_token_ids == (7, 9) and request.banned_strings == ("Foo", "bar baz")
    job = DynamicJob.from_request(request)
    assert {7, 9} <= set(job.stop_tokens) and job.uses_default_stops  # and the model's EOS
    assert job.banned_strings == ("Foo", "bar baz") and job.token_healing
    assert job.input_ids == [1, 2]  # the last prompt token is chosen again with the output
    one = fields({"banned_strings": "Foo", "stop_token_ids": [4], "ignore_eos": True})
    job = DynamicJob.from_request(one.generation([1, 2], 4, []))
    assert job.banned_strings == ("Foo",) and set(job.stop_tokens) == {4}
    assert not job.uses_default_stops and MODEL_EOS not in job.stop_tokens
    plain = DynamicJob.from_request(fields({}).generation([1, 2], 4, []))
    assert plain.banned_strings == () and not plain.token_healing


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "not a token id"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "not a token id"),
        ({"stop_token_ids": 5}, "stop_token_ids", "must be a list"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64"),
        ({"banned_strings": ["a"] * 65}, "banned_strings", "more than 64"),
        ({"banned_strings": [3]}, "banned_strings", "must be a string"),
        ({"banned_strings": ["x" * 257]}, "banned_strings", "longer than 256"),
        ({"token_healing": "yes"}, "token_healing", "boolean"),
        ({"token_healing": True, "guided_regex": "a+"}, "token_healing", "guided_regex"),
        ({"token_healing": True, "response_format": {"type": "json_object"}}, "token_healing",
         "response_format"),
        ({"token_healing": True, "echo": True}, "token_healing", "echo"),
        ({"token_healing": True, "cfg_scale": 2.0, "negative_prompt": "y"}, "token_healing",
         "cfg_scale"),
        ({"banned_strings": ["a"], "cfg_scale": 2.0, "negative_prompt": "y"}, "banned_strings",
         "cfg_scale"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(body, param, says) -> None:
    with pytest.raises(OpenAIError) as info:
        fields(body)
    assert info.value.param == param and says in info.value.message


def test_token_healing_with_embeddings_is_refused(builder) -> None:
    import torch

    from deployments.prompt_embeds import encode_rows

    embeds = encode_rows(torch.zeros(2, builder.config.hidden_size))
    body = {"prompt_embeds": embeds, "token_healing": True, "max_tokens": 2}
    with pytest.raises(OpenAIError) as info:
        builder.requests(body, chat=False)
    assert info.value.param == "token_healing"
