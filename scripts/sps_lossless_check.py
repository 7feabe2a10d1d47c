"""Is `sps` lossless on the default model, in the configuration the benchmark runs (block kernel,
C layers, the int8 exit head as the draft model)? The tests check the rule on tiny models; this
checks the production path on the first drafted position. The first generated token comes from
the prefill forward, never from a draft, so the check is on the first two tokens: their joint
distribution over many seeds against the exact one (temperature / top-k / top-p applied to the
target's logits, the second token's for each possible first token), by a chi-square
goodness-of-fit test (cells with expected count < 5 pooled; the test suite's `chi_square_pvalue`).
`ar` runs alongside as a control.

    python scripts/sps_lossless_check.py --seeds 1200
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

import verispec
from verispec.sampling import SamplingConfig, probabilities
from verispec.text import PLAIN_TEMPLATE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import chi_square_pvalue  # noqa: E402  (the tests' chi-square, not a second copy)

PROMPT = "Describe the town where you grew up, its streets and its people."


def warped(target, ids: list[int], config: SamplingConfig) -> torch.Tensor:
    """The target's next-token distribution after `ids`, warped as sampling warps it: [vocab]."""
    with torch.no_grad():
        logits = target.model(torch.tensor([ids])).logits[0, -1:].float()  # [1, vocab]
    return probabilities(logits, config)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1200)
    parser.add_argument("--methods", nargs="+", default=["ar", "sps"])
    args = parser.parse_args()
    target = verispec.load()
    config = SamplingConfig(temperature=1.0, top_k=10, top_p=0.9)
    ids = target.tokenizer(PLAIN_TEMPLATE.format(prompt=PROMPT))["input_ids"]
    first = warped(target, ids, config)
    exact = {}
    for t1 in torch.nonzero(first).flatten().tolist():
        second = warped(target, ids + [t1], config)
        for t2 in torch.nonzero(second).flatten().tolist():
            exact[(t1, t2)] = float(first[t1]) * float(second[t2])
    print(f"exact joint distribution of the first two tokens: {len(exact)} outcomes")
    for method in args.methods:
        counts, drafted, accepted = Counter(), 0, 0
        for seed in tqdm(range(args.seeds), desc=method):
            result = verispec.generate(target, ids, method, max_new_tokens=3, temperature=1.0, top_k=10,
                                       top_p=0.9, seed=seed)
            counts[tuple(result.token_ids[:2])] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
        statistic, pvalue, df = chi_square_pvalue(counts, exact)
        print(f"{method}: chi2 = {statistic:.1f}, df = {df}, p = {pvalue:.3g}; drafted {drafted}, accepted {accepted}")


if __name__ == "__main__":
    main()
