"""What the verify saves by taking an EESD draft's rows of the first N layers: a verify of k drafts
after the drafter fed them (its rows offered, as `eesd` runs it) against the same verify with
nothing offered (every row through every layer), on the loaded target after a 256-token context
(medians of 15 calls in each of 3 rounds, in one-token steps too). An exit head of any weights
will do: the cost does not depend on what it drafts.

    python scripts/draft_reuse_cost.py [--model FILE] [--exit-layer 4] [--widths 2,4,8]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from verispec.bench.profile import median_time, timing_context
from verispec.core.drafters.early_exit import ExitHead, ExitHeadLM, PreparedHead
from verispec.runtime.static_kv import Tree
from verispec.target.loading import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--exit-layer", type=int, default=4)
    parser.add_argument("--widths", default="2,4,8")
    args = parser.parse_args()
    target = load(args.model)
    reuses = getattr(target.backend, "reuses_drafted", None)
    if reuses is None or not reuses():
        raise SystemExit(f"{target.name}: its verify does not take drafted rows (its layers are not batch-invariant)")
    lm = ExitHeadLM(target, PreparedHead(target, ExitHead(target, args.exit_layer, list(range(4096)))))
    context = timing_context(256, target.vocab_size)
    drafts = timing_context(16, target.vocab_size)[::-1]
    target.reset()
    lm.begin(context)
    target.forward(context[:-1], last_only=True)

    def verify(k: int, offered: bool):
        def run():
            lm.sync(context)
            for i, token in enumerate(drafts[: k - 1]):  # the drafter feeds all but the last draft token
                lm.extend(torch.tensor([token]), Tree.contiguous(len(context) + i, 1))
            if not offered:
                lm._drafted = None  # nothing offered: the verify recomputes every row
            lm.end_draft()
            target.forward([context[-1], *drafts[:k]])
            lm.keep(0)
            target.crop(len(context) - 1)
        return run

    def step():
        target.forward([context[-1]])
        target.crop(len(context) - 1)

    one = median_time(step)
    for k in (int(w) for w in args.widths.split(",")):
        rounds = [(median_time(verify(k, False)), median_time(verify(k, True))) for _ in range(3)]
        plain, reused = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        print(f"k = {k}: draft + verify {plain * 1e3:.1f} ms recomputing, {reused * 1e3:.1f} ms taking the "
              f"draft's rows ({(plain - reused) * 1e3:+.1f} ms saved, {(plain - reused) / one:.2f} of a step)")
    print(f"one-token step {one * 1e3:.1f} ms; exit layer {args.exit_layer} of {len(target.decoder.layers)}")


if __name__ == "__main__":
    main()
