"""One forward of the target over the rows of many sequences at once: what a step hands it.

Owns `Part` (one sequence's rows in a shared forward: a prompt chunk, a verify of a linear
draft, a tree of drafts, or a draft model's rows, and which of its rows want logits), the small
pure piece of placing them (`wanted_rows`), and `run_alone`, which runs the
parts a stepwise caller (a drafter that feeds a draft model) asks for one at a time, where a
batch would run many callers' parts in one forward. The forward itself is the paged backend's
(`backends.PagedBackend.forward_parts`): it places every sequence's rows after its own cache
(`static_kv.Tree`), describes them all to the C layers in one `rows.Rows` (each row with its
sequence's block table), runs the embeddings, every decoder layer and the final norm over all
rows in one pass, and the LM head over the rows whose logits are asked for. Linears see every
row at once; attention runs each row over its own sequence's keys.

Every row's logits are the bits its sequence gets alone (`TargetSequence.forward`,
`forward_tree`), whatever the other rows: the C layers and the int8 head are batch-invariant,
so a row's result depends on its position and its sequence's keys only. Afterwards each
sequence is where its own forward would have left it: a linear part appended (length moved, its
tokens noted for the prefix cache), a tree written to its slots awaiting `keep_path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, Sequence, TypeVar

import torch


ALL, LAST, NONE = "all", "last", "none"  # which rows of a part get logits


@dataclass
class Part:
    """One sequence's rows in a shared forward: `tokens` after its cache, as a chain (parents
    None) or as a tree (`parents[i]`: the row token i follows, -1 for the cache's end); `logits`:
    ALL rows, the LAST one (a prompt's end) or NONE (a prompt chunk before its end);
    `prefix_cache`: whether its sequence's tokens are noted and its full blocks offered to the
    prefix cache (False for a draft model's sequence, whose rows past the context are guesses)."""

    sequence: object  # a `sequence.TargetSequence` on a paged backend
    tokens: Sequence[int]
    parents: Sequence[int] | None = None
    logits: str = ALL
    prefix_cache: bool = True


Result = TypeVar("Result")
# A stepwise computation: it yields the `Part`s it needs run, is sent each one's logits
# ([rows wanted, vocab], or None where it wants none), and returns its result.
Steps = Generator[Part, "torch.Tensor | None", Result]


def run_alone(steps: Steps) -> Result:
    """Drive `steps` with a forward of its own for each part it asks for."""
    try:
        part = next(steps)
        while True:
            part = steps.send(part.sequence.backend.forward_parts([part])[0])
    except StopIteration as stop:
        return stop.value


def prepare(part: Part):
    """Place `part`'s rows after its sequence's cache (blocks reserved: may raise
    `kv_pool.PoolExhausted`, before anything is written) and describe them for the C layers."""
    return part.sequence.backend.prepare(part)


def wanted_rows(parts: list[Part]) -> list[list[int]]:
    """Per part, the indices (in the call's rows) of the rows whose logits it asks for."""
    wanted, begin = [], 0
    for part in parts:
        n = len(part.tokens)
        wanted.append(list(range(begin, begin + n)) if part.logits == ALL else
                      [begin + n - 1] if part.logits == LAST else [])
        begin += n
    return wanted
