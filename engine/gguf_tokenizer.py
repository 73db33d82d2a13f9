"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata.

A GGUF carries no ``tokenizer.json``: the vocabulary, merges or scores, token types and special
ids are metadata under llama.cpp's key names. This module rebuilds the tokenizer llama.cpp runs
from them, plus the ``tokenizer_config.json`` / ``config.json`` entries the HF path reads, so
``engine.tokenizer.Tokenizer`` works unchanged on top.

Two vocabulary kinds: ``gpt2`` (byte-level BPE; the split regex is named by
``tokenizer.ggml.pre``) and ``llama`` (SentencePiece-style: ``▁`` for spaces, ``<0xNN>`` byte
fallback, merges ranked by piece score when the file lists none).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf_file import end_of_generation_ids, metadata

if TYPE_CHECKING:
    from gguf import GGUFReader

logger = logging.getLogger(__name__)

SPIECE_UNDERLINE = "▁"


class TokenType(IntEnum):
    """llama.cpp's ``tokenizer.ggml.token_type`` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# The split regexes of the byte-level pre-tokenizers llama.cpp names (as their HF
# tokenizer.json files spell them). None: GPT-2's own regex, inside ByteLevel.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizerSpec:
    split: str | None = None  # a regex applied before byte-level mapping; None: GPT-2's
    individual_digits: bool = False  # every digit its own piece (StarCoder / SmolLM)
    ignore_merges: bool = False  # a whole pre-token in the vocab is taken as is (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag


PRE_TOKENIZERS = {
    "default": PreTokenizerSpec(),
    "gpt2": PreTokenizerSpec(),
    "smollm": PreTokenizerSpec(individual_digits=True),
    "starcoder": PreTokenizerSpec(individual_digits=True),
    "llama-bpe": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama3": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "llama-v3": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "smaug-bpe": PreTokenizerSpec(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    "qwen2": PreTokenizerSpec(_QWEN2_SPLIT),
    "deepseek-r1-qwen": PreTokenizerSpec(_QWEN2_SPLIT),
}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerParts:
    """What ``engine.tokenizer.Tokenizer`` is built from: ``tokenizer.json`` text and the
    entries the HF path reads from ``tokenizer_config.json`` and ``config.json``."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    model_config: dict[str, Any]


def gguf_tokenizer_parts(reader: GGUFReader) -> GGUFTokenizerParts:
    """Everything the engine's ``Tokenizer`` needs, from an open GGUF file."""
    kind = metadata(reader, "tokenizer.ggml.model", None)
    if kind is None:
        raise ValueError("GGUF file has no tokenizer metadata (tokenizer.ggml.model is missing)")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type", None) or [TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF token_type has {len(types)} entries for {len(tokens)} tokens")
    if kind == "gpt2":
        tokenizer = byte_level_tokenizer(reader, tokens)
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(reader, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: gpt2, llama")
    add_special_tokens(tokenizer, tokens, types)
    return GGUFTokenizerParts(
        tokenizer.to_str(),
        _tokenizer_config(reader, tokens, _default_add_bos(reader, kind)),
        _model_config(reader, len(tokens)),
    )


def byte_level_tokenizer(reader: GGUFReader, tokens: list[str]) -> HFTokenizer:
    """GPT-2-style byte-level BPE; the pre-tokenizer named by ``tokenizer.ggml.pre``."""
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    merges = _split_merges(metadata(reader, "tokenizer.ggml.merges"))
    vocab = _vocab(tokens)
    tokenizer = HFTokenizer(models.BPE(vocab, merges, ignore_merges=spec.ignore_merges))
    tokenizer.pre_tokenizer = _byte_level_pre_tokenizer(spec)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _byte_level_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    steps: list[pre_tokenizers.PreTokenizer] = []
    if spec.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def sentencepiece_tokenizer(reader: GGUFReader, tokens: list[str], types: list[int]) -> HFTokenizer:
    """SentencePiece-style BPE as llama.cpp runs it: '▁' for spaces (one prepended to the text
    and after every special token when ``add_space_prefix``), ``<0xNN>`` byte fallback, and the
    highest-scoring adjacent merge first."""
    merges_field = metadata(reader, "tokenizer.ggml.merges", None)
    if merges_field is not None:
        merges = _split_merges(merges_field)
    else:
        merges = merges_from_scores(tokens, metadata(reader, "tokenizer.ggml.scores"), types)
    unk_id = metadata(reader, "tokenizer.ggml.unknown_token_id", None)
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(_vocab(tokens), merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = HFTokenizer(model)
    prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPIECE_UNDERLINE)
    # A normalizer (not Metaspace) so the prefix also follows special tokens, as in llama.cpp.
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPIECE_UNDERLINE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_scores(
    tokens: list[str], scores: list[float], types: list[int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule (merge the adjacent pair whose joined
    piece scores highest): every split of a normal piece into two normal pieces, ranked by the
    joined piece's score."""
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF scores has {len(scores)} entries for {len(tokens)} tokens")
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], index, -len(left), left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def add_special_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens; user-defined ones plain added
    tokens. Both are then matched whole in text, as llama.cpp does (their ids are unchanged:
    the pieces are already in the vocabulary)."""
    special, plain = [], []
    for token, kind in zip(tokens, types, strict=True):
        if token and kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token and kind == TokenType.USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if vocab.setdefault(token, index) != index:
            logger.warning("GGUF token %d %r repeats token %d", index, token, vocab[token])
    return vocab


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"GGUF merge {merge!r} is not two pieces separated by a space")
        pairs.append((left, right))
    return pairs


def _token_text(reader: GGUFReader, key: str, tokens: list[str]) -> str | None:
    token_id = metadata(reader, f"tokenizer.ggml.{key}", None)
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.{key} {token_id} is outside the vocabulary")
    return tokens[int(token_id)]


def _default_add_bos(reader: GGUFReader, kind: str) -> bool:
    """llama.cpp's choice for files without ``add_bos_token``: yes for SentencePiece
    vocabularies and Llama-3-style byte-level ones."""
    if kind == "llama":
        return True
    spec = PRE_TOKENIZERS.get(metadata(reader, "tokenizer.ggml.pre", "default"))
    return spec is not None and spec.add_bos


def _tokenizer_config(reader: GGUFReader, tokens: list[str], add_bos: bool) -> dict[str, Any]:
    """The ``tokenizer_config.json`` entries the HF path reads."""
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id"}
    names |= {"unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    config: dict[str, Any] = {
        name: text for name, key in names.items() if (text := _token_text(reader, key, tokens))
    }
    config["add_bos_token"] = bool(metadata(reader, "tokenizer.ggml.add_bos_token", add_bos))
    config["add_eos_token"] = bool(metadata(reader, "tokenizer.ggml.add_eos_token", False))
    template = metadata(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _model_config(reader: GGUFReader, vocab_size: int) -> dict[str, Any]:
    """The special ids ``config.json`` would give (EOS includes end-of-turn ids)."""
    config = {
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": end_of_generation_ids(reader),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id", None),
    }
    for key, value in config.items():
        ids = value if isinstance(value, list) else [value]
        if any(i is not None and not 0 <= int(i) < vocab_size for i in ids):
            raise ValueError(f"GGUF {key} {value} is outside the vocabulary ({vocab_size})")
    return config
