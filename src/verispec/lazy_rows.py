"""Rows of a verify forward's logits, computed when a rule first reads them.

Owns `LazyRows`: an [n, vocab] stack of rows made in two chunks, rows 0..FIRST-1 and then the
rest, each the first time one of its rows is read. The engine asks the target for it when the
rule reads rows in order and stops at the first rejection (`acceptance.greedy_match`,
`sampled_match`, `tree_match`): on the CPU the LM head is most of a wide verify's arithmetic
(the default model's is 262,144 x 640, 63% of a row's multiply-adds), and the rows after a
rejected draft token are never read, so their head is never computed.

Why the chunks are 4 rows and the rest, and only from 8 rows on (`MIN_ROWS`): the head's call
costs about one read of its weights up to 4 rows and grows by one row's arithmetic per row after
that (timed on the default model's head on 2 AVX2 cores: 9.9 ms for 1 row, 13.8 for 4, 24.4 for
8, 42.8 for 16), so a first chunk of 4 costs little more than 1 row, and a second call costs
about one more read of the weights (about 5 ms) when every row is needed.

It is exact only where a row's logits do not depend on which other rows share the head's call:
the int8 block kernel, which is batch-invariant bit for bit; `model.Target` returns a plain tensor
everywhere else. `map` gives the same rows through a row-wise function (the sampling warp), chunk
by chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

FIRST = 4  # rows of the first chunk (see the module docstring)
MIN_ROWS = 8  # fewer rows are computed in one call: the second call's extra read of the weights
#   (about 5 ms) outweighs what skipping 1 to 3 rows saves (about 2.3 ms each)


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
        self.computed = 0  # rows computed so far (FIRST or n once read)

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
        while len(self._chunks) <= index:
            start = self.computed
            end = min(self._n, FIRST) if not self._chunks else self._n
            self._chunks.append(self._compute(start, end))
            self.computed = end
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
