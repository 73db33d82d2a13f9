"""N-gram drafts: propose the tokens that followed the last occurrence of the context's suffix.

Per job, an index maps every n-gram (1 <= n <= ``max_ngram``) of the prompt + output to the
position right after its latest occurrence whose continuation is known. A proposal looks up
the longest suffix of the context (``max_ngram`` tokens down to ``min_ngram``) and returns the
up to k tokens that followed it. The index grows incrementally (``max_ngram`` dict writes per
new token), so a step costs O(max_ngram + k) per job on the host, whatever the context length.

Input-grounded work (quote, rewrite or extract from a passage, edit code) repeats long runs
of the prompt; there these drafts are often right. They carry no distribution (q is one-hot),
so verification uses the deterministic-draft rule (see rejection.py).
"""

from __future__ import annotations

from collections.abc import Sequence


class NGramIndex:
    """The n-gram index of one growing token sequence (prompt + output)."""

    __slots__ = ("_indexed", "_next", "max_ngram", "min_ngram")

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._indexed = 1  # continuations at indices < this are in the index

    def _update(self, tokens: Sequence[int]) -> None:
        # INVARIANT: tokens only grow (a job's prompt + output); earlier entries never change.
        table, m = self._next, self.max_ngram
        for j in range(self._indexed, len(tokens)):
            for n in range(1, min(m, j) + 1):
                table[tuple(tokens[j - n : j])] = j  # later occurrences win
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (empty when no suffix recurs)."""
        if k <= 0 or len(tokens) < 2:
            return []
        self._update(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            j = self._next.get(tuple(tokens[length - n :]))
            if j is not None and j < length:
                return list(tokens[j : min(j + k, length)])
        return []
