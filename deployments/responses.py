"""OpenAI response shapes: completion and chat objects, stream chunks, usage, SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

FINISH_REASONS = {"stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length"}


def usage_of(finals: list[dict[str, Any]], per_prompt: int = 0) -> dict[str, Any]:
    """OpenAI usage of the choices ``finals``: each prompt counts once. ``per_prompt``: the
    choices of each prompt, in order (a completion with several prompts); 0: one prompt."""
    firsts = finals[:: per_prompt or len(finals)]
    prompt = sum(int(f["prompt_tokens"]) for f in firsts)
    completion = sum(int(f["new_tokens"]) for f in finals)
    cached = sum(int(f.get("cached_tokens", 0)) for f in firsts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(final: dict[str, Any]) -> str:
    return FINISH_REASONS.get(final.get("eos_reason"), "stop")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """OpenAI object shapes of one response (chat or text completion)."""

    chat: bool
    model: str
    id: str
    created: int
    request_id: str = ""  # the GenerationRequest's id (logs, routing audit); ``id`` wraps it
    per_prompt: int = 0  # choices per prompt when a completion has several prompts (usage)

    @classmethod
    def new(
        cls, chat: bool, model: str, request_id: str | None = None, per_prompt: int = 0
    ) -> ResponseFormat:
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = request_id or uuid.uuid4().hex
        return cls(chat, model, f"{prefix}-{request_id}", int(time.time()), request_id, per_prompt)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, index: int = 0
    ) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": None}
            choice["finish_reason"] = finish_reason
            return self._envelope("chat.completion.chunk", [choice])
        choice = {
            "index": index,
            "text": delta.get("content", ""),
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, finals: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope(kind, []), "usage": usage_of(finals, self.per_prompt)}

    def full(self, texts: list[str], finals: list[dict[str, Any]]) -> dict[str, Any]:
        choices = []
        for index, (text, final) in enumerate(zip(texts, finals, strict=True)):
            choice: dict[str, Any] = {"index": index, "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choice["finish_reason"] = finish_reason(final)
            choices.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._envelope(kind, choices), "usage": usage_of(finals, self.per_prompt)}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
