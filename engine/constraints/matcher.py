"""``JobConstraint``: one job's grammar state (one llguidance matcher per filter).

The matchers only ever consume tokens the job actually keeps, in order, so their state is the
job's generated tokens replayed through the grammar: a preempted job (its K/V recomputed, its
tokens unchanged) or a prefix-cache hit needs nothing here. Anything that takes tokens back
(banned-string rollback, rejected speculative drafts) calls ``rollback(n)``.

API for speculative decoding (drafts checked against the grammar before or after the forward):

    n = constraint.try_consume(draft)   # consumes the longest allowed prefix, returns its length
    ...                                  # verify; keep k <= n of them
    constraint.rollback(n - k)           # undo the rejected tail

``try_consume`` never puts the matcher into its error state; ``consume`` (the sampled token)
does when the token is not allowed, and ``error`` then says why.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from engine.constraints.filters import Filter


class FilterError(ValueError):
    """A job's grammar refused a token (or failed): the job ends with an "error" result."""


class JobConstraint:
    """The grammar state of one job: every filter must accept each token (masks are ANDed);
    the job's output is complete (``is_stopped``) as soon as any filter allows nothing but EOS.

    ``prefer_eos``: when EOS is allowed, it is the only token allowed (the mask keeps it alone).
    """

    def __init__(
        self,
        filters: Sequence[Filter],
        tokenizer: llguidance.LLTokenizer,
        prefer_eos: bool = False,
    ):
        if not filters:
            raise ValueError("a JobConstraint needs at least one filter")
        self.filters = tuple(filters)
        self.prefer_eos = prefer_eos
        self.eos_ids = tuple(tokenizer.eos_tokens)
        self.matchers = [_compile(f, tokenizer) for f in self.filters]
        self.num_consumed = 0

    # -- state ---------------------------------------------------------------------------------

    @property
    def error(self) -> str | None:
        """Why a matcher is in its error state (it never leaves it), else None."""
        for m in self.matchers:
            if m.is_error():
                return m.get_error()
        return None

    def is_stopped(self) -> bool:
        """True when the grammar is complete and allows no token but EOS."""
        return any(m.is_stopped() for m in self.matchers)

    def is_accepting(self) -> bool:
        """True when the output so far is a complete match (EOS would be allowed)."""
        return all(m.is_accepting() for m in self.matchers)

    # -- tokens --------------------------------------------------------------------------------

    def consume(self, token: int) -> None:
        """Advance over a sampled token; FilterError if any filter refuses it."""
        for m in self.matchers:
            if not m.consume_token(token):
                raise FilterError(f"token {token} refused by the grammar: {m.get_error()}")
        self.num_consumed += 1

    def try_consume(self, tokens: Sequence[int]) -> int:
        """Consume the longest prefix of ``tokens`` every filter allows; return its length.
        The matchers stay usable (no error state) whatever the tokens."""
        tokens = list(tokens)
        counts = [m.try_consume_tokens(tokens) for m in self.matchers]
        accepted = min(counts)
        for m, count in zip(self.matchers, counts, strict=True):
            if count > accepted:
                m.rollback(count - accepted)
        self.num_consumed += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` consumed tokens."""
        if not 0 <= num_tokens <= self.num_consumed:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self.num_consumed} were consumed"
            )
        if num_tokens == 0:
            return
        for m in self.matchers:
            if not m.rollback(num_tokens):
                raise FilterError(f"grammar rollback of {num_tokens} tokens failed")
        self.num_consumed -= num_tokens


def _compile(f: Filter, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, f.grammar(), log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid {f.kind} filter: {matcher.get_error()}")
    return matcher


def validate(filters: Sequence[Filter], tokenizer: llguidance.LLTokenizer) -> None:
    """Raise ValueError naming the first filter whose grammar does not compile."""
    for f in filters:
        message = llguidance.LLMatcher.validate_grammar(f.grammar(), tokenizer)
        if message and not message.startswith("WARNING"):
            raise ValueError(f"invalid {f.kind} filter: {message}")
