"""The serving preset turns n-gram speculation on (engine.speculative.ngram), validated."""

from __future__ import annotations

import pytest

from deployments.preset import EnginePreset, NgramSpeculation


def test_ngram_speculation_preset():
    engine = EnginePreset.parse({"speculative": {"ngram": {"max_ngram": 3}}})
    assert engine.speculative == NgramSpeculation(max_ngram=3, num_draft_tokens=4)
    assert engine.speculative.generator_kwargs() == {
        "use_ngram_draft": True,
        "max_ngram": 3,
        "num_draft_tokens": 4,
    }
    assert EnginePreset.parse({}).speculative is None
    assert EnginePreset.parse({"speculative": {"ngram": {}}}).speculative == NgramSpeculation()


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"draft_model": {}}, "unknown key"),
        ({"ngram": {"max_ngrams": 3}}, "unknown key"),
        ({"ngram": {"num_draft_tokens": 0}}, "num_draft_tokens must be >= 1"),
        ({"ngram": {"max_ngram": "4"}}, "max_ngram must be an integer"),
        ("ngram", "must be a mapping"),
    ],
)
def test_bad_speculation_presets_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        EnginePreset.parse({"speculative": raw})
