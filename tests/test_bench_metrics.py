"""Benchmark metric arithmetic on synthetic records (no model): speedup as a ratio of totals and
as a mean of per-prompt ratios, slower-than-baseline methods, exact match and first difference,
medians over repeats, the baseline choice (and its absence), acceptance, perplexity weighting,
CPU and energy; plus the energy meters' counter arithmetic."""

from __future__ import annotations

import math

import pytest

from verispec.bench import aggregate, energy
from verispec.bench.runner import RECORD_FIELDS, rotation


def rec(qid, method, total_s, new_tokens=10, *, category="a", repeat=0, token_ids=None, forwards=None,
        drafted=None, accepted=None, hist=None, ppl=None, cpu_s=None, energy_j=None, prefill_s=None) -> dict:
    """A record as the runner writes it (every field present)."""
    record = {
        "question_id": qid, "category": category, "method": method, "repeat": repeat,
        "prompt_tokens": 5, "new_tokens": new_tokens,
        "target_forwards": new_tokens if forwards is None else forwards,
        "drafted": drafted, "accepted": accepted, "accepted_histogram": hist,
        "prefill_s": prefill_s, "decode_s": None, "total_s": total_s,
        "cpu_s": total_s if cpu_s is None else cpu_s, "energy_j": energy_j, "perplexity": ppl,
        "token_ids": list(range(new_tokens)) if token_ids is None else token_ids, "text": "",
    }
    assert tuple(record) == RECORD_FIELDS
    return record


def test_speedup_is_a_ratio_of_totals_and_the_mean_of_prompt_ratios_is_reported_too():
    records = [
        rec(1, "ar", 1.0), rec(2, "ar", 3.0),  # 20 tokens in 4 s: 5 tokens/s
        rec(1, "fast", 0.5), rec(2, "fast", 3.0),  # 20 tokens in 3.5 s
    ]
    summary = aggregate.summarize(records, ["ar", "fast"])
    fast = summary["overall"]["fast"]
    assert summary["baseline"] == "ar"
    assert fast["tokens_per_s"] == pytest.approx(20 / 3.5)
    assert fast["speedup"] == pytest.approx((20 / 3.5) / (20 / 4.0))
    assert fast["mean_speedup"] == pytest.approx((2.0 + 1.0) / 2)  # per prompt: 2x and 1x
    assert summary["overall"]["ar"]["speedup"] == pytest.approx(1.0)
    assert summary["speedup_definition"] == aggregate.SPEEDUP_DEFINITION


def test_a_method_slower_than_ar_has_speedup_below_one():
    records = [rec(1, "ar", 1.0), rec(1, "slow", 4.0, new_tokens=10), rec(2, "ar", 1.0), rec(2, "slow", 2.0)]
    slow = aggregate.summarize(records, ["ar", "slow"])["overall"]["slow"]
    assert slow["speedup"] == pytest.approx((20 / 6.0) / (20 / 2.0))
    assert slow["speedup"] < 1
    assert slow["mean_speedup"] == pytest.approx((0.25 + 0.5) / 2)


def test_speedup_accounts_for_different_token_counts():
    # The method stopped early (EOS) on prompt 1: tokens/s, not seconds, is compared.
    records = [rec(1, "ar", 2.0, new_tokens=20), rec(1, "m", 0.5, new_tokens=5)]
    assert aggregate.summarize(records, ["ar", "m"])["overall"]["m"]["speedup"] == pytest.approx((5 / 0.5) / (20 / 2.0))


def test_speedups_per_category_and_overall():
    records = [
        rec(1, "ar", 1.0, category="x"), rec(1, "m", 0.5, category="x"),
        rec(2, "ar", 1.0, category="y"), rec(2, "m", 2.0, category="y"),
    ]
    summary = aggregate.summarize(records, ["ar", "m"])
    assert list(summary["categories"]) == ["x", "y"]
    assert summary["categories"]["x"]["m"]["speedup"] == pytest.approx(2.0)
    assert summary["categories"]["y"]["m"]["speedup"] == pytest.approx(0.5)
    assert summary["overall"]["m"]["speedup"] == pytest.approx((20 / 2.5) / (20 / 2.0))


def test_speedup_uses_only_prompts_both_ran():
    records = [rec(1, "ar", 1.0), rec(2, "ar", 100.0), rec(1, "m", 0.5)]
    m = aggregate.summarize(records, ["ar", "m"])["overall"]["m"]
    assert m["speedup"] == pytest.approx(2.0)
    assert m["prompts"] == 1


def test_exact_match_and_first_difference_against_the_baseline():
    base = [1, 2, 3, 4, 5]
    records = [
        rec(1, "ar", 1.0, new_tokens=5, token_ids=base), rec(2, "ar", 1.0, new_tokens=5, token_ids=base),
        rec(3, "ar", 1.0, new_tokens=5, token_ids=base),
        rec(1, "m", 1.0, new_tokens=5, token_ids=base),  # identical
        rec(2, "m", 1.0, new_tokens=5, token_ids=[1, 2, 3, 9, 5]),  # differs at 3
        rec(3, "m", 1.0, new_tokens=2, token_ids=[1, 2]),  # a prefix: differs at 2
        rec(1, "hf-pld", 1.0, new_tokens=5, token_ids=base),  # peers are compared too
        rec(2, "hf-pld", 1.0, new_tokens=5, token_ids=base), rec(3, "hf-pld", 1.0, new_tokens=5, token_ids=base),
    ]
    summary = aggregate.summarize(records, ["ar", "m", "hf-pld"], greedy=True)
    m = summary["overall"]["m"]
    assert m["exact_match"] == pytest.approx(1 / 3)
    assert m["first_difference_min"] == 2 and m["first_difference_mean"] == pytest.approx(2.5)
    assert summary["overall"]["hf-pld"]["exact_match"] == 1.0
    assert summary["overall"]["hf-pld"]["first_difference_min"] is None
    per_prompt = {(p["question_id"], p["method"]): p for p in summary["prompts"]}
    assert per_prompt[(2, "m")]["first_difference"] == 3 and per_prompt[(2, "m")]["exact_match"] is False
    assert per_prompt[(1, "m")]["first_difference"] is None and per_prompt[(1, "m")]["exact_match"] is True


def test_exact_match_is_not_computed_under_sampling():
    records = [rec(1, "ar", 1.0), rec(1, "m", 1.0, token_ids=[7] * 10)]
    summary = aggregate.summarize(records, ["ar", "m"], greedy=False)
    assert summary["overall"]["m"]["exact_match"] is None
    assert summary["overall"]["m"]["speedup"] == pytest.approx(1.0)


def test_first_difference():
    assert aggregate.first_difference([1, 2], [1, 2]) is None
    assert aggregate.first_difference([1, 2], [1, 3]) == 1
    assert aggregate.first_difference([1, 2, 3], [1, 2]) == 2
    assert aggregate.first_difference([], [4]) == 0


def test_repeats_use_the_median_time():
    records = [
        rec(1, "ar", 1.0, repeat=0), rec(1, "ar", 9.0, repeat=1), rec(1, "ar", 2.0, repeat=2),  # median 2
        rec(1, "m", 4.0, repeat=0), rec(1, "m", 0.5, repeat=1), rec(1, "m", 1.0, repeat=2),  # median 1
    ]
    summary = aggregate.summarize(records, ["ar", "m"])
    assert summary["overall"]["ar"]["total_s"] == pytest.approx(2.0)
    assert summary["overall"]["m"]["total_s"] == pytest.approx(1.0)
    assert summary["overall"]["m"]["speedup"] == pytest.approx(2.0)
    assert summary["overall"]["m"]["new_tokens"] == 10  # counted once, not per repeat
    assert [p["repeats"] for p in summary["prompts"]] == [3, 3]


def test_even_repeats_median_and_median_cpu_and_energy():
    records = [
        rec(1, "ar", 1.0, repeat=0, cpu_s=2.0, energy_j=10.0),
        rec(1, "ar", 3.0, repeat=1, cpu_s=4.0, energy_j=30.0),
    ]
    ar = aggregate.summarize(records, ["ar"])["overall"]["ar"]
    assert ar["total_s"] == pytest.approx(2.0)
    assert ar["cpu_s_per_token"] == pytest.approx(3.0 / 10)
    assert ar["energy_j"] == pytest.approx(20.0)
    assert ar["energy_j_per_token"] == pytest.approx(2.0)


def test_missing_baseline_gives_no_speedup():
    records = [rec(1, "pld", 1.0), rec(1, "hf-pld", 2.0)]
    summary = aggregate.summarize(records, ["pld", "hf-pld"])
    assert summary["baseline"] is None
    for s in summary["overall"].values():
        assert s["speedup"] is None and s["mean_speedup"] is None and s["exact_match"] is None
        assert s["tokens_per_s"] > 0
    assert all(p["speedup"] is None for p in summary["prompts"])


def test_hf_ar_is_the_baseline_without_ar_and_ar_wins_when_both_ran():
    records = [rec(1, "hf-ar", 2.0), rec(1, "pld", 1.0)]
    summary = aggregate.summarize(records, ["pld", "hf-ar"])
    assert summary["baseline"] == "hf-ar"
    assert summary["overall"]["pld"]["speedup"] == pytest.approx(2.0)
    both = aggregate.summarize([*records, rec(1, "ar", 4.0)], ["pld", "hf-ar", "ar"])
    assert both["baseline"] == "ar"
    assert both["overall"]["pld"]["speedup"] == pytest.approx(4.0)
    assert aggregate.choose_baseline(["x"]) is None


def test_acceptance_mean_accepted_and_histograms():
    records = [
        rec(1, "anpd", 1.0, new_tokens=12, forwards=4, drafted=16, accepted=8, hist=[1, 0, 2]),
        rec(2, "anpd", 1.0, new_tokens=6, forwards=5, drafted=4, accepted=1, hist=[3, 1]),
        rec(1, "hf-pld", 1.0, new_tokens=12, forwards=6),  # a peer: no drafts visible
    ]
    summary = aggregate.summarize(records, ["anpd", "hf-pld"])
    anpd, peer = summary["overall"]["anpd"], summary["overall"]["hf-pld"]
    assert anpd["mean_accepted_tokens"] == pytest.approx(18 / 9)
    assert anpd["acceptance_rate"] == pytest.approx(9 / 20)
    assert anpd["accepted_histogram"] == [4, 1, 2]
    assert peer["mean_accepted_tokens"] == pytest.approx(2.0)
    assert peer["acceptance_rate"] is None and peer["accepted_histogram"] is None and peer["drafted"] is None


def test_perplexity_is_token_weighted_and_skips_empty_outputs():
    records = [
        rec(1, "ar", 1.0, new_tokens=10, ppl=2.0),
        rec(2, "ar", 1.0, new_tokens=30, ppl=8.0),
        rec(3, "ar", 1.0, new_tokens=0, ppl=None),
    ]
    ar = aggregate.summarize(records, ["ar"])["overall"]["ar"]
    assert ar["perplexity"] == pytest.approx(math.exp((10 * math.log(2) + 30 * math.log(8)) / 40))
    assert aggregate.summarize([rec(1, "ar", 1.0, ppl=None)], ["ar"])["overall"]["ar"]["perplexity"] is None


def test_perplexity_against_the_baseline_is_paired_by_prompt():
    """ln ppl(method) - ln ppl(ar) per prompt, averaged, with its standard error; prompts without
    a baseline score are left out; one pair gives a mean but no standard error."""
    records = [
        rec(1, "ar", 1.0, ppl=2.0), rec(2, "ar", 1.0, ppl=4.0), rec(3, "ar", 1.0, ppl=None),
        rec(1, "mtad", 1.0, ppl=1.0), rec(2, "mtad", 1.0, ppl=4.0), rec(3, "mtad", 1.0, ppl=3.0),
    ]
    summary = aggregate.summarize(records, ["ar", "mtad"], greedy=False)
    mtad = summary["overall"]["mtad"]
    diffs = [math.log(1.0 / 2.0), 0.0]
    assert mtad["log_perplexity_vs_baseline"] == pytest.approx(sum(diffs) / 2)
    assert mtad["log_perplexity_vs_baseline_se"] == pytest.approx(abs(diffs[0] - diffs[1]) / math.sqrt(2) / math.sqrt(2))
    assert summary["overall"]["ar"]["log_perplexity_vs_baseline"] == 0.0
    one = aggregate.summarize(records[:1] + records[3:4], ["ar", "mtad"], greedy=False)["overall"]["mtad"]
    assert one["log_perplexity_vs_baseline"] == pytest.approx(math.log(0.5))
    assert one["log_perplexity_vs_baseline_se"] is None
    assert aggregate.summarize([rec(1, "mtad", 1.0, ppl=2.0)], ["mtad"], greedy=False)["overall"]["mtad"][
        "log_perplexity_vs_baseline"] is None  # no baseline


def test_report_shows_the_paired_perplexity_only_for_sampled_runs():
    from verispec.bench.report import perplexity_section

    records = [rec(q, m, 1.0, ppl=p) for q, m, p in
               [(1, "ar", 2.0), (2, "ar", 4.0), (1, "sps", 2.5), (2, "sps", 4.5)]]
    sampled = perplexity_section(aggregate.summarize(records, ["ar", "sps"], greedy=False))
    table = [line for line in sampled if line.startswith("| sps |")]
    expected = (math.log(2.5 / 2.0) + math.log(4.5 / 4.0)) / 2
    assert len(table) == 1 and f"{expected:+.3f}" in table[0] and f"{math.exp(expected):.3f}" in table[0]
    assert not any(line.startswith("| ar |") for line in sampled)  # the baseline against itself is left out
    assert perplexity_section(aggregate.summarize(records, ["ar", "sps"], greedy=True)) == []


def test_repeated_ngrams_counts_the_grams_seen_earlier_in_the_same_output():
    assert aggregate.repeated_ngrams([1, 2, 3, 4, 5]) == (0, 2)
    assert aggregate.repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4]) == (1, 5)  # only (1, 2, 3, 4) comes back
    assert aggregate.repeated_ngrams([7] * 10) == (6, 7)  # every 4-gram after the first
    assert aggregate.repeated_ngrams([1, 2, 3]) == (0, 0)
    assert aggregate.repeated_ngrams([1, 2, 1, 2, 1], n=2) == (2, 4)


def test_the_repeated_share_is_pooled_over_prompts_and_reported_with_the_paired_perplexity():
    from verispec.bench.report import perplexity_section

    records = [
        rec(1, "ar", 1.0, new_tokens=6, token_ids=[1, 2, 3, 4, 5, 6], ppl=2.0),  # 0 of 3
        rec(2, "ar", 1.0, new_tokens=5, token_ids=[1, 2, 3, 4, 5], ppl=3.0),  # 0 of 2
        rec(1, "mtad", 1.0, new_tokens=8, token_ids=[5] * 8, ppl=1.5),  # 4 of 5
        rec(2, "mtad", 1.0, new_tokens=2, token_ids=[1, 2], ppl=2.0),  # no 4-gram at all
    ]
    summary = aggregate.summarize(records, ["ar", "mtad"], greedy=False)
    assert summary["overall"]["ar"]["repeated_4grams"] == 0.0
    assert summary["overall"]["mtad"]["repeated_4grams"] == pytest.approx(4 / 5)
    assert aggregate.compact(summary)["methods"]["mtad"]["repeated_4grams"] == 0.8
    lines = perplexity_section(summary)
    assert any(line.startswith("| mtad |") and line.endswith("| 80.0% |") for line in lines)
    assert any("(ar: 0.0%)" in line for line in lines)
    empty = aggregate.summarize([rec(1, "ar", 1.0, new_tokens=2, token_ids=[1, 2])], ["ar"])
    assert empty["overall"]["ar"]["repeated_4grams"] is None


def test_energy_is_null_when_any_generation_was_not_measured():
    records = [rec(1, "ar", 1.0, energy_j=5.0), rec(2, "ar", 1.0, energy_j=None)]
    ar = aggregate.summarize(records, ["ar"])["overall"]["ar"]
    assert ar["energy_j"] is None and ar["energy_j_per_token"] is None
    assert ar["cpu_s_per_token"] == pytest.approx(2.0 / 20)


def test_prefill_is_summed_for_our_methods_and_null_for_peers():
    records = [rec(1, "ar", 1.0, prefill_s=0.25), rec(2, "ar", 1.0, prefill_s=0.5), rec(1, "hf-ar", 1.0)]
    overall = aggregate.summarize(records, ["ar", "hf-ar"])["overall"]
    assert overall["ar"]["prefill_s"] == pytest.approx(0.75)
    assert overall["hf-ar"]["prefill_s"] is None


def test_method_order_and_compact_summary():
    records = [rec(1, "m", 1.0), rec(1, "ar", 2.0), rec(1, "extra", 1.0)]
    summary = aggregate.summarize(records, ["ar", "m", "absent"])
    assert summary["methods"] == ["ar", "m", "extra"]
    assert list(summary["overall"]) == ["ar", "m", "extra"]
    compact = aggregate.compact(summary)
    assert compact["baseline"] == "ar"
    assert set(compact["methods"]) == {"ar", "m", "extra"}
    assert compact["methods"]["m"]["speedup"] == pytest.approx(2.0)
    assert set(compact["methods"]["m"]) == {
        "tokens_per_s", "speedup", "mean_accepted_tokens", "acceptance_rate", "exact_match",
        "perplexity", "repeated_4grams", "cpu_s_per_token", "energy_j",
    }


def test_zero_time_and_zero_tokens_do_not_divide_by_zero():
    records = [rec(1, "ar", 0.0, new_tokens=0, forwards=0), rec(1, "m", 1.0)]
    summary = aggregate.summarize(records, ["ar", "m"])
    assert summary["overall"]["ar"]["tokens_per_s"] == 0.0
    assert summary["overall"]["ar"]["mean_accepted_tokens"] is None
    assert summary["overall"]["m"]["speedup"] is None


def test_rotation_starts_prompt_i_at_method_i_mod_m():
    names = ["ar", "pld", "anpd"]
    assert rotation(names, 0) == ["ar", "pld", "anpd"]
    assert rotation(names, 1) == ["pld", "anpd", "ar"]
    assert rotation(names, 5) == ["anpd", "ar", "pld"]
    assert rotation([], 3) == []


# -- energy meters ----------------------------------------------------------------------------


def test_rapl_counter_wraps_around():
    assert energy.counter_delta(100, 250, 1000) == 150
    assert energy.counter_delta(900, 50, 1000) == 150  # wrapped at 1000


def test_rapl_meter_reads_top_level_zones_only(tmp_path):
    def zone(name, value, max_range=1_000_000):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "energy_uj").write_text(f"{value}\n")
        (directory / "max_energy_range_uj").write_text(f"{max_range}\n")
        return directory

    package = zone("intel-rapl:0", 999_000)
    zone("intel-rapl:0:0", 5)  # a sub-zone (cores): part of the package, not counted again
    meter = energy.RaplMeter.open(tmp_path)
    assert meter is not None and [p.parent.name for p in meter.zones] == ["intel-rapl:0"]
    probe = energy.EnergyProbe([lambda: meter])
    token = probe.start()
    (package / "energy_uj").write_text("1000\n")  # wrapped: 1,000 uJ to the top, then 1,000 more
    assert probe.stop(token) == pytest.approx(2000 / 1e6)
    assert probe.description == "rapl"


def test_no_meter_means_not_measured(tmp_path):
    assert energy.RaplMeter.open(tmp_path) is None
    probe = energy.EnergyProbe([lambda: None])
    assert not probe.available and probe.description == "not measured"
    assert probe.stop(probe.start()) is None
