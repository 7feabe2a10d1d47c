"""Offline replay of ANPD's drafter against the greedy answers `ar` gave in a benchmark run: for
each prompt (in the run's order, one memory across requests for the whole pass, as the benchmark
gives each method), the drafter proposes, the adaptive controller's rule cuts the draft under
fixed step costs, and the recorded answer decides what is accepted. Prints tokens per target
forward, acceptance and a modelled speed against `ar`, for drafter settings side by side, in
seconds and without the model's forward (the tokenizer only), so drafting ideas can be compared
before a timed benchmark. Single-turn datasets only (`spec-bench`, `code-edit`, `builtin`).

    verispec bench --dataset code-edit --methods ar --peers '' --max-new-tokens 128 --out runs/ce
    python scripts/replay_drafts.py runs/ce --ratios 1.10,1.48,2.60,4.40,9.90

--ratios: `verispec profile`'s verify costs of widths 2, 4, 8, 16, 32 relative to width 1
(interpolated linearly between them, past 32 with the controller's prior slope); other costs
(e.g. a target CPU's) show what the same drafts would give there. The last line cuts each draft
where the answer departs from it: the ceiling of any draft-length controller with this drafter.

--tree-budgets 8,16: also replays tree drafts against single paths at a constant node budget
(every drafted token verified, as `anpd/constant:B/tree=B` against `anpd/constant:B`), walking
each tree along the recorded answer; prints tokens per target forward for both, and how often,
where a single path failed, any of the tables' continuations (every level, the memory's too)
was the answer's token: the most that trees of n-gram drafts could add; and how often a
verify staged in two parts (`lazy_logits`) reads its second part.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verispec.target import lazy_logits as lazy_logits
from verispec.bench.datasets import encode_question, load_dataset
from verispec.core.control import CostModel, best_draft_length
from verispec.core.drafters.ngram import AnpdDrafter, NgramConfig, shared_memory
from verispec.target.loading import load

WIDTHS = (1, 2, 4, 8, 16, 32)
VARIANTS = {  # label -> (NgramConfig, memory across requests)
    "anpd": (NgramConfig(), True),
    "anpd, no long matches": (NgramConfig(span_min=0), True),
    "anpd, no memory": (NgramConfig(), False),
    "anpd, neither": (NgramConfig(span_min=0), False),
}


def step_costs(ratios: dict[int, float]) -> CostModel:
    """The adaptive controller's cost model, having seen each width's relative cost (trusted)."""
    cost = CostModel()
    for width, ratio in ratios.items():
        for _ in range(cost.trusted):
            cost.observe(width, ratio)
    return cost


def replay_pass(answers: list[tuple[list[int], list[int]]], make_drafter, k: int, judge) -> tuple[int, int]:
    """One pass over (prompt, answer) pairs, in order: each prompt gets `make_drafter()`, which
    proposes up to k tokens a step (never past the answer's last token); `judge(drafter, draft,
    context, rest)` -> (how many of its tokens the answer `rest` accepts, how many were verified);
    the accepted ones and the answer's next token are committed. Returns (target forwards, tokens)."""
    forwards = tokens = 0
    for prompt, answer in answers:
        drafter = make_drafter()
        drafter.begin(prompt)
        context, position = list(prompt), 0
        while position < len(answer):
            draft = drafter.propose(context, min(k, len(answer) - position - 1))
            accepted, verified = judge(drafter, draft, context, answer[position:])
            committed = answer[position : position + accepted + 1]
            drafter.commit(committed, verified)
            context += committed
            position += len(committed)
            forwards, tokens = forwards + 1, tokens + len(committed)
    return forwards, tokens


def walk(tokens: list[int], parents: list[int] | None, answer: list[int]) -> tuple[int, int]:
    """(how many drafted tokens a greedy walk from the root accepts, the last verify row it reads):
    at each node, the child that carries the answer's next token (parents None: a linear draft).
    Row 0 is the root's, row i + 1 drafted token i's."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents if parents is not None else range(-1, len(tokens) - 1)):
        children.setdefault(parent, []).append(i)
    node, accepted, last_row = -1, 0, 0
    while accepted < len(answer):
        node = next((c for c in children.get(node, ()) if tokens[c] == answer[accepted]), None)
        if node is None:
            break
        accepted, last_row = accepted + 1, max(last_row, node + 1)
    return accepted, last_row


def replay(answers: list[tuple[list[int], list[int]]], config: NgramConfig, memory: bool, cost: CostModel,
           k: int = 16, oracle: bool = False) -> tuple[float, float, float, str]:
    """(tokens per forward, acceptance, modelled speed vs ar, what the memory learned of long-match
    copies) of one pass over (prompt, answer). oracle: cut each draft where the answer departs from
    it instead of by the controller's rule (no controller can do better with this drafter)."""
    attachments: dict = {}
    drafted, seconds = 0, 0.0  # seconds: in one-token steps

    def judge(drafter, draft, context, rest):
        nonlocal drafted, seconds
        proposal = draft.tokens.tolist()
        if not oracle:
            proposal = proposal[: best_draft_length(draft.confidence or (), cost.relative)]
        accepted, _ = walk(proposal, None, rest)
        if oracle:
            proposal = proposal[:accepted]
        drafted, seconds = drafted + len(proposal), seconds + cost.relative(len(proposal))
        return accepted, len(proposal)

    forwards, tokens = replay_pass(
        answers, lambda: AnpdDrafter(config, shared_memory(attachments, config) if memory else None), k, judge)
    copies = [outcome for kind, outcome in shared_memory(attachments, config).outcomes.items() if kind[0] == "span"]
    accepted, rejected = sum(o[0] for o in copies), sum(o[1] for o in copies)
    learned = f"  long-match copies accepted {accepted / (accepted + rejected):.0%} of {accepted + rejected}" if (
        memory and copies) else ""
    return tokens / forwards, (tokens - forwards) / max(drafted, 1), tokens / seconds, learned


def held_anywhere(drafter: AnpdDrafter, tail: list[int], token: int) -> bool:
    """Whether `token` followed `tail`'s last n - 1 tokens for some n, in the request's tables or
    the memory's: the most any n-gram tree could offer after `tail`."""
    tables = [drafter.tables] + ([drafter.memory.tables] if drafter.memory is not None else [])
    return any(m.token == token for t in tables for n in range(t.min_n, t.max_n + 1) for m in t.candidates(tail, n))


def replay_constant(answers: list[tuple[list[int], list[int]]], budget: int,
                    tree: bool) -> tuple[float, float, float]:
    """(tokens per target forward, share of failures whose token the tables held, share of
    verifies of MIN_ROWS rows or more whose rows past the first FIRST are read) of ANPD (default
    config, memory on) drafting `budget` tokens a step, as a tree of that many nodes or as a
    single path, every drafted token verified. A failure: a step that commits fewer tokens than
    it drafted plus one, or drafted none."""
    attachments: dict = {}
    config = NgramConfig()
    failures = held = wide = second_part = 0

    def judge(drafter, draft, context, rest):
        nonlocal failures, held, wide, second_part
        ids = draft.tokens.tolist()
        accepted, last_row = walk(ids, None if draft.parents is None else draft.parents.tolist(), rest[:-1])
        if len(ids) + 1 >= lazy_logits.MIN_ROWS:
            wide, second_part = wide + 1, second_part + (last_row >= lazy_logits.FIRST)
        if accepted < len(ids) or not ids:
            failures += 1
            held += held_anywhere(drafter, (context + rest[:accepted])[-(config.max_n - 1) :], rest[accepted])
        return accepted, len(ids)

    forwards, tokens = replay_pass(
        answers, lambda: AnpdDrafter(config, shared_memory(attachments, config), tree=budget if tree else 0), budget,
        judge)
    return tokens / forwards, held / max(failures, 1), second_part / max(wide, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a `verispec bench --out` directory with an `ar` greedy run")
    parser.add_argument("--ratios", default="1.10,1.48,2.60,4.40,9.90")
    parser.add_argument("--k", default="16", help="draft length caps to replay at, e.g. 16,32")
    parser.add_argument("--tree-budgets", default="", help="node budgets to replay trees at, e.g. 8,16")
    args = parser.parse_args()
    ratios = dict(zip(WIDTHS, [1.0, *map(float, args.ratios.split(","))]))
    settings = json.loads((args.run / "config.json").read_text())["settings"]
    records = [json.loads(line) for line in (args.run / "records.jsonl").open()]
    answers_by_id = {r["question_id"]: r["token_ids"] for r in records if r["method"] == "ar" and r["repeat"] == 0}
    _, questions = load_dataset(settings["dataset"], settings["categories"] or None, settings["per_category"])
    tokenizer = load(settings.get("model")).tokenizer  # the run's model's
    answers = [(encode_question(tokenizer, q), answers_by_id[q.question_id]) for q in questions
               if q.question_id in answers_by_id]
    print(f"{len(answers)} answers from {args.run}")
    for k in (int(value) for value in args.k.split(",")):
        for label, (config, memory) in VARIANTS.items():
            per_forward, acceptance, speed, learned = replay(answers, config, memory, step_costs(ratios), k)
            print(f"{label + f', K {k}':30s} tokens/forward {per_forward:.2f}  acceptance {acceptance:.2f}  "
                  f"modelled vs ar {speed:.2f}x{learned}")
    per_forward, _, speed, _ = replay(answers, *VARIANTS["anpd"], step_costs(ratios), oracle=True)
    print(f"{'anpd, cut by an oracle':24s} tokens/forward {per_forward:.2f}  modelled vs ar {speed:.2f}x")
    for budget in (int(b) for b in args.tree_budgets.split(",") if b):
        (path, held, path_rest), (tree, _, tree_rest) = (replay_constant(answers, budget, False),
                                                          replay_constant(answers, budget, True))
        print(f"budget {budget:2d}: single path {path:.3f} tokens/forward, tree {tree:.3f} ({tree / path:.3f}x); "
              f"where a single path failed, the tables held the answer's token {held:.0%} of the time; "
              f"rows past the first {lazy_logits.FIRST} read in {path_rest:.0%} (path) and {tree_rest:.0%} (tree) "
              f"of the verifies of {lazy_logits.MIN_ROWS} rows or more")


if __name__ == "__main__":
    main()
