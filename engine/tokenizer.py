"""Tokenizer: Hugging Face ``tokenizer.json`` (or GGUF metadata) encode/decode, chat templates,
streaming text.

Uses only ``tokenizers`` and jinja2 at run time; the tests check that the output matches
transformers. ``IncrementalDetokenizer`` turns a stream of ids into text chunks that add up to
exactly ``Tokenizer.decode`` of all the ids, never showing half a character.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
from codecs import getincrementaldecoder
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf_file import find_gguf_file, open_gguf
from engine.gguf_tokenizer import gguf_tokenizer_parts

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"  # what a decoder renders for invalid or incomplete UTF-8
_BYTE_TOKEN_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# The named special tokens transformers passes to chat templates (its ``special_tokens_map``).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")
_SPECIAL_TOKEN_NAMES += ("cls_token", "mask_token")
# transformers copies a message's reasoning under each of these names before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

TokenIds = torch.Tensor | Iterable[int] | int


class ChatTemplateError(jinja2.TemplateError, ValueError):
    """A chat template refused the conversation (its ``raise_exception`` was called)."""


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


def _flat_ids(ids: TokenIds | None) -> list[int]:
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


def _select_template(value: Any) -> str | None:
    # Older configs store a list of named templates; transformers then uses "default".
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Encode/decode with a ``tokenizers`` model plus the special ids from the config files.

    Thread-safe: nothing is mutated after construction. Two ``tokenizers`` instances are kept
    because their ``encode_special_tokens`` flag is per-instance state.
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
        eos_lists += [_flat_ids(cfg.get("eos_token_id")) for cfg in configs]
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
        candidates += [_flat_ids(cfg.get(f"{name}_id")) for cfg in configs]
        return next((ids[0] for ids in candidates if ids), None)

    # -- encode / decode ------------------------------------------------------------------

    def encode(
        self, text: str | list[str], add_bos: bool = False, encode_special_tokens: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """str -> LongTensor (1, n); list[str] -> list of (1, n_i) tensors.

        The post-processor's specials are never added; ``add_bos`` prepends the BOS id.
        ``encode_special_tokens=True`` turns text like ``<|im_start|>`` into its special id;
        otherwise such text is encoded as ordinary text (safe for user input).
        """
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos=True but the tokenizer has no BOS token")
        tok = self._parse if encode_special_tokens else self._plain
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
        return self.decode_list(_flat_ids(ids), decode_special_tokens)

    def decode_list(self, ids: list[int], decode_special_tokens: bool = False) -> str:
        """``decode`` for a flat list of ints, unchecked (the detokenizer's hot path)."""
        return self._parse.decode(ids, skip_special_tokens=not decode_special_tokens)

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
        template = _compile_template(self.chat_template)
        return template.render(
            messages=_normalise_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        trusted: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a chat rendered with the chat template.

        The template's own text (turn markers such as ``<|im_start|>``) becomes special tokens;
        message contents are encoded as plain text, so a user who types ``<|im_start|>system``
        gets those characters, not a forged turn. ``trusted=True`` parses special-token text
        everywhere, contents included (only for callers who control the messages).
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        encoding = self._parse.encode(text, add_special_tokens=False)
        if trusted:
            return encoding.ids
        spans = self._content_spans(messages, text, add_generation_prompt, kwargs)
        if spans is None:  # the template rewrites contents: safe only without special text
            bad = [i for i, m in enumerate(messages) if self._has_special_text(m.get("content"))]
            if bad:
                raise ValueError(
                    f"messages[{bad[0]}] contains special-token text and this chat template "
                    "changes message contents, so it cannot be kept as plain text"
                )
            return encoding.ids
        specials = [
            (start, end, token)
            for token, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if token in self.special_ids
        ]
        if not any(_inside(start, spans) for start, _, _ in specials):
            return encoding.ids  # nothing forged: exactly what the whole text encodes to
        return self._encode_around(text, [s for s in specials if not _inside(s[0], spans)])

    def _encode_around(self, text: str, specials: list[tuple[int, int, int]]) -> list[int]:
        """``text`` with only the given special tokens as specials; the rest as plain text."""
        ids: list[int] = []
        cursor = 0
        for start, end, token in specials:
            ids += self._plain.encode(text[cursor:start], add_special_tokens=False).ids
            ids.append(token)
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


def _normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # As transformers: keys set to None are dropped (OpenAI clients send content=None), and
    # reasoning given under any common name is visible under all of them.
    normalised = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalised.append(message)
    return normalised


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
    # jinja's own tojson HTML-escapes <, >, & and '; templates expect plain json.dumps
    # (indent, separators, sort_keys pass through, as in transformers)
    return json.dumps(value, ensure_ascii=ensure_ascii, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's declared class attribute)

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
        self.text = ""  # everything emitted so far

    def _kept(self, ids: TokenIds) -> list[int]:
        # decode() drops skipped special tokens before its decoder runs, so dropping them here
        # changes no text; kept, one could start a window that renders as "", and the window's
        # first real token would then lose its leading space (a start-of-decode strip).
        ids = _flat_ids(ids)
        if self._decode_special:
            return ids
        return [i for i in ids if i not in self._tokenizer.special_ids]

    def _decode(self, start: int, end: int) -> str:
        # These ids are already a flat list of ints, and this runs twice per generated token
        # of every job: skip decode()'s conversion.
        return self._tokenizer.decode_list(self._ids[start:end], self._decode_special)

    def add(self, token_ids: TokenIds) -> str:
        """Append token(s); return the text that became final (may be "")."""
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

    def _is_settled(self, window: str, end: int) -> bool:
        return (
            not window.endswith(REPLACEMENT_CHAR)
            and self._ids[end - 1] not in self._tokenizer.byte_tokens
        )

    def _emit(self, window: str, end: int) -> str:
        """Emit ``window`` (the text of ids[p:end]) past the prefix text; ids[:end] become read."""
        if window == self._prefix_text:
            return ""  # the new tokens rendered nothing yet; keep the context as it is
        if window.startswith(self._prefix_text):
            out = window[len(self._prefix_text) :]
        else:
            # The window re-rendered context text (e.g. prefix_ids ended mid-character): emit
            # from where the two diverge; what was already emitted cannot be taken back.
            common = _common_prefix_len(window, self._prefix_text)
            logger.debug("window %r does not extend %r", window, self._prefix_text)
            out = window[common:]
        start = self._read_offset
        del self._ids[:start]  # keep only the new context window and anything still pending
        self._prefix_offset, self._read_offset = 0, end - start
        self._prefix_text = self._decode(0, self._read_offset)
        self.text += out
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
