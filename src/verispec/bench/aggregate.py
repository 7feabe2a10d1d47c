"""Pure metric arithmetic: benchmark records -> per-method summaries, per category and overall.

Owns every number the reports show and nothing else: no model, no files, no clock. The input is
the list of records the runner writes (one dict per prompt, method and repeat; see
`runner.RECORD_FIELDS`), the output a JSON-ready dict.

Repeats: the R records of one (prompt, method) are folded into one result. Its times (total,
prefill, decode, CPU) and energy are the medians over the repeats; its counts, token ids and
perplexity are those of the lowest repeat (identical across repeats under greedy decoding, and
under sampling with a fixed seed); its `passed` (code tasks) is the share of repeats that passed
(each repeat is one sample; 0 or 1 when they are identical).

Speedup (the definition the reports print, `SPEEDUP_DEFINITION`): for each method, over the prompts
that both it and the baseline ran, the ratio of totals

    speedup = (sum new tokens / sum seconds)[method] / (sum new tokens / sum seconds)[baseline]

per category and overall, where seconds is the median end-to-end time of a generation (prefill
included). The mean of the per-prompt ratios (tokens/s of the method over tokens/s of the baseline
on the same prompt) is reported next to it as `mean_speedup`. The baseline is `ar` when it ran,
otherwise `hf-ar` when it ran, otherwise there is no baseline and no speedup is reported.

Other metrics, per method:
- mean accepted tokens = new tokens / target forwards (prefill included; 1.0 for `ar`);
- acceptance rate = accepted / drafted (None for peers, whose drafts are not visible);
- accepted-length histogram: histogram[a] = verification steps that accepted a drafts (summed);
- exact match: the share of prompts whose token ids equal the baseline's exactly (greedy runs
  only; None under sampling), and the first position where they differ;
- perplexity: exp of the token-weighted mean NLL of the generated tokens under the target, i.e.
  exp(sum_i n_i * ln(ppl_i) / sum_i n_i) over prompts (ln ppl_i is prompt i's mean NLL);
- perplexity against the baseline, paired by prompt (sampled runs): the mean over prompts of
  ln ppl(method) - ln ppl(baseline) on the same prompt, with its standard error (sample standard
  deviation / sqrt(prompts); None below 2 prompts). Sampled texts vary so much between prompts
  that the overall perplexities of two methods need many prompts to separate; pairing removes
  each prompt's own difficulty. exp(mean) is the ratio of the per-prompt geometric means;
- repeated 4-grams: of all 4-grams of token ids in the outputs, the share that already occurred
  earlier in the same output (pooled over prompts). Lower perplexity can come from text that
  repeats itself (beam search is known for it), so sampled runs report the two side by side;
- pass@1 (prompts with tests only: the `code-tasks` set): passed / prompts, where a prompt's
  `passed` is the share of its repeats whose answer passed the task's tests (the records'
  `passed`, `runner.CODE_CHECK_FIELDS`); None when no prompt of the group has tests;
- CPU seconds per generated token = sum CPU seconds / sum new tokens;
- energy: sum of joules, or None ("not measured") if any generation had no meter reading.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

BASELINE_PREFERENCE = ("ar", "hf-ar")

SPEEDUP_DEFINITION = (
    "speedup = (sum of new tokens / sum of seconds) of the method divided by the same ratio for the "
    "baseline (ar, else hf-ar), over the prompts both ran, per category and overall; seconds is the "
    "median over repeats of each generation's end-to-end time, prefill included. mean_speedup is the "
    "mean over prompts of (method tokens/s) / (baseline tokens/s) on the same prompt."
)


@dataclass(frozen=True)
class PromptResult:
    """One (prompt, method), its repeats folded: median times, counts of the lowest repeat."""

    question_id: object
    category: str
    method: str
    repeats: int
    new_tokens: int
    target_forwards: int | None
    drafted: int | None
    accepted: int | None
    accepted_histogram: tuple[int, ...] | None
    prefill_s: float | None
    total_s: float
    cpu_s: float | None
    energy_j: float | None
    perplexity: float | None
    token_ids: tuple[int, ...]
    passed: float | None = None  # code tasks: share of repeats that passed the tests

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0


def choose_baseline(methods: Iterable[str]) -> str | None:
    """'ar' if it ran, else 'hf-ar' if it ran, else None."""
    present = set(methods)
    return next((name for name in BASELINE_PREFERENCE if name in present), None)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _median_or_none(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else float(statistics.median(values))


def _finite_or_none(value) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def _share_or_none(values: list) -> float | None:
    """The share of true values; None if any is missing (a record of a question without tests)."""
    return None if not values or any(v is None for v in values) else sum(map(bool, values)) / len(values)


def fold_repeats(records: Iterable[dict]) -> dict[tuple[str, str], PromptResult]:
    """(str(question_id), method) -> PromptResult, in the order the pairs first appear."""
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for record in records:
        key = (str(record["question_id"]), record["method"])
        groups.setdefault(key, {}).setdefault(int(record["repeat"]), record)  # first copy wins
    folded = {}
    for key, by_repeat in groups.items():
        runs = [by_repeat[r] for r in sorted(by_repeat)]
        first = runs[0]
        hist = first.get("accepted_histogram")
        folded[key] = PromptResult(
            question_id=first["question_id"],
            category=first["category"],
            method=first["method"],
            repeats=len(runs),
            new_tokens=int(first["new_tokens"]),
            target_forwards=first.get("target_forwards"),
            drafted=first.get("drafted"),
            accepted=first.get("accepted"),
            accepted_histogram=None if hist is None else tuple(hist),
            prefill_s=_median_or_none([r.get("prefill_s") for r in runs]),
            total_s=float(statistics.median(float(r["total_s"]) for r in runs)),
            cpu_s=_median_or_none([r.get("cpu_s") for r in runs]),
            energy_j=_median_or_none([r.get("energy_j") for r in runs]),
            perplexity=_finite_or_none(first.get("perplexity")),
            token_ids=tuple(first.get("token_ids") or ()),
            passed=_share_or_none([r.get("passed") for r in runs]),
        )
    return folded


def _sum_or_none(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else sum(values)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _histogram_sum(histograms: list) -> list[int] | None:
    if not histograms or any(h is None for h in histograms):
        return None
    total = [0] * max((len(h) for h in histograms), default=0)
    for histogram in histograms:
        for i, count in enumerate(histogram):
            total[i] += count
    return total


REPEAT_NGRAM = 4


def repeated_ngrams(token_ids: Sequence[int], n: int = REPEAT_NGRAM) -> tuple[int, int]:
    """(n-grams of `token_ids` that already occurred earlier in it, all its n-grams)."""
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(len(token_ids) - n + 1):
        gram = tuple(token_ids[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated, max(len(token_ids) - n + 1, 0)


def _repeated_share(results: list[PromptResult]) -> float | None:
    counts = [repeated_ngrams(r.token_ids) for r in results]
    return _ratio(sum(c[0] for c in counts), sum(c[1] for c in counts) or None)


def _pass_at_1(results: list[PromptResult]) -> float | None:
    checked = [r.passed for r in results if r.passed is not None]
    return sum(checked) / len(checked) if checked else None


def _perplexity(results: list[PromptResult]) -> float | None:
    scored = [(r.new_tokens, r.perplexity) for r in results if r.perplexity is not None and r.new_tokens > 0]
    tokens = sum(n for n, _ in scored)
    if not tokens:
        return None
    return math.exp(sum(n * math.log(p) for n, p in scored) / tokens)


def method_summary(
    results: list[PromptResult], baseline: dict[str, PromptResult] | None, greedy: bool
) -> dict:
    """Summary of one method over a group of prompts. `baseline`: the baseline's results of the
    same group by question key (None when there is no baseline)."""
    new_tokens = sum(r.new_tokens for r in results)
    total_s = sum(r.total_s for r in results)
    forwards = _sum_or_none([r.target_forwards for r in results])
    drafted = _sum_or_none([r.drafted for r in results])
    accepted = _sum_or_none([r.accepted for r in results])
    cpu_s = _sum_or_none([r.cpu_s for r in results])
    energy = _sum_or_none([r.energy_j for r in results])
    summary = {
        "prompts": len(results),
        "new_tokens": new_tokens,
        "total_s": total_s,
        "tokens_per_s": new_tokens / total_s if total_s > 0 else 0.0,
        "speedup": None,
        "mean_speedup": None,
        "target_forwards": forwards,
        "mean_accepted_tokens": _ratio(new_tokens, forwards),
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": _ratio(accepted, drafted),
        "accepted_histogram": _histogram_sum([r.accepted_histogram for r in results]),
        "exact_match": None,
        "first_difference_mean": None,
        "first_difference_min": None,
        "perplexity": _perplexity(results),
        "log_perplexity_vs_baseline": None,
        "log_perplexity_vs_baseline_se": None,
        "repeated_4grams": _repeated_share(results),
        "pass_at_1": _pass_at_1(results),
        "prefill_s": _sum_or_none([r.prefill_s for r in results]),
        "cpu_s": cpu_s,
        "cpu_s_per_token": _ratio(cpu_s, new_tokens),
        "energy_j": energy,
        "energy_j_per_token": _ratio(energy, new_tokens),
    }
    if baseline is None:
        return summary
    pairs = [(r, baseline[str(r.question_id)]) for r in results if str(r.question_id) in baseline]
    if not pairs:
        return summary
    ours_tokens, ours_s = sum(r.new_tokens for r, _ in pairs), sum(r.total_s for r, _ in pairs)
    base_tokens, base_s = sum(b.new_tokens for _, b in pairs), sum(b.total_s for _, b in pairs)
    summary["speedup"] = _ratio(_ratio(ours_tokens, ours_s), _ratio(base_tokens, base_s))
    per_prompt = [_ratio(r.tokens_per_s, b.tokens_per_s) for r, b in pairs]
    per_prompt = [s for s in per_prompt if s is not None]
    summary["mean_speedup"] = statistics.fmean(per_prompt) if per_prompt else None
    paired = [math.log(r.perplexity) - math.log(b.perplexity) for r, b in pairs
              if r.perplexity is not None and b.perplexity is not None]
    if paired:
        summary["log_perplexity_vs_baseline"] = statistics.fmean(paired)
        if len(paired) >= 2:
            summary["log_perplexity_vs_baseline_se"] = statistics.stdev(paired) / math.sqrt(len(paired))
    if greedy:
        differences = [first_difference(b.token_ids, r.token_ids) for r, b in pairs]
        summary["exact_match"] = sum(d is None for d in differences) / len(differences)
        positions = [d for d in differences if d is not None]
        summary["first_difference_mean"] = statistics.fmean(positions) if positions else None
        summary["first_difference_min"] = min(positions) if positions else None
    return summary


def summarize(records: Iterable[dict], methods: Sequence[str] = (), greedy: bool = True) -> dict:
    """Records -> {baseline, greedy, speedup_definition, methods, overall, categories, prompts}.

    `methods` fixes the order of methods in the output (methods found only in the records are
    appended); `greedy` says whether exact match against the baseline is meaningful.
    """
    folded = fold_repeats(records)
    names = list(dict.fromkeys([*methods, *(m for _, m in folded)]))
    names = [n for n in names if any(m == n for _, m in folded)]
    baseline_name = choose_baseline(names)
    categories = list(dict.fromkeys(r.category for r in folded.values()))

    def group(category: str | None) -> dict:
        chosen = [r for r in folded.values() if category is None or r.category == category]
        base = None
        if baseline_name is not None:
            base = {str(r.question_id): r for r in chosen if r.method == baseline_name}
        out = {}
        for name in names:
            results = [r for r in chosen if r.method == name]
            if results:
                out[name] = method_summary(results, base, greedy)
        return out

    prompts = []
    base_all = {str(r.question_id): r for r in folded.values() if r.method == baseline_name}
    for r in folded.values():
        b = base_all.get(str(r.question_id))
        prompts.append({
            "question_id": r.question_id,
            "category": r.category,
            "method": r.method,
            "repeats": r.repeats,
            "new_tokens": r.new_tokens,
            "total_s": r.total_s,
            "tokens_per_s": r.tokens_per_s,
            "speedup": None if b is None else _ratio(r.tokens_per_s, b.tokens_per_s),
            "exact_match": None if b is None or not greedy else r.token_ids == b.token_ids,
            "first_difference": None if b is None or not greedy else first_difference(b.token_ids, r.token_ids),
            "perplexity": r.perplexity,
            "passed": r.passed,
        })
    return {
        "baseline": baseline_name,
        "greedy": greedy,
        "speedup_definition": SPEEDUP_DEFINITION,
        "methods": names,
        "overall": group(None),
        "categories": {c: group(c) for c in categories},
        "prompts": prompts,
    }


def has_pass_at_1(group: dict) -> bool:
    """Whether any method of a group (summary["overall"] or a category) has a pass@1."""
    return any(s.get("pass_at_1") is not None for s in group.values())


def compact(summary: dict) -> dict:
    """The one-line summary: overall per method, the headline numbers only (rounded); pass@1
    only when the prompts had tests."""

    def r(value, digits=4):
        return None if value is None else round(value, digits)

    with_pass = has_pass_at_1(summary["overall"])
    return {
        "baseline": summary["baseline"],
        "methods": {
            name: {
                "tokens_per_s": r(s["tokens_per_s"], 3),
                "speedup": r(s["speedup"]),
                "mean_accepted_tokens": r(s["mean_accepted_tokens"]),
                "acceptance_rate": r(s["acceptance_rate"]),
                "exact_match": r(s["exact_match"]),
                "perplexity": r(s["perplexity"]),
                "repeated_4grams": r(s["repeated_4grams"]),
                **({"pass_at_1": r(s.get("pass_at_1"))} if with_pass else {}),
                "cpu_s_per_token": r(s["cpu_s_per_token"]),
                "energy_j": r(s["energy_j"]),
            }
            for name, s in summary["overall"].items()
        },
    }
