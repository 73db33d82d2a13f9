"""Model.logits and the paged forward against transformers, per architecture variant."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelConfig
from engine.model import Model
from engine.model.llama import LlamaForCausalLM
from engine.model.rotary import inverse_frequencies
from tests.hf_models import (
    VARIANTS,
    build_llama3_old_style,
    build_model,
    reference_logits,
    reference_model,
    relative_error,
)

TOLERANCE = 1e-4  # fp32: max |diff| / max |ref|


def _prompt(length: int, vocab: int = 320, seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return build_model(folder, request.param)


@pytest.mark.parametrize("length", [1, 17, 70])
def test_logits_match_transformers(variant_folder, length):
    ours = Model.from_pretrained(variant_folder)
    ref = reference_model(variant_folder)
    ids = _prompt(length)
    assert relative_error(ours.logits(ids), reference_logits(ref, ids)) <= TOLERANCE


def test_llama3_rope_old_config_style(tmp_path):
    folder = build_llama3_old_style(tmp_path)
    ours = Model.from_pretrained(folder)
    assert ours.config.rope.rope_type == "llama3"
    # the scaling must actually change frequencies, or this test would prove nothing
    default = inverse_frequencies(type(ours.config.rope)(theta=5e5), ours.config.head_dim)
    assert not torch.allclose(ours.network.inv_freq.cpu(), default)
    ids = _prompt(90)
    assert relative_error(ours.logits(ids), reference_logits(reference_model(folder), ids)) <= (
        TOLERANCE
    )


def test_sharded_checkpoint(tmp_path):
    folder = build_model(tmp_path, "llama_gqa", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ids = _prompt(33)
    got = Model.from_pretrained(folder).logits(ids)
    assert relative_error(got, reference_logits(reference_model(folder), ids)) <= TOLERANCE


@pytest.mark.parametrize("disk_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_runs_in_float32(tmp_path, disk_dtype):
    folder = build_model(tmp_path, "qwen2_tied", torch_dtype=disk_dtype)
    ours = Model.from_pretrained(folder, dtype="float32")
    assert ours.dtype == torch.float32
    ids = _prompt(25)
    # transformers upcasts the same stored values, so the comparison stays exact-ish
    assert relative_error(ours.logits(ids), reference_logits(reference_model(folder), ids)) <= (
        TOLERANCE
    )


def test_float16_run_dtype_is_close(tmp_path):
    folder = build_model(tmp_path, "llama_gqa")
    ours = Model.from_pretrained(folder, dtype=torch.float16)
    ids = _prompt(20)
    got = ours.logits(ids)
    assert got.dtype == torch.float32  # logits always come back in float32
    assert relative_error(got, reference_logits(reference_model(folder), ids)) <= 2e-2


def test_sliding_window_is_honoured(tmp_path):
    """The mistral window must change the result once the prompt is longer than it."""
    folder = build_model(tmp_path, "mistral")
    ours = Model.from_pretrained(folder)
    assert ours.config.sliding_windows == (8, 8)
    ids = _prompt(40)
    windowed = ours.logits(ids)
    unwindowed = ModelConfig.from_dict(
        {**json.loads((folder / "config.json").read_text()), "sliding_window": None}
    )
    network = LlamaForCausalLM(unwindowed, torch.float32, torch.device("cpu"))
    network.load_state_dict(ours.network.state_dict())  # same weights, no window
    full = Model(unwindowed, network).logits(ids)
    assert relative_error(windowed[:8], full[:8]) <= TOLERANCE
    assert relative_error(windowed[8:], full[8:]) > 1e-3


def test_logits_rejects_batches(tmp_path):
    ours = Model.from_pretrained(build_model(tmp_path, "llama_gqa"))
    with pytest.raises(ValueError, match="one sequence"):
        ours.logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one token"):
        ours.logits([])
