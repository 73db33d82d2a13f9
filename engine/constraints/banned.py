"""Banned strings, matched case-insensitively in a job's held text.

A job holds text while a suffix of it could still grow into a banned string; when a banned
string completes, the job rolls back to the token where it began and bans that token at that
position (``engine.job``). This module only answers the two text questions, torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def fold(text: str) -> str:
    """Lower case, one character for one: indices into the result are indices into ``text``
    (``str.lower`` turns a few characters, e.g. "İ", into two)."""
    lowered = text.lower()
    if len(lowered) == len(text):
        return lowered
    return "".join(c if len(low := c.lower()) != 1 else low for c in text)


class BannedStrings:
    def __init__(self, strings: Sequence[str]):
        if isinstance(strings, str) or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"banned_strings must be a list of non-empty strings, got {strings!r}")
        self.strings = tuple(dict.fromkeys(fold(s) for s in strings))

    def find(self, text: str) -> int | None:
        """Where the earliest full match in ``text`` begins, or None."""
        folded = fold(text)
        starts = [i for s in self.strings if (i := folded.find(s)) >= 0]
        return min(starts) if starts else None

    def partial_start(self, text: str) -> int:
        """Index of the earliest suffix of ``text`` that is a proper prefix of a banned string
        (text from there on must be held); ``len(text)`` when none is."""
        folded = fold(text)
        start = len(text)
        for s in self.strings:
            for length in range(min(len(s) - 1, len(folded)), 0, -1):
                if s.startswith(folded[-length:]):
                    start = min(start, len(folded) - length)
                    break
        return start
