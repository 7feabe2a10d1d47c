"""The runtime's own KV caches: `StaticKV`, a preallocated contiguous cache whose rollback moves a
length (the fast path's), and `Tree`, where a chunk's tokens sit in a cache (contiguous, or a tree
of drafts in scratch slots), with `tree_layout`. `StaticKV.keep_slots` keeps a tree's accepted
path: the only rollback code of the runtime's caches. Both describe themselves to the C layers as
`rows.Rows` (a contiguous cache is a pool whose one sequence has the block table 0, 1, 2, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from .rows import BLOCK, Rows


class StaticKV:
    """A preallocated KV cache for the fast path: rollback only moves `length`.

    keys[i] / values[i]: [kv_heads, capacity, head_dim] for layer i. Positions >= `length` hold
    stale entries that the next write overwrites; readers only see [low, high) ranges they ask
    for. Sliding-window layers keep every position (attention restricts itself to the window),
    so a rollback never needs what fell out of a window. The capacity, a multiple of
    `rows.BLOCK`, doubles when a write would exceed it (a copy, amortised O(1) per token). It
    lives on `device` (the fast path's: the CPU). To the C layers it is a pool of capacity /
    BLOCK blocks holding one sequence whose block table is 0, 1, 2, ... (`block_table`).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256,
                 device: torch.device | str = "cpu"):
        self.length = 0
        capacity = -(-capacity // BLOCK) * BLOCK
        self.keys = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def pool_blocks(self) -> int:
        """The cache as a pool of blocks for the C layers: capacity / BLOCK of them."""
        return self.capacity // BLOCK

    @property
    def block_table(self) -> np.ndarray:
        """Its one sequence's block table: logical block b is block b. [pool_blocks] int64."""
        return np.arange(self.pool_blocks, dtype=np.int64)

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions (doubling, keeping the contents)."""
        if positions <= self.capacity:
            return
        capacity = -(-max(positions, 2 * self.capacity) // BLOCK) * BLOCK
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = torch.zeros(old.shape[0], capacity, old.shape[2], dtype=old.dtype, device=old.device)
                new[:, : old.shape[1]] = old
                store[i] = new

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, n, head_dim] at positions start..start+n-1."""
        n = keys.shape[1]
        self.keys[layer][:, start : start + n] = keys
        self.values[layer][:, start : start + n] = values

    def write_slots(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values [kv_heads, n, head_dim] into the (not necessarily contiguous) slots [n]."""
        self.keys[layer].index_copy_(1, slots, keys)
        self.values[layer].index_copy_(1, slots, values)

    def read(self, layer: int, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of positions [low, high): [kv_heads, high-low, head_dim]."""
        return self.keys[layer][:, low:high], self.values[layer][:, low:high]

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length, f"cannot crop a cache of {self.length} positions to {length}"
        self.length = length

    @torch.inference_mode()
    def keep_slots(self, start: int, slots: Sequence[int]) -> None:
        """After a tree of drafts (`Tree.of_parents`) was written past the first `start`
        positions: keep the entries of `slots` (its accepted path, in order) as positions start..
        and drop the rest. A slot already at its position stays; the others (scratch slots, past
        every position kept) are copied, in every layer."""
        moved = [(start + j, slot) for j, slot in enumerate(slots) if slot != start + j]
        if moved:
            device = self.keys[0].device
            destinations = torch.tensor([d for d, _ in moved], device=device)
            sources = torch.tensor([s for _, s in moved], device=device)
            for store in (self.keys, self.values):
                for layer in store:
                    layer[:, destinations] = layer[:, sources]
        self.length = start + len(slots)


def tree_layout(parents: Sequence[int]) -> tuple[list[int], set[int]]:
    """Each row's depth (0 for a -1 row) and the rows of the primary branch (row 0, then
    each row's first child), for `Tree.of_parents` and `Tree.span`."""
    depth: list[int] = []
    first_child: dict[int, int] = {}
    for i, parent in enumerate(parents):
        assert -1 <= parent < i, f"row {i}: parent {parent} is not an earlier row"
        depth.append(0 if parent < 0 else depth[parent] + 1)
        first_child.setdefault(parent, i)
    primary, row = {0}, 0
    while row in first_child:
        row = first_child[row]
        primary.add(row)
    return depth, primary


@dataclass(frozen=True)
class Tree:
    """Where a chunk's tokens sit: their logical positions (for rotary embeddings and windows),
    the cache slots their keys/values are written to, and which slots each may attend to.

    The usual case is `contiguous`: a continuation at positions start..start+n-1, written to the
    same slots, attending causally. Beam and tree drafts place several alternative continuations
    side by side in scratch slots past the committed context: `visible[i, s]` says whether token
    i sees slot s (its ancestors and itself), `slot_positions[s]` is the logical position of
    slot s; sliding-window layers additionally hide slots outside their window.
    """

    positions: torch.Tensor  # [n] long
    slots: torch.Tensor | None = None  # [n] long; None: slots == positions (contiguous)
    visible: torch.Tensor | None = None  # [n, S] bool over slots 0..S-1
    slot_positions: torch.Tensor | None = None  # [S] long
    # The same placement as the C layers read it (`rows.Rows.placed`): rows see positions below
    # `base` at their own slots and positions base.. at the slots of their path (ancestors, then
    # itself). None: derived from `visible` when first needed.
    base: int | None = None
    paths: tuple[tuple[int, ...], ...] | None = None

    @staticmethod
    def contiguous(start: int, n: int, device: torch.device | str = "cpu") -> "Tree":
        """Positions start..start+n-1 on `device` (the cache's)."""
        return Tree(torch.arange(start, start + n, device=device))

    @staticmethod
    def of_parents(length: int, parents: Sequence[int], device: torch.device | str = "cpu") -> "Tree":
        """A tree of tokens after the first `length` positions of a cache: row i is a child of row
        parents[i] (parents[i] < i: rows in topological order) or, for -1, follows the cache, at
        position length + its depth (0 for a -1 row). The primary branch -- row 0, then each
        row's first child -- sits at slots equal to its positions, so that when it wins nothing
        has to move; every other row sits in a scratch slot past the deepest position, in row
        order. A row's ancestors then always hold lower slots than it, in position order, as the
        C layer requires (`native_layer`). Rows see the whole cache, their ancestors and
        themselves. Its tensors are on `device` (the cache's)."""
        depth, primary = tree_layout(parents)
        scratch = length + max(depth) + 1  # past every position the tree holds
        slots = []
        for i in range(len(parents)):
            if i in primary:
                slots.append(length + depth[i])
            else:
                slots.append(scratch)
                scratch += 1
        sees: list[list[bool]] = []  # sees[i][j]: row j is row i or one of its ancestors
        for i, parent in enumerate(parents):
            row_sees = list(sees[parent]) if parent >= 0 else [False] * len(parents)
            row_sees[i] = True
            sees.append(row_sees)
        positions = torch.tensor(depth, dtype=torch.long, device=device) + length  # [m]
        slot_tensor = torch.tensor(slots, dtype=torch.long, device=device)  # [m]
        visible = torch.zeros(len(parents), scratch, dtype=torch.bool, device=device)  # [m, S]
        visible[:, :length] = True
        visible[:, slot_tensor] = torch.tensor(sees, dtype=torch.bool, device=device)
        slot_positions = torch.arange(scratch, device=device)  # [S]; slots nobody sees keep their index
        slot_positions[slot_tensor] = positions
        paths: list[tuple[int, ...]] = []  # the slots of each row's ancestors, then its own
        for i, parent in enumerate(parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (slots[i],))
        return Tree(positions, slot_tensor, visible, slot_positions, length, tuple(paths))

    @staticmethod
    def span(parents: Sequence[int]) -> int:
        """Slots past the cache that `of_parents` places a tree of these parents in: its
        deepest position, then a scratch slot per row off the primary branch."""
        depth, primary = tree_layout(parents)
        return max(depth) + 1 + len(parents) - len(primary)

    def rows(self, begin: int, end: int) -> "Tree":
        """Rows begin..end-1 of a placed tree, at the same slots and seeing the same slots: run
        after rows 0..begin-1 (which wrote their keys and values), they give the bits the whole
        tree in one call gives them (a staged tree verify, `Target.forward_tree`)."""
        assert self.slots is not None and 0 <= begin < end <= len(self.positions), "rows of a placed tree"
        base, paths = self.placement
        return Tree(self.positions[begin:end], self.slots[begin:end], self.visible[begin:end], self.slot_positions,
                    base, paths[begin:end])

    @cached_property
    def placement(self) -> tuple[int, tuple[tuple[int, ...], ...]]:
        """(base, paths) of a placed tree (see the fields), derived from `visible` and
        `slot_positions` where not given: each row must see, in increasing slot order, the
        consecutive positions 0..its own (its context, its ancestors, itself); a ValueError
        otherwise (a placement the C layers could not read)."""
        if self.paths is not None:
            return self.base, self.paths
        visible, slot_positions = self.visible.cpu().numpy(), self.slot_positions.cpu().numpy()
        rows: list[tuple[int, list[int]]] = []  # per row: positions at their own slots, then its path
        for r, position in enumerate(self.positions.tolist()):
            seen = np.nonzero(visible[r])[0]
            if not np.array_equal(slot_positions[seen], np.arange(position + 1)):
                raise ValueError(f"tree row {r} does not see the consecutive positions 0..{position}")
            own = int(np.argmin(seen == np.arange(len(seen)))) if not np.array_equal(seen, np.arange(len(seen))) else len(seen)
            rows.append((own, seen[own:].tolist()))
        base = min(own for own, _ in rows)
        paths = tuple(tuple(range(base, own)) + tuple(path) for own, path in rows)
        return base, paths

    def c_rows(self, table: np.ndarray, pool_blocks: int) -> Rows:
        """This placement as the C layers read it, in a sequence with block table `table`."""
        if self.slots is None:
            return Rows.contiguous(self.start, len(self.positions), table, pool_blocks)
        base, paths = self.placement
        return Rows.placed(self.positions.cpu().numpy(), self.slots.cpu().numpy(), base, paths, table, pool_blocks)

    @property
    def end(self) -> int:
        """One past the largest slot written or read."""
        if self.slots is None:
            return int(self.positions[-1]) + 1
        return max(int(self.slots.max()) + 1, self.visible.shape[1])

    def attend(self, cache: StaticKV, layer: int, keys: torch.Tensor, values: torch.Tensor, window: int | None):
        """Write this chunk's keys/values [kv, n, d]; return the keys/values it reads [kv, L, d]
        and the boolean attention mask [n, L] (None: every query sees every key)."""
        n = keys.shape[1]
        if self.slots is None:  # contiguous: read only the visible range, mask only if n > 1
            start = self.start
            cache.write(layer, start, keys, values)
            low = 0 if window is None else max(0, start - window + 1)
            all_keys, all_values = cache.read(layer, low, start + n)
            if n == 1:
                return all_keys, all_values, None
            query = self.positions.unsqueeze(1)  # [n, 1]
            key = torch.arange(low, start + n, device=self.positions.device).unsqueeze(0)  # [1, L]
            mask = key <= query
            if window is not None:
                mask &= key > query - window
            return all_keys, all_values, mask
        cache.write_slots(layer, self.slots, keys, values)
        all_keys, all_values = cache.read(layer, 0, self.visible.shape[1])
        return all_keys, all_values, self.slot_mask(window)

    @cached_property
    def start(self) -> int:
        """The first token's position (read once per forward, not once per layer)."""
        return int(self.positions[0])

    @cached_property
    def _masks(self) -> dict:
        return {}

    def slot_mask(self, window: int | None) -> torch.Tensor:
        """Which slots each token attends to, [n, S] bool (placed chunks): `visible`, and for a
        sliding-window layer only slots within the window of the token's position. Built once
        per window and forward (every layer of a kind shares it)."""
        if window is None:
            return self.visible
        if window not in self._masks:
            self._masks[window] = self.visible & (self.slot_positions.unsqueeze(0) > self.positions.unsqueeze(1) - window)
        return self._masks[window]
