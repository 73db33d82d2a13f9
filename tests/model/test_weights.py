"""Checkpoint loading errors are clear, and dtype conversion happens tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model import Model
from engine.model.weights import WeightTarget, find_weight_files, load_weights
from tests.hf_models import build_model


@pytest.fixture
def folder(tmp_path):
    return build_model(tmp_path, "llama_gqa")


def _rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_missing_tensor_is_listed(folder):
    _rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"
    ):
        Model.from_pretrained(folder)


def test_unexpected_tensor_is_listed(folder):
    _rewrite(folder, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.0.extra.weight'\]"):
        Model.from_pretrained(folder)


def test_wrong_shape_names_tensor(folder):
    _rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        Model.from_pretrained(folder)


def test_inv_freq_buffers_are_ignored(folder):
    _rewrite(
        folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    )
    Model.from_pretrained(folder)


def test_missing_shard_and_no_weights(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="missing"):
        find_weight_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        find_weight_files(tmp_path)


def test_fused_slices_and_dtype_conversion(tmp_path):
    save_file({"a": torch.ones(2, 3, dtype=torch.bfloat16), "b": torch.full((1, 3), 2.0)},
              tmp_path / "model.safetensors")  # fmt: skip
    fused = torch.zeros(3, 3, dtype=torch.float16)
    load_weights({"a": WeightTarget(fused, 0), "b": WeightTarget(fused, 2)}, tmp_path)
    assert fused.dtype == torch.float16
    assert fused.tolist() == [[1.0] * 3, [1.0] * 3, [2.0] * 3]
    with pytest.raises(ValueError, match="does not fit"):
        load_weights({"a": WeightTarget(fused, 2), "b": WeightTarget(fused, 0)}, tmp_path)


def test_unknown_dtype_names_it(folder):
    with pytest.raises(ValueError, match="'float8'"):
        Model.from_pretrained(folder, dtype="float8")
