"""DynamicJob: one generation request, its decoding state, held text and results.

The generator hands each sampled token to ``receive_token``; the job decides what text is
final and whether it has finished. Text is held back while it could still be the start of a
stop string or an incomplete UTF-8 character, and is never lost: every finish flushes it
(except the part a stop string consumes).
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.cache.prefix_hash import salt_root
from engine.request import GenerationRequest
from engine.sampling import SampleRequest, SamplerSettings
from engine.scheduler import SeqState
from engine.stop_strings import StopStringMatcher

PREFIX_CONTEXT_TOKENS = 8  # prompt tokens given to the detokenizer as context (leading spaces)


class StopCondition(enum.Enum):
    """Markers that may stand in a ``stop_conditions`` list beside token ids and strings."""

    MODEL_EOS = "model_eos"  # the model's end-of-sequence tokens (what ``None`` means)


# ``stop_conditions=[MODEL_EOS, "\n\n"]``: the model's EOS tokens plus a stop string.
MODEL_EOS = StopCondition.MODEL_EOS


class DynamicJob:
    """A generation request. Create it, then ``generator.enqueue(job)``."""

    def __init__(
        self,
        input_ids: torch.Tensor | Seq[int],
        max_new_tokens: int,
        min_new_tokens: int = 0,
        stop_conditions: Seq[int | str | StopCondition] | None = None,
        gen_settings: SamplerSettings | None = None,
        seed: int | None = None,
        identifier: Any = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_probs: bool = False,
        return_logits: bool = False,
        max_skips: int | None = None,
        cache_salt: str | None = None,
    ):
        self.input_ids = _as_id_list(input_ids)
        _check_counts(max_new_tokens, min_new_tokens, return_top_tokens)
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.stop_tokens, self.stop_strings, self.uses_default_stops = _split_stop_conditions(
            stop_conditions
        )
        # Copied so a settings object shared between jobs can never carry state across them.
        self.gen_settings = _copy_settings(gen_settings)
        self.rng = random.Random(seed)
        self.seed = seed
        self.identifier = identifier
        self.decode_special_tokens = decode_special_tokens
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        self.return_logits = return_logits
        self.max_skips = max_skips
        self.serial: int | None = None
        # max_skips: how often admission may pass this job over for later ones before it
        # waits for it (None: the generator's default); the scheduler reads it from seq.
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        self.cache_salt = cache_salt  # only jobs with the same salt share cached pages
        self.seq = SeqState(
            tokens=list(self.input_ids),
            owner=self,
            max_skips=max_skips,
            hash_root=salt_root(cache_salt),
        )
        self.new_token_ids: list[int] = []
        self.accepted_draft_tokens = 0  # speculative decoding: drafts verified and kept
        self.rejected_draft_tokens = 0
        self.full_completion = ""
        self.finished = False
        self._held_text = ""
        self._detok = None
        self._matcher: StopStringMatcher | None = None
        self._times: dict[str, float] = {}

    @classmethod
    def from_request(
        cls, request: GenerationRequest, choice: int = 0, **options: Any
    ) -> DynamicJob:
        """Choice ``choice`` of ``request``: its own seed (``seed + choice``) and identifier.
        ``options``: the job's other keyword arguments (``return_probs``, ...)."""
        if not 0 <= choice < request.n:
            raise ValueError(f"choice {choice} is outside the request's n={request.n}")
        if request.constraint is not None or request.logprobs is not None:
            raise ValueError("constraint and logprobs are not supported by this engine yet")
        eos = [MODEL_EOS] if request.stop_on_eos else []
        return cls(
            list(request.prompt_ids),
            request.max_new_tokens,
            min_new_tokens=request.min_new_tokens,
            stop_conditions=[*eos, *request.stop_strings],
            gen_settings=request.settings,
            seed=request.choice_seed(choice),
            identifier=request.choice_id(choice),
            cache_salt=request.cache_salt,
            **options,
        )

    # -- lifecycle (called by the generator) --------------------------------------------------

    def bind(self, serial: int, tokenizer, default_stop_tokens: Seq[int]) -> None:
        """Attach to a generator at enqueue: serial, detokenizer, default stop tokens."""
        if self.serial is not None:
            raise ValueError(f"job {self.identifier!r} is already enqueued (serial {self.serial})")
        self.serial = serial
        if self.uses_default_stops:
            self.stop_tokens = self.stop_tokens | frozenset(default_stop_tokens)
        self._detok = tokenizer.detokenizer(
            self.input_ids[-PREFIX_CONTEXT_TOKENS:], self.decode_special_tokens
        )
        self._tokenizer = tokenizer
        self._matcher = StopStringMatcher(self.stop_strings)
        self._times["enqueued"] = time.perf_counter()

    def mark_started(self) -> None:
        self._times.setdefault("started", time.perf_counter())

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    def sample_request(self, ahead: Seq[int] = ()) -> SampleRequest:
        """The request for the next token; ``ahead``: draft tokens assumed to come first (the
        request then is for the position after them: its penalties and bans see them)."""
        new_tokens = len(self.new_token_ids) + len(ahead)
        banned = self.stop_tokens if new_tokens < self.min_new_tokens else ()
        context = self.seq.tokens + list(ahead) if ahead else self.seq.tokens
        return SampleRequest(
            settings=self.gen_settings,
            rng=self.rng,
            context=context if self.gen_settings.has_penalties else (),
            banned_tokens=tuple(banned),
            top_k_return=self.return_top_tokens,
            return_probs=self.return_probs,
        )

    # -- results -------------------------------------------------------------------------------

    def base_result(self, stage: str, eos: bool = False) -> dict[str, Any]:
        return {
            "job": self,
            "stage": stage,
            "eos": eos,
            "serial": self.serial,
            "identifier": self.identifier,
        }

    def started_result(self) -> dict[str, Any]:
        return self.base_result("started")

    def prefill_result(self) -> dict[str, Any]:
        result = self.base_result("prefill")
        result["curr_progress"] = min(self.seq.num_computed, self.prompt_tokens)
        result["max_progress"] = self.prompt_tokens
        return result

    def receive_token(
        self,
        token: int,
        prob: float | None = None,
        top_tokens: list[int] | None = None,
        top_probs: list[float] | None = None,
        logits: torch.Tensor | None = None,
        token_tensor: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Take one sampled token; return its streaming result (final when ``eos``).

        ``token_tensor``: the token as a (1, 1) long tensor if the caller has one (the
        generator makes a whole step's in one call: a tensor per token costs ~10 us)."""
        now = time.perf_counter()
        self._times.setdefault("first_token", now)
        self._times["last_token"] = now
        self.new_token_ids.append(token)
        self.seq.tokens.append(token)
        result = self.base_result("streaming")
        if token_tensor is None:
            token_tensor = torch.tensor([[token]], dtype=torch.long)
        _attach_token_data(result, token_tensor, prob, top_tokens, top_probs, logits)
        if token in self.stop_tokens and len(self.new_token_ids) > self.min_new_tokens:
            text = self._held_text + self._detok.flush()
            self._held_text = ""
            return self._finish(result, text, "stop_token", stop_token=token)
        self._held_text += self._detok.add(token)
        return self._emit_or_finish(result)

    def receive_tokens(self, tokens: Seq[int]) -> dict[str, Any]:
        """Take several tokens of one step (speculative decoding: accepted drafts plus the
        token sampled after them) one by one, exactly as ``receive_token`` would, stopping at
        the first that ends the job (tokens after it are dropped). One result for the step:
        its text and ``token_ids`` [1, n] cover the tokens taken."""
        texts, taken, result = [], [], None
        for token in tokens:
            result = self.receive_token(token)
            texts.append(result.get("text", ""))
            taken.append(token)
            if result["eos"]:
                break
        if result is None:
            raise ValueError("receive_tokens needs at least one token")
        result["text"] = "".join(texts)
        result["token_ids"] = torch.tensor([taken], dtype=torch.long)
        return result

    def _emit_or_finish(self, result: dict[str, Any]) -> dict[str, Any]:
        held = self._held_text
        stop_checks = len(self.new_token_ids) >= self.min_new_tokens
        match = self._matcher.find(held) if stop_checks else None
        if match is not None:
            index, stop = match
            self._held_text = held[index:]
            return self._finish(result, held[:index], "stop_string", stop_string=stop)
        if len(self.new_token_ids) >= self.max_new_tokens:
            self._held_text = ""
            return self._finish(result, held + self._detok.flush(), "max_new_tokens")
        keep = self._matcher.partial_suffix_start(held) if stop_checks else len(held)
        self._held_text = held[keep:]
        self._add_text(result, held[:keep])
        return result

    def error_result(self, error: BaseException) -> dict[str, Any]:
        """The final result of a job that failed inside a step (its own data, sampling,
        detokenizing...): ``eos_reason`` "error" and the exception under ``error``. Text still
        held back is dropped: after a failure it cannot be trusted."""
        result = self.base_result("streaming")
        self._held_text = ""
        self._add_text(result, "")
        self.finished = True
        result.update(eos=True, eos_reason="error", error=error)
        result.update(self._final_stats())
        return result

    def cancel_result(self) -> dict[str, Any]:
        result = self.base_result("streaming")
        text = self._held_text + (self._detok.flush() if self._detok else "")
        self._held_text = ""
        return self._finish(result, text, "cancelled")

    def _add_text(self, result: dict[str, Any], text: str) -> None:
        result["text"] = text
        self.full_completion += text

    def _finish(self, result: dict[str, Any], text: str, reason: str, **trigger) -> dict:
        self._add_text(result, text)
        self.finished = True
        result["eos"] = True
        result["eos_reason"] = reason
        if "stop_token" in trigger:
            token = trigger["stop_token"]
            result["eos_triggering_token_id"] = token
            result["eos_triggering_token_str"] = self._tokenizer.decode([token], True)
        if "stop_string" in trigger:
            result["eos_triggering_string"] = trigger["stop_string"]
        result.update(self._final_stats())
        return result

    def _final_stats(self) -> dict[str, Any]:
        t = self._times
        now = time.perf_counter()
        enqueued = t.get("enqueued", now)
        started = t.get("started", now)
        first = t.get("first_token", now)
        return {
            "full_completion": self.full_completion,
            "new_tokens": len(self.new_token_ids),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.seq.cached_tokens,
            "cached_pages": self.seq.cached_pages,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "rejected_draft_tokens": self.rejected_draft_tokens,
            "time_enqueued": started - enqueued,
            "time_prefill": first - started,
            "time_generate": t.get("last_token", first) - first,
        }


def _attach_token_data(result, token_tensor, prob, top_tokens, top_probs, logits) -> None:
    result["token_ids"] = token_tensor
    if prob is not None:
        result["token_probs"] = torch.tensor([[prob]], dtype=torch.float32)
    if top_tokens is not None:
        result["top_k_tokens"] = torch.tensor([[top_tokens]], dtype=torch.long)
        result["top_k_probs"] = torch.tensor([[top_probs]], dtype=torch.float32)
    if logits is not None:
        result["logits"] = logits.reshape(1, 1, -1)


def _as_id_list(input_ids: torch.Tensor | Seq[int]) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
            raise ValueError(
                f"input_ids must have shape (1, n) or (n,), got {tuple(input_ids.shape)}"
            )
        ids = input_ids.reshape(-1).tolist()
    else:
        ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids is empty: a job needs at least one prompt token")
    return ids


def _check_counts(max_new_tokens: int, min_new_tokens: int, return_top_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(
            f"min_new_tokens must be in [0, max_new_tokens={max_new_tokens}], "
            f"got {min_new_tokens!r}"
        )
    if return_top_tokens < 0:
        raise ValueError(f"return_top_tokens must be >= 0, got {return_top_tokens}")


def _split_stop_conditions(
    conditions: Seq[int | str | StopCondition] | None,
) -> tuple[frozenset[int], tuple[str, ...], bool]:
    """(stop token ids, stop strings, whether the model's EOS tokens stop too)."""
    if conditions is None:
        return frozenset(), (), True
    if isinstance(conditions, (str, int)):
        raise ValueError(f"stop_conditions must be a list, got {conditions!r}")
    tokens: set[int] = set()
    strings: list[str] = []
    model_eos = False
    for c in conditions:
        if c is MODEL_EOS:
            model_eos = True
        elif isinstance(c, bool) or not isinstance(c, (int, str)):
            raise ValueError(f"stop condition {c!r} is neither a token id (int) nor a string")
        elif isinstance(c, int):
            tokens.add(c)
        elif c == "":
            raise ValueError("an empty stop string would stop before the first token")
        else:
            strings.append(c)
    return frozenset(tokens), tuple(strings), model_eos


def _copy_settings(settings: SamplerSettings | None) -> SamplerSettings:
    if settings is None:
        return SamplerSettings()
    if not isinstance(settings, SamplerSettings):
        raise ValueError(f"gen_settings must be a SamplerSettings, got {type(settings).__name__}")
    return SamplerSettings(
        **{
            name: getattr(settings, name)
            for name in SamplerSettings.__dataclass_fields__
            if name != "token_bias"
        },
        token_bias=dict(settings.token_bias),
    )
