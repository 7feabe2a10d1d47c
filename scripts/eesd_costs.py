"""Cost of one EESD draft step against a one-token target step, by exit layer N and draft
vocabulary V_d, on the default model's fast path (untrained heads: cost does not depend on the
weights), with the head's layer on int8 forms (the default on the block kernel) and in float32.
Used to choose EESD's defaults.

    python scripts/eesd_costs.py --layers 2 3 4 6 8 --vocab 8192 16384 32768
"""

from __future__ import annotations

import argparse
import itertools

import verispec
from verispec.bench.profile import draft_step_seconds, target_step_seconds, timing_context
from verispec.drafters.early_exit import ExitHead, PreparedHead


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
