"""Cost of one EESD draft step against a one-token target step, by exit layer N and draft
vocabulary V_d, on the default model's fast path (untrained heads: cost does not depend on the
weights), with the head's layer on int8 forms (the default on the block kernel) and in float32.
Used to choose EESD's defaults.

    python scripts/eesd_costs.py --layers 2 3 4 6 8 --vocab 8192 16384 32768
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

import verispec
from verispec.drafters.early_exit import ExitHead, ExitHeadLM, PreparedHead
from verispec.fastpath import Tree


def median_time(fn, repeats: int = 15) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    parser.add_argument("--vocab", nargs="+", type=int, default=[8192, 16384, 32768])
    args = parser.parse_args()
    target = verispec.load()
    context = torch.randint(1000, 20000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    target.reset()
    target.forward(context, last_only=True)

    def target_step():
        target.forward(context[:1])
        target.crop(len(context))

    base = median_time(target_step)
    print(f"target 1-token step: {base * 1e3:.1f} ms ({target.dtype})")
    print(f"{'N':>3} {'V_d':>6} {'head':>7} {'draft ms':>9} {'ratio':>6}")
    for layers, vocab, int8 in itertools.product(args.layers, args.vocab, (True, False)):
        head = ExitHead(target.model, layers, list(range(vocab)))
        lm = ExitHeadLM(target, PreparedHead(target, head, quantize=int8))
        lm.begin(context)
        target.capture_exit(layers)
        lm._head_length = len(context)
        lm._cache.reserve(len(context) + 2)
        lm._cache.length = len(context)

        def draft_step():
            lm.extend(torch.tensor([context[0]]), Tree.contiguous(len(context), 1))

        seconds = median_time(draft_step)
        form = "int8" if int8 else "float32"
        print(f"{layers:>3} {vocab:>6} {form:>7} {seconds * 1e3:9.1f} {seconds / base:6.2f}", flush=True)

if __name__ == "__main__":
    main()
