"""A reasoning deployment end to end, through the official ``openai`` client: the preset's own
chat template (``model.chat_template``) opens a ``<think>`` block unless the request's
``chat_template_kwargs`` turn thinking off, and ``serving.reasoning_parser: think`` returns the
thinking as ``reasoning_content``, streamed and whole alike. The demo model's text is noise that
never closes the block, so with thinking on the whole output is thinking."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from tests.serve.live import start_preset_app  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.shared_serve]

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
)
ARGS = {
    "model": "demo",
    "messages": [{"role": "user", "content": "Why is the sky blue?"}],
    "max_tokens": 8,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(TEMPLATE)
    preset = {
        "model": {"demo": {"seed": 1234}, "dtype": "float32", "device": "cpu",
                  "chat_template": str(template)},
        "engine": {"max_num_tokens": 2048, "page_size": 16, "max_chunk_size": 256},
        "serving": {"num_replicas": 1, "torch_threads": 1, "reasoning_parser": "think"},
    }  # fmt: skip
    base = start_preset_app(request, tmp_path_factory, preset, "reasoning")
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_thinking_comes_back_as_reasoning_content(client) -> None:
    out = client.chat.completions.create(**ARGS)
    message = out.choices[0].message
    assert message.reasoning_content and message.content == ""
    assert out.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(**ARGS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == message.reasoning_content
    assert not "".join(d.content or "" for d in deltas)

    hidden = client.chat.completions.create(**ARGS, extra_body={"include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content == ""


def test_chat_template_kwargs_turn_thinking_off(client) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = client.chat.completions.create(**ARGS, extra_body=off)
    message = out.choices[0].message
    assert message.content and message.reasoning_content is None
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ARGS, extra_body={"chat_template_kwargs": {"x": 1}})
    assert "does not use 'x'" in info.value.body["message"]
