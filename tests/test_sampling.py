"""Logits -> probabilities: the fast path equals the slow reference; top-k / top-p keep the right
sets; every valid configuration (top_p and temperature down to the smallest double included)
gives a distribution that keeps the most likely token; SamplingConfig rejects bad values."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec.core import sampling as sampling_module
from verispec.errors import ConfigError
from verispec.core.sampling import SamplingConfig, probabilities, probabilities_reference, sample

CONFIGS = [
    SamplingConfig(temperature=t, top_k=k, top_p=p)
    for t, k, p in itertools.product((0.0, 0.3, 1.0, 1.7), (0, 1, 5, 40), (1.0, 0.95, 0.5, 0.05))
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"t{c.temperature}-k{c.top_k}-p{c.top_p}")
def test_probabilities_equals_reference(config):
    generator = torch.Generator().manual_seed(hash((config.temperature, config.top_k, config.top_p)) % 2**31)
    for rows, vocab, scale in [(1, 7, 1.0), (4, 50, 3.0), (3, 300, 0.3)]:
        logits = torch.randn(rows, vocab, generator=generator) * scale
        fast = probabilities(logits, config)
        slow = probabilities_reference(logits, config)
        assert fast.shape == (rows, vocab) and fast.dtype == torch.float32
        torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-7)
        # Same support exactly, and rows sum to one.
        assert torch.equal(fast > 0, slow > 0)
        torch.testing.assert_close(fast.sum(-1), torch.ones(rows), rtol=0, atol=1e-5)


def test_probabilities_equals_reference_past_the_top_p_candidate_window(monkeypatch):
    """When the nucleus needs more than the top candidates, the fast path falls back to the full
    sort; force that with a tiny candidate window and a flat distribution."""
    monkeypatch.setattr(sampling_module, "_TOP_P_CANDIDATES", 4)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=generator) * 0.1  # nearly flat: 90% needs ~58 tokens
    for config in (SamplingConfig(1.0, 0, 0.9), SamplingConfig(0.7, 30, 0.99), SamplingConfig(1.0, 0, 0.02)):
        torch.testing.assert_close(probabilities(logits, config), probabilities_reference(logits, config),
                                   rtol=1e-6, atol=1e-7)


def test_probabilities_reference_accepts_other_float_dtypes():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    config = SamplingConfig(0.8, 5, 0.9)
    torch.testing.assert_close(probabilities(logits, config), probabilities_reference(logits, config))


def test_greedy_config_returns_plain_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    torch.testing.assert_close(probabilities(logits, SamplingConfig()), torch.softmax(logits, -1))
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.5).greedy


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    torch.testing.assert_close(probabilities(logits, SamplingConfig(temperature=0.5)),
                               torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5, 2.5]])
    probs = probabilities(logits, SamplingConfig(temperature=1.0, top_k=3))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {1, 3, 5}
    expected = torch.softmax(torch.tensor([3.0, 2.0, 2.5]), -1)
    torch.testing.assert_close(probs[0, [1, 3, 5]], expected)
    # top_k >= vocab keeps everything
    assert (probabilities(logits, SamplingConfig(temperature=1.0, top_k=6)) > 0).all()
    assert (probabilities(logits, SamplingConfig(temperature=1.0, top_k=100)) > 0).all()
    # top_k = 1 is a point mass on the argmax
    assert probabilities(logits, SamplingConfig(temperature=1.0, top_k=1))[0].tolist() == [0, 1, 0, 0, 0, 0]


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


@pytest.mark.parametrize(
    "top_p,kept",
    [
        # (boundaries are approached within 0.01, not hit exactly: softmax rounding decides ties)
        (0.49, {0}),  # 0.5 alone reaches it
        (0.51, {0, 1}),  # needs the 2nd token
        (0.74, {0, 1}),  # 0.5 + 0.25
        (0.76, {0, 1, 2}),
        (0.89, {0, 1, 2}),  # 0.5 + 0.25 + 0.15 = 0.9
        (0.91, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
        (0.01, {0}),  # the most likely token is always kept
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs_in = [0.5, 0.25, 0.15, 0.1]
    probs = probabilities(_logits_of(probs_in), SamplingConfig(temperature=1.0, top_p=top_p))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == kept
    renormalised = torch.tensor([probs_in[i] for i in sorted(kept)])
    torch.testing.assert_close(probs[0, sorted(kept)], renormalised / renormalised.sum())


@pytest.mark.parametrize("top_k", [0, 3])
@pytest.mark.parametrize("top_p", [1e-46, 1e-300, 5e-324, 1e-45])  # 0 in float32 (1e-45: its smallest)
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(top_p, top_k):
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5], [5.0, 0.0, 0.0, 4.9]])
    config = SamplingConfig(temperature=1.0, top_k=top_k, top_p=top_p)
    for probs in (probabilities(logits, config), probabilities_reference(logits, config)):
        assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])), probs
    assert sample(probabilities(logits, config)[0], torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-46, 1e-40, 1e-7])
def test_a_tiny_temperature_is_the_argmax_not_nan(temperature):
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.5], [-3.0, -3.0, -7.0, -4.0]])  # a tie in row 1
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
        config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        fast, slow = probabilities(logits, config), probabilities_reference(logits, config)
        assert torch.equal(fast[0], torch.tensor([0.0, 1.0, 0.0, 0.0])), fast
        assert torch.equal(slow[0], fast[0])
        assert torch.isfinite(fast).all() and fast[1, 2:].sum() == 0  # only the tied maxima
        if top_p == 1.0:
            assert torch.equal(fast[1], torch.tensor([0.5, 0.5, 0.0, 0.0])) and torch.equal(slow[1], fast[1])


VALID_CONFIGS = st.builds(
    SamplingConfig,
    temperature=st.one_of(st.floats(min_value=0, max_value=2), st.sampled_from([5e-324, 1e-300, 1e-45, 2.0])),
    top_k=st.one_of(st.integers(0, 12), st.integers(min_value=0)),
    top_p=st.one_of(st.floats(min_value=0, max_value=1, exclude_min=True),
                    st.sampled_from([5e-324, 1e-300, 1e-46, 1e-45, 1.0 - 1e-16, 1.0])),
)


@settings(max_examples=300, deadline=None)
@given(config=VALID_CONFIGS, seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.01, 1.0, 30.0, 1e4]))
def test_every_valid_config_gives_a_distribution_that_keeps_the_argmax(config, seed, scale):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed)) * scale
    probs = probabilities(logits, config)
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    torch.testing.assert_close(probs.sum(-1), torch.ones(3), rtol=0, atol=1e-5)
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()
    if not config.greedy:
        assert 0 <= sample(probs[0], torch.Generator().manual_seed(seed)) < 40


def test_top_p_reads_tokens_in_probability_order_not_index_order():
    probs_in = [0.1, 0.15, 0.25, 0.5]
    probs = probabilities(_logits_of(probs_in), SamplingConfig(temperature=1.0, top_p=0.7))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {2, 3}


def test_top_k_then_top_p():
    # top_k=3 keeps {0,1,2} renormalised to 0.5/0.9, 0.25/0.9, 0.15/0.9 = .556 .278 .167;
    # top_p 0.8 then needs the first two (0.556 < 0.8, 0.833 >= 0.8).
    probs = probabilities(_logits_of([0.5, 0.25, 0.15, 0.1]), SamplingConfig(1.0, 3, 0.8))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {0, 1}


def test_sample_draws_from_the_support():
    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    draws = [sample(probs, generator) for _ in range(200)]
    assert set(draws) <= {1, 3} and draws.count(1) > draws.count(3)


def test_sample_follows_the_distribution_and_never_draws_a_zero():
    """The inverse-CDF draw is an exact draw: Pearson chi-square at level 1e-4 against probs
    with zeros interleaved (a wrong search side would land on them), unnormalised mass, and a
    wrong law is rejected by the same check."""
    from helpers import chi_square_pvalue

    generator = torch.Generator().manual_seed(7)
    probs = torch.rand(40, generator=generator) * (torch.arange(40) % 3 != 0)  # zeros at 0, 3, ...
    probs = probs * 3.7  # sample does not need a normalised vector
    draws = [sample(probs, generator) for _ in range(20000)]
    counts = {t: draws.count(t) for t in set(draws)}
    assert all(probs[t] > 0 for t in counts)
    expected = {t: float(probs[t] / probs.sum()) for t in range(40) if probs[t] > 0}
    assert chi_square_pvalue(counts, expected)[1] > 1e-4
    wrong = {t: 1.0 / len(expected) for t in expected}
    assert chi_square_pvalue(counts, wrong)[1] < 1e-4


def test_sample_point_mass_and_last_entry():
    generator = torch.Generator().manual_seed(0)
    for index in (0, 5, 9):
        probs = torch.zeros(10)
        probs[index] = 1.0
        assert {sample(probs, generator) for _ in range(50)} == {index}


def test_seeded_generator_is_reproducible():
    """Each generator() of a seeded config starts the same stream, one seeded with `seed` itself;
    another seed, or no seed, gives another stream (20 draws from 100 tokens: equal by chance
    with probability 1e-40)."""
    probs = torch.full((100,), 0.01)

    def draws(generator: torch.Generator) -> list[int]:
        return [sample(probs, generator) for _ in range(20)]

    seeded = SamplingConfig(temperature=1.0, seed=42)
    first = draws(seeded.generator())
    assert draws(seeded.generator()) == first
    assert draws(torch.Generator().manual_seed(42)) == first
    assert draws(SamplingConfig(temperature=1.0, seed=43).generator()) != first
    unseeded = SamplingConfig(temperature=1.0)
    assert draws(unseeded.generator()) != draws(unseeded.generator())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1.0),
        dict(temperature=-1e-9),
        dict(temperature=float("nan")),
        dict(temperature="hot"),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_p=0.0),
        dict(top_p=-0.1),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
        dict(seed=-1),
        dict(seed=1.5),
    ],
)
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        SamplingConfig(**kwargs)


def test_config_error_is_a_value_error_and_names_the_option():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=2.0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingConfig(temperature=-2)


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        # expected: (temperature, top_k, top_p, seed, greedy); dict() shows the defaults
        (dict(), (0.0, 0, 1.0, None, True)),
        (dict(temperature=0.7, top_k=50, top_p=0.9, seed=0), (0.7, 50, 0.9, 0, False)),
        (dict(top_p=1), (0.0, 0, 1, None, True)),
        (dict(temperature=2, top_k=1, top_p=1e-6, seed=2**40), (2, 1, 1e-6, 2**40, False)),
    ],
)
def test_sampling_config_accepts_valid_values(kwargs, expected):
    config = SamplingConfig(**kwargs)
    assert (config.temperature, config.top_k, config.top_p, config.seed, config.greedy) == expected
