"""The acceptance rules as pure functions: the exact speculative-sampling identity, hand-built
cases whose outcome is certain, a seeded Monte-Carlo check of speculative sampling's output
distribution, and MTAD's joint-likelihood rule."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import helpers
from verispec.core.acceptance import (
    Verdict,
    acceptance_mass,
    argmax,
    greedy_match,
    joint_likelihood,
    residual_distribution,
    sampled_match,
    speculative_sample,
    verify_lossless,
)
from verispec.core.drafters.base import Draft
from verispec.core.sampling import SamplingConfig, sample


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def one_hot_rows(*tokens: int, vocab: int = 6) -> torch.Tensor:
    rows = torch.zeros(len(tokens), vocab)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return rows  # [len(tokens), vocab]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_distribution(shape, generator, sparsity: float = 0.0) -> torch.Tensor:
    """Random probability rows; with sparsity > 0 some entries are exactly zero."""
    weights = torch.rand(*shape, generator=generator) ** 3
    if sparsity:
        weights = weights * (torch.rand(*shape, generator=generator) >= sparsity)
        weights[..., 0] += 1e-3  # never an all-zero row
    return weights / weights.sum(-1, keepdim=True)


# -- the exact identity -----------------------------------------------------------------------------

@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_speculative_identity_recovers_p(sparsity):
    """min(p,q) + (1 - sum min(p,q)) * norm(max(p-q, 0)) == p, for many random pairs."""
    generator = gen(1)
    p = random_distribution((500, 11), generator, sparsity).double()
    q = random_distribution((500, 11), generator, sparsity).double()
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)  # exactly normalised in float64
    recovered = torch.minimum(p, q) + (1 - acceptance_mass(p, q)).unsqueeze(-1) * residual_distribution(p, q)
    torch.testing.assert_close(recovered, p, rtol=0, atol=1e-12)


def test_speculative_identity_when_p_equals_q():
    p = random_distribution((3, 7), gen(2))
    torch.testing.assert_close(acceptance_mass(p, p), torch.ones(3))
    torch.testing.assert_close(residual_distribution(p, p), p)  # total: falls back to p
    recovered = torch.minimum(p, p) + (1 - acceptance_mass(p, p)).unsqueeze(-1) * residual_distribution(p, p)
    torch.testing.assert_close(recovered, p)


def test_residual_distribution_hand_built():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.4, 0.2, 0.2])
    # max(p - q, 0) = [0.3, 0, 0, 0] -> a point mass on token 0
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([1.0, 0, 0, 0]))
    torch.testing.assert_close(acceptance_mass(p, q), torch.tensor(0.2 + 0.3 + 0.2))


# -- greedy_match --------------------------------------------------------------------------------

def test_greedy_match_accepts_all_when_draft_is_the_argmax():
    logits = one_hot_rows(3, 1, 4, 2) * 5  # argmaxes 3, 1, 4, then 2
    assert greedy_match(ids(3, 1, 4), logits) == Verdict(3, 2)


@pytest.mark.parametrize("draft,expected", [((0, 1, 4), Verdict(0, 3)), ((3, 0, 4), Verdict(1, 1)),
                                            ((3, 1, 0), Verdict(2, 4))])
def test_greedy_match_stops_at_the_first_mismatch(draft, expected):
    logits = one_hot_rows(3, 1, 4, 2) * 5
    assert greedy_match(ids(*draft), logits) == expected


def test_greedy_match_does_not_resume_after_a_mismatch():
    logits = one_hot_rows(3, 1, 4, 2)
    assert greedy_match(ids(3, 5, 4), logits) == Verdict(1, 1)


def test_greedy_match_empty_draft():
    assert greedy_match(ids(), one_hot_rows(5)) == Verdict(0, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_equals_torch_argmax_ties_and_nan_included(dtype):
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(20, 262_144, generator=generator).to(dtype)
    rows[1, 7] = rows[1, 70_000] = rows[1].max() + 1  # a tie: the first index wins
    rows[2, 5:9] = float("inf")
    rows[3, 11] = rows[3, 12] = float("nan")  # NaN counts as the largest, the first NaN wins
    rows[4] = -float("inf")
    rows[5, 3::7] = 1000.0
    for row in [*rows, rows[:, 1]]:  # last: a strided (non-contiguous) column
        assert argmax(row) == int(torch.argmax(row))


def test_rules_check_shapes():
    with pytest.raises(AssertionError):
        greedy_match(ids(1, 2), one_hot_rows(1, 2))  # needs k + 1 rows
    with pytest.raises(AssertionError):
        speculative_sample(ids(1), torch.ones(2, 6) / 6, one_hot_rows(1, 2), gen())  # q must be [k, V]


# -- sampled_match -------------------------------------------------------------------------------

def test_sampled_match_with_certain_target():
    p = one_hot_rows(3, 1, 4, 2)
    assert sampled_match(ids(3, 1, 4), p, gen()) == Verdict(3, 2)
    assert sampled_match(ids(3, 0, 4), p, gen()) == Verdict(1, 1)
    assert sampled_match(ids(0, 1, 4), p, gen()) == Verdict(0, 3)
    assert sampled_match(ids(), p[:1], gen()) == Verdict(0, 3)


def test_sampled_match_draws_one_sample_per_committed_token_in_order():
    """The same draws autoregressive sampling would make: sample p_1, compare, sample p_2, ..."""
    p = random_distribution((6, 4), gen(3))
    for seed in range(200):
        draft = torch.randint(0, 4, (5,), generator=gen(1000 + seed))
        verdict = sampled_match(draft, p, gen(seed))
        replay = gen(seed)
        expected_tokens = []
        for i in range(6):
            token = sample(p[i], replay)
            expected_tokens.append(token)
            if i == 5 or token != int(draft[i]):
                break
        assert verdict == Verdict(len(expected_tokens) - 1, expected_tokens[-1])
        assert expected_tokens[:-1] == draft[: verdict.n_accepted].tolist()


# -- speculative_sample: certain cases -----------------------------------------------------------

def test_speculative_sample_accepts_everything_when_p_equals_q():
    generator = gen(4)
    for trial in range(100):
        p = random_distribution((5, 6), generator)
        draft = torch.stack([torch.multinomial(p[i], 1, generator=generator)[0] for i in range(4)])
        verdict = speculative_sample(draft, p[:4], p, generator)
        assert verdict.n_accepted == 4


def test_speculative_sample_rejects_a_token_the_target_never_produces():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.3, 0.3, 0.4]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for seed in range(50):
        # rejected at 0; residual max(p - q, 0) = [0, 1, 0] -> token 1 for sure
        assert speculative_sample(ids(0), q, p, gen(seed)) == Verdict(0, 1)


def test_speculative_sample_always_accepts_when_p_at_least_q():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.3, 0.4, 0.3], [0.3, 0.2, 0.5]])
    for seed in range(50):
        # p(1) = 0.6 >= q(1) = 0.4 and p(1) = 0.5 >= q(1) = 0.2: both accepted; then p_3 is certain
        assert speculative_sample(ids(1, 1), q, p, gen(seed)) == Verdict(2, 2)


def test_speculative_sample_stops_at_first_rejection_and_samples_residual():
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for seed in range(20):
        # first accepted (p == q there), second has p = 0 -> rejected; residual = [1, 0, 0]
        assert speculative_sample(ids(1, 2), q, p, gen(seed)) == Verdict(1, 0)


def test_speculative_sample_empty_draft_samples_from_p():
    p = one_hot_rows(4)
    assert speculative_sample(ids(), torch.empty(0, 6), p, gen()) == Verdict(0, 4)


# -- speculative_sample: Monte-Carlo -------------------------------------------------------------

ALPHA = 1e-4  # per-test false-positive rate of each chi-square goodness-of-fit check below


@pytest.mark.long
def test_speculative_sample_output_is_distributed_as_p():
    """Seeded Monte-Carlo: draft d_i ~ q_i independently, run speculative sampling, and compare
    (a) the first emitted token with p_1 and (b) given d_1 was accepted, the second emitted token
    with p_2, by Pearson chi-square tests at level ALPHA (a correct implementation fails each with
    probability ALPHA over seeds; the seed is fixed, so the outcome is deterministic). 20,000
    trials; p and q differ substantially so that rejections and residual draws are frequent."""
    vocab, k, trials = 5, 3, 20_000
    generator = gen(5)
    p = random_distribution((k + 1, vocab), generator, sparsity=0.3)
    q = random_distribution((k, vocab), generator, sparsity=0.3)
    q[:, 0] += 0.3  # q puts extra mass where p may have little
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=generator)
                          for i in range(k)], dim=1)  # [trials, k]
    first, second = Counter(), Counter()
    rejected_first = 0
    for trial in range(trials):
        draft = drafts[trial]
        verdict = speculative_sample(draft, q, p, generator)
        emitted = draft[: verdict.n_accepted].tolist() + [verdict.next_token]
        first[emitted[0]] += 1
        if verdict.n_accepted >= 1:
            second[emitted[1]] += 1
        else:
            rejected_first += 1
    # Both branches were exercised a lot.
    assert 0.1 * trials < rejected_first < 0.9 * trials
    for counts, row in [(first, p[0]), (second, p[1])]:
        expected = {token: float(row[token]) for token in range(vocab)}
        statistic, pvalue, df = helpers.chi_square_pvalue(counts, expected)
        assert pvalue > ALPHA, (statistic, df, dict(counts), expected)


def test_chi_square_helper_detects_a_wrong_distribution():
    """Power check of the test above: the same machinery rejects q in place of p."""
    vocab, trials = 5, 20_000
    generator = gen(6)
    p = random_distribution((1, vocab), generator)[0]
    q = (p + torch.tensor([0.1, 0, 0, 0, 0])) / 1.1
    draws = Counter(torch.multinomial(q, trials, replacement=True, generator=generator).tolist())
    _, pvalue, _ = helpers.chi_square_pvalue(draws, {t: float(p[t]) for t in range(vocab)})
    assert pvalue < ALPHA
    draws_p = Counter(torch.multinomial(p, trials, replacement=True, generator=generator).tolist())
    assert helpers.chi_square_pvalue(draws_p, {t: float(p[t]) for t in range(vocab)})[1] > ALPHA


# -- joint_likelihood (MTAD) ---------------------------------------------------------------------

def _jl_case(p_of_draft: list[float], q_of_draft: list[float], vocab: int = 6):
    """Draft tokens 0..k-1; row i of p gives drafted token i the probability p_of_draft[i] and
    puts the rest of its mass on the last token; row k is a point mass on the last token, so the
    token sampled after accepting everything is certain."""
    k = len(p_of_draft)
    p = torch.zeros(k + 1, vocab)
    for i, mass in enumerate(p_of_draft):
        p[i, i] = mass
        p[i, vocab - 1] = 1.0 - mass
    p[k, vocab - 1] = 1.0
    return ids(*range(k)), torch.tensor(q_of_draft), p


def test_joint_likelihood_takes_the_longest_passing_prefix_not_the_first_failure():
    # log ratios: ln(0.9/0.5) > 0, then a big drop (cumulative < 0), then a big gain (> 0 again)
    draft, q, p = _jl_case([0.9, 0.1, 1.0], [0.5, 0.9, 0.1])
    cumulative = torch.cumsum(torch.log(p[torch.arange(3), draft] / q), 0)
    assert cumulative[0] > 0 and cumulative[1] < 0 and cumulative[2] > 0
    # tau = 1: L = 3 passes (the longest), even though L = 2 failed
    verdict = joint_likelihood(draft, q, p, tau=1.0, generator=gen())
    assert verdict == Verdict(3, 5)


def test_joint_likelihood_accepts_nothing_when_no_prefix_passes():
    draft, q, p = _jl_case([0.1, 0.1], [0.9, 0.9])
    p[0] = torch.tensor([0, 0, 0, 1.0, 0, 0])  # drafted token 0 has p = 0 -> log ratio -inf
    verdict = joint_likelihood(draft, q, p, tau=0.5, generator=gen())
    assert verdict == Verdict(0, 3)  # L = 0; the next token is drawn from p_1 (certain here)


def test_joint_likelihood_tiny_tau_accepts_everything():
    draft, q, p = _jl_case([0.01, 0.02, 0.03], [0.9, 0.9, 0.9])
    assert joint_likelihood(draft, q, p, tau=1e-30, generator=gen()).n_accepted == 3
    # and a large tau rejects the same draft entirely
    assert joint_likelihood(draft, q, p, tau=1e6, generator=gen()).n_accepted == 0


def test_joint_likelihood_threshold_is_strict():
    draft, q, p = _jl_case([0.5], [0.5])  # ratio exactly 1: log ratio 0, not > log(1)
    assert joint_likelihood(draft, q, p, tau=1.0, generator=gen()).n_accepted == 0
    assert joint_likelihood(draft, q, p, tau=0.999, generator=gen()).n_accepted == 1


def test_joint_likelihood_samples_the_next_token_from_row_l_plus_1():
    draft, q, p = _jl_case([0.9, 0.9], [0.1, 0.1])
    p[2] = torch.tensor([0, 0, 1.0, 0, 0, 0])
    assert joint_likelihood(draft, q, p, tau=1.0, generator=gen()) == Verdict(2, 2)


def test_joint_likelihood_empty_draft_and_bad_tau():
    assert joint_likelihood(ids(), torch.empty(0), one_hot_rows(2), tau=1.0, generator=gen()) == Verdict(0, 2)
    with pytest.raises(AssertionError):
        joint_likelihood(ids(), torch.empty(0), one_hot_rows(2), tau=0.0, generator=gen())


# -- verify_lossless routing ---------------------------------------------------------------------

def test_verify_lossless_greedy_uses_argmax():
    logits = one_hot_rows(2, 3, 1) * 3
    assert verify_lossless(Draft.of([2, 0]), logits, SamplingConfig(), gen()) == Verdict(1, 3)


def test_verify_lossless_sampling_with_and_without_q():
    logits = torch.log(one_hot_rows(2, 3, 1) * (1 - 1e-6) + 1e-6 / 6)  # nearly certain rows
    sampling = SamplingConfig(temperature=1.0, top_k=1)  # top_k=1 makes them exactly certain
    assert verify_lossless(Draft.of([2, 3]), logits, sampling, gen()) == Verdict(2, 1)
    assert verify_lossless(Draft.of([2, 0]), logits, sampling, gen()) == Verdict(1, 3)
    q = one_hot_rows(2, 0)  # q = 1 on token 0 at row 1, where p(0) = 0: rejected, residual = p
    draft = Draft(ids(2, 0), q=q)
    assert verify_lossless(draft, logits, sampling, gen()) == Verdict(1, 3)
    assert math.isclose(float(acceptance_mass(one_hot_rows(3)[0], q[1])), 0.0)
