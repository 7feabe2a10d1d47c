"""Side-by-side timing of lossless methods with the LM head run lazily (`lazy_logits`: only on the
rows the acceptance rule reads) and on every row of each verify, in one process: for each prompt
(the first question of each Spec-Bench category) and method, both settings run back to back in
an order alternated per prompt, after a short warm-up generation; outputs must be identical.

    python scripts/lazy_head_ab.py --methods pld,anpd,suffix

Prints each method's tokens/s with each setting and their ratio (lazy / every row).
"""

from __future__ import annotations

import argparse
import collections
import json
import time

from verispec import api
from verispec.core import acceptance
from verispec.target.loading import load
from verispec.bench.datasets import resolve_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="pld,anpd,suffix")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = load()
    first: dict[str, str] = {}
    for line in resolve_dataset("spec-bench").read_text().splitlines():
        question = json.loads(line)
        first.setdefault(question["category"], question["turns"][0])
    seconds, tokens, outputs = collections.Counter(), collections.Counter(), {}
    methods = args.methods.split(",")
    for i, prompt in enumerate(first.values()):
        for method in methods:
            for lazy in ((True, False) if i % 2 else (False, True)):
                acceptance.verify_lossless.reads_rows_in_order = lazy
                api.generate(target, prompt, method=method, max_new_tokens=8)  # warm-up
                started = time.perf_counter()
                result = api.generate(target, prompt, method=method, max_new_tokens=args.max_new_tokens)
                seconds[method, lazy] += time.perf_counter() - started
                tokens[method, lazy] += len(result.token_ids)
                assert outputs.setdefault((method, i), result.token_ids) == result.token_ids, (method, i)
    for method in methods:
        every, lazy = (tokens[method, flag] / seconds[method, flag] for flag in (False, True))
        print(f"{method}: every row {every:.1f} tok/s, lazy {lazy:.1f} tok/s, ratio {lazy / every:.3f}")


if __name__ == "__main__":
    main()
