"""Build small Hugging Face-format tokenizer folders offline, for tests.

Both tokenizers are trained with the ``tokenizers`` library on the ASCII corpus below, so
building needs no network and gives the same files every time. The corpus is ASCII on
purpose: CJK and emoji text then exercises the byte-level alphabet (byte-level BPE) and the
``<0xNN>`` byte fallback (SentencePiece-style BPE) instead of learned pieces.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, but it stayed asleep.
A serving engine turns prompts into tokens, runs the model, and streams text back to users.
Each request gets a slice of the key-value cache; pages are shared when prompts share a prefix.
When the batch is full, new requests wait in a queue until a running request finishes.
Tokenizers split text into pieces. Common words become single tokens; rare words are split.
Numbers like 3.14159, 2718, 1024 and 65536 appear in code, in tables, and in prose.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

if x > 0 and y < 10:
    result = {"key": "value", "count": 42}
Hello, world! How are you today? I am fine, thank you. What would you like to do next?
Please write a short poem about the sea. The sea is wide, the sea is deep, the waves never sleep.
Explain why the sky is blue. Sunlight scatters off small molecules in the air, and blue light
scatters more than red light because it has a shorter wavelength.
The system prompt tells the assistant how to behave. The user asks a question; the assistant
answers it. Then the user may ask another question, and the conversation continues.
Streaming output must never show half a character, and it must never lose a space between words.
Python, Rust, C, and Go are programming languages. JSON, YAML, and TOML are data formats.
It's a lovely day, isn't it? They're going to the market; we'll meet them there at noon.
Don't panic. Keep calm and carry on. The answer is forty-two, or so the story goes.
In 1969, people walked on the moon. In 2024, language models wrote essays and computer code.
The cat sat on the mat. The bat flew over the hat. A rat ran past the vat near the flat.
Alice was beginning to get very tired of sitting by her sister on the bank, and of having
nothing to do: once or twice she had peeped into the book her sister was reading, but it had
no pictures or conversations in it, and what is the use of a book, thought Alice, without
pictures or conversations?
It was the best of times, it was the worst of times, it was the age of wisdom, it was the
age of foolishness, it was the epoch of belief, it was the epoch of incredulity.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in
my purse, and nothing particular to interest me on shore, I thought I would sail about a
little and see the watery part of the world.
Memory bandwidth limits decoding speed; compute limits prefill. Batching many requests
together keeps the accelerator busy and raises throughput without hurting latency too much.
Temperature, top-k, and top-p change how the next token is sampled from the probabilities.
A stop string ends generation early; the end-of-sequence token ends it as well.
Good morning! Good afternoon! Good evening! Good night! See you tomorrow, my friend.
She sells sea shells by the sea shore. Peter Piper picked a peck of pickled peppers.
One, two, three, four, five, six, seven, eight, nine, ten. First, second, third, last.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, and Sunday are the days of the week.
Red, orange, yellow, green, blue, indigo, and violet are the colors of the rainbow.
"""

# Byte-level BPE (GPT-2 / Llama 3 / Qwen style) special tokens.
BOS_BL = "<|begin_of_text|>"
EOT_BL = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + content.strip() + ' ' + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)

BYTE_TOKEN_FORMAT = "<0x{:02X}>"


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_byte_level_bpe(directory: str | os.PathLike, vocab_size: int = 1000) -> Path:
    """Write a Llama-3 / Qwen-style byte-level BPE tokenizer folder with a ChatML template.

    Special tokens are added after training, so their ids sit above the learned vocabulary
    (as in Llama 3). ``generation_config.json`` lists two EOS ids.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer)
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in (BOS_BL, EOT_BL, IM_START, IM_END)]
    )
    bos_id = tok.token_to_id(BOS_BL)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_BL} $A", pair=f"{BOS_BL} $A {BOS_BL} $B", special_tokens=[(BOS_BL, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    eot_id, im_end_id = tok.token_to_id(EOT_BL), tok.token_to_id(IM_END)
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_BL,
            "eos_token": IM_END,
            "pad_token": EOT_BL,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": CHATML_TEMPLATE,
        },
    )
    _write_json(out / "config.json", {"bos_token_id": bos_id, "eos_token_id": eot_id})
    _write_json(out / "generation_config.json", {"eos_token_id": [eot_id, im_end_id]})
    return out


def _train_sentencepiece_pieces(vocab_size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn '▁word' pieces and merges on the corpus (split on spaces, as SentencePiece does)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    tok.train_from_iterator(_corpus_lines(), trainer)
    model = json.loads(tok.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].__getitem__)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return pieces, merges


def build_sentencepiece_bpe(directory: str | os.PathLike, vocab_size: int = 700) -> Path:
    """Write a Llama-2-style tokenizer folder: BPE with byte fallback, '▁' for spaces.

    Vocab layout follows Llama 2: ``<unk>``, ``<s>``, ``</s>``, the 256 ``<0xNN>`` byte
    tokens, then the learned pieces.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    pieces, merges = _train_sentencepiece_pieces(vocab_size)
    specials = ["<unk>", "<s>", "</s>"]
    vocab: dict[str, int] = {}
    for piece in [*specials, *(BYTE_TOKEN_FORMAT.format(b) for b in range(256)), *pieces]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.save(str(out / "tokenizer.json"))
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": None,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
            "chat_template": LLAMA2_TEMPLATE,
        },
    )
    _write_json(out / "config.json", {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"]})
    return out
