"""The one typed generation request, and the sampler settings it carries.

A request is built once where it enters (the HTTP ingress, the batch job, library code) and then
travels unchanged: the router reads its ``page_hashes``, the replica turns each of its ``n``
choices into a ``DynamicJob`` (``DynamicJob.from_request``). Adding a sampling option means a
field here, validated in ``__post_init__``, plus the code that uses it.

Nothing here imports torch, so the serving front end (ingress, router) can use it cheaply.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.cache.prefix_hash import EmbeddingSpan
from engine.constraints.spec import ConstraintSpec

MAX_CHOICES = 16  # n: choices of one prompt run together on one replica
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit for top_logprobs)


@dataclass(slots=True)
class SamplerSettings:
    """Per-job sampling parameters. The defaults are neutral: plain sampling at temperature 1.

    temperature: 0 means greedy. top_k: 0 disables. top_p, typical: 1.0 disables.
    min_p: 0 disables. Penalties: repetition_penalty 1.0, frequency/presence 0.0 disable;
    they look at the last ``penalty_range`` tokens of the context (prompt included), or the
    whole context when ``penalty_range`` is 0. token_bias: {token id: added logit}.
    cfg_scale: classifier-free guidance for a job given ``[positive, negative]`` prompts
    (None: off); the logits sampled are ``cfg * log_softmax(l_pos) + (1 - cfg) *
    log_softmax(l_neg)``, so 1 samples the positive prompt and 0 the negative.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_range: int = 0
    token_bias: dict[int, float] = field(default_factory=dict)
    cfg_scale: float | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", self)
        _check(self.top_k >= 0, "top_k", self)
        _check(0.0 < self.top_p <= 1.0, "top_p", self)
        _check(0.0 <= self.min_p < 1.0, "min_p", self)
        _check(0.0 < self.typical <= 1.0, "typical", self)
        _check(self.repetition_penalty > 0, "repetition_penalty", self)
        _check(math.isfinite(self.frequency_penalty), "frequency_penalty", self)
        _check(math.isfinite(self.presence_penalty), "presence_penalty", self)
        _check(self.penalty_range >= 0, "penalty_range", self)
        _check(self.cfg_scale is None or math.isfinite(self.cfg_scale), "cfg_scale", self)
        for token, bias in self.token_bias.items():
            # -inf bans a token; +inf would turn the whole row into NaN after softmax
            if not isinstance(token, int) or token < 0 or math.isnan(bias) or bias == math.inf:
                raise ValueError(f"token_bias entry {token!r}: {bias!r} is not a valid bias")

    @classmethod
    def greedy(cls) -> SamplerSettings:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def copy(self) -> SamplerSettings:
        """An independent copy (the bias dict included): jobs never share mutable settings."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["token_bias"] = dict(self.token_bias)
        return SamplerSettings(**values)


def _check(ok: bool, name: str, settings: SamplerSettings) -> None:
    if not ok:
        raise ValueError(f"invalid {name}={getattr(settings, name)!r}")


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt, how to sample it, when to stop, and how many choices (``n``).

    Choice ``i`` is seeded with ``seed + i`` and identified as ``request_id`` (choice 0) or
    ``f"{request_id}/{i}"``. ``stop_on_eos``: stop at the model's end-of-sequence tokens (the
    OpenAI ``ignore_eos`` is its negation); ``stop_strings`` are matched across tokens and never
    appear in the text. ``page_hashes``: the prompt's full-page hashes
    (``engine.cache.prefix_hash``), for the prefix-aware router; empty when nobody routes.
    ``cache_salt``: requests share cached pages only with requests of the same salt (tenant
    isolation of the prefix cache); ``page_hashes`` must be computed with it.
    ``constraint``: what the output must match (JSON schema, regex, ...), enforced by a filter
    built on the replica. ``logprobs``: None for none; k >= 0 reports each token's
    log-probability and the k most likely alternatives; ``prompt_logprobs`` the same for every
    prompt token after the first (the prompt is computed whole: no cached pages are taken for
    it). ``embeddings``: the per-job embedding
    containers (``engine.embeddings.MMEmbedding``) whose placeholder ids ``prompt_ids`` holds;
    ``page_hashes`` must be computed with them (``prefix_hashes(..., embeddings=...)``).
    ``negative_prompt_ids``: classifier-free guidance's negative prompt, given exactly when
    ``settings.cfg_scale`` is (each choice is a ``[positive, negative]`` job, ``engine.cfg``);
    ``embeddings`` covers its placeholders too, ``page_hashes`` only the positive prompt's.
    ``decode_special_tokens``: the text shows special tokens too (skipped by default).
    ``stop_token_ids``: more tokens that end a choice (besides the model's EOS tokens, unless
    ``stop_on_eos`` is false), kept out of the text as they are. ``banned_strings``:
    case-insensitive strings that never appear in the text (rolled back and resampled).
    ``token_healing``: the prompt's last token is re-chosen with the output (see
    ``DynamicJob``).
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    settings: SamplerSettings = field(default_factory=SamplerSettings)
    min_new_tokens: int = 0
    seed: int | None = None
    n: int = 1
    stop_strings: tuple[str, ...] = ()
    stop_on_eos: bool = True
    page_hashes: tuple[int, ...] = ()
    request_id: str = field(default_factory=new_request_id)
    cache_salt: str | None = None
    constraint: ConstraintSpec | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    embeddings: tuple[EmbeddingSpan, ...] = ()
    negative_prompt_ids: tuple[int, ...] | None = None
    decode_special_tokens: bool = False
    stop_token_ids: tuple[int, ...] = ()
    banned_strings: tuple[str, ...] = ()
    token_healing: bool = False

    def __post_init__(self) -> None:
        # Sequences are frozen into tuples so one request can be shared by its choices.
        object.__setattr__(self, "prompt_ids", _token_ids(self.prompt_ids))
        object.__setattr__(self, "stop_strings", _strings(self.stop_strings, "stop_strings"))
        object.__setattr__(self, "banned_strings", _strings(self.banned_strings, "banned_strings"))
        object.__setattr__(
            self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids", empty=True)
        )
        object.__setattr__(self, "page_hashes", tuple(self.page_hashes))
        object.__setattr__(self, "embeddings", _embeddings(self.embeddings))
        object.__setattr__(self, "negative_prompt_ids", self._negative_prompt())
        _require_int(self.max_new_tokens, "max_new_tokens", 1)
        _require_int(self.min_new_tokens, "min_new_tokens", 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}"
            )
        _require_int(self.n, "n", 1)
        if self.n > MAX_CHOICES:
            raise ValueError(f"n must be <= {MAX_CHOICES}, got {self.n}")
        if self.seed is not None:
            _require_int(self.seed, "seed", None)
        if not isinstance(self.settings, SamplerSettings):
            raise ValueError(f"settings must be a SamplerSettings, got {self.settings!r}")
        _require_bools(self, ("stop_on_eos", "decode_special_tokens", "token_healing"))
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {self.cache_salt!r}")
        if self.constraint is not None and not isinstance(self.constraint, ConstraintSpec):
            raise ValueError(f"constraint must be a ConstraintSpec, got {self.constraint!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(value, name, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {value}")

    def _negative_prompt(self) -> tuple[int, ...] | None:
        """The negative prompt as a tuple, checked to come with ``cfg_scale`` (engine.cfg)."""
        negative = self.negative_prompt_ids
        scale = getattr(self.settings, "cfg_scale", None)  # settings are checked below
        if (scale is None) != (negative is None):
            raise ValueError(
                "settings.cfg_scale and negative_prompt_ids go together, got "
                f"cfg_scale={scale!r} and {'no' if negative is None else 'a'} negative prompt"
            )
        return None if negative is None else _token_ids(negative, "negative_prompt_ids")

    @property
    def input_ids(self) -> list[int] | list[list[int]]:
        """A job's ``input_ids``: the prompt, or ``[positive, negative]`` under CFG."""
        if self.negative_prompt_ids is None:
            return list(self.prompt_ids)
        return [list(self.prompt_ids), list(self.negative_prompt_ids)]

    def choice_seed(self, choice: int) -> int | None:
        return None if self.seed is None else self.seed + choice

    def choice_id(self, choice: int) -> str:
        return self.request_id if choice == 0 else f"{self.request_id}/{choice}"


def _require_bools(request: GenerationRequest, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(request, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(request, name)!r}")


def _require_int(value: object, name: str, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _token_ids(
    ids: Sequence[int], name: str = "prompt_ids", empty: bool = False
) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    if not ids and not empty:
        raise ValueError(f"{name} is empty: a request needs at least one prompt token")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{name} holds {token!r}, not a token id")
    return tuple(ids)


def _embeddings(embeddings: Sequence[EmbeddingSpan]) -> tuple[EmbeddingSpan, ...]:
    # The containers hold tensors, so they are checked against the model at enqueue
    # (engine.embeddings.check_prompt); here only their shape as far as hashing needs it.
    if not isinstance(embeddings, Sequence):
        raise ValueError(f"embeddings must be a sequence of containers, got {embeddings!r}")
    for e in embeddings:
        if not all(hasattr(e, name) for name in ("first_id", "num_tokens", "identity")):
            raise ValueError(f"embeddings holds {type(e).__name__}, not an embedding container")
    return tuple(embeddings)


def _strings(strings: Sequence[str], name: str) -> tuple[str, ...]:
    """``strings`` (``stop_strings``, ``banned_strings``) as a tuple of non-empty strings."""
    if isinstance(strings, str) or not isinstance(strings, Sequence):
        raise ValueError(f"{name} must be a sequence of strings, got {strings!r}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(
                f"{name.removesuffix('s').replace('_', ' ')} {s!r} is not a non-empty string"
            )
    return tuple(strings)
