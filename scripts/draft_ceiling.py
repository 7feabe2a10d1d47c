"""What the measured acceptance of a benchmark's model-drafted methods (eesd, sps, mtad drafting
with the exit head) allows on this machine, under step costs timed here on the run's own path.

    python scripts/draft_ceiling.py runs/torch-greedy runs/torch-sampled
    python scripts/draft_ceiling.py runs/torch-sampled --max-draft 8 --json

Reads each run directory's `config.json` (its model, path, dtype, methods and settings) and
`summary.json` (per method: tokens per target forward T, draft tokens per forward D, the share
alpha of drafted tokens accepted), loads the target as the run did, and times, relative to a
one-token target step (medians of interleaved rounds, as `verispec profile`): target forwards of
1..K+1 tokens v(w), one exit-head draft token d, and one MTAD beam step of W rows d_W. Then, per
method:

- model: the speed over `ar` that T, D and these costs give with nothing else in a step, T /
  cost per forward (eesd, sps: D d + v(1 + D); mtad, drafting gamma tokens each forward it
  drafts: (D / gamma) (d + (gamma - 1) d_W) + v(1 + D); v interpolated between widths); the gap
  to the measured speed is the loop's own time (sampling, bookkeeping) and the approximation of
  the mean of v by v of the mean;
- eesd, sps: the best speed any constant draft length k = 0..K reaches if every draft token is
  accepted with probability alpha independently, (1 + alpha + ... + alpha^k) / (k d + v(k + 1)),
  the same with drafts made free, and the acceptance that would reach 1.00x, 1.10x and 1.25x at
  this draft cost. alpha is measured under the run's controller: for eesd, which drafts where its
  head is confident, it is higher than the head's agreement over all positions (the
  unconditional figure, and trace replays of it: `scripts/early_exit_agreement.py --ceiling`);
- mtad: the speed with its drafts made free, T / v(1 + D).

Runs that drafted with another model (--draft-model) are refused: only the exit head's steps are
timed here. Figures are this machine's; ratios, not times, carry over between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import verispec
from verispec.bench.profile import draft_step_seconds, target_step_seconds, timing_context
from verispec.bench.runner import BenchSettings
from verispec.errors import ConfigError, VerispecError
from verispec.core.methods import get_method, prepared_exit_head

MODEL_DRAFTED = ("eesd", "sps", "mtad")
TARGETS = (1.0, 1.1, 1.25)


def read_run(directory: Path) -> tuple[BenchSettings, dict]:
    """(settings, summary) of a benchmark run directory; a ConfigError naming what is missing."""
    for name in ("config.json", "summary.json"):
        if not (directory / name).is_file():
            raise ConfigError(f"{directory} is not a finished benchmark run ({name} missing)")
    saved = json.loads((directory / "config.json").read_text())["settings"]
    saved.update(categories=tuple(saved["categories"]), methods=tuple(saved["methods"]), peers=tuple(saved["peers"]))
    settings = BenchSettings(**saved)
    if settings.draft_model is not None:
        raise ConfigError(f"{directory} drafted with {settings.draft_model}: this script times the exit head's steps only")
    return settings, json.loads((directory / "summary.json").read_text())


def interpolate(relative: list[float], width: float) -> float:
    """v(width) from v(1), v(2), ... (relative[w - 1]), linear between integer widths."""
    low = min(int(width), len(relative))
    if low >= len(relative):
        return relative[-1] * width / len(relative)  # past the timed widths: proportional (not reached here)
    return relative[low - 1] + (width - low) * (relative[low] - relative[low - 1])


def geometric_best(alpha: float, draft: float, verify: list[float], max_draft: int, least: int = 0) -> tuple[float, int]:
    """(best speed over ar, its k) of constant draft lengths least..max_draft when each draft
    token is accepted with probability alpha independently (k = 0: `ar`, 1.0)."""
    best = (1.0, 0) if least == 0 else (0.0, least)
    for k in range(max(1, least), max_draft + 1):
        tokens = sum(alpha ** i for i in range(k + 1))
        best = max(best, (tokens / (k * draft + verify[k]), k))
    return best


def needed_acceptance(goal: float, draft: float, verify: list[float], max_draft: int) -> float | None:
    """The least alpha at which drafting (some constant k >= 1) reaches `goal` (None: not even
    alpha = 1)."""
    def speed(alpha: float) -> float:
        return geometric_best(alpha, draft, verify, max_draft, least=1)[0]

    if speed(1.0) < goal:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if speed(middle) < goal else (low, middle)
    return high


def costs(target, prepared, widths: int, beams: set[int], rounds: int = 3, repeats: int = 15) -> dict:
    """Step costs relative to a one-token step: {"step_ms", "verify": [v(1)..v(widths)], "draft",
    "beam": {W: d_W}}, each the median of `rounds` interleaved rounds."""
    context = timing_context(vocab_size=target.vocab_size)
    per_round = []
    for _ in range(rounds):
        verify = [target_step_seconds(target, context, w, repeats) for w in range(1, widths + 1)]
        drafts = {w: draft_step_seconds(target, prepared, context, repeats, width=w) for w in sorted({1, *beams})}
        per_round.append((verify, drafts))
    verify = [statistics.median(r[0][i] for r in per_round) for i in range(widths)]
    drafts = {w: statistics.median(r[1][w] for r in per_round) for w in per_round[0][1]}
    base = verify[0]
    return {"step_ms": base * 1e3, "verify": [v / base for v in verify], "draft": drafts[1] / base,
            "beam": {w: s / base for w, s in drafts.items() if w > 1}}


def method_row(name: str, settings: BenchSettings, summary: dict, cost: dict, max_draft: int) -> dict:
    """One method's measured figures, the model's speed and its ceilings."""
    method, options = settings.method_options(name)
    s = summary["overall"][name]
    forwards, drafted, accepted = s["target_forwards"], s["drafted"], s["accepted"]
    T = s["new_tokens"] / forwards
    D = drafted / forwards
    alpha = accepted / drafted if drafted else 0.0
    verify, d = cost["verify"], cost["draft"]
    row = {"method": name, "measured": s["speedup"], "tokens_per_forward": T, "drafted_per_forward": D,
           "acceptance": alpha}
    if method == "mtad":
        controller = options.controller or get_method("mtad").default_controller
        gamma = options.draft_length or int(controller.partition(":")[2] or get_method("mtad").default_length)
        draft_step = d + (gamma - 1) * cost["beam"][options.beams]
        row["model"] = T / (D / gamma * draft_step + interpolate(verify, 1 + D))
        row["free_drafts"] = T / interpolate(verify, 1 + D)
        return row
    row["model"] = T / (D * d + interpolate(verify, 1 + D))
    best, k = geometric_best(alpha, d, verify, max_draft)
    row["best_constant"], row["best_k"] = best, k
    row["free_drafts"] = geometric_best(alpha, 0.0, verify, max_draft)[0]
    row["needed"] = {goal: needed_acceptance(goal, d, verify, max_draft) for goal in TARGETS}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="benchmark run directories (--out of verispec bench)")
    parser.add_argument("--max-draft", type=int, default=8, help="longest constant draft considered (K)")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per cost and round (the median is kept)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    try:
        for option, value in (("--max-draft", args.max_draft), ("--repeats", args.repeats), ("--rounds", args.rounds)):
            if value < 1:
                raise ConfigError(f"{option} must be >= 1, got {value}")
        runs = [(path, *read_run(path)) for path in args.runs]
        first = runs[0][1]
        keys = ("model", "dtype", "fast", "block_kernel", "numerics", "device", "exit_head")
        for path, settings, _ in runs[1:]:
            if any(getattr(settings, key) != getattr(first, key) for key in keys):
                raise ConfigError(f"{path} ran another model, path or head than {runs[0][0]}: time them apart")
        target = verispec.load(first.model, first.dtype, fast=first.fast, block_kernel=first.block_kernel,
                               numerics=first.numerics, device=first.device)
        prepared = prepared_exit_head(target, first.exit_head)
        beams, widths = set(), args.max_draft + 1
        for _, settings, summary in runs:
            for name in summary["overall"]:
                method, options = settings.method_options(name) if name in settings.methods else (name, None)
                if method == "mtad":
                    beams.add(options.beams)
                if method in MODEL_DRAFTED:
                    forwards = summary["overall"][name]["target_forwards"]
                    widths = max(widths, int(summary["overall"][name]["drafted"] / forwards) + 2)
    except (VerispecError, OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    cost = costs(target, prepared, widths, beams, args.rounds, args.repeats)
    rows = [{"run": str(path), **method_row(name, settings, summary, cost, args.max_draft)}
            for path, settings, summary in runs for name in summary["overall"]
            if name in settings.methods and settings.method_options(name)[0] in MODEL_DRAFTED]
    if args.json:
        print(json.dumps({"target": target.name, "dtype": first.dtype, "fast": first.fast, "costs": cost, "methods": rows}))
        return
    print(f"{target.name}, {'fast path' if first.fast else 'PyTorch path'}, {first.dtype}; one-token step "
          f"{cost['step_ms']:.1f} ms; relative to it: forwards of 1..{widths} tokens "
          + " ".join(f"{v:.2f}" for v in cost["verify"]) + f"; a draft token {cost['draft']:.2f}"
          + "".join(f"; a beam step of {w} rows {v:.2f}" for w, v in sorted(cost["beam"].items())))
    print("\n| run | method | measured vs ar | tokens per forward | drafted per forward | acceptance | model | "
          "best constant k (i.i.d.) | free drafts | acceptance for 1.00x / 1.10x / 1.25x |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        measured = "-" if row["measured"] is None else f"{row['measured']:.2f}x"
        best = f"{row['best_constant']:.2f}x (k = {row['best_k']})" if "best_constant" in row else "-"
        needed = " / ".join("-" if a is None else f"{a:.0%}" for a in row["needed"].values()) if "needed" in row else "-"
        print(f"| {row['run']} | `{row['method']}` | {measured} | {row['tokens_per_forward']:.2f} | "
              f"{row['drafted_per_forward']:.2f} | {row['acceptance']:.1%} | {row['model']:.2f}x | {best} | "
              f"{row['free_drafts']:.2f}x | {needed} |")


if __name__ == "__main__":
    main()
