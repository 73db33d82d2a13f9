"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes): the token ids a prompt or a
conversation becomes on this deployment, exactly as a completion or chat request would send
them to a replica, and the text of token ids. Clients count tokens against the context
(``max_model_len``) before they send, or check what a chat template renders.

``/tokenize``: ``{"prompt": str, "add_special_tokens": true}`` (false: no BOS token), or
``{"messages": [...], "add_generation_prompt": true, "tools": [...], "chat_template_kwargs":
{...}}``; answers ``{"count", "max_model_len", "tokens"}``. A prompt longer than the context is
counted, not refused. ``/detokenize``: ``{"tokens": [ids]}`` answers ``{"prompt": text}``, special
tokens shown. Both take ``model``; any other field is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deployments.protocol import OpenAIError, _bool_field, _short, _template_kwargs, text_value
from deployments.structured import parse_tools

if TYPE_CHECKING:
    from deployments.ingress import PromptBuilder

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
     "chat_template_kwargs"}
)  # fmt: skip
CHAT_ONLY = ("add_generation_prompt", "tools", "chat_template_kwargs")
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _known_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(k for k, v in body.items() if k not in known and v is not None)
    if unknown:
        raise OpenAIError(f"unknown field '{unknown[0][:64]}'", param=unknown[0][:64])


def tokenize(builder: PromptBuilder, body: dict[str, Any]) -> dict[str, Any]:
    _known_fields(body, TOKENIZE_FIELDS)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise OpenAIError("give either 'prompt' or 'messages'", param="prompt")
    if prompt is not None:
        ids = _prompt_ids(builder, body, prompt)
    else:
        ids = _chat_ids(builder, body, messages)
    return {"count": len(ids), "max_model_len": builder.context_length, "tokens": ids}


def _prompt_ids(builder: PromptBuilder, body: dict[str, Any], prompt: Any) -> list[int]:
    extra = [name for name in CHAT_ONLY if body.get(name) is not None]
    if extra:
        raise OpenAIError(f"'{extra[0]}' goes with 'messages', not 'prompt'", param=extra[0])
    text_value(prompt, "prompt", "'prompt'")
    builder.check_text_length(len(prompt), "prompt")
    add_bos = builder.add_bos and _bool_field(body, "add_special_tokens", default=True)
    return builder.tokenizer.encode(prompt, add_bos=add_bos)[0].tolist()


def _chat_ids(builder: PromptBuilder, body: dict[str, Any], messages: Any) -> list[int]:
    if _bool_field(body, "add_special_tokens"):  # the chat template places them itself
        message = "'add_special_tokens' goes with 'prompt': a chat template places its own"
        raise OpenAIError(message, param="add_special_tokens")
    # the tools as a request would list them (whatever its tool_choice: the prompt is the same)
    choice = {"tools": body.get("tools"), "tool_choice": "none"}
    tools = parse_tools(choice, True, builder.call_syntax)
    ids, _ = builder.chat_prompt(
        messages,
        tools,
        template_kwargs=_template_kwargs(body),
        add_generation_prompt=_bool_field(body, "add_generation_prompt", default=True),
        checked=False,
    )
    return ids


def detokenize(builder: PromptBuilder, body: dict[str, Any]) -> dict[str, Any]:
    _known_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    vocab = builder.config.vocab_size
    if not isinstance(tokens, list) or len(tokens) > builder.context_length:
        message = f"'tokens' must be a list of at most {builder.context_length} token ids"
        raise OpenAIError(message, param="tokens")
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise OpenAIError(f"'tokens' has {_short(token)}, not a token id", param="tokens")
    return {"prompt": builder.tokenizer.decode(tokens, True)}
