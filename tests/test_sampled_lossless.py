"""Sampling is lossless at the sequence level.

On a micro Llama with an 8-token vocabulary, the exact distribution of the first three generated
tokens under autoregressive sampling is computed by enumeration (8^3 outcomes). Each method is
run over many seeds, and its empirical distribution of those three tokens is compared with the
exact one by a Pearson chi-square goodness-of-fit test (cells with expected count < 5 pooled).

Statistical contract: ALPHA = 1e-4 is the false-positive rate of each chi-square test, i.e. the
probability that a correct implementation fails it for a random choice of seeds. The seeds are
fixed, so each test is deterministic; a correct implementation with these seeds passes.

Two more checks, both exact:
- Deterministic drafts (q = None: `anpd`, and a scripted drafter) use `sampled_match`, which
  draws exactly one sample per committed token, in order, as `ar` does. With the same seed they
  therefore produce the *same* tokens as `ar` (up to float rounding of a k-row forward against
  one-row forwards, which could flip a draw only when a uniform lands within ~1e-7 of a bucket
  edge); we require >= 99.5% identical and see 100%.
- A drafter with a q distribution goes through `speculative_sample`: identical only in
  distribution, so the chi-square test is its check. A negative control (a rule that samples
  from p instead of the residual after a rejection, a classic bug) must fail the same test at
  the same sample size, showing the test has the power to catch it.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import helpers
from verispec.core.acceptance import Verdict, verify_lossless
from verispec.core.control import ConstantLength
from verispec.core.engine import Recipe
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig, probabilities, sample

pytestmark = pytest.mark.long

ALPHA = 1e-4
VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
LENGTH = 3  # tokens whose joint distribution is tested
MAX_NEW = 5  # generate a little more so drafts cover the tested positions with k > 1
CONFIGS = {
    "t1": (SamplingConfig(temperature=1.0), 500),
    "t0.8-k5-p0.9": (SamplingConfig(temperature=0.8, top_k=5, top_p=0.9), 300),
}


@pytest.fixture(scope="module")
def micro() -> Target:
    # init 0.3: neither flat nor nearly deterministic (top outcome ~0.3 of the 512)
    return Target(helpers.make_model(helpers.micro_llama_config(VOCAB, init=0.3), seed=0), None, name="micro")


@pytest.fixture(scope="module")
def greedy_reference(micro) -> list[int]:
    return helpers.run(micro, build("ar", micro), PROMPT, MAX_NEW)[0]


def sample_many(target, make_recipe, sampling: SamplingConfig, seeds: int):
    """First LENGTH tokens of `seeds` seeded runs, and the summed stats counts."""
    outcomes, accepted, drafted = [], 0, 0
    for seed in range(seeds):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        recipe = make_recipe(seed) if getattr(make_recipe, "takes_seed", False) else make_recipe()
        ids, stats, _ = helpers.run(target, recipe, PROMPT, MAX_NEW, config)
        assert len(ids) == MAX_NEW
        outcomes.append(tuple(ids[:LENGTH]))
        accepted += stats.accepted
        drafted += stats.drafted
    return outcomes, accepted, drafted


def conditional_argmax(exact: dict):
    """plausible(context): the most likely next token given the generated prefix (exact), for
    prefixes shorter than LENGTH; a fixed guess after that."""
    table = {}
    for outcome, probability in exact.items():
        for cut in range(LENGTH):
            key = (outcome[:cut], outcome[cut])
            table[key] = table.get(key, 0.0) + probability

    def plausible(context):
        generated = tuple(context[len(PROMPT):])
        options = {t: table.get((generated, t), 0.0) for t in range(VOCAB)}
        if len(generated) >= LENGTH or not any(options.values()):
            return (context[-1] + 1) % VOCAB
        return max(options, key=options.get)

    return plausible



@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_deterministic_drafts_are_lossless_under_sampling(micro, greedy_reference, config_name):
    sampling, seeds = CONFIGS[config_name]
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, LENGTH, sampling)
    assert abs(sum(exact.values()) - 1) < 1e-9

    ar, _, _ = sample_many(micro, lambda: build("ar", micro), sampling, seeds)
    helpers.assert_fits(ar, exact, "ar")  # validates the exact oracle and the ar path

    recipes = {
        "anpd": lambda: build("anpd", micro, MethodOptions(controller="constant:4")),
        "scripted": lambda: helpers.scripted_recipe(
            helpers.ScriptedDrafter(greedy_reference, "all", VOCAB, lenient=True), 4),
    }
    for label, make_recipe in recipes.items():
        outcomes, accepted, drafted = sample_many(micro, make_recipe, sampling, seeds)
        assert accepted > 0.02 * seeds and accepted < drafted, (label, accepted, drafted)  # both paths
        helpers.assert_fits(outcomes, exact, label)
        same = sum(a == b for a, b in zip(ar, outcomes))
        assert same >= 0.995 * seeds, f"{label}: only {same}/{seeds} seeds reproduce ar"


def test_model_drafts_with_q_are_lossless_in_distribution(micro):
    sampling, _ = CONFIGS["t1"]
    seeds = 600
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, LENGTH, sampling)
    plausible = conditional_argmax(exact)

    def recipe(rule=verify_lossless):
        # The drafter's own randomness must be independent of the target's and fresh per
        # request (a fixed drafter seed would make q a lie), hence a seed derived per run.
        def make(seed):
            drafter = helpers.DistributionDrafter(VOCAB, plausible, seed=1_000_003 + seed)
            return Recipe(drafter, ConstantLength(3), rule)

        make.takes_seed = True
        return make

    outcomes, accepted, drafted = sample_many(micro, recipe(), sampling, seeds)
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    helpers.assert_fits(outcomes, exact, "q-drafter")

    # Negative control: after a rejection, sample from p instead of norm(max(p - q, 0)).
    def broken_rule(draft, logits, config, generator):
        p = probabilities(logits, config)  # [k+1, vocab]
        for i, token in enumerate(draft.tokens.tolist()):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if not u * float(draft.q[i, token]) < float(p[i, token]):
                return Verdict(i, sample(p[i], generator))
        return Verdict(len(draft), sample(p[len(draft)], generator))

    broken, _, _ = sample_many(micro, recipe(broken_rule), sampling, seeds)
    _, pvalue, _ = helpers.chi_square_pvalue(Counter(broken), exact)
    assert pvalue < ALPHA, "the chi-square test lacks the power to see a wrong residual"


def test_sampling_with_a_seed_is_reproducible(micro):
    sampling = SamplingConfig(temperature=1.0, seed=123)
    recipe = lambda: build("anpd", micro, MethodOptions(controller="constant:4"))  # noqa: E731
    first = helpers.run(micro, recipe(), PROMPT, 12, sampling)[0]
    assert helpers.run(micro, recipe(), PROMPT, 12, sampling)[0] == first
