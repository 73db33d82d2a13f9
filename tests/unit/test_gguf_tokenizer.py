"""Tokenizers rebuilt from GGUF metadata equal the HF tokenizer folder they were written from
(byte-level BPE and SentencePiece-style byte-fallback BPE), pre-tokenizers are picked by
``tokenizer.ggml.pre``, and bad metadata fails with a ValueError naming it."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFWriter

from engine.tokenizer import Tokenizer
from tests.gguf_builders import write_tokenizer_gguf, write_tokenizer_metadata
from tests.tokenizer_builders import build_byte_level_bpe, build_sentencepiece_bpe

TEXTS = [
    "Hello, world! How are you today? It's fine; they're here.",
    "  leading spaces,\ttabs\tand\n\nnewlines   \r\n trailing  ",
    "日本語のテキスト, émojis 🤖🎉👨‍👩‍👧 and accents: héllo wörld",
    "def add(a, b):\n    return a + b  # 1024 + 65536 = 66560\n",
    "x   2024 3.14159 v1.2.3",
]
SPECIAL_TEXTS = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] Hello [/INST] Hi!</s><s> again <unk>",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return build_byte_level_bpe(tmp_path_factory.mktemp("bl"))


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory):
    return build_sentencepiece_bpe(tmp_path_factory.mktemp("sp"))


def assert_same_tokenizer(ours: Tokenizer, ref: Tokenizer) -> None:
    for text in TEXTS + SPECIAL_TEXTS:
        for special in (False, True):
            ids = ref.encode(text, encode_special_tokens=special)
            assert ours.encode(text, encode_special_tokens=special).tolist() == ids.tolist()
            for decode_special in (False, True):
                assert ours.decode(ids, decode_special) == ref.decode(ids, decode_special)
            stream = ours.detokenizer()
            streamed = "".join(stream.add(i) for i in ids[0].tolist()) + stream.flush()
            assert streamed == ref.decode(ids)
    assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "special_tokens", "vocab_size"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.special_ids == ref.special_ids
    assert ours.byte_tokens == ref.byte_tokens


def test_byte_level_bpe(byte_level, tmp_path):
    gguf_file = write_tokenizer_gguf(byte_level, tmp_path / "t.gguf", add_bos=True)
    ours = Tokenizer.from_pretrained(gguf_file)
    assert_same_tokenizer(ours, Tokenizer.from_pretrained(byte_level))
    assert ours.add_bos_token


@pytest.mark.parametrize("with_merges", [True, False], ids=["merges", "scores"])
def test_sentencepiece_bpe(sentencepiece, tmp_path, with_merges):
    """With the file's merges, or with merges rebuilt from piece scores (older llama files)."""
    gguf_file = write_tokenizer_gguf(sentencepiece, tmp_path / "t.gguf", with_merges=with_merges)
    ours = Tokenizer.from_pretrained(gguf_file)
    assert_same_tokenizer(ours, Tokenizer.from_pretrained(sentencepiece))
    assert ours.byte_tokens  # byte fallback is on
    assert ours.add_bos_token  # llama.cpp's default for SentencePiece vocabularies


def test_sentencepiece_scores_match_transformers_gguf_loader(sentencepiece, tmp_path):
    """transformers rebuilds merges from scores its own way; plain text agrees. (Not text that
    starts with a space: transformers' Metaspace then skips the prefix space that llama.cpp
    and SentencePiece always add.)"""
    transformers = pytest.importorskip("transformers")
    write_tokenizer_gguf(sentencepiece, tmp_path / "t.gguf", with_merges=False)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    ours = Tokenizer.from_pretrained(tmp_path / "t.gguf")
    for text in (t for t in TEXTS if not t[0].isspace()):
        ids = ours.encode(text)[0].tolist()
        assert ids == ref(text, add_special_tokens=False).input_ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


# HF tokenizer.json pre-tokenizers of the families llama.cpp names (as their repos ship them).
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
HF_PRE_TOKENIZERS = {
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


def _hf_pre_tokenizer(pre: str) -> dict:
    if pre == "smollm":
        steps = [{"type": "Digits", "individual_digits": True}, {**_BYTE_LEVEL, "use_regex": True}]
    else:
        split = {"type": "Split", "pattern": {"Regex": HF_PRE_TOKENIZERS[pre]}}
        split |= {"behavior": "Isolated", "invert": False}
        steps = [split, {**_BYTE_LEVEL, "use_regex": False}]
    return {"type": "Sequence", "pretokenizers": steps}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_named_pre_tokenizers(byte_level, tmp_path, pre):
    """The same byte-level vocabulary split as each family's HF tokenizer.json splits it."""
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        (folder / name).write_text((byte_level / name).read_text())
    spec = json.loads((byte_level / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = _hf_pre_tokenizer(pre)
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    gguf_file = write_tokenizer_gguf(folder, tmp_path / "t.gguf", pre=pre)
    ours = Tokenizer.from_pretrained(gguf_file)
    ref = Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text).tolist() == ref.encode(text).tolist(), text
    # the choice matters: GPT-2's split differs from each of these on digits and whitespace
    plain = Tokenizer.from_pretrained(byte_level)
    assert any(ours.encode(t).tolist() != plain.encode(t).tolist() for t in TEXTS)
    assert ours.add_bos_token == (pre == "llama-bpe")  # llama.cpp defaults without the flag


def test_smollm_splits_digits_before_whitespace_runs(byte_level, tmp_path):
    """llama.cpp's smollm pre-tokenizer isolates every digit first, so a space run before a
    number stays one piece (GPT-2's regex alone would give its last space to the number)."""
    ours = Tokenizer.from_pretrained(
        write_tokenizer_gguf(byte_level, tmp_path / "t.gguf", pre="smollm")
    )
    pieces = [ours.id_to_piece(i) for i in ours.encode("x   2024")[0].tolist()]
    assert pieces[-4:] == ["2", "0", "2", "4"]
    assert "".join(pieces[:-4]) == "xĠĠĠ"


# -- errors and flags -----------------------------------------------------------------------


def _write(tmp_path, folder, edit, **kwargs):
    writer = GGUFWriter(tmp_path / "t.gguf", "llama")
    write_tokenizer_metadata(writer, folder, **kwargs)
    edit(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "t.gguf"


def test_unknown_pre_tokenizer_is_named(byte_level, tmp_path):
    gguf_file = write_tokenizer_gguf(byte_level, tmp_path / "t.gguf", pre="mystery-bpe")
    with pytest.raises(ValueError, match=r"unsupported GGUF pre-tokenizer 'mystery-bpe'"):
        Tokenizer.from_pretrained(gguf_file)


def test_unknown_tokenizer_model_is_named(byte_level, tmp_path):
    gguf_file = _write(tmp_path, byte_level, lambda w: w.add_tokenizer_model("rwkv"))
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_pretrained(gguf_file)


def test_missing_token_list_is_named(byte_level, tmp_path):
    def drop_tokens(writer):
        writer.kv_data[0].pop("tokenizer.ggml.tokens")

    with pytest.raises(ValueError, match=r"no 'tokenizer.ggml.tokens'"):
        Tokenizer.from_pretrained(_write(tmp_path, byte_level, drop_tokens))


def test_special_id_outside_vocabulary(byte_level, tmp_path):
    gguf_file = _write(tmp_path, byte_level, lambda w: w.add_bos_token_id(10**6))
    with pytest.raises(ValueError, match=r"bos_token_id 1000000 is outside the vocabulary"):
        Tokenizer.from_pretrained(gguf_file)


def test_add_bos_flag_is_honoured(sentencepiece, tmp_path):
    gguf_file = write_tokenizer_gguf(sentencepiece, tmp_path / "t.gguf", add_bos=False)
    assert not Tokenizer.from_pretrained(gguf_file).add_bos_token


def test_hf_folder_add_bos_token(sentencepiece, byte_level):
    """HF folders: the config's add_bos_token if set, else whether a BOS token is declared."""
    assert Tokenizer.from_pretrained(byte_level).add_bos_token  # bos declared, no flag
    config_file = sentencepiece / "tokenizer_config.json"
    original = config_file.read_text()
    try:
        config_file.write_text(json.dumps({**json.loads(original), "add_bos_token": False}))
        assert not Tokenizer.from_pretrained(sentencepiece).add_bos_token
    finally:
        config_file.write_text(original)
