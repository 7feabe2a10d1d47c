"""How often an early exit after layer N predicts the full model's greedy token, on the default
model's own greedy continuations of Spec-Bench prompts (teacher-forced, continuation positions
only). Two kinds of exit are compared:

- raw: the layer-N residual stream through the target's final norm and full LM head, which is
  what transformers' `assistant_early_exit` drafts with (the model was not trained for it);
- trained: a self-distilled exit head (one decoder layer + norm, V_d tokens): the shipped one, or
  those given with --exit-head (several heads are compared on the same positions). For trained
  heads the table also gives the expected speculative-sampling acceptance at temperature 1,
  sum_v min(p(v), q(v)) with q zero outside the draft vocabulary.

    python scripts/early_exit_agreement.py --per-category 1 --layers 2 4 6 8 12 --max-new-tokens 64
    python scripts/early_exit_agreement.py --layers 4 --exit-head old-head new-head
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

import verispec
from verispec.bench.datasets import encode_question, load_dataset
from verispec.drafters.early_exit import load_head
from verispec.methods import DEFAULT_EXIT_HEAD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4, 6, 8, 12])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--exit-head", nargs="+", default=[str(DEFAULT_EXIT_HEAD)], help="head directories to compare")
    args = parser.parse_args()
    target = verispec.load()
    model = target.model
    heads = [(path, *load_head(Path(path), model, target.name)) for path in args.exit_head]
    _, questions = load_dataset("spec-bench", per_category=args.per_category)
    raw_agree = {n: 0 for n in args.layers}
    trained_agree, sampled, positions = [0] * len(heads), [0.0] * len(heads), 0
    with torch.no_grad():
        for question in tqdm(questions, desc="prompts"):
            prompt = encode_question(target.tokenizer, question)
            result = verispec.generate(target, prompt, method="ar", max_new_tokens=args.max_new_tokens)
            ids = torch.tensor([prompt + list(result.token_ids)])  # [1, T]
            # logits at position t predict token t+1: score the positions that predict the continuation
            span = slice(len(prompt) - 1, ids.shape[1] - 1)
            out = model(ids, output_hidden_states=True, logits_to_keep=ids.shape[1] - span.start)
            full = out.logits[0, :-1].argmax(-1)  # [n]
            positions += full.numel()
            for n in args.layers:
                raw = model.get_output_embeddings()(model.get_decoder().norm(out.hidden_states[n][0, span])).argmax(-1)  # [n]
                raw_agree[n] += int((raw == full).sum())
            p = torch.softmax(out.logits[0, :-1].float(), -1)  # [n, vocab]
            for i, (_, head, spec) in enumerate(heads):
                q_logits = head(out.hidden_states[spec.exit_layer])[0, span].float()  # [n, V_d]
                trained_agree[i] += int((head.vocab[q_logits.argmax(-1)] == full).sum())
                q = torch.zeros_like(p)
                q[:, head.vocab] = torch.softmax(q_logits, -1)
                sampled[i] += float(torch.minimum(p, q).sum())
    print(f"{len(questions)} prompts, {positions} continuation positions, {model.config.num_hidden_layers} layers")
    print("| exit | agreement with the full model's greedy token |")
    print("|---|---:|")
    for n in args.layers:
        print(f"| raw, N = {n} (final norm + full LM head) | {raw_agree[n] / positions:.1%} |")
    for i, (path, _, spec) in enumerate(heads):
        print(f"| trained head {path}, N = {spec.exit_layer} (V_d = {len(spec.draft_vocab)}) | "
              f"{trained_agree[i] / positions:.1%} (sampled acceptance at temperature 1: {sampled[i] / positions:.1%}) |")


if __name__ == "__main__":
    main()
