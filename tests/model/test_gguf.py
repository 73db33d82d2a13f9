"""GGUF loading on small files the tests write: every supported tensor type lands in the right
parameter (fused slices, q/k rows un-permuted), logits equal the same weights loaded from the
HF folder, and bad files fail with a ValueError that names the problem."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.config import ModelConfig
from engine.gguf_file import find_gguf_file
from engine.model import Model
from engine.model.gguf import SUPPORTED_TYPES, unpermute_rows
from engine.model.rotary import inverse_frequencies
from engine.tokenizer import Tokenizer
from tests.gguf_builders import Q, permute_rows, write_model_gguf
from tests.hf_models import (
    build_llama3_old_style,
    build_model,
    reference_logits,
    reference_model,
    relative_error,
)

TOLERANCE = 1e-4  # fp32: max |diff| / max |ref|
# K types need rows of 256 values: a model whose every matrix has 256 columns.
WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4}


def _prompt(length: int, vocab: int = 320, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("wide"), "llama_gqa", **WIDE)


def _expected_parameters(gguf_file, config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF-named reference tensors: each stored tensor dequantized by gguf-py, then (q/k) put
    back in HF row order with the test's own inverse of the converter's permutation."""
    reader = GGUFReader(gguf_file)
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj"}
    parts |= {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
    parts |= {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    parts |= {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    expected = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
        if tensor.name in names:
            expected[names[tensor.name]] = torch.from_numpy(values.copy())
            continue
        _, layer, part, _ = tensor.name.split(".")
        if part in ("attn_q", "attn_k"):
            heads = config.num_heads if part == "attn_q" else config.num_kv_heads
            half = values.shape[0] // heads // 2
            values = values.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(values.shape)
        expected[f"model.layers.{layer}.{parts[part]}.weight"] = torch.from_numpy(values.copy())
    return expected


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_every_type_round_trips(wide_llama, tmp_path, qtype):
    gguf_file = write_model_gguf(wide_llama, tmp_path / f"{qtype.name}.gguf", qtype)
    model = Model.from_pretrained(gguf_file)
    targets = model.network.weight_targets()
    expected = _expected_parameters(gguf_file, model.config)
    assert set(expected) == set(targets)
    for name, want in expected.items():
        target = targets[name]
        got = target.param
        if target.offset is not None:
            got = got.narrow(0, target.offset, want.shape[0])
        assert torch.equal(got, want), name


def test_unpermute_inverts_the_converter_permutation():
    weight = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    bias = np.arange(16, dtype=np.float32)
    for heads in (1, 2):
        assert np.array_equal(unpermute_rows(torch.from_numpy(permute_rows(weight, heads)), heads),
                              weight)  # fmt: skip
        assert np.array_equal(unpermute_rows(torch.from_numpy(permute_rows(bias, heads)), heads),
                              bias)  # fmt: skip


VARIANTS = ["llama_gqa", "llama_mha_bias", "qwen2_tied", "qwen3", "mistral"]
# Special ids come from tokenizer metadata (none here); GGUF stores the eps as float32.
NOT_COMPARED = {"bos_token_id", "eos_token_ids", "torch_dtype", "rms_norm_eps"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_the_hf_folder(tmp_path, variant):
    """Same weights, two formats: GGUF (q/k permuted, norms F32) and HF safetensors."""
    folder = build_model(tmp_path / "hf", variant)
    gguf_file = write_model_gguf(folder, tmp_path / "model.gguf")
    ours = Model.from_pretrained(gguf_file)
    hf_config = ModelConfig.from_pretrained(folder)
    for name in set(hf_config.__dataclass_fields__) - NOT_COMPARED:
        assert getattr(ours.config, name) == getattr(hf_config, name), name
    assert ours.config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    ids = _prompt(40)
    assert relative_error(ours.logits(ids), reference_logits(reference_model(folder), ids)) <= (
        TOLERANCE
    )


def test_quantized_logits_stay_close(tmp_path):
    """Q8_0 weights: the logits move a little from fp32, not a lot (a layout slip would)."""
    folder = build_model(tmp_path / "hf", "llama_gqa")
    ours = Model.from_pretrained(write_model_gguf(folder, tmp_path / "q8.gguf", Q.Q8_0))
    ids = _prompt(30)
    error = relative_error(ours.logits(ids), reference_logits(reference_model(folder), ids))
    assert 0 < error < 0.05


def test_llama3_rope_freqs_tensor(tmp_path):
    """llama.cpp stores llama 3 rope scaling as per-frequency divisors (rope_freqs.weight)."""
    folder = build_llama3_old_style(tmp_path / "hf")
    config = ModelConfig.from_pretrained(folder)
    default = inverse_frequencies(type(config.rope)(theta=config.rope.theta), config.head_dim)
    factors = (default / inverse_frequencies(config.rope, config.head_dim)).numpy()

    def add_rope_freqs(writer):
        writer.add_tensor("rope_freqs.weight", factors.astype(np.float32))

    gguf_file = write_model_gguf(folder, tmp_path / "m.gguf", metadata_hook=add_rope_freqs)
    ours = Model.from_pretrained(gguf_file)
    ids = _prompt(90)
    assert relative_error(ours.logits(ids), reference_logits(reference_model(folder), ids)) <= (
        TOLERANCE
    )


# -- finding the file ---------------------------------------------------------------------


def test_folder_with_one_gguf_and_no_config(tmp_path):
    folder = build_model(tmp_path / "hf", "llama_gqa")
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_model_gguf(folder, gguf_dir / "m.gguf")
    assert find_gguf_file(gguf_dir) == gguf_dir / "m.gguf"
    assert Model.from_pretrained(gguf_dir).config.num_layers == 2
    # a folder with config.json stays an HF folder, whatever else it holds
    shutil.copy(gguf_dir / "m.gguf", folder / "m.gguf")
    assert find_gguf_file(folder) is None
    shutil.copy(gguf_dir / "m.gguf", gguf_dir / "n.gguf")
    with pytest.raises(ValueError, match=r"several GGUF files \(m\.gguf, n\.gguf\)"):
        Model.from_pretrained(gguf_dir)


# -- errors ---------------------------------------------------------------------------------


@pytest.fixture
def small_hf(tmp_path):
    return build_model(tmp_path / "hf", "llama_gqa")


def test_unknown_architecture(small_hf, tmp_path):
    def rename_architecture(writer):
        writer.add_string("general.architecture", "gptj")

    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf", metadata_hook=rename_architecture)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gptj'"):
        Model.from_pretrained(gguf_file)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gptj'"):
        ModelConfig.from_pretrained(gguf_file)


def test_unsupported_tensor_type_names_type_and_tensor(small_hf, tmp_path):
    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf", Q.Q5_0)
    with pytest.raises(ValueError, match=r"unsupported types: 'output.weight' \(Q5_0\)"):
        Model.from_pretrained(gguf_file)


def test_missing_metadata_names_the_key(small_hf, tmp_path):
    def drop_block_count(writer):
        for kv in writer.kv_data:
            kv.pop("llama.block_count", None)

    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf", metadata_hook=drop_block_count)
    with pytest.raises(ValueError, match=r"no 'llama.block_count'"):
        Model.from_pretrained(gguf_file)


def test_missing_tensor_is_named(small_hf, tmp_path):
    gguf_file = write_model_gguf(
        small_hf, tmp_path / "m.gguf", tensor_hook=_drop("blk.1.ffn_up.weight")
    )
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        Model.from_pretrained(gguf_file)


def _drop(name):
    def hook(gguf_name, values):
        return None if gguf_name == name else values

    return hook


@pytest.mark.parametrize("cut", [0.5, 0.999])
def test_truncated_file(small_hf, tmp_path, cut):
    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf")
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ValueError, match=r"m\.gguf.*(truncated|corrupt)"):
        Model.from_pretrained(gguf_file)


def test_corrupt_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a readable GGUF file"):
        Model.from_pretrained(bad)
    with pytest.raises(ValueError, match=r"bad\.gguf.*not a readable GGUF file"):
        Tokenizer.from_pretrained(bad)


def test_missing_tokenizer_metadata(small_hf, tmp_path):
    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"no tokenizer metadata \(tokenizer\.ggml\.model"):
        Tokenizer.from_pretrained(gguf_file)


def test_one_parse_per_file_version(small_hf, tmp_path):
    """Config, weights and tokenizer of one file share one parse; a rewritten file is read
    again (its size and mtime are part of the key)."""
    from engine.gguf_file import open_gguf

    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf")
    first = open_gguf(gguf_file)
    assert open_gguf(str(gguf_file)) is first
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated|corrupt"):
        open_gguf(gguf_file)


def test_the_parse_reads_the_files_map_in_place(small_hf, tmp_path):
    """The reader slices a plain ndarray view of its memory map (memmap slices cost a
    ``__array_finalize__`` each, ~250k of them for a real vocabulary): the metadata and tensors
    are those of gguf's own reader, and tensor data still lies in the map, not in a copy."""
    from engine.gguf_file import metadata, open_gguf

    gguf_file = write_model_gguf(small_hf, tmp_path / "m.gguf")
    ours, plain = open_gguf(gguf_file), GGUFReader(gguf_file)
    assert type(ours.data) is np.ndarray and isinstance(ours.data.base, np.memmap)
    assert list(ours.fields) == list(plain.fields)
    for key in ours.fields:
        if not key.startswith("GGUF."):
            assert metadata(ours, key) == metadata(plain, key), key
    assert [t.name for t in ours.tensors] == [t.name for t in plain.tensors]
    for mine, theirs in zip(ours.tensors, plain.tensors, strict=True):
        assert type(mine.data) is np.ndarray and np.shares_memory(mine.data, ours.data)
        assert np.array_equal(mine.data, theirs.data), mine.name
