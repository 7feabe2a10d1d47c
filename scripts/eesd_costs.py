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


def target_step_seconds(target, context: list[int], width: int = 1) -> float:
    """Median seconds of a target forward of `width` tokens after `context` (left in the cache)."""
    target.reset()
    target.forward(context, last_only=True)

    def step():
        target.forward(context[:width])
        target.crop(len(context))

    return median_time(step)


def draft_step_seconds(target, prepared: PreparedHead, context: list[int]) -> float:
    """Median seconds of one draft token (layers 1..N of the target, the head's layer, norm and
    the draft-vocabulary projection) after `context`."""
    target.reset()
    target.forward(context, last_only=True)
    lm = ExitHeadLM(target, prepared)
    lm.begin(context)
    target.capture_exit(prepared.exit_layer)
    lm._head_length = len(context)
    lm._cache.reserve(len(context) + 2)
    lm._cache.length = len(context)
    return median_time(lambda: lm.extend(torch.tensor([context[0]]), Tree.contiguous(len(context), 1)))


def timing_context(length: int = 256) -> list[int]:
    return torch.randint(1000, 20000, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    parser.add_argument("--vocab", nargs="+", type=int, default=[8192, 16384, 32768])
    args = parser.parse_args()
    target = verispec.load()
    context = timing_context()
    base = target_step_seconds(target, context)
    print(f"target 1-token step: {base * 1e3:.1f} ms ({target.dtype})")
    print(f"{'N':>3} {'V_d':>6} {'head':>7} {'draft ms':>9} {'ratio':>6}")
    for layers, vocab, int8 in itertools.product(args.layers, args.vocab, (True, False)):
        head = ExitHead(target.model, layers, list(range(vocab)))
        seconds = draft_step_seconds(target, PreparedHead(target, head, quantize=int8), context)
        form = "int8" if int8 else "float32"
        print(f"{layers:>3} {vocab:>6} {form:>7} {seconds * 1e3:9.1f} {seconds / base:6.2f}", flush=True)


if __name__ == "__main__":
    main()
