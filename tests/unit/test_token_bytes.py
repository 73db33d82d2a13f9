"""``engine.token_bytes``: each token's own bytes (what logprobs show), for byte-level BPE and
SentencePiece byte-fallback tokenizers; concatenated they give back the text, byte for byte,
even where one token holds half a UTF-8 character."""

from __future__ import annotations

import pytest

from engine.token_bytes import TokenBytes
from engine.tokenizer import Tokenizer
from tests.tokenizer_builders import build_byte_level_bpe, build_sentencepiece_bpe

TEXT = "Hello wörld, 世界 ends 🙂!"


@pytest.mark.parametrize("builder", [build_byte_level_bpe, build_sentencepiece_bpe])
def test_token_bytes_spell_the_text(builder, tmp_path) -> None:
    tokenizer = Tokenizer.from_pretrained(builder(tmp_path))
    spell = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT)[0].tolist()
    data = b"".join(spell.bytes_of(i) for i in ids)
    # SentencePiece prepends "▁" to the text: its first piece starts with a space
    assert data.decode() in (TEXT, " " + TEXT)
    split = 0
    for i in ids:
        text, raw = spell.text_of(i), spell.bytes_of(i)
        if text.startswith("bytes:"):  # not valid UTF-8 alone: spelled as escaped bytes
            split += 1
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert text.encode() == raw
    assert split  # the small vocabularies split the CJK characters and the emoji
    eos = tokenizer.eos_token_id
    if eos is not None:  # special tokens are their text
        assert spell.text_of(eos) == tokenizer.id_to_piece(eos)
