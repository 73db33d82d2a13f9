"""``input_embeds`` content parts: precomputed embedding rows inside chat messages.

A user, system or developer message's ``content`` may mix text parts with parts such as

    {"type": "input_embeds", "input_embeds": "<base64 of a safetensors file>"}

(the same tensor file as ``prompt_embeds``: one ``[num_tokens, hidden_size]`` float tensor).
Each part becomes one ``MMEmbedding``; its text alias takes the part's place in the message,
and ``Tokenizer.encode_chat(..., embeddings=...)`` turns the alias into the container's
placeholder ids exactly where the chat template renders that message, so the rows sit between
the surrounding text's tokens. Page hashes cover the rows' content (``prefix_hashes`` with the
containers), as for ``prompt_embeds``.

A client must not be able to write an alias itself (it would place rows where the template
did not put the part), so message text containing ``ALIAS_PREFIX`` is refused. Limits per
request (``messages`` and ``negative_messages`` together): ``MAX_EMBED_PARTS`` parts and
``MAX_EMBED_ROWS`` rows in all; the context length bounds the prompt as usual.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from deployments.messages import parse_messages
from deployments.prompt_embeds import embedding_from_body
from deployments.protocol import OpenAIError
from engine.embeddings import MMEmbedding

PART_TYPE = "input_embeds"
PART_KEYS = frozenset({"type", PART_TYPE})
EMBED_ROLES = frozenset({"user", "system", "developer"})
ALIAS_PREFIX = "<$EMB_"  # every engine.embeddings alias starts so
MAX_EMBED_PARTS = 8
MAX_EMBED_ROWS = 8192


@dataclass
class ChatEmbeds:
    """Decodes the ``input_embeds`` parts of one request's conversations into containers in
    the replicas' run dtype (the limits count over all conversations of the request)."""

    hidden_size: int
    dtype: torch.dtype
    embeddings: list[MMEmbedding] = field(default_factory=list)

    def messages(
        self, value: Any, param: str = "messages"
    ) -> tuple[list[dict[str, Any]], tuple[MMEmbedding, ...]]:
        """The conversation in ``value`` (the body's ``param``) with string contents, each
        embed part replaced by its container's alias, and the containers it holds."""
        first = len(self.embeddings)
        inserted: list[int] = []  # per message: how many aliases it got
        if isinstance(value, list):
            value = [self._message(m, i, param, inserted) for i, m in enumerate(value)]
        messages = parse_messages(value, param)
        for i, message in enumerate(messages):
            content = message["content"] or ""
            # each inserted alias holds the prefix once; any other occurrence is the client's
            if content.count(ALIAS_PREFIX) != inserted[i]:
                raise OpenAIError(
                    f"{param}[{i}].content contains {ALIAS_PREFIX!r}, which is reserved for "
                    "embedding placeholders",
                    param=param,
                )
        return messages, tuple(self.embeddings[first:])

    def _message(self, message: Any, index: int, param: str, inserted: list[int]) -> Any:
        inserted.append(0)
        if not isinstance(message, dict) or not isinstance(message.get("content"), list):
            return message  # parse_messages judges it
        parts = message["content"]
        if not any(isinstance(p, dict) and p.get("type") == PART_TYPE for p in parts):
            return message
        if message.get("role") not in EMBED_ROLES:
            raise OpenAIError(
                f"{param}[{index}]: '{PART_TYPE}' parts are accepted in user, system and "
                f"developer messages only, not in {message.get('role')!r} ones",
                param=param,
            )
        content = []
        for j, part in enumerate(parts):
            if isinstance(part, dict) and part.get("type") == PART_TYPE:
                where = f"{param}[{index}].content[{j}]"
                part = {"type": "text", "text": self._decode(part, where, param).text_alias}
                inserted[-1] += 1
            content.append(part)
        return {**message, "content": content}

    def _decode(self, part: dict[str, Any], where: str, param: str) -> MMEmbedding:
        extra = sorted(k for k in part if k not in PART_KEYS)
        if extra:
            raise OpenAIError(f"{where}.{extra[0]} is not supported by this server", param=param)
        if len(self.embeddings) == MAX_EMBED_PARTS:
            message = f"a request may carry at most {MAX_EMBED_PARTS} '{PART_TYPE}' parts"
            raise OpenAIError(message, param=param)
        what = f"{where}.{PART_TYPE}"
        embedding = embedding_from_body(
            part.get(PART_TYPE), self.hidden_size, self.dtype, param, what
        )
        rows = embedding.num_tokens + sum(e.num_tokens for e in self.embeddings)
        if rows > MAX_EMBED_ROWS:
            message = f"'{PART_TYPE}' parts hold {rows} rows in all, more than {MAX_EMBED_ROWS}"
            raise OpenAIError(message, param=param)
        self.embeddings.append(embedding)
        return embedding


def check_tools_text(tools: Any) -> None:
    """Tool definitions are rendered into the prompt too: no alias-like text there either."""
    if ALIAS_PREFIX in json.dumps(tools, ensure_ascii=False):
        message = f"'tools' contains {ALIAS_PREFIX!r}, which is reserved for embedding placeholders"
        raise OpenAIError(message, param="tools")
