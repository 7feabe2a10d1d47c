"""One forward of the target over the rows of many sequences at once.

Owns `forward_parts`: given, for several paged sequences of one target (`sequence.TargetSequence`
on the target's block pool), the tokens each appends this step -- a prompt chunk, a verify of a
linear draft, or a tree of drafts -- it places every sequence's rows after its own cache
(`cache.Tree`), describes them all to the C layers in one `rows.Rows` (each row with its
sequence's block table), runs the embeddings, every decoder layer and the final norm over all
rows in one pass (`FastDecoder.run_rows`), and the LM head over the rows whose logits are asked
for. Linears see every row at once; attention runs each row over its own sequence's keys.

Every row's logits are the bits its sequence gets alone (`TargetSequence.forward`,
`forward_tree`), whatever the other rows: the C layers and the int8 head are batch-invariant,
so a row's result depends on its position and its sequence's keys only. Afterwards each
sequence is where its own forward would have left it: a linear part appended (length moved, its
tokens noted for the prefix cache), a tree written to its slots awaiting `keep_path`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .cache import Tree
from .runtime.rows import Rows

if TYPE_CHECKING:
    from .sequence import TargetSequence

ALL, LAST, NONE = "all", "last", "none"  # which rows of a part get logits


@dataclass
class Part:
    """One sequence's rows in a shared forward: `tokens` after its cache, as a chain (parents
    None) or as a tree (`parents[i]`: the row token i follows, -1 for the cache's end); `logits`:
    ALL rows, the LAST one (a prompt's end) or NONE (a prompt chunk before its end)."""

    sequence: "TargetSequence"
    tokens: Sequence[int]
    parents: Sequence[int] | None = None
    logits: str = ALL


def prepare(part: Part) -> tuple[Tree, Rows]:
    """Place `part`'s rows after its sequence's cache (blocks reserved: may raise
    `kv_pool.PoolExhausted`, before anything is written) and describe them for the C layers."""
    sequence = part.sequence
    cache = sequence.cache
    start, n = cache.length, len(part.tokens)
    sequence._prepare_write()
    if part.parents is None:
        tree = Tree.contiguous(start, n)
    else:
        assert len(part.parents) == n, "one parent per token"
        tree = Tree.of_parents(start, part.parents)
    cache.reserve(tree.end)
    return tree, tree.c_rows(cache.block_table, cache.pool_blocks)


@torch.inference_mode()
def forward_parts(target, parts: list[Part]) -> list[torch.Tensor | None]:
    """Run every part's rows in one forward (see the module docstring); returns, per part, its
    logits ([n, vocab] for ALL, [1, vocab] for LAST) or None. The sequences must be paged in
    `target`'s pool (`TargetSequence.paged`) and distinct. Reserve their blocks first
    (`prepare`) where running out of KV memory must leave every sequence untouched: this
    function reserves any still missing, in order."""
    fast = target._fast
    assert parts and all(part.sequence.paged and part.sequence.target is target for part in parts)
    assert len({id(part.sequence) for part in parts}) == len(parts), "one part per sequence"
    placed = [prepare(part) for part in parts]
    ids = torch.tensor([token for part in parts for token in part.tokens], dtype=torch.long)  # [N]
    rows = Rows.concat([rows for _, rows in placed])
    x = fast.run_rows(fast.embed(ids), rows, target.pool)  # [N, hidden]
    wanted, begin = [], 0  # row indices whose logits are asked for, per part
    for part in parts:
        n = len(part.tokens)
        wanted.append(list(range(begin, begin + n)) if part.logits == ALL else
                      [begin + n - 1] if part.logits == LAST else [])
        begin += n
    flat = [row for rows_of_part in wanted for row in rows_of_part]
    logits = target._head(fast.norm(x[flat])) if flat else None  # [len(flat), vocab]
    results, offset = [], 0
    for part, (tree, _), rows_of_part in zip(parts, placed, wanted):
        sequence, cache = part.sequence, part.sequence.cache
        if part.parents is None:
            cache.note_tokens(cache.length, list(part.tokens))
            cache.length += len(part.tokens)
        else:
            sequence._tree_slots, sequence._tree_ids = (cache.length, tree.slots.tolist()), list(part.tokens)
        results.append(logits[offset : offset + len(rows_of_part)] if rows_of_part else None)
        offset += len(rows_of_part)
    return results
