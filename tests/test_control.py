"""Draft-length controllers on synthetic acceptance streams.

A simulated step: the controller says K; draft token j is produced and `keep(j, c_j)` asked;
the draft is verified: each token is accepted with probability alpha (or with its confidence,
in the calibrated setting) until the first rejection. Costs, relative to a one-token target
forward: a draft token costs `draft_cost`, a verification of w tokens 1 + slope * (w - 1).
Throughput = committed tokens / total cost. Each test uses fixed seeds (deterministic).
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest

import helpers
from verispec.core.control import (
    model_draft_length,
    BetaThompson, CalibratedThompson, ConstantLength, ControllerMemory, CostModel, ExpectedThroughput, Heuristic,
    agreement_runs, best_draft_length, break_even_thresholds, constant_trace_cost, oracle_trace_cost,
    parse_controller, threshold_trace_cost,
)
from verispec.errors import ConfigError
from verispec.core.methods import CONTROLLER_MEMORIES, MethodOptions, build
from verispec.core.sampling import SamplingConfig

DRAFT_COST = 0.15
SLOPE = 0.1


def verify_cost(width: int) -> float:
    return 1.0 + SLOPE * (width - 1)


def simulate(controller, alphas, seed=0, confident=False):
    """Run len(alphas) steps; alphas[i] is the acceptance probability at step i. With
    confident=True each token gets a random confidence c and is accepted with probability c
    (a perfectly calibrated drafter, mean acceptance 0.5). Returns tokens / cost per step."""
    rng = random.Random(seed)
    tokens = cost = 0.0
    per_step = []
    for alpha in alphas:
        k = controller.next_length()
        confidences, accepted_flags = [], []
        previous = None
        while len(confidences) < k and controller.keep(len(confidences), previous):
            c = rng.random() if confident else alpha
            confidences.append(c)
            accepted_flags.append(rng.random() < c)
            previous = c if confident else None
        drafted = controller.cut(confidences if confident else [], len(confidences))
        accepted = 0
        for flag in accepted_flags[:drafted]:
            if not flag:
                break
            accepted += 1
        step_cost = DRAFT_COST * len(confidences) + verify_cost(drafted + 1)
        controller.observe(drafted, accepted, confidences[:drafted], verify_cost(drafted + 1) * 0.1,
                           DRAFT_COST * 0.1 * len(confidences))
        tokens += accepted + 1
        cost += step_cost
        per_step.append((accepted + 1, step_cost))
    return tokens / cost, per_step


def rate(per_step):
    return sum(t for t, _ in per_step) / sum(c for _, c in per_step)


def best_constant(alphas, confident=False):
    return max(simulate(ConstantLength(k), alphas, seed=1, confident=confident)[0] for k in range(0, 13))


@pytest.mark.long
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9])
@pytest.mark.parametrize("controller_class", [BetaThompson, CalibratedThompson])
def test_thompson_is_within_10_percent_of_the_best_constant(alpha, controller_class):
    alphas = [alpha] * 3000
    throughput, _ = simulate(controller_class(12), alphas)
    assert throughput >= 0.9 * best_constant(alphas), (alpha, throughput)


@pytest.mark.long
def test_thompson_readapts_after_the_acceptance_rate_changes():
    alphas = [0.9] * 1500 + [0.3] * 1500
    controller = BetaThompson(12)
    _, per_step = simulate(controller, alphas)
    late = per_step[2000:]  # well after the change
    best_after = best_constant([0.3] * 1500)
    assert rate(late) >= 0.9 * best_after
    # and it had really been drafting long before the change
    high = best_constant([0.9] * 1500)
    assert rate(per_step[500:1500]) >= 0.9 * high


def test_thompson_finds_a_drafter_again_when_its_acceptance_rises():
    alphas = [0.1] * 1500 + [0.9] * 1500  # below break-even (0.25 here), then well above it
    _, per_step = simulate(BetaThompson(12), alphas)
    assert rate(per_step[:1500]) >= 0.95  # hardly drafts while it does not pay
    assert rate(per_step[2000:]) >= 0.9 * best_constant([0.9] * 1500)


@pytest.mark.parametrize("controller_class", [BetaThompson, CalibratedThompson])
def test_thompson_seldom_drafts_with_a_drafter_below_break_even(monkeypatch, controller_class):
    """The EESD head on 2 CPU cores: a draft token costs 0.375 of a step, each verified row 0.35
    (break-even acceptance ~0.72), the head is accepted 39% of the time. Without the posterior's
    floor the decay flattened it between drafts and the controller kept drafting at a loss (4.3%
    of steps, 0.977 of not drafting); with it, 0.5% of steps."""
    monkeypatch.setattr(sys.modules[__name__], "DRAFT_COST", 0.375)
    monkeypatch.setattr(sys.modules[__name__], "SLOPE", 0.35)
    alphas = [0.39] * 1400
    throughput, per_step = simulate(controller_class(8), alphas)
    drafting = sum(cost > 1.0 + 1e-9 for _, cost in per_step) / len(per_step)
    assert drafting < 0.02
    assert throughput >= 0.99 * best_constant(alphas)


@pytest.mark.long
def test_calibrated_thompson_learns_the_calibration_of_the_confidence():
    """With a perfectly calibrated drafter (token accepted with probability = its confidence),
    each bin's posterior mean approaches the bin's centre, and throughput stays within 10% of the
    best constant length."""
    alphas = [0.5] * 3000
    controller = CalibratedThompson(12, decay=1.0)
    throughput, _ = simulate(controller, alphas, confident=True)
    assert throughput >= 0.9 * best_constant(alphas, confident=True)
    for b in range(controller.bins):
        a, f = controller.posterior[1 + b]
        if a + f > 50:  # bins with enough observations
            assert abs(a / (a + f) - (b + 0.5) / controller.bins) < 0.12, (b, a, f)


def test_heuristic_follows_transformers_rule():
    controller = Heuristic(5)
    controller.observe(5, 5, [], 0.1, 0.0)
    assert controller.next_length() == 7
    controller.observe(7, 2, [], 0.1, 0.0)
    assert controller.next_length() == 6
    for _ in range(10):
        controller.observe(3, 0, [], 0.1, 0.0)
    assert controller.next_length() == 1


def test_adaptive_cut_maximises_expected_tokens_per_cost():
    cost = CostModel()
    for width, seconds in [(1, 0.1), (2, 0.16), (4, 0.2), (8, 0.22), (16, 0.3)]:
        cost.observe(width, seconds)
    assert cost.verify(8) == pytest.approx(2.2)
    assert cost.verify(6) == pytest.approx(2.1)  # interpolated between 4 and 8
    controller = ExpectedThroughput(16, ControllerMemory(cost))
    assert controller.cut([0.1] * 8, 8) == 0  # unlikely drafts are not worth a wider forward
    assert controller.cut([0.99] * 8, 8) == 8
    # brute force agrees with best_draft_length
    confidences = [0.9, 0.8, 0.7, 0.2, 0.9]
    rates = []
    for length in range(len(confidences) + 1):
        expected, survive = 1.0, 1.0
        for c in confidences[:length]:
            survive *= c
            expected += survive
        rates.append(expected / cost.relative(length))
    assert best_draft_length(confidences, cost.relative) == max(range(len(rates)), key=rates.__getitem__)


def test_break_even_thresholds_are_monotone():
    thresholds = break_even_thresholds(8, lambda length: length * 0.2 + verify_cost(length + 1))
    assert thresholds == sorted(thresholds)
    assert 0 < thresholds[0] < 1


@pytest.mark.parametrize("cost", [
    lambda length: 1.0 + 0.3 * length,  # cheap drafts, linear verify
    lambda length: length * 0.2 + verify_cost(length + 1),
    lambda length: 1.0 + 2.0 * length,  # drafting never pays: every threshold is 1.0
    lambda length: 1.0 + 0.01 * length ** 2,
])
def test_break_even_thresholds_match_their_definition(cost):
    """tau_j = the smallest grid alpha whose best draft length (brute force over L, ties to the
    shorter) is at least j; 1.0 where none is."""
    k, grid = 8, 100
    expected_thresholds = []
    for j in range(1, k + 1):
        found = 1.0
        for step in range(grid + 1):
            alpha = step / grid
            rates = [sum(alpha ** i for i in range(length + 1)) / cost(length) for length in range(k + 1)]
            if rates.index(max(rates)) >= j:
                found = alpha
                break
        expected_thresholds.append(found)
    assert break_even_thresholds(k, cost, grid) == pytest.approx(expected_thresholds, abs=1e-12)


@pytest.mark.parametrize("spec", ["nope", "constant:x", "beta-ts:0", "adaptive:0", "heuristic:0", "constant:-1"])
def test_bad_controller_specs_are_refused(spec):
    with pytest.raises(ConfigError):
        parse_controller(spec, 4)


def test_specs_parse_to_their_controllers():
    assert isinstance(parse_controller("beta-ts", 6), BetaThompson)
    assert isinstance(parse_controller("calibrated-ts:3", 6), CalibratedThompson)
    assert parse_controller("constant", 6).next_length() == 6
    assert parse_controller("adaptive:9", 6).next_length() == 9


def trace_cost(length: int) -> float:
    """A step drafting and verifying `length` tokens, with this file's costs."""
    return length * DRAFT_COST + verify_cost(length + 1)


def test_agreement_runs():
    assert agreement_runs([]) == []
    assert agreement_runs([True, True, False, True, False, False]) == [2, 1, 0, 1, 0, 0]


def test_trace_costs_by_hand():
    agreement = [False, True, True, True, False, True]  # runs: 0 3 2 1 0 1
    # constant 2: t=0 drafts 2 keeps 0 -> t=1 drafts 2 keeps 2 -> t=4 drafts 1 keeps 0 -> t=5 drafts 0
    assert constant_trace_cost(agreement, DRAFT_COST, verify_cost, 2) == pytest.approx(
        trace_cost(2) + trace_cost(2) + trace_cost(1) + trace_cost(0))
    confidence = [0.2, 0.9, 0.8, 0.7, 0.3, 0.9]
    # threshold 0.5: t=0 drafts 1, drops it (0.2) -> t=1 keeps 0.9, 0.8, 0.7, drafts and drops 0.3:
    # 3 kept, all accepted -> t=5 (the last token) drafts none
    assert threshold_trace_cost(agreement, confidence, DRAFT_COST, verify_cost, 0.5, 8) == pytest.approx(
        DRAFT_COST + 1 + 4 * DRAFT_COST + verify_cost(4) + 1)
    # threshold 0 keeps every token, as far as allowed: the constant controller
    assert threshold_trace_cost(agreement, confidence, DRAFT_COST, verify_cost, 0.0, 2) == pytest.approx(
        constant_trace_cost(agreement, DRAFT_COST, verify_cost, 2))
    # oracle: no draft at 0, three drafts at 1 (-> 5), none at 5 (last token)
    assert oracle_trace_cost(agreement, DRAFT_COST, verify_cost, 8) == pytest.approx(1 + trace_cost(3) + 1)
    # with drafts capped at 1: 0 | 1,2 | 3,4 | 5
    assert oracle_trace_cost(agreement, DRAFT_COST, verify_cost, 1) == pytest.approx(1 + 2 * trace_cost(1) + 1)


def test_oracle_trace_cost_bounds():
    rng = random.Random(3)
    for _ in range(200):
        agreement = [rng.random() < rng.random() for _ in range(rng.randrange(1, 40))]
        oracle = oracle_trace_cost(agreement, DRAFT_COST, verify_cost, 6)
        assert oracle <= len(agreement) + 1e-9  # decoding without drafts is one of its choices
        for k in range(0, 7):
            assert oracle <= constant_trace_cost(agreement, DRAFT_COST, verify_cost, k) + 1e-9
        assert constant_trace_cost(agreement, DRAFT_COST, verify_cost, 0) == pytest.approx(len(agreement))
        confidence = [rng.random() for _ in agreement]
        for threshold in (0.0, 0.3, 0.7, 1.01):
            assert oracle <= threshold_trace_cost(agreement, confidence, DRAFT_COST, verify_cost, threshold, 6) + 1e-9
    # free drafts and free verification: one step per maximal run of agreements plus its bonus token
    free = lambda width: 1.0  # noqa: E731
    assert oracle_trace_cost([True] * 9, 0.0, free, 8) == 1
    assert oracle_trace_cost([False] * 5, 0.0, free, 8) == 5


def test_memory_carries_what_a_controller_learned_to_the_next_request(monkeypatch):
    """Twenty requests of 120 steps with the EESD-like costs above: controllers that share a
    ControllerMemory stop re-learning each request, so they draft less at a loss."""
    monkeypatch.setattr(sys.modules[__name__], "DRAFT_COST", 0.375)
    monkeypatch.setattr(sys.modules[__name__], "SLOPE", 0.35)
    memory = ControllerMemory()
    results = {"fresh": [], "shared": []}
    for request in range(20):
        for kind in results:
            controller = CalibratedThompson(8, seed=request, memory=memory if kind == "shared" else None)
            results[kind] += simulate(controller, [0.39] * 120, seed=request)[1]
            if kind == "shared":
                assert controller.posterior is memory.posterior and controller.cost is memory.cost
    drafting = {kind: sum(cost > 1.0 + 1e-9 for _, cost in steps) / len(steps) for kind, steps in results.items()}
    assert drafting["shared"] < 0.5 * drafting["fresh"], drafting
    assert rate(results["shared"]) > rate(results["fresh"])
    assert sum(memory.posterior[0]) > 2.0  # it holds observations


def test_build_shares_memory_per_method_options_and_sampling():
    target = helpers.make_target("llama", seed=0)
    memory = lambda recipe: recipe[1].cost  # noqa: E731 - the shared part of a learning controller
    eesd_like = MethodOptions(controller="beta-ts")
    first = build("anpd", target, eesd_like)
    assert memory(build("anpd", target, eesd_like)) is memory(first)
    assert build("anpd", target, eesd_like)[1].posterior is first[1].posterior
    assert memory(build("anpd", target, eesd_like, SamplingConfig(0.8, seed=1))) is not memory(first)
    assert memory(build("anpd", target, MethodOptions(controller="beta-ts:4"))) is not memory(first)
    assert memory(build("anpd", target, MethodOptions(controller="calibrated-ts"))) is not memory(first)
    assert memory(build("pld", target, eesd_like)) is not memory(first)
    # the seed is not part of the key
    assert memory(build("anpd", target, eesd_like, SamplingConfig(0.8, seed=2))) is \
        memory(build("anpd", target, eesd_like, SamplingConfig(0.8, seed=1)))
    assert memory(build("anpd", target)) is memory(build("anpd", target))  # adaptive, anpd's default
    assert memory(build("anpd", target)) is not memory(first)
    assert not hasattr(build("ar", target)[1], "cost")


def test_controller_memories_are_bounded_and_least_recently_used_goes_first():
    target = helpers.make_target("llama", seed=0)
    memory = lambda recipe: recipe[1].cost  # noqa: E731
    options = MethodOptions(controller="beta-ts")
    kept = memory(build("anpd", target, options, SamplingConfig(0.5)))
    for i in range(3 * CONTROLLER_MEMORIES):  # a server's requests, each with another temperature
        build("anpd", target, options, SamplingConfig(1.0 + i / 1000))
        if i % 8 == 0:
            assert memory(build("anpd", target, options, SamplingConfig(0.5))) is kept  # recently used: stays
    assert len(target.attachments["controller-memories"]) == CONTROLLER_MEMORIES
    first_evicted = SamplingConfig(1.0)
    assert (first_evicted.temperature, 0, 1.0) not in {key[-3:] for key in target.attachments["controller-memories"]}


def test_one_slow_forward_does_not_price_a_width_out():
    """A width's cost is robust to an outlier: one forward slowed 20x (another process, a page
    fault) must not make the controller stop drafting, which would also stop re-measuring it."""
    cost = CostModel()
    for _ in range(6):
        cost.observe(1, 0.010)
        cost.observe(2, 0.011)
    cost.observe(2, 0.200)
    assert cost.verify(2) == pytest.approx(1.1)
    assert ExpectedThroughput(16, ControllerMemory(cost)).cut([0.7], 1) == 1


def test_a_width_seen_once_costs_at_most_what_the_others_say():
    cost = CostModel()
    for width, seconds in [(1, 0.010)] * 3 + [(4, 0.016)] * 3:
        cost.observe(width, seconds)
    cost.observe(2, 0.100)  # first measurement of width 2, an outlier
    assert cost.verify(2) == pytest.approx(1.2)  # interpolated between 1 and 4 until confirmed
    cost.observe(2, 0.100)
    cost.observe(2, 0.100)
    assert cost.verify(2) == pytest.approx(10.0)  # confirmed: it really is that slow


# -- speculation under load --------------------------------------------------------------------------

def _goodput(confidences, lengths, costs, rows=0):
    """Expected tokens per second of a step that verifies these prefixes."""
    a, b = costs
    tokens = float(len(confidences))
    for confidence, n in zip(confidences, lengths):
        survival = 1.0
        for j in range(n):
            survival *= confidence[j]
            tokens += survival
    return tokens / (a + b * (len(confidences) + rows + sum(lengths)))


def test_allocate_drafts_is_the_best_cut_of_every_draft_together():
    """Against brute force over every combination of prefix lengths, on random small cases."""
    import itertools

    from verispec.core.control import allocate_drafts

    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 4))
        confidences = [tuple(rng.uniform(0.05, 1.0, int(rng.integers(0, 5)))) for _ in range(n)]
        costs = (float(rng.uniform(0.005, 0.02)), float(rng.uniform(0.0005, 0.005)))
        rows = int(rng.integers(0, 20))
        got = allocate_drafts(confidences, costs, rows)
        best = max(_goodput(confidences, lengths, costs, rows)
                   for lengths in itertools.product(*[range(len(c) + 1) for c in confidences]))
        assert _goodput(confidences, got, costs, rows) == pytest.approx(best, rel=1e-12)


def test_drafts_shrink_as_the_batch_fills():
    from verispec.core.control import allocate_drafts

    costs, draft = (0.015, 0.0015), (0.9, 0.85, 0.8, 0.7, 0.5, 0.3)
    alone = allocate_drafts([draft], costs)[0]
    crowded = allocate_drafts([draft] * 16, costs)
    assert alone >= 4 and max(crowded) < alone and min(crowded) >= 1
    assert allocate_drafts([(0.3, 0.3)] * 16, costs) == [0] * 16  # unlikely tokens are not worth a row
    assert allocate_drafts([(), (0.99, 0.99)], costs) == [0, 2]


def test_row_costs_fit_a_line_and_fall_back_on_the_prior_slope():
    from verispec.core.control import RowCosts

    costs = RowCosts(prior_slope=0.1)
    assert costs.fit() is None
    for rows in (4, 4, 4, 4):
        costs.observe(rows, 0.014)
    a, b = costs.fit()  # no spread in width: b is the prior share of a
    assert b == pytest.approx(0.1 * a) and a + 4 * b == pytest.approx(0.014)
    costs = RowCosts()
    for rows in (1, 8, 16, 32, 2, 24):
        costs.observe(rows, 0.012 + 0.002 * rows)
    a, b = costs.fit()
    assert a == pytest.approx(0.012, rel=0.15) and b == pytest.approx(0.002, rel=0.15)


def test_model_draft_length_is_the_best_length_under_both_models_costs():
    """Brute force over k against the closed form's terms; a cheap draft model drafts long,
    one that costs more than the tokens it saves drafts nothing, and more sequences sharing
    the forward draft less."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        rates = rng.uniform(0, 1, n).tolist()
        costs, draft_costs = tuple(rng.uniform(0.01, 0.1, 2)), tuple(rng.uniform(0.0, 0.05, 2))
        rows, k_max = n + int(rng.integers(0, 20)), int(rng.integers(0, 8))
        catch_up = float(rng.choice([0.0, rng.uniform(0, 50)]))

        def rate(k):
            gain = n + sum(r ** j for r in rates for j in range(1, k + 1))
            seconds = costs[0] + costs[1] * (rows + n * k)
            if k:
                seconds += k * draft_costs[0] + draft_costs[1] * (n * (k + 1) + catch_up)
            return gain / seconds

        rates_by_k = [rate(k) for k in range(k_max + 1)]
        assert model_draft_length(rates, k_max, costs, draft_costs, rows, n, catch_up) == int(np.argmax(rates_by_k))
    memory_bound = (0.060, 0.004)  # a 1.5B step: 60 ms, 4 ms a row more
    assert model_draft_length([0.9], 8, memory_bound, (0.001, 0.0001), 1, 1) == 8
    assert model_draft_length([0.9], 8, memory_bound, (0.060, 0.004), 1, 1) == 0  # a draft model as dear as the target
    compute_bound = (0.060, 0.020)
    one = model_draft_length([0.8], 8, compute_bound, (0.010, 0.002), 1, 1)
    eight = model_draft_length([0.8] * 8, 8, compute_bound, (0.010, 0.002), 8, 8)
    assert one > eight
    assert model_draft_length([0.9], 8, memory_bound, (0.030, 0.004), 1, 1, catch_up=300) == 0  # far behind
