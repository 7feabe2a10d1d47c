"""Structured output on a model: extraction prompts under JSON schemas, constrained `ar` against
the lossless methods (outputs must be identical), the grammar's share of the decode time.

    .venv/bin/python scripts/structured_output.py [--model PATH] [--methods pld,anpd,eesd] [-n 96]

Prints, per prompt, the output and (new tokens, target forwards, accepted forced tokens) for each
method, then totals with tokens per second, and the seconds constrained `ar` spent in the
grammar's code (masks, the matcher's advance: `core/constraint.py`) over its decode seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import verispec
import verispec.core.constraint as constraint

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "paid"],
         "properties": {"customer": {"type": "string"}, "paid": {"type": "boolean"},
                        "items": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "required": ["product", "quantity"],
                            "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"}}}}}}
CASES = [
    ("Extract the person as JSON with name, age and city.\nText: Maria Lopez is 34 and lives in Seville.\nJSON:",
     PERSON),
    ("Extract the person as JSON with name, age and city.\nText: Tom Becker, aged 51, moved to Hamburg last year.\n"
     "JSON:", PERSON),
    ("Extract the order as JSON.\nText: Anna Berg ordered 2 lamps and 3 chairs and has paid.\nJSON:", ORDER),
    ("Extract the order as JSON.\nText: Li Wei wants 10 pencils, 1 notebook and 4 erasers; not paid yet.\nJSON:",
     ORDER),
]


class RuleClock:
    """Seconds spent in the constrained rule (masks and the matcher's advance)."""

    def __init__(self):
        self.seconds = 0.0
        original = constraint.ConstrainedRule.__call__

        def timed(rule, *args, **kwargs):
            started = time.perf_counter()
            try:
                return original(rule, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        constraint.ConstrainedRule.__call__ = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded one)")
    parser.add_argument("--methods", default="pld,anpd,eesd")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target = verispec.load(args.model)
    clock = RuleClock()

    def run(prompt, method, schema):
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
        return verispec.generate(target, prompt, method, max_new_tokens=args.max_new_tokens,
                                 response_format=response_format, prompt_format="chat")

    for prompt, schema in CASES:  # warm-up (the first format builds llguidance's tokenizer)
        run(prompt, "ar", schema)
    totals: dict[str, list] = {}
    ar_rule = ar_decode = 0.0
    for prompt, schema in CASES:
        clock.seconds = 0.0
        reference = run(prompt, "ar", schema)
        ar_rule += clock.seconds
        ar_decode += reference.stats.decode_s
        valid = reference.stats.stop_reason == "eos" and bool(json.loads(reference.text))
        row = {"ar": reference.stats}
        for method in args.methods.split(","):
            result = run(prompt, method, schema)
            assert result.token_ids == reference.token_ids, (method, prompt)
            row[method] = result.stats
        for name, stats in row.items():
            total = totals.setdefault(name, [0, 0.0, 0, 0])
            total[0] += stats.new_tokens
            total[1] += stats.prefill_s + stats.decode_s
            total[2] += stats.target_forwards
            total[3] += stats.forced
        print(repr(reference.text), "valid" if valid else reference.stats.stop_reason,
              {name: (s.new_tokens, s.target_forwards, s.forced) for name, s in row.items()}, flush=True)
    base = totals["ar"][0] / totals["ar"][1]
    for name, (tokens, seconds, forwards, forced) in totals.items():
        print(f"{name:8s} tokens {tokens:4d} forwards {forwards:4d} forced {forced:4d} "
              f"tokens/s {tokens / seconds:6.2f} ({tokens / seconds / base:.2f}x constrained ar)")
    print(f"constrained ar: {ar_rule:.2f} s of {ar_decode:.2f} s decoding in the grammar's code "
          f"({100 * ar_rule / ar_decode:.1f}%)")


if __name__ == "__main__":
    main()
