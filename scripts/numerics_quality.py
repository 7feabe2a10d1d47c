"""Quality of int8 numerics against float32 activations on the default model: `ar`'s greedy
answers (generated in float32 numerics) to Spec-Bench questions, scored teacher-forced by the
target's own forward path under each numerics (`score.target_logits`: the prompt prefilled, then
the answer in chunks, as decoding computes them): token-weighted perplexity, and the agreement of
the two numerics' greedy choices (argmax) at every answer position.

    python scripts/numerics_quality.py --per-category 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import math

import verispec
from verispec.bench.datasets import load_dataset
import torch

from verispec.score import target_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target = verispec.load(numerics="fp32")
    _, questions = load_dataset("spec-bench", [], args.per_category)
    nll = {"fp32": 0.0, "int8": 0.0}
    tokens = agree = 0
    for question in questions:
        target.numerics = "fp32"
        result = verispec.generate(target, question.prompt, method="ar", max_new_tokens=args.max_new_tokens,
                                   prompt_format="chat")
        prompt, output = result.prompt_ids, result.token_ids
        choices = {}
        for numerics in nll:
            target.numerics = numerics
            log_probs = torch.log_softmax(target_logits(target, prompt, output).float(), dim=-1)  # [m, vocab]
            nll[numerics] -= float(log_probs[torch.arange(len(output)), torch.tensor(output)].sum())
            choices[numerics] = log_probs.argmax(-1)
        tokens += len(output)
        agree += int((choices["fp32"] == choices["int8"]).sum())
    ppl = {n: math.exp(v / tokens) for n, v in nll.items()}
    print(f"{len(questions)} questions, {tokens} tokens: perplexity fp32 {ppl['fp32']:.4f}, int8 {ppl['int8']:.4f} "
          f"({(ppl['int8'] / ppl['fp32'] - 1) * 100:+.2f}%); greedy choices agree at {agree / tokens:.2%} of positions")


if __name__ == "__main__":
    main()
