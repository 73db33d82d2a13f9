"""The bytes each token id stands for, out of context: what log-probability reports show as a
token (OpenAI's ``token`` and ``bytes``), where decoding one id alone would lose bytes (half a
UTF-8 character reads as U+FFFD) or spaces (a Metaspace decoder strips a leading one).

Byte-level BPE pieces map back through GPT-2's byte <-> printable-character table; SentencePiece
pieces turn ``▁`` into a space and ``<0xNN>`` byte tokens into their byte; added and special
tokens are their text. Torch-free.
"""

from __future__ import annotations

import functools
import json
from typing import Any

METASPACE = "\u2581"


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's table, inverted: printable character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _uses(decoder_spec: Any, kind: str) -> bool:
    """Whether a tokenizer.json decoder (possibly a Sequence of decoders) includes ``kind``."""
    return f'"{kind}"' in json.dumps(decoder_spec)


class TokenBytes:
    """``bytes_of(id)``: the token's bytes; ``text_of(id)``: them as text, or OpenAI's
    ``bytes:\\xNN`` spelling when they are not valid UTF-8 on their own. Cached per id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = json.loads(tokenizer._parse.to_str()).get("decoder")
        self._byte_level = _uses(decoder, "ByteLevel")
        self._added = {i: t.content for i, t in tokenizer._parse.get_added_tokens_decoder().items()}
        self.bytes_of = functools.lru_cache(maxsize=65536)(self._bytes_of)
        self.text_of = functools.lru_cache(maxsize=65536)(self._text_of)

    def _bytes_of(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        if token_id in self._tokenizer.byte_tokens:
            return bytes([self._tokenizer.byte_tokens[token_id]])
        piece = self._tokenizer.id_to_piece(token_id)
        if self._byte_level:
            table = byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace(METASPACE, " ").encode()

    def _text_of(self, token_id: int) -> str:
        data = self.bytes_of(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
