"""The seeded request mix of a load run.

Two kinds of request:

- ``chat``: a shared-prefix chat. A few long system prompts are shared by many requests; the user
  turn varies. This is what the prefix cache and the prefix-aware router are for.
- ``completion``: a unique prompt (no prefix in common with any other request).

``shared_fraction`` of the requests are chats, the rest completions; ``disconnect_fraction`` of
them (either kind) are closed by the client after a few content chunks, to exercise cancellation.
Both fractions are exact over the whole list (rounded), spread over it by a seeded shuffle, so a
run cut short by its time limit still sees about the same mix. The same spec and count give the
same requests, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/v1/completions"

# Plain English words: any tokenizer (the demo model's BPE included) splits them into a few tokens.
_WORD_TEXT = """
    the of and to in is was for on with as by at from that this it be are or an which have
    has had not but all were when there can more one their also its about into other time than
    two first been would some after new most them these only many over such where made between
    may years both through during under people world city river house water light music garden
    market history language science morning evening winter summer mountain island village road
    bridge station library school harbour forest field window table letter story question answer
    travel weather season ocean valley castle engine paper stone glass silver copper cotton wheat
    bread cheese apple orange coffee tea sugar salt pepper bird horse fish tree flower leaf root
    quiet bright gentle early late simple careful curious ancient modern northern southern small
    large narrow wide slow quick warm cold soft heavy open busy calm
"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send. Word counts are ranges ``(low, high)``, inclusive."""

    seed: int = 0
    shared_fraction: float = 0.5
    disconnect_fraction: float = 0.0
    max_tokens: int = 64
    systems: int = 4  # distinct shared system prompts
    system_words: int = 300
    user_words: tuple[int, int] = (8, 40)
    prompt_words: tuple[int, int] = (40, 160)
    disconnect_chunks: tuple[int, int] = (1, 3)  # content chunks read before closing
    temperature: float = 0.8
    ignore_eos: bool = True  # every request generates max_tokens (stable token counts)
    model: str | None = None  # the "model" field; None leaves it out

    def __post_init__(self) -> None:
        for name in ("shared_fraction", "disconnect_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"WorkloadSpec.{name} must be in [0, 1], got {value}")
        if self.max_tokens < 1:
            raise ValueError(f"WorkloadSpec.max_tokens must be >= 1, got {self.max_tokens}")
        if self.systems < 1 or self.system_words < 1:
            raise ValueError(
                f"WorkloadSpec needs systems >= 1 and system_words >= 1, got "
                f"{self.systems} and {self.system_words}"
            )
        for name in ("user_words", "prompt_words", "disconnect_chunks"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"WorkloadSpec.{name} must be 1 <= low <= high, got {low, high}")


@dataclass(frozen=True)
class LoadRequest:
    """One request of the run: where to send it and what, and when the client hangs up."""

    index: int
    kind: str  # "chat" | "completion"
    path: str
    body: dict[str, Any] = field(repr=False)
    system_id: int | None = None  # which shared system prompt (chats)
    disconnect_after: int | None = None  # close after this many content chunks; None: read all

    @property
    def shared(self) -> bool:
        return self.system_id is not None


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _sentence_text(rng: random.Random, count: int) -> str:
    text = _words(rng, count)
    return text[:1].upper() + text[1:] + "."


def system_prompts(spec: WorkloadSpec) -> list[str]:
    """The shared system prompts (their own seed stream: the same for any request count)."""
    rng = random.Random(f"systems-{spec.seed}")
    return [
        f"You are assistant number {i}. " + _sentence_text(rng, spec.system_words)
        for i in range(spec.systems)
    ]


def _sampling(spec: WorkloadSpec, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "seed": rng.randrange(2**31),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.model is not None:
        body["model"] = spec.model
    return body


def _chat(spec: WorkloadSpec, rng: random.Random, system_id: int, system: str) -> dict[str, Any]:
    user = _sentence_text(rng, rng.randint(*spec.user_words))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"messages": messages, **_sampling(spec, rng)}


def _completion(spec: WorkloadSpec, rng: random.Random, index: int) -> dict[str, Any]:
    # The index up front makes every prompt unique from its first page on.
    prompt = f"Request {index}: " + _sentence_text(rng, rng.randint(*spec.prompt_words))
    return {"prompt": prompt, **_sampling(spec, rng)}


def _marked(rng: random.Random, count: int, fraction: float) -> set[int]:
    return set(rng.sample(range(count), round(count * fraction)))


def make_workload(spec: WorkloadSpec, count: int) -> list[LoadRequest]:
    """``count`` requests in the order the clients take them."""
    if count < 0:
        raise ValueError(f"request count must be >= 0, got {count}")
    rng = random.Random(spec.seed)
    shared = _marked(rng, count, spec.shared_fraction)
    disconnect = _marked(rng, count, spec.disconnect_fraction)
    systems = system_prompts(spec)
    requests = []
    for index in range(count):
        hang_up = rng.randint(*spec.disconnect_chunks) if index in disconnect else None
        if index in shared:
            system_id = rng.randrange(len(systems))
            body = _chat(spec, rng, system_id, systems[system_id])
            request = LoadRequest(index, "chat", CHAT_PATH, body, system_id, hang_up)
        else:
            body = _completion(spec, rng, index)
            request = LoadRequest(index, "completion", COMPLETION_PATH, body, None, hang_up)
        requests.append(request)
    return requests
