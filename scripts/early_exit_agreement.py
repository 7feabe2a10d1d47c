"""How often an early exit after layer N predicts the full model's greedy token, on the default
model's own greedy continuations of Spec-Bench prompts (teacher-forced, continuation positions
only). Two kinds of exit are compared:

- raw: the layer-N residual stream through the target's final norm and full LM head, which is
  what transformers' `assistant_early_exit` drafts with (the model was not trained for it);
- trained: a self-distilled exit head (one decoder layer + norm, V_d tokens): the shipped one, or
  those given with --exit-head (several heads are compared on the same positions). For trained
  heads the table also gives the expected speculative-sampling acceptance at temperature 1,
  sum_v min(p(v), q(v)) with q zero outside the draft vocabulary.

With --ceiling, each trained head's greedy agreement along the continuations (whether it proposes
the generated token at each position after the first, given the tokens before it) is replayed
under step costs measured here on the fast path (a draft token of the head, with its layer on
int8 forms as `eesd` runs it, and target forwards of 1..K+1 tokens): the speedup over `ar` of
greedy `eesd` with a constant draft length (the best k), and of the best any draft-length
controller could do with hindsight (`control.oracle_trace_cost`: it never drafts a token that
will be rejected), also with drafting made free; and of a controller that verifies the draft tokens
whose head top-1 probability is at least theta, stopping at the first below it
(`control.threshold_trace_cost`, the best theta of a grid, chosen with hindsight). Agreement is taken with the float32 head, so
it can differ from the int8 head's by a few near-ties.

    python scripts/early_exit_agreement.py --per-category 1 --layers 2 4 6 8 12 --max-new-tokens 64
    python scripts/early_exit_agreement.py --layers 4 --exit-head old-head new-head
    python scripts/early_exit_agreement.py --per-category 2 --layers 4 --max-new-tokens 128 --ceiling
    python scripts/early_exit_agreement.py --per-category 2 --layers 4 --max-new-tokens 128 --ceiling --no-fast

--no-fast measures the step costs on the PyTorch path (transformers' forward, in float32 unless
--dtype says otherwise), where eesd then runs.
"""

from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

import verispec
from verispec.bench.profile import draft_step_seconds, target_step_seconds, timing_context
from verispec.bench.datasets import encode_question, load_dataset
from verispec.core.control import constant_trace_cost, oracle_trace_cost, threshold_trace_cost
from verispec.core.drafters.early_exit import PreparedHead, load_head
from verispec.core.methods import DEFAULT_EXIT_HEAD

THRESHOLDS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01]


def print_ceiling(target, heads, traces: list[list[list[bool]]], confidences: list[list[list[float]]],
                  max_draft: int) -> None:
    """The speedups over ar that greedy eesd could reach on the recorded traces (see the module
    docstring), under step costs measured now."""
    context = timing_context()
    widths = range(1, max_draft + 2)
    rounds = [[target_step_seconds(target, context, width) for width in widths] for _ in range(3)]
    seconds = [statistics.median(column) for column in zip(*rounds)]  # [K + 1], interleaved rounds
    base = seconds[0]
    relative = [s / base for s in seconds]  # [K + 1]: forwards of 1..K+1 tokens relative to one

    def verify(width):
        return relative[width - 1]

    tokens = sum(len(trace) for trace in traces[0])
    print(f"\ntarget forward of 1..{max_draft + 1} tokens, relative to 1 ({base * 1e3:.1f} ms): "
          + " ".join(f"{v:.2f}" for v in relative))
    rows, needed = [], []
    for (path, head, _), head_traces, head_confidences in zip(heads, traces, confidences):
        draft = draft_step_seconds(target, PreparedHead(target, head), context) / base
        constant = {k: tokens / sum(constant_trace_cost(t, draft, verify, k) for t in head_traces)
                    for k in range(max_draft + 1)}
        best_k = max(constant, key=constant.get)
        threshold = {theta: tokens / sum(threshold_trace_cost(t, c, draft, verify, theta, max_draft)
                                         for t, c in zip(head_traces, head_confidences)) for theta in THRESHOLDS}
        best_theta = max(threshold, key=threshold.get)
        oracle = tokens / sum(oracle_trace_cost(t, draft, verify, max_draft) for t in head_traces)
        oracle_free = tokens / sum(oracle_trace_cost(t, 0.0, verify, max_draft) for t in head_traces)
        agreement = sum(sum(t) for t in head_traces) / tokens
        rows.append(f"| {path} | {draft:.2f} | {agreement:.1%} | {constant[best_k]:.2f}x (k = {best_k}) | "
                    f"{threshold[best_theta]:.2f}x (theta = {best_theta}) | {oracle:.2f}x | {oracle_free:.2f}x |")
        needed.append(_needed_agreement(draft, verify, [len(t) for t in head_traces], max_draft))
    print("| head | draft token / target step | agreement | best constant k | best confidence threshold | oracle "
          "| oracle, free drafts |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nreplayed on independent agreements (each position agrees with probability a, same lengths and costs):")
    print("| head | a | best constant k | oracle |")
    print("|---|---:|---:|---:|")
    for (path, _, _), table in zip(heads, needed):
        for a, (constant, oracle) in table.items():
            print(f"| {path} | {a:.2f} | {constant:.2f}x | {oracle:.2f}x |")


def _needed_agreement(draft: float, verify, lengths: list[int], max_draft: int) -> dict:
    """a -> (best constant-k speedup, oracle speedup) on i.i.d. Bernoulli(a) traces of these lengths."""
    rng = random.Random(0)
    table = {}
    for a in [0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9]:
        traces = [[rng.random() < a for _ in range(n)] for n in lengths * 4]
        tokens = sum(len(t) for t in traces)
        constant = max(tokens / sum(constant_trace_cost(t, draft, verify, k) for t in traces)
                       for k in range(max_draft + 1))
        table[a] = (constant, tokens / sum(oracle_trace_cost(t, draft, verify, max_draft) for t in traces))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4, 6, 8, 12])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--exit-head", nargs="+", default=[str(DEFAULT_EXIT_HEAD)], help="head directories to compare")
    parser.add_argument("--ceiling", action="store_true", help="replay the heads' agreement under measured step costs")
    parser.add_argument("--max-draft", type=int, default=8, help="longest draft for --ceiling (eesd's K)")
    parser.add_argument("--no-fast", dest="fast", action="store_false", help="the PyTorch path's step costs")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (default float32)")
    args = parser.parse_args()
    # the default file's transformers form (numerics "fp32" loads it): its hidden states feed the heads
    target = verispec.load(dtype=args.dtype, fast=args.fast, numerics="fp32")
    model = target.model
    heads = [(path, *load_head(Path(path), model, target.name)) for path in args.exit_head]
    _, questions = load_dataset("spec-bench", per_category=args.per_category)
    raw_agree = {n: 0 for n in args.layers}
    trained_agree, sampled, positions = [0] * len(heads), [0.0] * len(heads), 0
    traces: list[list[list[bool]]] = [[] for _ in heads]  # [head][prompt][position after the first]
    confidences: list[list[list[float]]] = [[] for _ in heads]  # the head's top-1 probability, same shape
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
                proposed = head.vocab[q_logits.argmax(-1)]  # [n]
                trained_agree[i] += int((proposed == full).sum())
                traces[i].append((proposed == ids[0, span.start + 1:])[1:].tolist())
                confidences[i].append(torch.softmax(q_logits, -1).amax(-1)[1:].tolist())
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
    if args.ceiling:
        print_ceiling(target, heads, traces, confidences, args.max_draft)


if __name__ == "__main__":
    main()
