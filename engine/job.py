"""DynamicJob: one generation request, its decoding state, held text and results.

The generator hands each sampled token to ``receive_token``; the job decides what text is
final and whether it has finished. Text is held back while it could still be the start of a
stop string or an incomplete UTF-8 character, and is never lost: every finish flushes it
(except the part a stop string consumes).
"""

from __future__ import annotations

import enum
import math
import random
import time
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine.cache.prefix_hash import salt_root
from engine.cfg import attach_negative, split_prompt_rows
from engine.constraints.banned import BannedStrings
from engine.constraints.errors import FilterError
from engine.embeddings import MMEmbedding
from engine.inflight import PENDING_TOKEN
from engine.request import GenerationRequest
from engine.sampling import SampleRequest, SamplerSettings, token_logprobs
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
        return_logprobs: int | None = None,
        max_skips: int | None = None,
        cache_salt: str | None = None,
        filters: Seq[Any] | None = None,
        filter_prefer_eos: bool = False,
        banned_strings: Seq[str] | None = None,
        token_healing: bool = False,
        embeddings: Seq[MMEmbedding] | None = None,
        return_prompt_logprobs: int | None = None,
    ):
        """``filters``: ``engine.constraints`` filters the output must match (all of them);
        ``filter_prefer_eos``: sample EOS whenever the filters allow it. ``banned_strings``:
        case-insensitive strings that never appear in the output (rolled back and resampled).
        ``token_healing``: drop the last prompt token and let the first sampled token be any
        token whose text starts with its text (not with filters). ``embeddings``: the
        ``MMEmbedding`` containers whose placeholder ids ``input_ids`` holds.
        ``input_ids=[positive, negative]`` with ``gen_settings.cfg_scale``: a CFG job
        (``engine.cfg``). ``return_prompt_logprobs`` (k >= 0): the model's log-probability of
        every prompt token after the first, and its k most likely alternatives, as
        ``prompt_logprobs`` entries of the prefill results (the job computes its whole prompt:
        it takes no pages from the prefix cache)."""
        self.input_ids, self.cfg_input_ids = split_prompt_rows(input_ids, gen_settings, _as_id_list)
        self.filters, self.filter_prefer_eos, self.banned_strings = _check_constraints(
            filters, filter_prefer_eos, banned_strings, token_healing
        )
        if self.cfg_input_ids is not None:
            _check_cfg_options(
                self.filters, self.banned_strings, token_healing, return_logprobs,
                return_prompt_logprobs,
            )  # fmt: skip
        self.token_healing = token_healing
        self._heal_token: int | None = None
        if token_healing and len(self.input_ids) > 1:
            self._heal_token = self.input_ids.pop()
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
        # k: the model's log-probability of each token and its k most likely alternatives
        # (raw logits, no temperature; see engine.sampling); None: not computed
        self.return_logprobs = _check_logprobs(return_logprobs)
        self.max_skips = max_skips
        self.serial: int | None = None
        # max_skips: how often admission may pass this job over for later ones before it
        # waits for it (None: the generator's default); the scheduler reads it from seq.
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        self.cache_salt = cache_salt  # only jobs with the same salt share cached pages
        # containers whose placeholder ids input_ids holds (checked against the model at
        # enqueue: engine.embeddings.check_prompt)
        self.embeddings: tuple[MMEmbedding, ...] = tuple(embeddings or ())
        self.seq = SeqState(
            tokens=list(self.input_ids),
            owner=self,
            max_skips=max_skips,
            hash_root=salt_root(cache_salt),
            embeddings=self.embeddings,
        )
        if self.cfg_input_ids is not None:
            attach_negative(self.seq, self.cfg_input_ids)
        self._init_prompt_logprobs(return_prompt_logprobs)
        self.new_token_ids: list[int] = []
        self.accepted_draft_tokens = 0  # speculative decoding: drafts verified and kept
        self.rejected_draft_tokens = 0
        self._completion: list[str] = []  # (chunks: see full_completion)
        self.finished = False
        self._held_text = ""
        self._detok = None
        self._matcher: StopStringMatcher | None = None
        self._times: dict[str, float] = {}
        self.constraint = None  # JobConstraint (the filters' matchers), built at bind
        self._banned = BannedStrings(self.banned_strings) if self.banned_strings else None
        self._bans: dict[int, set[int]] = {}  # position -> tokens banned there (rollbacks)
        # the last request with nothing banned: every step's request is this one until a ban
        # or a rollback (``sample_request``), so it is built once, not once per step
        self._steady_request: SampleRequest | None = None
        # banned-string jobs hold token data with their text: [data, end of its text in held]
        self._held_tokens: list[list[Any]] = []
        self.rewind_to: int | None = None  # set by a rollback; the generator truncates seq
        self._heal_ids: frozenset[int] | None = None
        self._heal_text = ""

    @classmethod
    def from_request(
        cls, request: GenerationRequest, choice: int = 0, **options: Any
    ) -> DynamicJob:
        """Choice ``choice`` of ``request``: its own seed (``seed + choice``) and identifier.
        ``options``: the job's other keyword arguments (``return_probs``, ...)."""
        if not 0 <= choice < request.n:
            raise ValueError(f"choice {choice} is outside the request's n={request.n}")
        if request.constraint is not None:
            from engine.constraints.filters import Filter

            options.setdefault("filters", [Filter.from_spec(request.constraint)])
        eos = [MODEL_EOS] if request.stop_on_eos else []
        return cls(
            request.input_ids,
            request.max_new_tokens,
            min_new_tokens=request.min_new_tokens,
            stop_conditions=[*eos, *request.stop_token_ids, *request.stop_strings],
            gen_settings=request.settings,
            seed=request.choice_seed(choice),
            identifier=request.choice_id(choice),
            cache_salt=request.cache_salt,
            return_logprobs=request.logprobs,
            return_prompt_logprobs=request.prompt_logprobs,
            embeddings=request.embeddings,
            decode_special_tokens=request.decode_special_tokens,
            banned_strings=request.banned_strings or None,
            token_healing=request.token_healing,
            **options,
        )

    # -- lifecycle (called by the generator) --------------------------------------------------

    @property
    def needs_masks(self) -> bool:
        """Whether sampling this job needs allowed-token masks (filters or token healing)."""
        return bool(self.filters) or self._heal_token is not None

    def bind(self, serial: int, tokenizer, default_stop_tokens: Seq[int], masks=None) -> None:
        """Attach to a generator at enqueue: serial, detokenizer, default stop tokens and, for
        ``needs_masks`` jobs, the generator's ``MaskEngine`` (the filters compile here)."""
        if self.serial is not None:
            raise ValueError(f"job {self.identifier!r} is already enqueued (serial {self.serial})")
        if self.needs_masks:
            if masks is None:
                raise ValueError("filters and token healing need the generator's MaskEngine")
            if self.filters:
                self.constraint = masks.constraint(self.filters, self.filter_prefer_eos)
            if self._heal_token is not None:
                self._heal_ids = masks.healing_ids(self._heal_token)
                heal = tokenizer.detokenizer(self.input_ids[-PREFIX_CONTEXT_TOKENS:])
                self._heal_piece = self._heal_text = heal.add(self._heal_token) + heal.flush()
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

    def mask_source(self):
        """What restricts this job's next token: its healing set, its JobConstraint, or None."""
        if self._heal_ids is not None and not self.new_token_ids:
            return self._heal_ids
        if self.constraint is not None:
            # EOS is not preferred before min_new_tokens (it is banned then)
            reached = len(self.new_token_ids) >= self.min_new_tokens
            self.constraint.prefer_eos = self.filter_prefer_eos and reached
        return self.constraint

    def sample_request(self, ahead: Seq[int] = ()) -> SampleRequest:
        """The request for the next token; ``ahead``: draft tokens assumed to come first (the
        request then is for the position after them: its penalties and bans see them)."""
        new_tokens = len(self.new_token_ids) + len(ahead)
        steady = not ahead and not self._bans and new_tokens >= self.min_new_tokens
        cached = self._steady_request
        if steady and cached is not None and self._still(cached):
            return cached
        banned = self.stop_tokens if new_tokens < self.min_new_tokens else ()
        context = self.seq.tokens + list(ahead) if ahead else self.seq.tokens
        if self._bans:
            banned = (*banned, *self._bans.get(new_tokens, ()))
        request = SampleRequest(
            settings=self.gen_settings,
            rng=self.rng,
            context=context if self.gen_settings.has_penalties else (),
            banned_tokens=tuple(banned),
            top_k_return=self.return_top_tokens,
            return_probs=self.return_probs,
            logprobs=self.return_logprobs,
            key=None if ahead else self.serial,  # drafts ahead: a context of this call only
        )
        if steady:
            self._steady_request = request
        return request

    def _still(self, request: SampleRequest) -> bool:
        """Whether ``request`` is still what ``sample_request`` would build (nothing banned, no
        drafts): the job's fields it was built from are the same objects and values. A
        penalised request's context is the sequence's own list, grown in place."""
        settings = self.gen_settings
        return (
            request.settings is settings
            and request.rng is self.rng
            and (not settings.has_penalties or request.context is self.seq.tokens)
            and request.top_k_return == self.return_top_tokens
            and request.return_probs == self.return_probs
            and request.logprobs == self.return_logprobs
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

    def _init_prompt_logprobs(self, k: int | None) -> None:
        """k: the prompt tokens' log-probabilities (entries as return_logprobs' results hold:
        token id, logprob, top ids, top logprobs), one per prompt token after the first."""
        _check_prompt_logprobs(k, self.token_healing, self.embeddings)
        self.return_prompt_logprobs = _check_logprobs(k)
        self.prompt_logprobs: list[tuple[int, float, list[int], list[float]]] = []
        self._prompt_logprobs_sent = 0
        self.seq.prompt_logits = k is not None and len(self.input_ids) > 1

    def prefill_result(self) -> dict[str, Any]:
        result = self.base_result("prefill")
        result["curr_progress"] = min(self.seq.num_computed, self.prompt_tokens)
        result["max_progress"] = self.prompt_tokens
        if len(self.prompt_logprobs) > self._prompt_logprobs_sent:
            result["prompt_logprobs"] = self.prompt_logprobs[self._prompt_logprobs_sent :]
            self._prompt_logprobs_sent = len(self.prompt_logprobs)
        return result

    def receive_prompt_logits(self, start: int, logits: torch.Tensor, vocab_size: int) -> None:
        """The logits of prompt positions ``start``.. (one row each, cut to nothing past the
        last prompt token but one): the log-probabilities of the prompt tokens they predict.
        Positions a preemption made the job compute again are known already and skipped."""
        count = logits.shape[0]
        targets = self.seq.tokens[start + 1 : start + 1 + count]
        if len(targets) != count or start > len(self.prompt_logprobs):
            raise RuntimeError(f"job {self.identifier!r}: prompt logits out of order")
        # an id past the tokenizer's vocabulary (a model's padded rows) has no probability
        # there: -inf, and a gather that stays inside the rows (a device assert otherwise)
        ids = torch.tensor(targets, dtype=torch.long, device=logits.device).clamp(0, vocab_size - 1)
        k = self.return_prompt_logprobs or 0
        values, top_ids, top_values = token_logprobs(logits[:, :vocab_size], ids, k)
        values = [v if t < vocab_size else -math.inf for v, t in zip(values, targets, strict=True)]
        known = len(self.prompt_logprobs) - start
        for i in range(max(known, 0), count):
            self.prompt_logprobs.append((targets[i], values[i], top_ids[i], top_values[i]))
        if len(self.prompt_logprobs) >= len(self.input_ids) - 1:
            self.seq.prompt_logits = False  # all known: a recomputed prompt needs no rows

    def receive_token(self, token: int) -> dict[str, Any]:
        """Take one sampled token; return its streaming result (final when ``eos``): the same
        as ``take_token`` then ``render_token``, for callers with no per-token data."""
        return self.render_token(token, self.take_token(token))

    def take_token(
        self,
        token: int,
        prob: float | None = None,
        top_tokens: list[int] | None = None,
        top_probs: list[float] | None = None,
        logits: torch.Tensor | None = None,
        token_tensor: torch.Tensor | None = None,
        logprobs: tuple[float, list[int], list[float]] | None = None,
        replaces_pending: bool = False,
    ) -> dict[str, Any]:
        """The token-level half of ``receive_token``: the sequence (and grammar) take the
        token, so the next step can be scheduled; returns the token's result data for
        ``render_token``, which makes the text (the generator may defer it a step).

        ``replaces_pending``: the sequences already hold the token as their last one, as
        ``PENDING_TOKEN`` (async scheduling, engine/inflight.py): its value replaces it.

        ``token_tensor``: the token as a (1, 1) long tensor if the caller has one (the
        generator makes a whole step's in one call: a tensor per token costs ~10 us).
        ``logprobs``: (the token's model logprob, top ids, their logprobs), with
        ``return_logprobs``."""
        now = time.perf_counter()
        self._times.setdefault("first_token", now)
        self._times["last_token"] = now
        if self.constraint is not None:
            self.constraint.consume(token)  # FilterError: the generator ends this job alone
        self.new_token_ids.append(token)
        seq, partner = self.seq, self.seq.partner  # a CFG job's negative row continues alike
        if not replaces_pending:
            seq.tokens.append(token)
            if partner is not None:
                partner.tokens.append(token)
        elif seq.tokens[-1] == PENDING_TOKEN:
            seq.tokens[-1] = token
            if partner is not None:
                partner.tokens[-1] = token
        else:
            raise RuntimeError(f"job {self.identifier!r} holds no pending token to replace")
        if token_tensor is None:
            token_tensor = torch.tensor([[token]], dtype=torch.long)
        data: dict[str, Any] = {"token_ids": token_tensor}
        if prob is not None or top_tokens is not None or logits is not None:
            _attach_token_data(data, token_tensor, prob, top_tokens, top_probs, logits)
        if logprobs is not None:
            _attach_logprobs(data, *logprobs)
        return data

    @property
    def tokens_complete(self) -> bool:
        """Whether the tokens taken so far end the job whatever their text holds (a stop
        token, ``max_new_tokens``, a finished grammar): no further token is needed. A stop
        string may end it sooner, which only ``render_token`` can see."""
        count = len(self.new_token_ids)
        if count and self.new_token_ids[-1] in self.stop_tokens and count > self.min_new_tokens:
            return True
        if count >= self.max_new_tokens:
            return True
        return self.constraint is not None and self.constraint.is_stopped()

    @property
    def defers_text(self) -> bool:
        """Whether this job's text may be made a step after its token: not with banned
        strings (a rollback takes the token back before the next one is sampled) or filters
        (their masks follow the tokens step by step)."""
        return self._banned is None and not self.needs_masks

    @property
    def reads_late(self) -> bool:
        """Whether the host may learn this job's token a step after it was sampled (async
        scheduling): its text may wait (``defers_text``) and nothing else of the step is
        returned with it (probabilities, logits, logprobs come from the sampling step)."""
        return (
            self.defers_text
            and not self.return_probs
            and not self.return_top_tokens
            and not self.return_logits
            and self.return_logprobs is None
        )

    def render_token(self, token: int, data: dict[str, Any]) -> dict[str, Any]:
        """The text-level half of ``receive_token`` for the job's latest taken token: its
        text (held back while it may start a stop string), and the end of the job by stop
        token, stop string, grammar or ``max_new_tokens``."""
        if self._banned is None:
            result = {**self.base_result("streaming"), **data}
        else:
            result = self.base_result("streaming")
            self._held_tokens.append([data, len(self._held_text)])
        if token in self.stop_tokens and len(self.new_token_ids) > self.min_new_tokens:
            banned_at = self._banned_start(self._held_text, ends=True)
            if banned_at is not None:  # the pending bytes' text would complete one
                return self._roll_back(result, banned_at)
            text = self._held_text + self._detok.flush()
            self._held_text = ""
            return self._finish(result, text, "stop_token", stop_token=token)
        self._held_text += self._healed(self._detok.add(token))
        if self._banned is not None:
            self._held_tokens[-1][1] = len(self._held_text)
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

    def _healed(self, text: str) -> str:
        """The first text after token healing, without the prompt piece it re-generates."""
        if not self._heal_text or not text:
            return text
        strip, self._heal_text = self._heal_text, ""
        return text[len(strip) :] if text.startswith(strip) else text

    def _emit_or_finish(self, result: dict[str, Any]) -> dict[str, Any]:
        held = self._held_text
        # (no stop strings: neither question has anything to find)
        stop_checks = bool(self._matcher.stop_strings) and (
            len(self.new_token_ids) >= self.min_new_tokens
        )
        match = self._matcher.find(held) if stop_checks else None
        banned_at = self._banned_start(held, ends=False if match is not None else None)
        if banned_at is not None and (match is None or banned_at < match[0]):
            return self._roll_back(result, banned_at)
        if match is not None:
            index, stop = match
            self._held_text = held[index:]
            return self._finish(result, held[:index], "stop_string", stop_string=stop)
        if self.constraint is not None and self.constraint.is_stopped():
            self._held_text = ""
            return self._finish(result, held + self._detok.flush(), "end_filter")
        if len(self.new_token_ids) >= self.max_new_tokens:
            self._held_text = ""
            return self._finish(result, held + self._detok.flush(), "max_new_tokens")
        keep = self._matcher.partial_suffix_start(held) if stop_checks else len(held)
        n = None
        if self._banned is not None:
            # released text ends at a token boundary: a rollback never splits emitted text
            n, keep = self._token_boundary(min(keep, self._banned.partial_start(held)))
        self._held_text = held[keep:]
        self._add_text(result, held[:keep])
        if n is not None:
            self._release_tokens(result, n, keep)
        return result

    def _finishing(self) -> bool:
        """Whether the job ends at this token by its grammar or ``max_new_tokens`` (its held
        bytes are then flushed into the text)."""
        stopped = self.constraint is not None and self.constraint.is_stopped()
        return stopped or len(self.new_token_ids) >= self.max_new_tokens

    def _banned_start(self, held: str, ends: bool | None) -> int | None:
        """Where a banned string begins in the held text (None: nowhere). When the job ends
        here (``ends``; None: when ``_finishing``), the text of bytes still pending (U+FFFD
        for an incomplete character) counts too; a string that begins in it is taken back
        with the tokens that pend."""
        if self._banned is None:
            return None
        found = self._banned.find(held)
        if found is not None or ends is False or (ends is None and not self._finishing()):
            return found
        pending = self._detok.pending_text()
        found = self._banned.find(held + pending) if pending else None
        return None if found is None else min(found, len(held))

    def _token_boundary(self, limit: int) -> tuple[int, int]:
        """(n, end): the first n held tokens render exactly the held text[:end], the longest
        such text within ``limit`` characters (tokens that render nothing yet, such as the
        first bytes of a character, stay with the text that follows them)."""
        n, end, previous = 0, 0, 0
        for i, (_, token_end) in enumerate(self._held_tokens):
            if token_end > limit:
                break
            if token_end > previous:
                n, end = i + 1, token_end
            previous = token_end
        return n, end

    def _can_avoid_bans(self, position: int) -> bool:
        """Whether a token outside the bans is allowed at ``position`` by the job's grammar or
        healing set (sampling keeps their mask when the bans leave nothing, and would then
        pick a banned token again, forever)."""
        banned = self._bans.get(position, set())
        if self._heal_ids is not None and position == 0:
            return bool(self._heal_ids - banned)
        if self.constraint is not None:
            return self.constraint.allows_other_than(banned)
        return True

    def _release_tokens(self, result: dict[str, Any], n: int | None = None, chars: int = 0):
        """Banned-string jobs: attach the data of the first ``n`` held tokens (None: all),
        whose text (``chars`` characters of the held text) is released with it."""
        held = self._held_tokens
        n = len(held) if n is None else n
        out, self._held_tokens = held[:n], held[n:]
        for record in self._held_tokens:
            record[1] -= chars
        if out:
            result.update(merge_token_data([data for data, _ in out]))

    def _roll_back(self, result: dict[str, Any], start: int) -> dict[str, Any]:
        """A banned string begins at held text index ``start``: take back the tokens from the
        one that produced that text on, ban that token at its position, keep everything before
        (held text and token data included: the reference generator lost held tokens here)."""
        kept, kept_end = self._token_boundary(start)
        dropped = self.new_token_ids[len(self.new_token_ids) - len(self._held_tokens) + kept :]
        if not dropped:
            raise RuntimeError("banned string found in text no held token produced")
        suppressed = self._held_text[kept_end:]
        self._held_text = self._held_text[:kept_end]
        self._held_tokens = self._held_tokens[:kept]
        del self.new_token_ids[len(self.new_token_ids) - len(dropped) :]
        position = len(self.new_token_ids)
        self._bans = {p: b for p, b in self._bans.items() if p <= position}
        self._bans.setdefault(position, set()).add(dropped[0])
        if self.constraint is not None:
            self.constraint.rollback(len(dropped))
        if not self._can_avoid_bans(position):
            # Backing up further would take back text already emitted: the job fails.
            raise FilterError(
                f"every token allowed at position {position} leads to a banned string"
            )
        self.rewind_to = len(self.input_ids) + position
        if position == 0 and self._heal_ids is not None:
            self._heal_text = self._heal_piece  # the first token is healed (and cut) again
        context = (self.input_ids + self.new_token_ids)[-PREFIX_CONTEXT_TOKENS:]
        self._detok = self._tokenizer.detokenizer(context, self.decode_special_tokens)
        result["suppressed_text"] = suppressed
        result["suppressed_tokens"] = torch.tensor([dropped], dtype=torch.long)
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

    @property
    def full_completion(self) -> str:
        """The text emitted so far (kept as chunks: a string attribute grown by += is copied
        whole each token, O(n^2) over a long completion)."""
        return "".join(self._completion)

    def _add_text(self, result: dict[str, Any], text: str) -> None:
        result["text"] = text
        if text:
            self._completion.append(text)

    def _finish(self, result: dict[str, Any], text: str, reason: str, **trigger) -> dict:
        self._add_text(result, text)
        self._release_tokens(result)
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


def _attach_logprobs(result, logprob: float, top_ids: list[int], top_values: list[float]) -> None:
    result["token_logprobs"] = torch.tensor([[logprob]], dtype=torch.float32)
    result["top_logprob_ids"] = torch.tensor([[top_ids]], dtype=torch.long).reshape(1, 1, -1)
    result["top_logprobs"] = torch.tensor([[top_values]], dtype=torch.float32).reshape(1, 1, -1)


def _check_prompt_logprobs(k: int | None, token_healing: bool, embeddings) -> None:
    """Prompt logprobs score the prompt as given: token healing would drop its last token,
    and embedding placeholders are not tokens of the vocabulary."""
    if k is None:
        return
    if token_healing:
        raise ValueError("return_prompt_logprobs cannot be combined with token_healing")
    if embeddings:
        raise ValueError("return_prompt_logprobs cannot be combined with embeddings")


def _check_logprobs(k: int | None) -> int | None:
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"return_logprobs must be None or an int >= 0, got {k!r}")
    return k


def merge_token_data(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Several tokens' result data (each (1, 1, ...)) as one (1, n, ...) per key."""
    return {key: torch.cat([p[key] for p in parts], dim=1) for key in parts[0]}


def _check_constraints(filters, prefer_eos, banned_strings, token_healing):
    if not isinstance(prefer_eos, bool) or not isinstance(token_healing, bool):
        raise ValueError("filter_prefer_eos and token_healing must be bools")
    if filters:
        from engine.constraints.filters import check_filters

        filters = check_filters(filters)
    else:
        filters = ()
    if prefer_eos and not filters:
        raise ValueError("filter_prefer_eos=True needs filters")
    if token_healing and filters:
        raise ValueError("token_healing cannot be combined with filters")
    if banned_strings is not None:
        BannedStrings(banned_strings)  # validates
        banned_strings = tuple(banned_strings)
    return filters, prefer_eos, banned_strings or ()


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


def _check_cfg_options(
    filters, banned_strings, token_healing: bool, logprobs, prompt_logprobs
) -> None:
    """A CFG job samples one merged row from two sequences; the per-row features below do not
    follow that merge yet, so they are refused rather than applied to one row only."""
    given = {
        "filters": bool(filters),
        "banned_strings": bool(banned_strings),
        "token_healing": token_healing,
        "return_logprobs": logprobs is not None,
        "return_prompt_logprobs": prompt_logprobs is not None,
    }
    refused = [name for name, on in given.items() if on]
    if refused:
        raise ValueError(f"a CFG job (input_ids=[positive, negative]) cannot use {refused} yet")
