"""Choose a method's default draft length / controller by measurement.

Runs several (method, controller) variants side by side on the same prompts, rotating their
order per prompt, greedy, and prints tokens/s, speedup over `ar` (ratio of totals), mean
accepted tokens and exact match against `ar`. Used to pick ANPD's default (see README).

    python scripts/tune_draft_length.py --category summarization --n 10 --max-new-tokens 128 \
        --variants ar anpd:constant:4 anpd:constant:8 anpd:adaptive:8 pld:constant:10
"""

from __future__ import annotations

import argparse
import json

from verispec import load
from verispec.api import stream
from verispec.bench.datasets import encode_question, load_dataset
from verispec.methods import MethodOptions


def parse_variant(spec: str) -> tuple[str, MethodOptions]:
    method, _, controller = spec.partition(":")
    return method, MethodOptions(controller=controller or None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="spec-bench")
    parser.add_argument("--category", default="summarization")
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", nargs="+", required=True)
    args = parser.parse_args()

    target = load(None, args.dtype)
    _, questions = load_dataset(args.dataset, [args.category] if args.category else None, args.n)
    totals = {v: {"tokens": 0, "seconds": 0.0, "forwards": 0, "same": 0} for v in args.variants}
    reference: dict[int, list[int]] = {}
    for index, question in enumerate(questions):
        prompt = encode_question(target.tokenizer, question)
        order = args.variants[index % len(args.variants):] + args.variants[: index % len(args.variants)]
        outputs = {}
        for variant in order:
            method, options = parse_variant(variant)
            text_stream = stream(target, prompt, method, max_new_tokens=args.max_new_tokens, options=options)
            for _ in text_stream:
                pass
            result = text_stream.result
            outputs[variant] = result.token_ids
            t = totals[variant]
            t["tokens"] += result.stats.new_tokens
            t["seconds"] += result.stats.total_s
            t["forwards"] += result.stats.target_forwards
        reference[question.question_id] = outputs.get("ar", [])
        for variant in args.variants:
            totals[variant]["same"] += outputs[variant] == reference[question.question_id]
        print(json.dumps({"question": question.question_id, "prompt_tokens": len(prompt),
                          **{v: round(len(outputs[v]) / 1, 0) for v in []}}), flush=True)
    base = totals.get("ar")
    base_rate = base["tokens"] / base["seconds"] if base else None
    print(f"{'variant':24} {'tok/s':>7} {'speedup':>8} {'mean acc':>9} {'exact':>6}")
    for variant, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        speedup = rate / base_rate if base_rate else float("nan")
        print(f"{variant:24} {rate:7.2f} {speedup:8.3f} {t['tokens'] / t['forwards']:9.2f} {t['same']:>3}/{len(questions)}")


if __name__ == "__main__":
    main()
