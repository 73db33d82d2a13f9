"""Batched sampling: settings validation, greedy, truncations, penalties, bias, bans,
reproducibility, returned probabilities and a rough distribution check.

Truncation sets and penalised logits are computed by hand for a small vocabulary; sampled
tests draw many seeded rows in one batch so they stay fast and deterministic.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from engine.sampling import SampleRequest, SamplerSettings, sample

# Token i has probability P[i] at temperature 1 (logits are log-probabilities).
P = [0.10, 0.40, 0.01, 0.15, 0.03, 0.25, 0.01, 0.05]
V = len(P)
LOGITS = [math.log(p) for p in P]


def _rows(row: list[float], n: int) -> torch.Tensor:
    return torch.tensor([row] * n, dtype=torch.float32)


def _draw_many(settings: SamplerSettings, n: int = 2000, row=LOGITS, **extra) -> Counter:
    """Sample ``n`` rows of the same logits, each with its own seeded generator."""
    reqs = [SampleRequest(settings, random.Random(i), **extra) for i in range(n)]
    return Counter(sample(_rows(row, n), reqs).tokens)


def _final_probs(settings: SamplerSettings, row, **extra) -> list[float]:
    """The row's whole final distribution, in token order (via top_k_return=V)."""
    req = SampleRequest(settings, random.Random(0), top_k_return=len(row), **extra)
    out = sample(torch.tensor([row], dtype=torch.float32), [req])
    probs = [0.0] * len(row)
    for t, p in zip(out.top_tokens[0], out.top_probs[0], strict=True):
        probs[t] = p
    return probs


def _short(value) -> str:
    """Test id: only the fields that differ from the defaults."""
    if not isinstance(value, SamplerSettings):
        return (
            "tokens" + "_".join(map(str, sorted(value))) if isinstance(value, set) else repr(value)
        )
    default = SamplerSettings()
    changed = [
        f"{name}={getattr(value, name)}"
        for name in SamplerSettings.__slots__
        if getattr(value, name) != getattr(default, name)
    ]
    return ",".join(changed) or "default"


def _softmax(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != -math.inf]
    m = max(finite)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [x / s for x in e]


def _renormalised(keep: set[int]) -> list[float]:
    total = sum(P[i] for i in keep)
    return [P[i] / total if i in keep else 0.0 for i in range(V)]


# -- settings ------------------------------------------------------------------------------


def test_defaults_are_neutral():
    s = SamplerSettings()
    assert s.temperature == 1.0
    assert (s.top_k, s.top_p, s.min_p, s.typical) == (0, 1.0, 0.0, 1.0)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty) == (1.0, 0.0, 0.0)
    assert s.penalty_range == 0 and s.token_bias == {}
    assert not s.is_greedy and not s.has_penalties
    # neutral means the final distribution is the plain softmax
    assert _final_probs(s, LOGITS) == pytest.approx(P, abs=1e-6)


def test_greedy_constructor_and_flags():
    g = SamplerSettings.greedy()
    assert g.temperature == 0.0 and g.is_greedy
    assert SamplerSettings(top_k=1).is_greedy
    assert not SamplerSettings(top_k=2).is_greedy
    assert SamplerSettings(presence_penalty=0.5).has_penalties
    assert SamplerSettings(repetition_penalty=1.2).has_penalties
    # each instance owns its bias dict
    assert SamplerSettings().token_bias is not SamplerSettings().token_bias


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"typical": 0.0}, "typical"),
        ({"typical": 1.01}, "typical"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"penalty_range": -1}, "penalty_range"),
        ({"token_bias": {-1: 1.0}}, "token_bias"),
        ({"token_bias": {"7": 1.0}}, "token_bias"),
        ({"token_bias": {3: math.nan}}, "token_bias"),
    ],
)
def test_invalid_settings_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplerSettings(**kwargs)


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        sample(_rows(LOGITS, 2), [SampleRequest(SamplerSettings(), random.Random(0))])


# -- greedy --------------------------------------------------------------------------------


def test_greedy_picks_argmax_of_logits_even_for_near_ties():
    near = [0.0, 0.5, 0.3, 0.5 + 1e-7, -2.0]
    t = torch.tensor([near], dtype=torch.float32)
    assert t[0, 3] > t[0, 1]  # still distinct in float32
    req = SampleRequest(SamplerSettings.greedy(), random.Random(0))
    assert sample(t, [req]).tokens == [3]
    # the same inside a batch with sampled rows (the non-shortcut path)
    batch = torch.tensor([LOGITS[:5], near, LOGITS[:5], near], dtype=torch.float32)
    reqs = [
        SampleRequest(SamplerSettings(), random.Random(1), return_probs=True),
        SampleRequest(SamplerSettings.greedy(), random.Random(2)),
        SampleRequest(SamplerSettings(top_p=0.5, temperature=1.5), random.Random(3)),
        SampleRequest(SamplerSettings(top_k=1), random.Random(4)),
    ]
    out = sample(batch, reqs)
    assert out.tokens[1] == 3 and out.tokens[3] == 3


def test_greedy_rows_mixed_with_sampled_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen)
    reqs = []
    for i in range(16):
        if i % 3 == 0:
            settings = SamplerSettings.greedy()
        elif i % 3 == 1:
            settings = SamplerSettings(top_k=1, temperature=0.7)
        else:
            settings = SamplerSettings(temperature=2.0)
        reqs.append(SampleRequest(settings, random.Random(i)))
    out = sample(logits, reqs)
    argmax = logits.argmax(-1).tolist()
    for i in range(16):
        if i % 3 != 2:
            assert out.tokens[i] == argmax[i]


def test_top_k_1_is_greedy_over_many_draws():
    counts = _draw_many(SamplerSettings(top_k=1, temperature=1.0), n=500)
    assert set(counts) == {1}
    counts = _draw_many(SamplerSettings(top_k=1, temperature=5.0), n=500, return_probs=True)
    assert set(counts) == {1}


def test_greedy_still_draws_one_number_per_call():
    """A job's random stream must not depend on its settings."""
    rng, ref = random.Random(42), random.Random(42)
    sample(_rows(LOGITS, 1), [SampleRequest(SamplerSettings.greedy(), rng)])
    ref.random()
    assert rng.random() == ref.random()


# -- truncations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "allowed"),
    [
        (SamplerSettings(top_k=3), {1, 5, 3}),
        (SamplerSettings(top_k=5), {1, 5, 3, 0, 7}),
        # smallest set of most likely tokens whose mass reaches top_p
        (SamplerSettings(top_p=0.3), {1}),
        (SamplerSettings(top_p=0.6), {1, 5}),  # 0.40 + 0.25 = 0.65 >= 0.6
        (SamplerSettings(top_p=0.7), {1, 5, 3}),  # 0.65 < 0.7 <= 0.80
        (SamplerSettings(top_p=0.85), {1, 5, 3, 0}),  # 0.80 < 0.85 <= 0.90
        # min_p: p >= min_p * max p (max p = 0.4)
        (SamplerSettings(min_p=0.3), {1, 5, 3}),  # threshold 0.12
        (SamplerSettings(min_p=0.2), {1, 5, 3, 0}),  # threshold 0.08
        (SamplerSettings(min_p=0.1), {1, 5, 3, 0, 7}),  # threshold 0.04
        # typical: entropy H = 1.575; ordered by |-log p - H|: 0.25, 0.15, 0.40, 0.10, ...
        (SamplerSettings(typical=0.3), {5, 3}),
        (SamplerSettings(typical=0.5), {5, 3, 1}),
        (SamplerSettings(typical=0.85), {5, 3, 1, 0}),
        # combined: top_k=4 keeps mass 0.9; top_p=0.7 of that is 0.63 -> {0.40, 0.25}
        (SamplerSettings(top_k=4, top_p=0.7), {1, 5}),
    ],
    ids=_short,
)
def test_truncation_allows_exactly_the_hand_computed_set(settings, allowed):
    counts = _draw_many(settings, n=3000)
    assert set(counts) == allowed  # only allowed tokens, and every allowed one shows up
    expected = _renormalised(allowed)
    assert _final_probs(settings, LOGITS) == pytest.approx(expected, abs=1e-6)


def test_temperature_scales_logits_before_truncation():
    for temp in (0.5, 2.0):
        expected = _softmax([x / temp for x in LOGITS])
        got = _final_probs(SamplerSettings(temperature=temp), LOGITS)
        assert got == pytest.approx(expected, abs=1e-6)
    # at temperature 2 the distribution is flatter: top_p=0.6 needs more tokens
    flat = _softmax([x / 2.0 for x in LOGITS])
    order = sorted(range(V), key=lambda i: -flat[i])
    mass, keep = 0.0, set()
    for i in order:
        if mass >= 0.6:
            break
        keep.add(i)
        mass += flat[i]
    assert len(keep) > 2
    assert set(_draw_many(SamplerSettings(temperature=2.0, top_p=0.6), n=3000)) == keep


# -- penalties -----------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    row = [2.0, 1.5, -1.0, -1.2, 0.5]
    s = SamplerSettings(repetition_penalty=2.0)
    got = _final_probs(s, row, context=[0, 2, 2])
    expected_logits = [1.0, 1.5, -2.0, -1.2, 0.5]  # 2/2 and -1*2; repeats count once
    assert got == pytest.approx(_softmax(expected_logits), abs=1e-6)
    # greedy outcome flips from token 0 to token 1
    out = sample(
        torch.tensor([row, row]),
        [
            SampleRequest(SamplerSettings.greedy(), random.Random(0), context=[0]),
            SampleRequest(
                SamplerSettings(temperature=0.0, repetition_penalty=2.0),
                random.Random(0),
                context=[0],
            ),
        ],
    )
    assert out.tokens == [0, 1]
    # negative logits move further down: [-1.0, -1.5] with token 0 penalised -> -2.0
    neg = [-1.0, -1.5]
    greedy_rep = SampleRequest(
        SamplerSettings(temperature=0.0, repetition_penalty=2.0), random.Random(0), context=[0]
    )
    assert sample(torch.tensor([neg]), [greedy_rep]).tokens == [1]


def test_frequency_and_presence_penalties_match_hand_computation():
    row = [0.0, 0.0, 0.0, 0.0, 0.0]
    context = [1, 1, 1, 2, 4, 1]
    counts = Counter(context)
    freq = SamplerSettings(frequency_penalty=0.5)
    expected = [-0.5 * counts.get(i, 0) for i in range(5)]
    assert _final_probs(freq, row, context=context) == pytest.approx(_softmax(expected), abs=1e-6)

    pres = SamplerSettings(presence_penalty=0.7)
    expected = [-0.7 if i in counts else 0.0 for i in range(5)]
    assert _final_probs(pres, row, context=context) == pytest.approx(_softmax(expected), abs=1e-6)

    # all three together: repetition first, then frequency and presence are subtracted
    row = [1.0, 2.0, -1.0, 0.5, 3.0]
    both = SamplerSettings(repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.1)
    expected = []
    for i, x in enumerate(row):
        if counts.get(i):
            x = x / 1.5 if x > 0 else x * 1.5
            x -= 0.25 * counts[i] + 0.1
        expected.append(x)
    assert _final_probs(both, row, context=context) == pytest.approx(_softmax(expected), abs=1e-6)

    # negative frequency penalty encourages repeats (greedy picks the repeated token)
    greedy = SampleRequest(
        SamplerSettings(temperature=0.0, frequency_penalty=-1.0), random.Random(0), context=[3]
    )
    assert sample(torch.zeros(1, 5), [greedy]).tokens == [3]


def test_penalty_range_limits_the_window_to_the_last_tokens():
    row = [0.0] * 6
    context = [1, 1, 1, 2, 3]
    s = SamplerSettings(presence_penalty=1.0, frequency_penalty=0.5, penalty_range=2)
    expected = [0.0, 0.0, -1.5, -1.5, 0.0, 0.0]  # only [2, 3] are looked at
    assert _final_probs(s, row, context=context) == pytest.approx(_softmax(expected), abs=1e-6)
    # a window larger than the context looks at everything
    s = SamplerSettings(presence_penalty=1.0, penalty_range=100)
    expected = [0.0, -1.0, -1.0, -1.0, 0.0, 0.0]
    assert _final_probs(s, row, context=context) == pytest.approx(_softmax(expected), abs=1e-6)
    # greedy: token 1 wins unless it is inside the window
    row = [0.0, 1.0, 0.9, 0.0]
    in_window = SamplerSettings(temperature=0.0, presence_penalty=0.5, penalty_range=1)
    reqs = [
        SampleRequest(in_window, random.Random(0), context=[1, 3]),
        SampleRequest(in_window, random.Random(0), context=[3, 1]),
    ]
    assert sample(torch.tensor([row, row]), reqs).tokens == [1, 2]


def test_penalties_without_context_change_nothing():
    s = SamplerSettings(repetition_penalty=3.0, frequency_penalty=1.0, presence_penalty=1.0)
    assert _final_probs(s, LOGITS) == pytest.approx(P, abs=1e-6)


def test_out_of_vocabulary_context_ids_are_ignored_by_penalties():
    row = [0.0, 1.0, 2.0, 0.5]
    s = SamplerSettings(presence_penalty=5.0, repetition_penalty=2.0)
    got = _final_probs(s, row, context=[10, 4])
    assert got == pytest.approx(_softmax(row), abs=1e-6)


# -- bias, bans, vocab limit ---------------------------------------------------------------


def test_token_bias_forces_a_token():
    s = SamplerSettings(token_bias={6: 100.0})  # token 6 has p = 0.01 without bias
    assert set(_draw_many(s, n=500)) == {6}
    greedy = SamplerSettings(temperature=0.0, token_bias={6: 100.0})
    assert set(_draw_many(greedy, n=10)) == {6}
    # a negative bias suppresses, an out-of-vocabulary id is ignored
    s = SamplerSettings(temperature=0.0, token_bias={1: -100.0, 10_000: 5.0})
    assert set(_draw_many(s, n=10)) == {5}


def test_infinite_token_bias():
    # +inf would make softmax NaN for the whole row: rejected up front, naming the field
    with pytest.raises(ValueError, match="token_bias"):
        SamplerSettings(token_bias={0: math.inf})
    # -inf is a ban
    s = SamplerSettings(token_bias={1: -math.inf, 5: -math.inf})
    counts = _draw_many(s, n=1000)
    assert not {1, 5} & set(counts)
    greedy = SamplerSettings(temperature=0.0, token_bias={1: -math.inf})
    assert set(_draw_many(greedy, n=5)) == {5}


def test_banned_tokens_are_never_picked():
    banned = [1, 5]  # the two most likely tokens
    counts = _draw_many(SamplerSettings(), n=2000, banned_tokens=banned)
    assert not set(counts) & set(banned)
    assert set(counts) == set(range(V)) - set(banned)
    greedy = _draw_many(SamplerSettings.greedy(), n=5, banned_tokens=banned)
    assert set(greedy) == {3}
    # bans win over bias; out-of-vocabulary bans are ignored
    s = SamplerSettings(token_bias={1: 50.0})
    counts = _draw_many(s, n=500, banned_tokens=[1, 999])
    assert 1 not in counts


def test_vocab_limit_excludes_padded_ids():
    row = [0.0, 0.1, 0.2, 0.3, 0.4, 5.0, 6.0, 7.0]  # padding rows have the largest logits
    counts = _draw_many(SamplerSettings(temperature=3.0), n=2000, row=row)
    assert max(counts) >= 5  # without a limit they are picked
    reqs = [SampleRequest(SamplerSettings(temperature=3.0), random.Random(i)) for i in range(2000)]
    out = sample(_rows(row, 2000), reqs, vocab_limit=5)
    assert max(out.tokens) < 5 and len(set(out.tokens)) == 5
    greedy = [SampleRequest(SamplerSettings.greedy(), random.Random(0))]
    assert sample(_rows(row, 1), greedy, vocab_limit=5).tokens == [4]
    # a limit at or above the vocabulary changes nothing
    assert sample(_rows(row, 1), greedy, vocab_limit=8).tokens == [7]
    assert sample(_rows(row, 1), greedy, vocab_limit=100).tokens == [7]


# -- reproducibility -----------------------------------------------------------------------


def _other_rows(step: int) -> list[SampleRequest]:
    return [
        SampleRequest(SamplerSettings.greedy(), random.Random(1000 + step)),
        SampleRequest(SamplerSettings(top_p=0.5, temperature=0.7), random.Random(step)),
        SampleRequest(
            SamplerSettings(repetition_penalty=1.3, frequency_penalty=0.2),
            random.Random(7),
            context=[1, 2, 3, 3],
        ),
        SampleRequest(SamplerSettings(typical=0.4, min_p=0.05), random.Random(99), top_k_return=3),
        SampleRequest(SamplerSettings(top_k=2), random.Random(5), banned_tokens=[0]),
    ]


def test_same_seed_same_tokens_alone_or_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    mine = SamplerSettings(temperature=0.9, top_k=20, presence_penalty=0.3)
    alone_rng, batch_rng = random.Random(1234), random.Random(1234)
    context: list[int] = [4, 4, 9]
    alone, batched = [], []
    for step in range(40):
        logits = torch.randn(6, 64, generator=gen)
        a = sample(logits[:1], [SampleRequest(mine, alone_rng, context=list(context))])
        others = _other_rows(step)
        position = step % 6  # the row's position in the batch varies
        reqs = [*others[:position], SampleRequest(mine, batch_rng, context=list(context))]
        reqs += others[position:]
        rows = torch.cat([logits[1 : 1 + position], logits[:1], logits[1 + position :]])
        b = sample(rows, reqs)
        alone.append(a.tokens[0])
        batched.append(b.tokens[position])
        context.append(a.tokens[0])
    assert alone == batched
    assert len(set(alone)) > 5  # it really sampled


def test_different_seeds_differ_and_same_seed_repeats():
    def run(seed: int) -> list[int]:
        rng = random.Random(seed)
        uniform = torch.zeros(1, 8)
        return [
            sample(uniform, [SampleRequest(SamplerSettings(), rng)]).tokens[0] for _ in range(60)
        ]

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert len(set(run(3))) == 8


# -- returned probabilities ----------------------------------------------------------------


def test_return_probs_and_top_k_return_shapes_and_values():
    reqs = [
        SampleRequest(SamplerSettings(), random.Random(0), return_probs=True, top_k_return=3),
        SampleRequest(SamplerSettings(top_p=0.6), random.Random(1), return_probs=True),
        SampleRequest(SamplerSettings(top_k=3), random.Random(2), top_k_return=5),
        SampleRequest(SamplerSettings(temperature=0.5), random.Random(3)),
        SampleRequest(SamplerSettings(), random.Random(4), top_k_return=100),  # > vocab
    ]
    out = sample(_rows(LOGITS, len(reqs)), reqs)
    assert len(out.tokens) == len(reqs) and len(out.probs) == len(reqs)
    assert [len(t) for t in out.top_tokens] == [3, 0, 5, 0, V]
    assert [len(p) for p in out.top_probs] == [3, 0, 5, 0, V]
    for tokens, probs in zip(out.top_tokens, out.top_probs, strict=True):
        assert probs == sorted(probs, reverse=True)
        assert sum(probs) <= 1.0 + 1e-6
        assert len(set(tokens)) == len(tokens)
    # row 0: plain softmax
    assert out.top_tokens[0] == [1, 5, 3]
    assert out.top_probs[0] == pytest.approx([0.40, 0.25, 0.15], abs=1e-6)
    assert out.probs[0] == pytest.approx(P[out.tokens[0]], abs=1e-6)
    # row 1: the chosen prob is taken from the truncated, renormalised distribution
    assert out.tokens[1] in {1, 5}
    assert out.probs[1] == pytest.approx(_renormalised({1, 5})[out.tokens[1]], abs=1e-6)
    # row 2: truncated tokens come back with probability 0
    assert out.top_tokens[2][:3] == [1, 5, 3]
    assert out.top_probs[2][:3] == pytest.approx([0.5, 0.25 / 0.8, 0.15 / 0.8], abs=1e-6)
    assert out.top_probs[2][3:] == [0.0, 0.0]
    assert sum(out.top_probs[4]) == pytest.approx(1.0, abs=1e-5)


def test_no_extras_when_nobody_asks():
    out = sample(
        _rows(LOGITS, 2), [SampleRequest(SamplerSettings(), random.Random(i)) for i in (0, 1)]
    )
    assert out.probs is None and out.top_tokens is None and out.top_probs is None


def test_empirical_distribution_matches_softmax():
    expected = [0.5, 0.3, 0.2]
    row = [math.log(p) + 3.0 for p in expected]  # a shift does not change softmax
    n = 4000
    rng = random.Random(2024)
    reqs = [SampleRequest(SamplerSettings(), rng) for _ in range(n)]
    counts = Counter(sample(_rows(row, n), reqs).tokens)
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < 0.03
    # temperature 0.5 squares and renormalises the probabilities
    sharp = [p**2 / sum(q**2 for q in expected) for p in expected]
    reqs = [SampleRequest(SamplerSettings(temperature=0.5), rng) for _ in range(n)]
    counts = Counter(sample(_rows(row, n), reqs).tokens)
    for token, p in enumerate(sharp):
        assert abs(counts[token] / n - p) < 0.03


# -- edge cases of the inverse CDF and of batch-wide truncation ----------------------------


class _AlmostOne(random.Random):
    """A generator whose draws sit just below 1 (a float32 copy of them rounds to 1.0)."""

    def random(self) -> float:
        return 1.0 - 2.0**-26


class _Zero(random.Random):
    def random(self) -> float:
        return 0.0


def test_uniform_at_the_ends_picks_the_first_and_last_allowed_token():
    row = [-5.0, math.log(0.7), -6.0, math.log(0.3), -7.0]
    # top_k=2 keeps tokens 1 (0.7) and 3 (0.3); cdf over the row: [0, .7, .7, 1, 1]
    near_one = SampleRequest(SamplerSettings(top_k=2), _AlmostOne())
    assert sample(torch.tensor([row]), [near_one]).tokens == [3]
    zero = SampleRequest(SamplerSettings(top_k=2), _Zero())
    assert sample(torch.tensor([row]), [zero]).tokens == [1]  # skips the truncated token 0
    # also when the draw lands exactly on an interior CDF boundary
    boundary = [math.log(0.5), -math.inf, math.log(0.5)]

    class _Half(random.Random):
        def random(self) -> float:
            return 0.5

    req = SampleRequest(SamplerSettings(), _Half())
    assert sample(torch.tensor([boundary]), [req]).tokens == [2]


@pytest.mark.parametrize(
    "other",
    [SamplerSettings(top_p=0.5), SamplerSettings(typical=0.5), SamplerSettings(min_p=0.2)],
    ids=_short,
)
def test_disabled_truncation_is_not_affected_by_other_rows(other):
    row = [0.0, -20.0, -1.0, -2.0]  # token 1 has p ~ 1.4e-9
    mine = SampleRequest(SamplerSettings(), random.Random(0), top_k_return=4)
    alone = sample(torch.tensor([row]), [mine]).top_probs[0]
    mine = SampleRequest(SamplerSettings(), random.Random(0), top_k_return=4)
    mixed = sample(torch.tensor([row, row]), [mine, SampleRequest(other, random.Random(1))])
    assert alone[-1] > 0
    assert mixed.top_probs[0] == alone
