"""Where the rows of a C-layer call sit: positions, KV slots and block tables (`kernels/decoder_layer.c`'s `Rows`).

Owns the description of a forward's rows that the C decoder layers read, for one sequence or
for many at once (a batch):

- KV memory is paged: each layer's keys (and values) are a pool of blocks of `BLOCK` positions,
  [kv_heads, blocks * BLOCK, head_dim], and each sequence has a block table mapping its logical
  blocks to the pool's. A contiguous cache (`static_kv.StaticKV`) is a pool whose one sequence has
  the table 0, 1, 2, ...; a paged sequence (`kv_pool.PagedKV`) has the blocks it was given.
- Row r is at position `positions[r]` and writes its key and value to logical slot `slots[r]`
  of its sequence (`sequences[r]`, a row of `tables`). It sees the positions up to its own: those
  below `bases[r]` at the logical slot of the same number, the rest (a tree row's ancestors and
  itself, in scratch slots) at `paths[path_starts[r]:path_starts[r + 1]]`. A contiguous row has
  no path.

`BLOCK` is also the attention's fixed chunk of keys (a task scores the keys of one block), which
is what makes a row's attention independent of where its keys are stored: a position computes
the same bits in a contiguous cache, in a paged one, in a tree, or beside other sequences' rows.
Pure NumPy: arrays are built here and handed to C by address (`native_layer`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import numpy as np

BLOCK = 64  # positions per block of KV memory; the C layer's attention chunk (decoder_layer.c)


class _CRows(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("positions", "slots", "bases", "path_starts", "paths", "sequences", "tables")] + [
        ("table_width", ctypes.c_int64), ("pool_blocks", ctypes.c_int64)]


def _int64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.int64)


@dataclass(frozen=True)
class Rows:
    """The rows of one call (see the module docstring). Arrays are int64:
    positions, slots, bases, sequences [n]; path_starts [n + 1]; paths [P]; tables [S, W]
    (-1 past a sequence's blocks); pool_blocks: blocks in each layer's pool."""

    positions: np.ndarray
    slots: np.ndarray
    bases: np.ndarray
    path_starts: np.ndarray
    paths: np.ndarray
    sequences: np.ndarray
    tables: np.ndarray
    pool_blocks: int

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def contiguous(start: int, n: int, table: Sequence[int] | np.ndarray, pool_blocks: int) -> "Rows":
        """n rows at positions start..start+n-1 of one sequence with block table `table`."""
        positions = np.arange(start, start + n, dtype=np.int64)
        return Rows(positions, positions, positions + 1, np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                    np.zeros(n, dtype=np.int64), _int64(table).reshape(1, -1), pool_blocks)

    @staticmethod
    def placed(positions: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray, base: int,
               paths: Sequence[Sequence[int]], table: Sequence[int] | np.ndarray, pool_blocks: int) -> "Rows":
        """Rows of one sequence placed as a tree: row r at positions[r], written to slots[r],
        seeing positions < `base` at their own slots and positions base..positions[r] at the
        logical slots paths[r] (its ancestors', then its own)."""
        lengths = [len(path) for path in paths]
        starts = np.zeros(len(paths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        flat = _int64([slot for path in paths for slot in path]) if starts[-1] else np.zeros(0, dtype=np.int64)
        n = len(paths)
        return Rows(_int64(positions), _int64(slots), np.full(n, base, dtype=np.int64), starts, flat,
                    np.zeros(n, dtype=np.int64), _int64(table).reshape(1, -1), pool_blocks)

    def select(self, begin: int, end: int) -> "Rows":
        """Rows begin..end-1 (their sequences' tables unchanged): run after rows 0..begin-1 have
        written their keys, they compute what they compute in the whole call."""
        starts = self.path_starts[begin : end + 1]
        return Rows(self.positions[begin:end], self.slots[begin:end], self.bases[begin:end], starts - starts[0],
                    self.paths[starts[0] : starts[-1]], self.sequences[begin:end], self.tables, self.pool_blocks)

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        """The rows of several calls in one (each part's sequences get their own table rows);
        all parts must address the same pools."""
        assert parts and len({part.pool_blocks for part in parts}) == 1, "rows of one pool"
        if len(parts) == 1:
            return parts[0]
        width = max(part.tables.shape[1] for part in parts)
        tables, sequences, starts, offset_sequences, offset_paths = [], [], [np.zeros(1, dtype=np.int64)], 0, 0
        for part in parts:
            padded = np.full((part.tables.shape[0], width), -1, dtype=np.int64)
            padded[:, : part.tables.shape[1]] = part.tables
            tables.append(padded)
            sequences.append(part.sequences + offset_sequences)
            starts.append(part.path_starts[1:] + offset_paths)
            offset_sequences += part.tables.shape[0]
            offset_paths += int(part.path_starts[-1])
        cat = np.concatenate
        return Rows(cat([p.positions for p in parts]), cat([p.slots for p in parts]), cat([p.bases for p in parts]),
                    cat(starts), cat([p.paths for p in parts]), cat(sequences), np.ascontiguousarray(cat(tables)),
                    parts[0].pool_blocks)

    def c_struct(self) -> tuple[_CRows, int]:
        """The C struct pointing at these arrays (kept alive by self), and the sequence count."""
        arrays = (self.positions, self.slots, self.bases, self.path_starts, self.paths, self.sequences, self.tables)
        assert all(a.dtype == np.int64 and a.flags.c_contiguous for a in arrays)
        empty = np.zeros(1, dtype=np.int64)  # a valid address for an empty array
        object.__setattr__(self, "_empty", empty)
        pointers = [(a if a.size else empty).ctypes.data for a in arrays]
        return _CRows(*pointers, self.tables.shape[1], self.pool_blocks), self.tables.shape[0]
