"""What splitting a verify costs when the rule reads every row after all: a staged verify
(`lazy_logits`, the first 4 tokens, then the rest) against one whole forward of the same tokens,
on the loaded target after a 256-token context (medians of 15 calls in each of 3 rounds).

    python scripts/staged_verify_cost.py
"""

from __future__ import annotations

import statistics

from verispec.bench.profile import median_time, timing_context
from verispec.target.loading import load


def main() -> None:
    target = load()
    context = timing_context(256, target.vocab_size)
    target.reset()
    target.forward(context, last_only=True)

    def verify(width: int, lazy: bool):
        def run():
            target.forward(context[:width], lazy=lazy)[width - 1]  # the last row: every part computed
            target.crop(len(context))
        return run

    for width in (8, 16):
        rounds = [(median_time(verify(width, False)), median_time(verify(width, True))) for _ in range(3)]
        whole, staged = (statistics.median(r[i] for r in rounds) * 1e3 for i in (0, 1))
        print(f"width {width}: one forward {whole:.1f} ms, staged with every row read {staged:.1f} ms "
              f"(+{staged - whole:.1f})")
    print(f"one-token step {median_time(verify(1, False)) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
