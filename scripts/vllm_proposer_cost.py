"""What the ANPD proposer for vLLM costs per engine step, by batch size (no vLLM needed).

Feeds `verispec.integrations.vllm.AnpdProposer` batches as vLLM passes them: B rows of real text
(Spec-Bench questions through the embedded model's tokenizer, each row a different mix of them,
`--context` tokens before the first step), each step committing one to three tokens per row, the
rows shuffled between steps. Prints the mean CPU seconds (of this process: on a shared machine
the wall clock says more about the neighbours) of one `propose` call and per row, after `--warm`
steps (states built, costs learned), for each batch size and cost source. The stand-in
clock of a step is `--step-ms` per row-token, so `cost=measured` sees a compute-bound device.

    .venv/bin/python scripts/vllm_proposer_cost.py --rows 1,16,64,256 --steps 30
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

import numpy as np

from verispec.integrations import vllm as hook


def corpus(tokens_needed: int) -> list[int]:
    from transformers import AutoTokenizer

    from verispec.bench.datasets import load_dataset
    from verispec.paths import cache_root

    converted = sorted((cache_root() / "converted").glob("gemma-3-270m*/tokenizer.json"))
    if not converted:
        raise SystemExit("error: no converted default model under verispec's cache: run `make demo` once")
    tokenizer = AutoTokenizer.from_pretrained(str(converted[-1].parent))
    _, questions = load_dataset("spec-bench")
    ids: list[int] = []
    for question in questions:
        ids += tokenizer(question.prompt)["input_ids"]
        if len(ids) >= tokens_needed:
            break
    return ids


def measure(rows: int, settings: str, text: list[int], args) -> float:
    rng = random.Random(rows)
    width = args.context + 4 * (args.steps + args.warm) + 16
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=args.k),
                             model_config=SimpleNamespace(max_model_len=width),
                             scheduler_config=SimpleNamespace(max_num_seqs=max(rows, 1)))
    proposer = hook.AnpdProposer(config, settings)
    tokens = np.zeros((rows, width), dtype=np.int32)  # [rows, max_model_len]
    for i in range(rows):
        start = rng.randrange(0, len(text) - width)
        tokens[i] = text[start : start + width]
    lengths = np.full(rows, args.context, dtype=np.int64)
    sampled = [[int(tokens[i, args.context - 1])] for i in range(rows)]
    clock = [0.0]
    real, cpu = time.perf_counter, time.process_time
    hook.time.perf_counter = lambda: clock[0]  # the proposer's view of step times
    spent = 0.0
    try:
        for step in range(args.warm + args.steps):
            started = cpu()
            drafts = proposer.propose(sampled, lengths, tokens)
            if step >= args.warm:
                spent += cpu() - started
            clock[0] += args.step_ms / 1000 * (rows + sum(map(len, drafts)))
            order = list(range(rows))
            rng.shuffle(order)  # rows move between steps
            tokens, lengths = tokens[order], lengths[order]
            commits = [rng.randint(1, 3) for _ in range(rows)]
            sampled = [tokens[i, lengths[i] : lengths[i] + c].tolist() for i, c in enumerate(commits)]
            lengths = lengths + commits
    finally:
        hook.time.perf_counter = real
    return spent / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=2.0, help="stand-in step time per row-token")
    parser.add_argument("--costs", default="measured,off")
    args = parser.parse_args()
    text = corpus(200_000)
    print(f"{len(text)} tokens of Spec-Bench text; context {args.context}, k={args.k}")
    print("| rows | cost | CPU ms per call | CPU us per row |\n|---:|---|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        for cost in args.costs.split(","):
            seconds = measure(rows, f"cost={cost}", text, args)
            print(f"| {rows} | {cost} | {seconds * 1e3:.2f} | {seconds / rows * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
