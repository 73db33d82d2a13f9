"""Pieces of constrained decoding without a model: bitmask packing, the sampler's masked fill
(never NaN), banned-string text matching, filter construction and the lazy package."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from engine.constraints.banned import BannedStrings, fold
from engine.constraints.masks import device_mask_bias, mask_bias, pack_ids
from engine.sampling import BANNED_ROW, SampleRequest, SamplerSettings, sample


def test_pack_and_bias_round_trip():
    vocab = 77
    ids = frozenset({0, 5, 31, 32, 63, 64, 76})
    words = (vocab + 31) // 32
    bitmask = torch.from_numpy(pack_ids(ids, words)[None, :].copy())
    bias = mask_bias(bitmask, vocab, torch.device("cpu"))
    assert bias.shape == (1, vocab) and bias.dtype == torch.float32
    assert set((bias[0] == 0).nonzero().flatten().tolist()) == ids
    assert bool((bias[0][bias[0] != 0] == -math.inf).all())
    assert torch.equal(device_mask_bias(bitmask, vocab, "cpu"), bias)  # the accelerator's way
    everything = mask_bias(torch.full((2, words), -1, dtype=torch.int32), vocab, "cpu")
    assert bool((everything == 0).all())


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed, 0.0, -math.inf)


def _requests(n, greedy=False, banned=()):
    settings = SamplerSettings.greedy() if greedy else SamplerSettings()
    return [
        SampleRequest(settings, random.Random(i), banned_tokens=banned, return_probs=True)
        for i in range(n)
    ]


@pytest.mark.parametrize("greedy", [True, False])
def test_masked_rows_pick_allowed_tokens_only(greedy):
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    mask = torch.zeros(3, 50, dtype=torch.bool)
    mask[0, [3, 7]] = True
    mask[1, 40] = True
    mask[2] = True  # an unconstrained row
    out = sample(logits, _requests(3, greedy), token_mask=_bias(mask))
    assert out.tokens[0] in (3, 7) and out.tokens[1] == 40
    assert out.tokens[2] == sample(logits[2:], _requests(3, greedy)[2:]).tokens[0]
    assert all(p == p and 0 < p <= 1 for p in out.probs)  # no NaN


@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_the_mask_and_bans_leave_empty_is_reported_never_nan(greedy):
    """Row 0: the grammar allows 9 and 12, a ban takes 9: 12 is picked. Row 1: the grammar
    allows only 9 and a ban takes it: BANNED_ROW (the generator ends that job), no NaN.
    (A mask row allowing nothing never reaches the sampler: test_no_mask_row_is_ever_empty.)"""
    logits = torch.randn(2, 20)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[0, [9, 12]] = True
    mask[1, 9] = True
    out = sample(logits, _requests(2, greedy, banned=(9,)), token_mask=_bias(mask))
    assert out.tokens == [12, BANNED_ROW]
    assert out.probs[0] == pytest.approx(1.0) and out.probs[1] == 0.0


def test_banned_strings_match_case_insensitively():
    banned = BannedStrings(["Hello World", "xyz"])
    assert banned.find("say HELLO world!") == 4
    assert banned.find("say hello worl") is None
    assert banned.partial_start("say hello wor") == 4
    assert banned.partial_start("abc xY") == 4
    assert banned.partial_start("nothing") == len("nothing")
    assert len(fold("İstanbul")) == len("İstanbul")  # indices stay those of the text
    with pytest.raises(ValueError):
        BannedStrings("hello")
    with pytest.raises(ValueError):
        BannedStrings([""])


def test_filters_from_spec_and_validation():
    from engine.constraints import (
        ChoiceFilter,
        ConstraintSpec,
        Filter,
        GrammarFilter,
        JSONObjectFilter,
        JSONSchemaFilter,
        RegexFilter,
    )

    assert isinstance(Filter.from_spec(ConstraintSpec("json_object")), JSONObjectFilter)
    schema = Filter.from_spec(ConstraintSpec.json_schema({"type": "integer"}, strict=False))
    assert isinstance(schema, JSONSchemaFilter) and schema.strict is False
    assert Filter.from_spec(ConstraintSpec("regex", "a+")) == RegexFilter("a+")
    choice = Filter.from_spec(ConstraintSpec("choice", choices=("a", "b")))
    assert choice == ChoiceFilter(["a", "b"])
    assert Filter.from_spec(ConstraintSpec("lark", 'start: "x"')) == GrammarFilter('start: "x"')
    with pytest.raises(ValueError):
        JSONSchemaFilter("{not json")
    with pytest.raises(ValueError):
        ChoiceFilter([])


def test_the_package_imports_without_llguidance_or_torch():
    code = (
        "import sys; import engine.constraints as c; c.ConstraintSpec('json_object'); "
        "assert 'llguidance' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
