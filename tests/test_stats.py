"""GenerationStats: counts in, metrics out; merging sums counts (never averages averages)."""

from __future__ import annotations

import json

import pytest

import helpers
from verispec.core.methods import build
from verispec.core.stats import GenerationStats


def test_record_step_counts_and_histogram():
    stats = GenerationStats(method="anpd")
    stats.target_forwards = 1  # the prefill
    for drafted, accepted in [(4, 4), (4, 0), (3, 1), (0, 0), (6, 4)]:
        stats.record_step(drafted, accepted)
    assert stats.target_forwards == 6
    assert stats.drafted == 17 and stats.accepted == 9
    assert stats.accepted_histogram == [2, 1, 0, 0, 2]
    assert sum(stats.accepted_histogram) == 5
    assert sum(i * c for i, c in enumerate(stats.accepted_histogram)) == stats.accepted


def test_derived_metrics():
    stats = GenerationStats(new_tokens=30, target_forwards=12, drafted=40, accepted=18,
                            prefill_s=0.5, decode_s=1.5)
    assert stats.mean_accepted_tokens == pytest.approx(30 / 12)
    assert stats.acceptance_rate == pytest.approx(18 / 40)
    assert stats.total_s == pytest.approx(2.0)
    assert stats.tokens_per_s == pytest.approx(15.0)
    assert stats.decode_tokens_per_s == pytest.approx(29 / 1.5)


def test_degenerate_metrics():
    empty = GenerationStats()
    assert empty.mean_accepted_tokens == 0.0
    assert empty.acceptance_rate is None
    assert empty.tokens_per_s == 0.0 and empty.decode_tokens_per_s == 0.0
    one = GenerationStats(new_tokens=1, target_forwards=1, prefill_s=0.1)
    assert one.mean_accepted_tokens == 1.0
    assert one.decode_tokens_per_s == 0.0  # no decode phase
    assert one.tokens_per_s == pytest.approx(10.0)


def test_autoregressive_mean_accepted_tokens_is_one():
    stats = GenerationStats(new_tokens=7, target_forwards=7)
    assert stats.mean_accepted_tokens == 1.0


def test_merge_sums_counts_and_histograms():
    a = GenerationStats(method="anpd", prompt_tokens=10, new_tokens=20, target_forwards=8, drafted=30,
                        accepted=12, accepted_histogram=[3, 2, 0, 2], prefill_s=0.1, decode_s=1.0)
    b = GenerationStats(method="anpd", prompt_tokens=5, new_tokens=10, target_forwards=9, drafted=8,
                        accepted=1, accepted_histogram=[7, 1], prefill_s=0.2, decode_s=2.0)
    merged = a.merge(b)
    assert merged.method == "anpd"
    assert (merged.prompt_tokens, merged.new_tokens, merged.target_forwards) == (15, 30, 17)
    assert (merged.drafted, merged.accepted) == (38, 13)
    assert merged.accepted_histogram == [10, 3, 0, 2]
    assert merged.prefill_s == pytest.approx(0.3) and merged.decode_s == pytest.approx(3.0)
    # rates of the total, not averages of rates
    assert merged.mean_accepted_tokens == pytest.approx(30 / 17)
    assert merged.acceptance_rate == pytest.approx(13 / 38)
    assert merged.mean_accepted_tokens != pytest.approx((a.mean_accepted_tokens + b.mean_accepted_tokens) / 2)
    # merge is symmetric in counts and leaves its inputs alone
    assert b.merge(a).accepted_histogram == [10, 3, 0, 2]
    assert a.accepted_histogram == [3, 2, 0, 2] and b.accepted_histogram == [7, 1]


def test_merge_with_empty_is_identity_on_counts():
    a = GenerationStats(method="pld", new_tokens=5, target_forwards=3, drafted=4, accepted=2,
                        accepted_histogram=[1, 0, 1])
    merged = GenerationStats().merge(a)
    assert merged.method == "pld"
    assert (merged.new_tokens, merged.target_forwards, merged.drafted, merged.accepted) == (5, 3, 4, 2)
    assert merged.accepted_histogram == [1, 0, 1]


def test_to_dict_is_json_ready_with_derived_metrics():
    stats = GenerationStats(method="anpd", new_tokens=9, target_forwards=4, drafted=10, accepted=5,
                            accepted_histogram=[1, 1, 0, 1], prefill_s=0.123456, decode_s=0.5, stop_reason="length")
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["mean_accepted_tokens"] == pytest.approx(2.25)
    assert data["acceptance_rate"] == pytest.approx(0.5)
    assert data["accepted_histogram"] == [1, 1, 0, 1]
    assert data["stop_reason"] == "length" and data["method"] == "anpd"
    assert data["prefill_s"] == pytest.approx(0.1235)
    assert GenerationStats().to_dict()["acceptance_rate"] is None


def test_engine_fills_stats_consistently(llama_target):
    prompt = helpers.repetitive_prompt(128, 0, period=5, repeats=4)
    reference = helpers.run(llama_target, build("ar", llama_target), prompt, 30)[0]
    drafter = helpers.ScriptedDrafter(reference, "random", llama_target.vocab_size, seed=3)
    ids, stats, steps = helpers.run(llama_target, helpers.scripted_recipe(drafter, 5), prompt, 30)
    assert stats.prompt_tokens == len(prompt)
    assert stats.new_tokens == len(ids) == 30
    assert stats.target_forwards == len(steps)  # the prefill's step plus one per verification
    assert stats.target_forwards == 1 + sum(stats.accepted_histogram)
    assert stats.new_tokens == stats.target_forwards + stats.accepted
    assert stats.accepted == sum(i * c for i, c in enumerate(stats.accepted_histogram))
    assert stats.drafted == sum(len(p) for p in drafter.proposed)
    assert stats.mean_accepted_tokens == pytest.approx(30 / stats.target_forwards)
    assert stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.stop_reason == "length"


def test_drafts_and_accepted_per_position_have_vllms_meaning():
    stats = GenerationStats(method="anpd")
    for drafted, accepted in [(4, 4), (4, 0), (3, 1), (0, 0), (6, 4), (2, 2)]:
        stats.record_step(drafted, accepted)
    assert stats.drafts == 5  # the step that drafted nothing is not a draft
    # position i counts the drafts that accepted more than i tokens; positions drafted but never
    # accepted (4 and 5, drafted only by the (6, 4) step) count 0
    assert stats.accepted_per_position == [4, 3, 2, 2, 0, 0]
    assert sum(stats.accepted_per_position) == stats.accepted == 11
    assert stats.mean_acceptance_length == pytest.approx(1 + 11 / 5)
    assert stats.mean_accepted_tokens != stats.mean_acceptance_length  # forwards include the empty step


def test_mean_acceptance_length_without_drafts():
    stats = GenerationStats()
    stats.record_step(0, 0)
    stats.record_step(0, 0)
    assert stats.drafts == 0 and stats.accepted_per_position == []
    assert stats.mean_acceptance_length is None
    assert stats.to_dict()["mean_acceptance_length"] is None
    none_accepted = GenerationStats()
    none_accepted.record_step(3, 0)
    assert none_accepted.mean_acceptance_length == 1.0
    assert none_accepted.accepted_per_position == [0, 0, 0]


def test_record_step_refuses_more_accepted_than_drafted():
    stats = GenerationStats()
    with pytest.raises(ValueError):
        stats.record_step(2, 3)
    with pytest.raises(ValueError):
        stats.record_step(2, -1)
    assert stats.target_forwards == 0 and stats.drafts == 0


def test_merge_and_to_dict_carry_drafts_and_positions():
    a, b = GenerationStats(method="pld"), GenerationStats(method="pld")
    for drafted, accepted in [(3, 3), (3, 1)]:
        a.record_step(drafted, accepted)
    for drafted, accepted in [(5, 2), (0, 0)]:
        b.record_step(drafted, accepted)
    merged = a.merge(b)
    assert merged.drafts == 3
    assert merged.accepted_per_position == [3, 2, 1, 0, 0]
    assert merged.mean_acceptance_length == pytest.approx(1 + 6 / 3)
    data = json.loads(json.dumps(merged.to_dict()))
    assert data["drafts"] == 3 and data["accepted_per_position"] == [3, 2, 1, 0, 0]
    assert data["mean_acceptance_length"] == pytest.approx(3.0)
    assert a.accepted_per_position == [2, 1, 1]  # merge leaves its inputs alone


def test_engine_counts_drafts_and_positions(llama_target):
    prompt = helpers.repetitive_prompt(128, 1, period=5, repeats=4)
    reference = helpers.run(llama_target, build("ar", llama_target), prompt, 30)[0]
    drafter = helpers.ScriptedDrafter(reference, "random", llama_target.vocab_size, seed=5)
    _, stats, _ = helpers.run(llama_target, helpers.scripted_recipe(drafter, 4), prompt, 30)
    # what the engine told the drafter at each step: (committed tokens, drafts verified)
    steps = [(len(committed) - 1, drafted) for committed, drafted, _ in drafter.commits if drafted]
    assert stats.drafts == len(steps) > 0
    assert stats.accepted_per_position == [sum(1 for accepted, _ in steps if accepted > i)
                                           for i in range(max(drafted for _, drafted in steps))]
    assert stats.mean_acceptance_length == pytest.approx(1 + sum(a for a, _ in steps) / len(steps))
