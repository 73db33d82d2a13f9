"""Tokenizer: Hugging Face ``tokenizer.json`` (or GGUF metadata) encode/decode, chat templates,
streaming text.

Uses only ``tokenizers`` and jinja2 at run time; the tests check that the output matches
transformers. Streaming text is ``engine.detokenizer``; template rendering helpers are
``engine.chat_template``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import compile_template, normalise_messages
from engine.detokenizer import IncrementalDetokenizer, TokenIds, flat_ids
from engine.embeddings import MMEmbedding, find_aliases, split_on_aliases
from engine.gguf_file import find_gguf_file, open_gguf
from engine.gguf_tokenizer import gguf_tokenizer_parts
from engine.token_bytes import byte_level_decoder

logger = logging.getLogger(__name__)

_BYTE_TOKEN_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The named special tokens transformers passes to chat templates (its ``special_tokens_map``).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")
_SPECIAL_TOKEN_NAMES += ("cls_token", "mask_token")
# transformers copies a message's reasoning under each of these names before rendering.


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or serialised AddedToken dicts
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _select_template(value: Any) -> str | None:
    # Older configs store a list of named templates; transformers then uses "default".
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode with a ``tokenizers`` model plus the special ids from the config files.

    Thread-safe: nothing is mutated after construction but the ``standalone_text`` cache,
    whose entries never change once written. Two ``tokenizers`` instances are kept because
    their ``encode_special_tokens`` flag is per-instance state.
    """

    def __init__(
        self,
        tokenizer_json: str,
        tokenizer_config: Mapping[str, Any] | None = None,
        model_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        tok_cfg = dict(tokenizer_config or {})
        configs = (model_config or {}, generation_config or {})
        self._parse = HFTokenizer.from_str(tokenizer_json)  # special-token text -> special ids
        self._add_config_tokens(tok_cfg.get("added_tokens_decoder") or {})
        self._plain = HFTokenizer.from_str(self._parse.to_str())
        # tokenizers' flag means "encode special tokens as plain text": the opposite of ours
        self._plain.encode_special_tokens = True

        added = self._parse.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added_ids = frozenset(added)
        spec = json.loads(tokenizer_json)
        # decode() is the pieces' bytes joined, then UTF-8: a token's text never depends on
        # the tokens around it once it is complete UTF-8 on its own (see standalone_text)
        self._joins_bytes = (spec.get("decoder") or {}).get("type") == "ByteLevel" and (
            spec.get("model") or {}
        ).get("type") == "BPE"
        self._standalone: list[str | None] | None = None  # (standalone_text: on first use)
        self.vocab_size: int = self._parse.get_vocab_size(with_added_tokens=True)
        # id -> byte value of each <0xNN> token, for ByteFallback decoders only
        self.byte_tokens = self._find_byte_tokens(json.loads(tokenizer_json).get("decoder"))
        self.special_tokens: dict[str, str] = {
            name: text
            for name in _SPECIAL_TOKEN_NAMES
            if (text := _token_content(tok_cfg.get(name)))
        }
        self.bos_token_id = self._resolve_id("bos_token", configs)
        self.pad_token_id = self._resolve_id("pad_token", configs)
        eos_lists = [self._config_token_ids("eos_token")]
        eos_lists += [flat_ids(cfg.get("eos_token_id")) for cfg in configs]
        self.eos_token_id: int | None = next((ids[0] for ids in eos_lists if ids), None)
        self.eos_token_ids: frozenset[int] = frozenset(i for ids in eos_lists for i in ids)
        self.chat_template = chat_template or _select_template(tok_cfg.get("chat_template"))
        # Whether a raw prompt starts with BOS, as HF tokenizers do it: the config's
        # add_bos_token if set, else whenever a BOS token is declared (Llama 3 yes, Qwen no).
        wants_bos = tok_cfg.get("add_bos_token")
        if wants_bos is None:
            wants_bos = "bos_token" in self.special_tokens
        self.add_bos_token: bool = bool(wants_bos) and self.bos_token_id is not None
        self.add_eos_token: bool = bool(tok_cfg.get("add_eos_token", False))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a Hugging Face model folder (``tokenizer.json`` is required), or from a GGUF
        file's metadata (a ``.gguf`` path, or a folder holding one and no ``config.json``)."""
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            return cls.from_gguf(gguf_file)
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {folder} (only fast tokenizers are supported)")
        template_file = folder / "chat_template.jinja"
        # transformers gives chat_template.jinja precedence over tokenizer_config.json
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(
            tokenizer_file.read_text(encoding="utf-8"),
            tokenizer_config=_read_json(folder / "tokenizer_config.json"),
            model_config=_read_json(folder / "config.json"),
            generation_config=_read_json(folder / "generation_config.json"),
            chat_template=template,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a GGUF file's ``tokenizer.ggml.*`` and ``tokenizer.chat_template``."""
        parts = gguf_tokenizer_parts(open_gguf(path))
        return cls(
            parts.tokenizer_json,
            tokenizer_config=parts.tokenizer_config,
            model_config=parts.model_config,
        )

    def _add_config_tokens(self, added_tokens_decoder: Mapping[str, Any]) -> None:
        # tokenizer_config.json may declare added tokens that tokenizer.json lacks
        for token_id, spec in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
            content = spec.get("content")
            if not content or self._parse.token_to_id(content) is not None:
                continue
            special = bool(spec.get("special"))
            added = AddedToken(content, special=special, normalized=spec.get("normalized", False))
            self._parse.add_tokens([added])
            if (got := self._parse.token_to_id(content)) != int(token_id):
                logger.warning("added token %r got id %d, config says %s", content, got, token_id)

    def _find_byte_tokens(self, decoder_spec: Any) -> dict[int, int]:
        # With a ByteFallback decoder a run of <0xNN> tokens renders all-or-nothing, so the
        # detokenizer must know which ids are byte tokens.
        if '"ByteFallback"' not in json.dumps(decoder_spec):
            return {}
        vocab = self._parse.get_vocab(with_added_tokens=False)
        return {i: int(p[3:5], 16) for p, i in vocab.items() if _BYTE_TOKEN_RE.fullmatch(p)}

    def _config_token_ids(self, name: str) -> list[int]:
        text = self.special_tokens.get(name)
        if text is None:
            return []
        token_id = self._parse.token_to_id(text)
        if token_id is None:
            logger.warning("tokenizer_config %s %r is not in the vocabulary", name, text)
            return []
        return [token_id]

    def _resolve_id(self, name: str, configs: Iterable[Mapping[str, Any]]) -> int | None:
        # tokenizer_config.json first, then config.json, then generation_config.json
        candidates = [self._config_token_ids(name)]
        candidates += [flat_ids(cfg.get(f"{name}_id")) for cfg in configs]
        return next((ids[0] for ids in candidates if ids), None)

    # -- encode / decode ------------------------------------------------------------------

    def encode(
        self,
        text: str | list[str],
        add_bos: bool = False,
        encode_special_tokens: bool = False,
        embeddings: Sequence[MMEmbedding] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """str -> LongTensor (1, n); list[str] -> list of (1, n_i) tensors.

        The post-processor's specials are never added; ``add_bos`` prepends the BOS id.
        ``encode_special_tokens=True`` turns text like ``<|im_start|>`` into its special id;
        otherwise such text is encoded as ordinary text (safe for user input).
        ``embeddings`` (one str only): each container's ``text_alias`` becomes its placeholder
        ids; the text between aliases is encoded piece by piece.
        """
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos=True but the tokenizer has no BOS token")
        tok = self._parse if encode_special_tokens else self._plain
        if embeddings is not None:
            if not isinstance(text, str):
                raise ValueError("embeddings are given per prompt: encode one str at a time")
            ids: list[int] = []
            for part in split_on_aliases(text, embeddings):
                if isinstance(part, str):
                    ids += tok.encode(part, add_special_tokens=False).ids
                else:
                    ids += part.placeholder_ids
            return self._as_tensor(ids, add_bos)
        if isinstance(text, str):
            return self._as_tensor(tok.encode(text, add_special_tokens=False).ids, add_bos)
        encodings = tok.encode_batch(list(text), add_special_tokens=False)
        return [self._as_tensor(e.ids, add_bos) for e in encodings]

    def _as_tensor(self, ids: list[int], add_bos: bool) -> torch.Tensor:
        if add_bos:
            ids = [self.bos_token_id, *ids]
        return torch.tensor(ids, dtype=torch.long).reshape(1, -1)

    def decode(self, ids: TokenIds, decode_special_tokens: bool = False) -> str:
        """Text of ``ids`` (any tensor shape is flattened); special tokens skipped by default."""
        return self.decode_list(flat_ids(ids), decode_special_tokens)

    def decode_list(self, ids: list[int], decode_special_tokens: bool = False) -> str:
        """``decode`` for a flat list of ints, unchecked (the detokenizer's hot path)."""
        return self._parse.decode(ids, skip_special_tokens=not decode_special_tokens)

    def standalone_text(self, token_id: int) -> str | None:
        """The text ``token_id`` adds to any text that ends on a character boundary, when it
        does not depend on what came before: a regular (not added) token of a byte-level BPE
        whose bytes are complete UTF-8. None otherwise. The detokenizer's shortcut: two
        decodes of its window per token become one list lookup."""
        table = self._standalone
        if table is None:
            table = self._standalone = self._standalone_table()
        return table[token_id] if 0 <= token_id < len(table) else None

    def _standalone_table(self) -> list[str | None]:
        """``standalone_text`` of every id, made at once (~70 ms for 49k ids on one CPU
        core): id by id, the first sight of each id cost ~1.6 us inside the step loop."""
        size = self.vocab_size
        if not self._joins_bytes:
            return [None] * size
        table = byte_level_decoder()
        as_bytes = str.maketrans({c: chr(b) for c, b in table.items()})  # 1 char = 1 byte
        alphabet = str.maketrans(dict.fromkeys(table))  # deletes the table's characters
        # the decoder's own answer must agree, or the shortcut is not taken for that id
        decoded = self._parse.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        texts: list[str | None] = [None] * size
        for i, answer in enumerate(decoded):
            piece = self._parse.id_to_token(i)
            if piece is None or i in self._added_ids or piece.translate(alphabet):
                continue  # not a byte-level piece (a character outside the table)
            try:
                text = piece.translate(as_bytes).encode("latin-1").decode("utf-8")
            except UnicodeDecodeError:  # half a character
                continue
            if text and text == answer:
                texts[i] = text
        return texts

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (config-declared added tokens
        included; for a GGUF file, the one rebuilt from its metadata): what llguidance loads."""
        return self._parse.to_str()

    def id_to_piece(self, token_id: int) -> str:
        piece = self._parse.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is out of range (vocab size {self.vocab_size})")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        return self._parse.token_to_id(piece)

    def detokenizer(
        self, prefix_ids: TokenIds = (), decode_special_tokens: bool = False
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prefix_ids, decode_special_tokens)

    # -- chat templates -------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the chat template as transformers' ``apply_chat_template(tokenize=False)`` does.

        Extra keyword arguments (``tools``, ``documents``, ``enable_thinking``...) reach the
        template as variables. The result contains special-token text: encode it with
        ``encode_special_tokens=True``.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        template = compile_template(self.chat_template)
        return template.render(
            messages=normalise_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        trusted: bool = False,
        embeddings: Sequence[MMEmbedding] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a chat rendered with the chat template.

        The template's own text (turn markers such as ``<|im_start|>``) becomes special tokens;
        message contents are encoded as plain text, so a user who types ``<|im_start|>system``
        gets those characters, not a forged turn. ``trusted=True`` parses special-token text
        everywhere, contents included (only for callers who control the messages).
        ``embeddings``: containers whose ``text_alias`` the messages hold; each alias becomes
        the container's placeholder ids where the rendered chat has it (as ``encode``).
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        encoding = self._parse.encode(text, add_special_tokens=False)
        specials = [
            (start, end, token)
            for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if token in self.special_ids
        ]
        kept = specials
        if not trusted:
            kept = self._template_specials(messages, text, specials, add_generation_prompt, kwargs)
        if embeddings:
            return self._encode_around(text, kept, embeddings)
        if len(kept) == len(specials):
            return encoding.ids  # nothing forged: exactly what the whole text encodes to
        return self._encode_around(text, kept)

    def _template_specials(
        self,
        messages: list[dict[str, Any]],
        text: str,
        specials: list[tuple[int, int, int]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> list[tuple[int, int, int]]:
        """The special tokens of the rendered chat that the template wrote (not a message)."""
        spans = self._content_spans(messages, text, add_generation_prompt, kwargs)
        if spans is None:  # the template rewrites contents: safe only without special text
            bad = [i for i, m in enumerate(messages) if self._has_special_text(m.get("content"))]
            if bad:
                raise ValueError(
                    f"messages[{bad[0]}] contains special-token text and this chat template "
                    "changes message contents, so it cannot be kept as plain text"
                )
            return specials
        return [s for s in specials if not _inside(s[0], spans)]

    def _encode_around(
        self,
        text: str,
        specials: list[tuple[int, int, int]],
        embeddings: Sequence[MMEmbedding] = (),
    ) -> list[int]:
        """``text`` with only the given special tokens as specials and the embeddings'
        aliases as their placeholder ids; the rest as plain text."""
        cuts = [(start, end, [token]) for start, end, token in specials]
        cuts += [(s, e, list(c.placeholder_ids)) for s, e, c in find_aliases(text, embeddings)]
        ids: list[int] = []
        cursor = 0
        for start, end, piece in sorted(cuts, key=lambda cut: cut[0]):
            if start < cursor:
                raise ValueError("an embedding alias overlaps a special token of the chat")
            ids += self._plain.encode(text[cursor:start], add_special_tokens=False).ids
            ids += piece
            cursor = end
        return ids + self._plain.encode(text[cursor:], add_special_tokens=False).ids

    def _content_spans(
        self,
        messages: list[dict[str, Any]],
        text: str,
        add_generation_prompt: bool,
        kwargs: dict[str, Any],
    ) -> list[tuple[int, int]] | None:
        """Where each message content sits in the rendered chat ``text``, found by rendering
        once more with a unique marker for each content; None if the template does not copy
        contents verbatim (then the markers and the real render disagree)."""
        nonce = secrets.token_hex(8)
        contents = [c if isinstance(c := m.get("content"), str) else "" for m in messages]
        markers = [f"\u27e6{nonce}:{i}\u27e7" if c else "" for i, c in enumerate(contents)]
        marked = [
            {**m, "content": mk} if mk else m for m, mk in zip(messages, markers, strict=True)
        ]
        rest = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        spans: list[tuple[int, int]] = []
        rebuilt = ""
        for content, marker in zip(contents, markers, strict=True):
            if not marker:
                continue
            before, found, rest = rest.partition(marker)
            if not found or marker in rest:
                return None
            rebuilt += before
            spans.append((len(rebuilt), len(rebuilt) + len(content)))
            rebuilt += content
        return spans if rebuilt + rest == text else None

    def _has_special_text(self, content: Any) -> bool:
        if not isinstance(content, str):
            return False
        return any(t in content for t in self._special_texts)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        added = self._parse.get_added_tokens_decoder()
        return tuple(t.content for t in added.values() if t.special and t.content)


def _inside(position: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= position < end for start, end in spans)
