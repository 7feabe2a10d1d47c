"""Replay recorded greedy outputs through vLLM's `ngram` drafter and verispec's ANPD proposer.

Runs in vLLM's environment (it calls vLLM's own prompt-lookup function). Reads the prompts and
the outputs without speculation that scripts/vllm_bench.py wrote to --run, then decodes each
output again as a greedy speculative decoder would (each step verifies the draft against the
recorded output, commits the accepted prefix and one more token), one request at a time, and
prints per drafter the target forwards, the tokens drafted, and the cost of the steps under a
linear step cost: a forward of 1 + D tokens costs (overhead + 1 + D) / (overhead + 1) of a
one-token forward (`--overhead`, the fixed part in tokens; the ANPD proposer measures its costs
from a stand-in clock that follows the same rule). Offline and deterministic: it prices drafting
choices without a machine's noise, not vLLM's real step time.

    .venv-vllm/bin/python scripts/vllm_replay.py --run runs/vllm-bench --overhead 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from verispec.integrations import vllm as hook


def recorded(run: Path) -> list[tuple[list[int], list[int]]]:
    prompts = json.loads((run / "prompts.json").read_text())
    found = sorted(run.glob("none-one_stream-*.json"))
    if not found:
        raise SystemExit(f"error: no outputs without speculation in {run} (run scripts/vllm_bench.py first)")
    outputs = json.loads(found[0].read_text())["one_stream"]["outputs"]
    return [(p["ids"], o) for p, o in zip(prompts, outputs)]


def replay(pairs, draft, overhead: float, clock: list[float]) -> dict:
    forwards = drafted = accepted = 0
    cost = 0.0
    for prompt, output in pairs:
        tokens, at, sampled = list(prompt), 0, [prompt[-1]]
        while at < len(output):
            proposal = draft(tokens, sampled, len(output) - at - 1) if at else []
            proposal = proposal[: max(0, len(output) - at - 1)]
            n = 0
            while n < len(proposal) and proposal[n] == output[at + n]:
                n += 1
            sampled = output[at : at + n + 1]
            tokens += sampled
            at += n + 1
            forwards += 1
            drafted += len(proposal)
            accepted += n
            step = (overhead + 1 + len(proposal)) / (overhead + 1)
            cost += step
            clock[0] += step
    total = sum(len(o) for _, o in pairs)
    return {"forwards": forwards, "drafted": drafted, "accepted": accepted, "cost": cost,
            "tokens_per_forward": total / forwards, "speed": total / cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default="runs/vllm-bench")
    parser.add_argument("--overhead", type=float, default=8.0)
    parser.add_argument("--ngram-k", type=int, default=8)
    parser.add_argument("--anpd", default="k=8;k=16", help="';'-separated variants: k=N plus proposer settings")
    args = parser.parse_args()
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as lookup

    pairs = recorded(Path(args.run))
    clock = [0.0]
    width = max(len(p) + len(o) for p, o in pairs) + 64

    def ngram(tokens, sampled, room):
        found = lookup(np.asarray(tokens, dtype=np.int32), 2, 4, width, min(args.ngram_k, room))
        return found.tolist()

    rows = [("vLLM ngram k=%d, lookup 2-4" % args.ngram_k, replay(pairs, ngram, args.overhead, clock))]
    hook.time.perf_counter = lambda: clock[0]
    for variant in args.anpd.split(";"):
        parts = [p for p in variant.split("/") if p]
        k = int(next((p.split("=")[1] for p in parts if p.startswith("k=")), 8))
        settings = "/".join(p for p in parts if not p.startswith("k="))
        config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                                 model_config=SimpleNamespace(max_model_len=width),
                                 scheduler_config=SimpleNamespace(max_num_seqs=16))
        proposer = hook.AnpdProposer(config, settings)
        buffer = np.zeros((1, width), dtype=np.int32)  # [1, max_model_len]

        def anpd(tokens, sampled, room, proposer=proposer, buffer=buffer):
            buffer[0, : len(tokens)] = tokens
            return proposer.propose([sampled], np.array([len(tokens)]), buffer)[0][:room]

        rows.append((f"ANPD k={k} {settings}".strip(), replay(pairs, anpd, args.overhead, clock)))
    base = rows[0][1]["speed"]
    print(f"{len(pairs)} outputs, {sum(len(o) for _, o in pairs)} tokens; step cost (overhead {args.overhead:g} + 1 + D)"
          f" / (overhead + 1)")
    print("| drafter | forwards | tokens per forward | drafted | accepted | cost (one-token steps) | x ngram |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['forwards']} | {r['tokens_per_forward']:.2f} | {r['drafted']} | {r['accepted']} | "
              f"{r['cost']:.0f} | {r['speed'] / base:.3f} |")


if __name__ == "__main__":
    main()
