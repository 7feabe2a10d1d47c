"""Rows of a verify forward's logits, computed when a rule first reads them.

Owns `LazyRows`: an [n, vocab] stack of rows made in two chunks, rows 0..FIRST-1 and then the
rest, each the first time one of its rows is read, and `worth_deferring`, the engine's choice of
when to ask for it. The lossless rules read a verify's rows in order and stop at the first
rejected draft token (`acceptance.greedy_match`, `sampled_match`, `tree_match`), so the rows
after it are never needed. `model.Target` fills `LazyRows` in one of two ways:

- a staged forward (`Target.forward(lazy=True)` for linear drafts, `forward_tree(lazy=True)`
  for trees, whose rows come ancestors first): the first FIRST tokens run through the layers
  and the LM head at once, the rest only if a rule reads one of their rows (appended to the KV
  cache, or written to their tree slots, then);
- a lazy head (where the layers are not all in C): every token runs through the layers, the LM
  head (the default model's is 262,144 x 640, 63% of a row's multiply-adds) only on the chunks
  read.

Why the chunks are 4 rows and the rest, and only from 8 rows on (`MIN_ROWS`): up to about 4
rows a forward costs little more than one row's (mostly one read of the weights), and each row
after that adds its arithmetic (`verispec profile` on 2 AVX2 cores, two runs: 4 tokens 1.4-1.7x
a one-token step, 8 tokens 2.6-3.0x, 16 tokens 4.9-6.2x). So a first chunk of 4 is cheap, and
what a split costs, when every row is read after all, is a second pass over the weights
(`scripts/staged_verify_cost.py`, two runs: +3.6 and +7.0 ms at 8 tokens on 42 ms, +3.2 and
+13.0 ms at 16 on 83 ms). That is why a
draft whose own confidences say its first 4 tokens are probably all accepted is verified in one
part (`worth_deferring`), and a verify of fewer than 8 rows too (too little to skip).

It is exact only where a row's logits do not depend on which other rows share the call: the C
decoder layers and the int8 block kernel are batch-invariant bit for bit; `model.Target` returns
a plain tensor everywhere else. `map` gives the same rows through a row-wise function (the
sampling warp), chunk by chunk.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

FIRST = 4  # rows of the first chunk (see the module docstring)
MIN_ROWS = 8  # narrower verifies run in one call (see the module docstring)


def worth_deferring(confidence: tuple[float, ...]) -> bool:
    """Whether a draft's verify should compute its rows lazily, from the drafter's per-token
    confidences (estimated acceptance probabilities; none known: yes). Row FIRST and later are
    read only if the first FIRST draft tokens are all accepted; when the confidences say that is
    more likely than not, the later rows would be computed anyway and deferring them would cost
    one more read of the weights, so no."""
    return len(confidence) < FIRST or math.prod(confidence[:FIRST]) < 0.5


class LazyRows:
    """rows[i] -> [vocab] for i in 0..n-1, computed by `compute(start, end)` -> [end - start, vocab]
    for the chunks [0, FIRST) and [FIRST, n). What rules read: `shape`, `dim()`, `device`,
    `dtype`, `rows[i]`; `full()` computes every row and returns the [n, vocab] tensor."""

    def __init__(self, n: int, compute: Callable[[int, int], torch.Tensor], row_shape: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype):
        self._n, self._compute = n, compute
        self.shape = torch.Size((n, *row_shape))
        self.device, self.dtype = device, dtype
        self._chunks: list[torch.Tensor] = []  # [FIRST, vocab], then [n - FIRST, vocab]

    @staticmethod
    def of_head(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> "LazyRows":
        """The logits head(hidden) [n, vocab] of final-normed states `hidden` [n, d]."""
        return LazyRows(hidden.shape[0], lambda start, end: head(hidden[start:end]), (vocab,), hidden.device,
                        torch.float32)

    def __len__(self) -> int:
        return self._n

    def dim(self) -> int:
        return len(self.shape)

    def _chunk(self, index: int) -> torch.Tensor:
        """Chunk `index` (0: rows [0, FIRST), 1: the rest), computed on first use."""
        while len(self._chunks) <= index:  # in order: a staged forward's rest follows its first part
            start, end = (FIRST, self._n) if self._chunks else (0, min(self._n, FIRST))
            self._chunks.append(self._compute(start, end))
        return self._chunks[index]

    def __getitem__(self, i: int) -> torch.Tensor:
        if not isinstance(i, int):
            raise TypeError(f"LazyRows is read one row at a time (an int), not {type(i).__name__}")
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"row {i} of {self._n}")
        return self._chunk(0)[i] if i < FIRST else self._chunk(1)[i - FIRST]

    def full(self) -> torch.Tensor:
        """Every row: [n, vocab]."""
        chunks = [self._chunk(index) for index in range(1 if self._n <= FIRST else 2)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "LazyRows":
        """The rows of fn(this) for a row-wise `fn` ([m, vocab] -> [m, vocab]), computed per chunk."""
        chunk_of = lambda start, end: fn(self._chunk(0 if start == 0 else 1))  # noqa: E731 - chunks align
        return LazyRows(self._n, chunk_of, tuple(self.shape[1:]), self.device, self.dtype)


def materialize(rows: "torch.Tensor | LazyRows") -> torch.Tensor:
    """A tensor of every row, for rules that read them all."""
    return rows.full() if isinstance(rows, LazyRows) else rows
