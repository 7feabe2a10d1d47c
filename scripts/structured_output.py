"""Structured output on a model: extraction prompts under JSON schemas, constrained `ar` against
the lossless methods (outputs must be identical), unconstrained `ar` and, optionally,
llama-server's `json_schema` on the same file.

    .venv/bin/python scripts/structured_output.py [--model PATH] [--methods pld,anpd,eesd] [-n 128]
        [--cases scripts/extraction_cases.jsonl] [--peer] [--llama-server PATH]

The cases (scripts/extraction_cases.jsonl, written for this project: people, orders, events,
reviews, contacts, books, flights and bug reports, two of each) are asked greedily through the
model's chat template. Prints one line per case, then per method: valid outputs (checked with
`jsonschema`, not with the grammar that produced them), new tokens, target forwards, accepted
forced tokens, tokens per second over prefill and decode, and the speed against constrained
`ar`. Then the decode cost of a token with and without the constraint (unconstrained `ar` on the
same prompts writes other text, so only the cost per token compares) and the share of
constrained `ar`'s decode time spent in the grammar's code (masks, the matcher's advance:
`core/constraint.py`). With `--peer`, llama-server (`make llama-native`, else `make
llama-server`) serves the same GGUF file with the same threads, one slot, and gets each case as
`response_format: {"type": "json_schema", ...}`; its own timings give its speed.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import torch

import verispec
import verispec.core.constraint as constraint
from verispec.bench.servers import ManagedServer, ModelFiles, free_port, parse_server, server_command, wait_ready

CASES = Path(__file__).with_name("extraction_cases.jsonl")


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


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "extraction", "strict": True, "schema": schema}}


@dataclass
class Total:
    """One method's sums over the cases."""

    cases: int = 0
    valid: int = 0
    tokens: int = 0
    seconds: float = 0.0  # prefill + decode
    prefill_s: float = 0.0
    forwards: int = 0
    forced: int = 0


def add(totals: dict[str, Total], name: str, valid: bool, tokens: int, seconds: float, forwards: int = 0,
        forced: int = 0, prefill_s: float = 0.0) -> None:
    total = totals.setdefault(name, Total())
    total.cases += 1
    total.valid += valid
    total.tokens += tokens
    total.seconds += seconds
    total.prefill_s += prefill_s
    total.forwards += forwards
    total.forced += forced


def print_totals(totals: dict[str, Total], base: str) -> None:
    reference = totals[base].tokens / totals[base].seconds
    for name, t in totals.items():
        speed = t.tokens / t.seconds
        print(f"{name:14s} valid {t.valid:2d}/{t.cases:2d} tokens {t.tokens:5d} forwards {t.forwards:5d} "
              f"forced {t.forced:4d} seconds {t.seconds:6.2f} (prefill {t.prefill_s:5.2f}) tokens/s {speed:6.2f} "
              f"({speed / reference:.2f}x constrained ar)")


def llama_server_runs(model_path: str, cases: list[dict], max_tokens: int, threads: int, binary: str | None):
    """Each case through llama-server's json_schema: (text, predicted tokens, (seconds of prompt,
    seconds of decode) by its own timings)."""
    import httpx

    spec = parse_server("llama-server:1", 1)
    scratch = Path(tempfile.mkdtemp(prefix="structured-"))
    port = free_port()
    argv, env = server_command(spec, ModelFiles(model_path), threads, port, llama_server=binary, scratch=scratch)
    server = ManagedServer(argv, env, scratch / "llama-server.log", port)
    try:
        wait_ready(server.base_url, 300, server.alive)

        def ask(case: dict) -> dict:
            body = {"messages": [{"role": "user", "content": case["prompt"]}], "max_tokens": max_tokens,
                    "temperature": 0, "response_format": response_format(case["schema"]),
                    "cache_prompt": False}  # cold prefill, as verispec's runs here
            return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600).json()

        ask(cases[0])  # warm-up
        answers = [ask(case) for case in cases]
        return [(a["choices"][0]["message"]["content"], a["timings"]["predicted_n"],
                 (a["timings"]["prompt_ms"] / 1000, a["timings"]["predicted_ms"] / 1000)) for a in answers]
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model directory (default: the embedded one)")
    parser.add_argument("--methods", default="pld,anpd,eesd")
    parser.add_argument("-n", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--cases", type=Path, default=CASES)
    parser.add_argument("--peer", action="store_true", help="also llama-server's json_schema on the same GGUF file")
    parser.add_argument("--llama-server", default=None, help="the llama-server binary (default: the project's build)")
    args = parser.parse_args()
    cases = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    target = verispec.load(args.model)
    # Every run prefills its prompt cold, as a new document would: with the prefix cache on, the
    # methods run after constrained `ar` on a case would find their whole prompt cached.
    target.prefix_cache = False
    clock = RuleClock()

    def run(prompt, method, schema):
        return verispec.generate(target, prompt, method, max_new_tokens=args.max_new_tokens,
                                 response_format=None if schema is None else response_format(schema),
                                 prompt_format="chat")

    for case in cases[:4]:  # warm-up (the first format builds llguidance's tokenizer)
        run(case["prompt"], "ar", case["schema"])
    totals: dict[str, Total] = {}
    ar_rule = ar_decode = free_decode = 0.0
    ar_decoded = free_decoded = 0
    for case in cases:
        prompt, schema = case["prompt"], case["schema"]
        clock.seconds = 0.0
        reference = run(prompt, "ar", schema)
        ar_rule += clock.seconds
        ar_decode += reference.stats.decode_s
        ar_decoded += reference.stats.new_tokens
        valid = is_valid(reference.text, schema)
        row = {"ar": reference.stats}
        for method in args.methods.split(","):
            result = run(prompt, method, schema)
            assert result.token_ids == reference.token_ids, (method, prompt)
            row[method] = result.stats
        for name, stats in row.items():
            add(totals, name, valid, stats.new_tokens, stats.prefill_s + stats.decode_s, stats.target_forwards,
                stats.forced, stats.prefill_s)
        free = run(prompt, "ar", None)
        free_decode += free.stats.decode_s
        free_decoded += free.stats.new_tokens
        print(repr(reference.text), "valid" if valid else f"INVALID ({reference.stats.stop_reason})",
              {name: (s.new_tokens, s.target_forwards, s.forced) for name, s in row.items()}, flush=True)
    if args.peer:
        threads = torch.get_num_threads()  # the threads this process decoded with
        model = args.model or str(ModelFiles(None).gguf())
        for case, (text, tokens, seconds) in zip(cases, llama_server_runs(model, cases, args.max_new_tokens, threads,
                                                                          args.llama_server)):
            valid = is_valid(text, case["schema"])
            add(totals, "llama-server", valid, tokens, sum(seconds), prefill_s=seconds[0])
            print("llama-server", repr(text), "valid" if valid else "INVALID", flush=True)
    print_totals(totals, "ar")
    print(f"decode per token: constrained ar {1000 * ar_decode / ar_decoded:.1f} ms, unconstrained ar "
          f"{1000 * free_decode / free_decoded:.1f} ms ({ar_decode / ar_decoded / (free_decode / free_decoded):.3f}x)")
    print(f"constrained ar: {ar_rule:.2f} s of {ar_decode:.2f} s decoding in the grammar's code "
          f"({100 * ar_rule / ar_decode:.1f}%)")


if __name__ == "__main__":
    main()
