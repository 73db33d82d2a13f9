"""``prompt_embeds`` on completions: parsed into one embedding container in the replicas' dtype,
its placeholder ids as the prompt, page hashes over the rows' content; everything malformed is a
400 naming the field."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import torch
from safetensors.torch import save

from deployments.prompt_embeds import encode_rows
from deployments.protocol import OpenAIError
from engine.cache.prefix_hash import prefix_hashes


def _rows(builder, n: int = 20, seed: int = 0, dtype=torch.float16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, builder.config.hidden_size, generator=generator).to(dtype)


def _body(value: Any, **extra: Any) -> dict[str, Any]:
    return {"prompt_embeds": value, "max_tokens": 4, **extra}


def test_rows_become_one_container_in_the_run_dtype(builder) -> None:
    rows = _rows(builder)
    _, request = builder.request(_body(encode_rows(rows)), chat=False)
    (embedding,) = request.embeddings
    assert embedding.embeddings.dtype == builder.run_dtype == torch.float32  # the demo preset
    assert torch.equal(embedding.embeddings, rows.to(torch.float32))
    assert request.prompt_ids == tuple(embedding.placeholder_ids)  # no BOS: the rows alone
    expected = prefix_hashes(request.prompt_ids, builder.page_size, embeddings=[embedding])
    assert list(request.page_hashes) == expected and len(expected) == 20 // builder.page_size


def test_same_rows_share_page_hashes_and_other_rows_do_not(builder) -> None:
    first = builder.request(_body(encode_rows(_rows(builder))), chat=False)[1]
    again = builder.request(_body(encode_rows(_rows(builder))), chat=False)[1]
    other = builder.request(_body(encode_rows(_rows(builder, seed=1))), chat=False)[1]
    assert first.prompt_ids != again.prompt_ids  # two containers, two id ranges ...
    assert first.page_hashes == again.page_hashes  # ... one content: the same pages
    assert not set(first.page_hashes) & set(other.page_hashes)


def _two_tensors(builder) -> str:
    rows = _rows(builder)
    return base64.b64encode(save({"a": rows, "b": rows.clone()})).decode()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda b: "not base64!", "not valid base64"),
        (lambda b: base64.b64encode(b"junk" * 10).decode(), "not a safetensors file"),
        (lambda b: 17, "must be a base64 string"),
        (_two_tensors, "exactly one tensor"),
        (lambda b: encode_rows(torch.zeros(3, 7)), "the model's hidden size"),
        (lambda b: encode_rows(torch.zeros(3, b.config.hidden_size, dtype=torch.int32)), "float"),
        (lambda b: encode_rows(torch.full((2, b.config.hidden_size), float("nan"))), "non-finite"),
    ],
)
def test_malformed_rows_are_a_400_naming_the_field(builder, value, message: str) -> None:
    with pytest.raises(OpenAIError, match=message) as caught:
        builder.request(_body(value(builder)), chat=False)
    assert caught.value.status == 400 and caught.value.param == "prompt_embeds"


def test_prompt_and_embeds_together_too_long_or_on_chat_are_refused(builder) -> None:
    value = encode_rows(_rows(builder))
    with pytest.raises(OpenAIError, match="either 'prompt' or 'prompt_embeds'"):
        builder.request(_body(value, prompt="hi"), chat=False)
    long = encode_rows(_rows(builder, n=builder.context_length))
    with pytest.raises(OpenAIError, match="context") as caught:
        builder.request(_body(long), chat=False)
    assert caught.value.param == "prompt_embeds"
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_embeds": value}
    with pytest.raises(OpenAIError) as caught:
        builder.request(chat, chat=True)
    assert caught.value.param == "prompt_embeds"
