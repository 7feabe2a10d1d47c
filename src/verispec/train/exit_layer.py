"""Choosing an exit head's layer by measured acceptance and modelled cost.

Owns the candidates a target's exit layer is chosen from (`candidates`), the cost of one EESD
draft token at exit layer N in target steps (`draft_cost`, from the weights each reads), the
speed that a per-token acceptance a and that cost give (`expected_speedup`), and the choice
(`choose`). Training (`exit_head.train_exit_head` with `exit_layer="auto"`) measures a for each
candidate with a short probe head; this module is pure arithmetic on those measurements.

The model of a step, on a CPU where a forward's cost is mostly reading weights:

- a draft token runs the target's first N layers, the head's one layer and its projection onto
  the draft vocabulary: c(N) = (N * layer + layer + V_d * hidden) / (L * layer + vocab * hidden)
  of a one-token target step (parameter counts from the config; the file's bit widths are taken
  as equal across matrices);
- a verify of k drafts costs 1 + k * r * (L - N) / L steps: each extra row adds r of a step's
  arithmetic (`ROW_COST`), less the first N layers, whose rows the verify takes from the draft
  (`backends.DecoderBackend.reuses_drafted`);
- a draft of k tokens each accepted with probability a (independently) yields
  (1 - a^(k+1)) / (1 - a) tokens a step.

The speedup at N is the best over k = 0..MAX_K of tokens / (verify + k * c(N)); the choice is the
N with the highest. Where no candidate pays (every speedup 1.0: short probes measure low
acceptance), the best over k >= 1 alone, below 1.0, ranks them: the layer closest to paying.
A deeper exit accepts more and costs more a token: which wins is what the measurement decides,
per model.
"""

from __future__ import annotations

ROW_COST = 0.1  # one extra verify row in one-token steps (`verispec profile`: 8 rows 1.65 steps on AVX-512 VNNI)
MAX_K = 8  # the longest draft the model considers


def candidates(layers: int) -> list[int]:
    """Exit layers worth probing on a model of `layers` layers: about 1/14, 1/7 and 2/7 of its
    depth (2, 4 and 8 of 28), distinct, in 1..layers - 1."""
    picked = {min(layers - 1, max(1, round(layers * fraction))) for fraction in (1 / 14, 1 / 7, 2 / 7)}
    return sorted(picked)


def draft_cost(config, exit_layer: int, draft_vocab: int) -> float:
    """One draft token's cost at `exit_layer`, in one-token target steps (see the module docstring).
    config: the target's transformers config (hidden_size, intermediate_size, attention heads,
    num_hidden_layers, vocab_size)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attention = hidden * head_dim * (2 * config.num_attention_heads + 2 * kv_heads)  # q, o; k, v
    layer = attention + 3 * hidden * config.intermediate_size  # gate, up, down
    step = layers * layer + config.vocab_size * hidden
    return (exit_layer * layer + layer + min(draft_vocab, config.vocab_size) * hidden) / step


def draft_speedups(acceptance: float, cost: float, exit_layer: int, layers: int,
                   row_cost: float = ROW_COST) -> list[float]:
    """Speed against `ar` of drafts of k = 1..MAX_K tokens, each accepted with probability
    `acceptance`, at `cost` steps a draft token (below 1.0 where drafting loses)."""
    a = min(max(acceptance, 0.0), 1.0)
    row = row_cost * (layers - exit_layer) / layers
    return [(k + 1 if a == 1.0 else (1 - a ** (k + 1)) / (1 - a)) / (1 + k * row + k * cost)
            for k in range(1, MAX_K + 1)]


def best_draft(speedups: list[float]) -> tuple[float, int]:
    """(the best speed against `ar`, the draft length that gives it; 0: not drafting) of
    `draft_speedups`' list."""
    best = max(range(len(speedups)), key=lambda i: speedups[i])
    return (speedups[best], best + 1) if speedups[best] > 1.0 else (1.0, 0)


def expected_speedup(acceptance: float, cost: float, exit_layer: int, layers: int,
                     row_cost: float = ROW_COST) -> tuple[float, int]:
    """(tokens per unit of time against `ar`, the draft length that gives it; 0: not drafting)."""
    return best_draft(draft_speedups(acceptance, cost, exit_layer, layers, row_cost))


def choose(acceptance: dict[int, float], config, draft_vocab: int, row_cost: float = ROW_COST) -> tuple[int, dict]:
    """The exit layer with the best expected speedup among the measured ones, and per layer
    {"acceptance", "draft_cost", "speedup", "draft_length", "drafting": the best speed of drafting
    at all} (for the training summary)."""
    if not acceptance:
        raise ValueError("no exit layer was measured")
    layers = config.num_hidden_layers
    table = {}
    for exit_layer, accepted in sorted(acceptance.items()):
        cost = draft_cost(config, exit_layer, draft_vocab)
        speedups = draft_speedups(accepted, cost, exit_layer, layers, row_cost)
        speedup, k = best_draft(speedups)
        table[exit_layer] = {"acceptance": round(accepted, 4), "draft_cost": round(cost, 4),
                             "speedup": round(speedup, 4), "draft_length": k, "drafting": round(max(speedups), 4)}
    best = max(sorted(table), key=lambda n: (table[n]["speedup"], table[n]["drafting"], -n))
    return best, table
