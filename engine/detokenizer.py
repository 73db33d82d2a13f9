"""Streaming text: ``IncrementalDetokenizer`` turns a stream of token ids into text chunks that
add up to exactly ``Tokenizer.decode`` of all the ids, never showing half a character."""

from __future__ import annotations

import logging
from codecs import getincrementaldecoder
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
REPLACEMENT_CHAR = "\ufffd"  # what a decoder renders for invalid or incomplete UTF-8
TokenIds = torch.Tensor | Iterable[int] | int


def flat_ids(ids: TokenIds | None) -> list[int]:
    # config files give ids as int, list or null; callers give tensors or lists
    if ids is None:
        return []
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1).tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class IncrementalDetokenizer:
    """Streams text token by token, correct for byte-level BPE (Llama 3, Qwen: a character
    split over several tokens) and SentencePiece-style byte-fallback vocabularies (Llama 2,
    Mistral: '▁' spaces that the decoder strips at the start of a decode, ``<0xNN>`` tokens).

    Prefix-offset / read-offset technique: ``ids[p:r]`` is emitted context, ``ids[r:]`` is
    pending. Each step decodes the window ``ids[p:]`` and emits what it adds to the text of
    ``ids[p:r]``; because both decodes start at the same token, start-of-decode effects (the
    stripped leading space) cancel out. Text is held while it ends in U+FFFD (a character still
    incomplete) or, with a byte-fallback decoder, while the last token is a byte token (a later
    invalid byte turns the whole run into U+FFFDs). Ids before ``p`` are dropped, so each step
    costs O(window), not O(sequence).

    Invariant: ``"".join(add(t) for t in ids) + flush() == tokenizer.decode(ids)`` (and with
    ``prefix_ids``, the part of ``decode(prefix + ids)`` after ``decode(prefix)``), exact as
    long as no more than ``max_held_tokens`` tokens are held at once. Longer holds (a long
    byte-fallback run, garbage bytes) are cut at the latest clean token boundary, so latency and
    work stay bounded; only a run that turns invalid after such a cut can then differ.

    ``prefix_ids`` (e.g. the last few prompt tokens) give context so the first generated
    token's leading space comes out right; their text is never emitted. Call ``flush()`` once,
    at the end of the stream.
    """

    max_held_tokens = 16

    def __init__(
        self, tokenizer: Tokenizer, prefix_ids: TokenIds = (), decode_special_tokens: bool = False
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_special = decode_special_tokens
        self._ids = self._kept(prefix_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(0, self._read_offset)
        # everything emitted so far, as chunks: a string grown by += is copied whole each
        # token (an attribute is never resized in place), O(n^2) over a long stream
        self._emitted: list[str] = []

    def _kept(self, ids: TokenIds) -> list[int]:
        # decode() drops skipped special tokens before its decoder runs, so dropping them here
        # changes no text; kept, one could start a window that renders as "", and the window's
        # first real token would then lose its leading space (a start-of-decode strip).
        if isinstance(ids, int):  # one generated token: the common case, kept cheap
            if self._decode_special or ids not in self._tokenizer.special_ids:
                return [ids]
            return []
        ids = flat_ids(ids)
        if self._decode_special:
            return ids
        return [i for i in ids if i not in self._tokenizer.special_ids]

    def _decode(self, start: int, end: int) -> str:
        # These ids are already a flat list of ints, and this runs twice per generated token
        # of every job: skip decode()'s conversion.
        return self._tokenizer.decode_list(self._ids[start:end], self._decode_special)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def add(self, token_ids: TokenIds) -> str:
        """Append token(s); return the text that became final (may be "")."""
        if isinstance(token_ids, int) and self._read_offset == len(self._ids):
            # nothing held: a token whose text is context-free needs no decode (the state
            # is the one _emit would leave: the token alone, read)
            text = self._tokenizer.standalone_text(token_ids)  # (None for added tokens)
            if text is not None:
                self._ids = [token_ids]
                self._prefix_offset, self._read_offset = 0, 1
                self._prefix_text = text
                self._emitted.append(text)
                return text
        new_ids = self._kept(token_ids)
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        end = len(self._ids)
        window = self._decode(self._prefix_offset, end)
        if self._is_settled(window, end):
            return self._emit(window, end)
        if end - self._read_offset > self.max_held_tokens:
            return self._emit(*self._forced_split(window))
        return ""

    def flush(self) -> str:
        """Emit whatever is held, rendered as decode renders it (e.g. U+FFFD for bad bytes)."""
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        return self._emit(self._decode(self._prefix_offset, end), end)

    def pending_text(self) -> str:
        """What ``flush()`` would emit now, without emitting it (the stream goes on)."""
        end = len(self._ids)
        if end == self._read_offset:
            return ""
        return self._text_past_prefix(self._decode(self._prefix_offset, end))

    def _text_past_prefix(self, window: str) -> str:
        """What ``window`` (the text of ids[p:...]) adds to the prefix text."""
        if window.startswith(self._prefix_text):
            return window[len(self._prefix_text) :]
        # The window re-rendered context text (e.g. prefix_ids ended mid-character): from
        # where the two diverge; what was already emitted cannot be taken back.
        logger.debug("window %r does not extend %r", window, self._prefix_text)
        return window[_common_prefix_len(window, self._prefix_text) :]

    def _is_settled(self, window: str, end: int) -> bool:
        return (
            not window.endswith(REPLACEMENT_CHAR)
            and self._ids[end - 1] not in self._tokenizer.byte_tokens
        )

    def _emit(self, window: str, end: int) -> str:
        """Emit ``window`` (the text of ids[p:end]) past the prefix text; ids[:end] become read."""
        if window == self._prefix_text:
            return ""  # the new tokens rendered nothing yet; keep the context as it is
        out = self._text_past_prefix(window)
        start = self._read_offset
        del self._ids[:start]  # keep only the new context window and anything still pending
        self._prefix_offset, self._read_offset = 0, end - start
        self._prefix_text = self._decode(0, self._read_offset)
        self._emitted.append(out)
        return out

    def _forced_split(self, window: str) -> tuple[str, int]:
        """Too much held: find the latest token boundary whose text no later token can change."""
        end = len(self._ids)
        if self._open_run_is_broken():
            return window, end  # it renders as U+FFFDs whatever follows: no need to wait
        for split in range(end - 1, self._read_offset, -1):
            head = self._decode(self._prefix_offset, split)
            extends = head != self._prefix_text and head.startswith(self._prefix_text)
            if extends and self._is_clean_split(head, split, window):
                return head, split
        logger.debug(
            "no clean split in %d held tokens; emitting them as is", end - self._read_offset
        )
        return window, end

    def _is_clean_split(self, head: str, split: int, window: str) -> bool:
        """Whether no later token can change ``head``, the text of ids[p:split]."""
        if not head.endswith(REPLACEMENT_CHAR):
            return True  # ends in a complete character
        byte_tokens = self._tokenizer.byte_tokens
        if self._ids[split - 1] in byte_tokens:
            # a byte-fallback run renders as a whole: final once a non-byte token closes it
            return self._ids[split] not in byte_tokens
        # Bad UTF-8 before the split renders the same whatever follows iff it already does
        # with the tokens held (the decoder only looks ahead to the next byte to end it).
        return head + self._decode(split, len(self._ids)) == window

    def _open_run_is_broken(self) -> bool:
        """Whether the trailing byte-fallback run already holds invalid (not just incomplete)
        UTF-8: ByteFallback then renders every byte of the run as U+FFFD, whatever follows."""
        byte_tokens = self._tokenizer.byte_tokens
        start = len(self._ids)
        while start > 0 and self._ids[start - 1] in byte_tokens:
            start -= 1
        data = bytes(byte_tokens[i] for i in self._ids[start:])
        try:
            getincrementaldecoder("utf-8")().decode(data, final=False)
        except UnicodeDecodeError:
            return True
        return False
