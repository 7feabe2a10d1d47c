"""Paged KV memory: a pool of fixed-size blocks, each sequence's block table, and an exact prefix cache.

Owns three things, kept apart as vLLM keeps its block pool and KV-cache manager apart:

- `BlockPool`: every layer's keys and values as one pool [kv_heads, blocks * BLOCK, head_dim]
  per layer (the C layers' layout, `rows.py`), a free list and a reference count per block. A
  budget in bytes sets the number of blocks; the memory is reserved with `torch.empty`, so a
  block costs resident memory only once it is first written, and freed blocks are reused most
  recently freed first (the pool's resident size grows to what its busiest moment used, and
  stays). Asking for more blocks than are free or evictable raises `PoolExhausted` and takes
  nothing.
- `PrefixCache`: full blocks of computed KV, kept after their sequence ends, in a tree keyed by
  their tokens (each node a block of BLOCK tokens under the block before it, as SGLang's radix
  tree or vLLM's chained block hashes; keys are the tokens themselves, compared exactly, so a
  hash collision can never hand a sequence another text's keys). A sequence whose tokens start
  with cached blocks shares them without copying (reference counts); blocks nobody references
  are evicted least recently used first (leaves first) when the pool needs room. A sequence's
  last, partial block is kept too (a tail: its first t positions, under the block before it),
  and a later sequence whose tokens go on with the first tokens of a cached block (a tail, or a
  full block that goes on differently) copies it into a block of its own (it writes the rest of
  that block) and keeps the positions that match instead of recomputing them: a repeated short
  prompt, or a chat's next turn, recomputes nothing it already computed. Exact because
  the C layers are batch-invariant: a position's keys and values are the same bits however they
  were computed (prefill chunk, decode step, verify, alone or batched), so a cached block holds
  what recomputing it would write.
- `PagedKV`: one sequence's block table over a pool, with the interface the fast path uses of a
  cache (`length`, `crop`, `reserve`, `keep_slots`, `block_table`, `pool_blocks`, `keys`,
  `values`). Blocks a sequence shares are never written: a rollback into one copies it first
  (copy on write), and a sequence writes only positions at or past its committed length.

Sliding-window layers keep every position (their attention restricts itself to the window); a
rollback therefore never needs what fell out of a window.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np
import torch

from ..errors import VerispecError
from .rows import BLOCK


class PoolExhausted(VerispecError):
    """The KV pool has too few free or evictable blocks for what was asked."""


def block_bytes(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one block (keys and values of BLOCK positions in every layer)."""
    return 2 * layers * kv_heads * BLOCK * head_dim * torch.empty(0, dtype=dtype).element_size()


def default_budget_bytes(fraction: float = 0.25, cap: int = 2 << 30) -> int:
    """The default KV budget: `fraction` of the memory available now (MemAvailable), at most
    `cap` bytes (1 GiB where /proc/meminfo cannot be read)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return min(cap, int(int(line.split()[1]) * 1024 * fraction))
    except OSError:
        pass
    return 1 << 30


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes; a ConfigError for anything else."""
    from ..errors import ConfigError

    value = text.strip().lower().replace(" ", "")
    number = value.rstrip("kmgib")
    unit = value[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or not amount > 0 or amount != amount or amount == float("inf"):
        raise ConfigError(f"a memory size must be a positive number with an optional unit (B, KiB, MiB, GiB, KB, "
                          f"MB, GB), got {text!r}")
    return int(amount * _UNITS[unit])


class _Node:
    """A cached full block: its tokens, the node of the block before it, its children by tokens,
    and the tails cached after it (partial blocks, by their tokens)."""

    __slots__ = ("block", "tokens", "parent", "children", "tails")

    def __init__(self, block: int, tokens: tuple[int, ...], parent: "_Node | None"):
        self.block, self.tokens, self.parent = block, tokens, parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.tails: dict[tuple[int, ...], int] = {}


class PrefixCache:
    """Full blocks kept by their tokens (see the module docstring); owned by a `BlockPool`,
    which asks it for blocks to evict. Counts its queries and hits, in blocks and in tokens."""

    def __init__(self):
        self._root = _Node(-1, (), None)
        self._nodes: dict[int, _Node] = {}  # block -> its node
        self._tails: dict[int, tuple[_Node, tuple[int, ...]]] = {}  # tail block -> (the node it follows, its tokens)
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced, oldest first
        self.queried_tokens = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._nodes) + len(self._tails)

    def cached(self, block: int) -> bool:
        return block in self._nodes or block in self._tails

    def match(self, tokens: Sequence[int], count: bool = True) -> list[int]:
        """The blocks holding the longest run of whole blocks that `tokens` starts with (`count`:
        a real query, counted in `queried_tokens`/`hit_tokens`; False for a look ahead)."""
        node, found = self._root, []
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            node = node.children.get(tuple(tokens[start : start + BLOCK]))
            if node is None:
                break
            found.append(node.block)
        if count:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(found) * BLOCK
        return found

    def insert(self, parent: int | None, tokens: Sequence[int], block: int) -> int:
        """Cache `block` holding `tokens` (BLOCK of them) after the cached block `parent` (None:
        the first block). Returns the block now cached for them: `block`, or an equal one cached
        earlier (computed by another sequence), which the caller should use instead."""
        assert len(tokens) == BLOCK
        node = self._root if parent is None else self._nodes[parent]
        key = tuple(tokens)
        existing = node.children.get(key)
        if existing is not None:
            return existing.block
        assert block not in self._nodes, f"block {block} is cached already"
        child = _Node(block, key, node)
        node.children[key] = child
        self._nodes[block] = child
        return block

    def insert_tail(self, parent: int | None, tokens: Sequence[int], block: int) -> bool:
        """Cache `block` as a tail: its first len(tokens) (< BLOCK) positions hold `tokens`, after
        the cached block `parent` (None: from the start). False (nothing cached) where an equal
        tail is cached already."""
        assert 0 < len(tokens) < BLOCK
        node = self._root if parent is None else self._nodes[parent]
        key = tuple(tokens)
        if key in node.tails:
            return False
        assert not self.cached(block), f"block {block} is cached already"
        node.tails[key] = block
        self._tails[block] = (node, key)
        return True

    def match_leading(self, parent: int | None, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(block, t): the cached block after `parent`, a tail or a full block, whose first t
        positions hold the first t of `tokens`, t > 0 the most any gives (a block's leading
        positions are valid on their own: a prompt that ends inside a block another sequence
        filled further); None if none. Counted as hit tokens (the caller copies the block)."""
        node = self._root if parent is None else self._nodes.get(parent)
        if node is None:
            return None
        best = None
        candidates = [*node.tails.items(), *((key, child.block) for key, child in node.children.items())]
        for key, block in candidates:
            same = 0
            for a, b in zip(key, tokens):
                if a != b:
                    break
                same += 1
            if same and (best is None or same > best[1]):
                best = (block, same)
        if best is not None:
            self.hit_tokens += best[1]
        return best

    def idle(self, block: int) -> None:
        """`block` (cached) has no reference any more: it may be evicted, least recently idle first."""
        self._idle[block] = None

    def busy(self, block: int) -> None:
        """`block` (cached) is referenced again."""
        self._idle.pop(block, None)

    @property
    def evictable(self) -> int:
        return len(self._idle)

    def evict(self) -> int:
        """Forget the least recently idle block that no other cached block follows, and return it
        (its memory is free to reuse). Sequences release their blocks last first, so the oldest
        idle block is a leaf; if not, its idle subtree goes first (a referenced child would mean
        a referenced parent)."""
        block = next(iter(self._idle))
        if block in self._tails:
            return self._drop_tail(block)
        node = self._nodes[block]
        while node.children or node.tails:
            if node.tails:  # a tail is never referenced: it goes before the block it follows
                return self._drop_tail(next(iter(node.tails.values())))
            node = next(iter(node.children.values()))
            assert node.block in self._idle, "a cached block's child is referenced but not the block"
        del self._nodes[node.block]
        del node.parent.children[node.tokens]
        del self._idle[node.block]
        return node.block

    def _drop_tail(self, block: int) -> int:
        node, key = self._tails.pop(block)
        del node.tails[key]
        del self._idle[block]
        return block

    def clear(self) -> list[int]:
        """Forget every cached block; returns the idle ones (now free memory). Referenced ones stay
        with their sequences, uncached."""
        idle = list(self._idle)
        self._root, self._nodes, self._tails, self._idle = _Node(-1, (), None), {}, {}, collections.OrderedDict()
        return idle


class BlockPool:
    """Blocks of KV memory for the C layers (see the module docstring).

    keys[i] / values[i]: layer i's [kv_heads, blocks * BLOCK, head_dim]. `prefix_cache`:
    whether full blocks are kept after their sequence ends (`PrefixCache`)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, blocks: int, dtype: torch.dtype = torch.float32,
                 prefix_cache: bool = True):
        if blocks < 1:
            raise PoolExhausted(f"a KV pool needs at least one block of {BLOCK} positions")
        self.blocks = blocks
        self.block = BLOCK  # positions a block holds
        self.block_bytes = block_bytes(layers, kv_heads, head_dim, dtype)
        self.keys = [torch.empty(kv_heads, blocks * BLOCK, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.empty(kv_heads, blocks * BLOCK, head_dim, dtype=dtype) for _ in range(layers)]
        self._free = list(range(blocks - 1, -1, -1))  # a stack: the most recently freed on top
        self._refs = [0] * blocks
        self.prefix = PrefixCache()
        self.prefix_cache = prefix_cache

    @staticmethod
    def for_budget(layers: int, kv_heads: int, head_dim: int, budget_bytes: int, dtype: torch.dtype = torch.float32,
                   prefix_cache: bool = True) -> "BlockPool":
        """A pool of as many blocks as `budget_bytes` holds."""
        per_block = block_bytes(layers, kv_heads, head_dim, dtype)
        blocks = budget_bytes // per_block
        if blocks < 1:
            raise PoolExhausted(f"a KV budget of {budget_bytes} bytes holds no block of {BLOCK} positions "
                                f"({per_block} bytes each)")
        return BlockPool(layers, kv_heads, head_dim, int(blocks), dtype, prefix_cache)

    # -- counts ----------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now: free, or cached and unreferenced (evictable)."""
        return len(self._free) + self.prefix.evictable

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.blocks - len(self._free) - self.prefix.evictable

    def references(self, block: int) -> int:
        return self._refs[block]

    def shared_busy(self, tokens: Sequence[int]) -> int:
        """Of the cached blocks a new sequence of `tokens` would go on sharing
        (`PagedKV.start_from_cache`: a last block that is all cached is copied, not shared), how
        many a sequence holds already: blocks its start takes nothing for (`scheduler`)."""
        if not self.prefix_cache:
            return 0
        found = self.prefix.match(tokens, count=False)
        if found and len(found) * BLOCK == len(tokens):
            found = found[:-1]
        return sum(1 for block in found if self._refs[block] > 0)

    # -- handing blocks out and back -----------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each referenced once: free ones first, then evicted cached ones
        (least recently used first). PoolExhausted (nothing taken) if there are not enough."""
        if count > self.free_blocks:
            raise PoolExhausted(f"KV memory exhausted: {count} more blocks of {BLOCK} positions asked, "
                                f"{self.free_blocks} of {self.blocks} free")
        taken = []
        for _ in range(count):
            block = self._free.pop() if self._free else self.prefix.evict()
            self._refs[block] = 1
            taken.append(block)
        return taken

    def share(self, blocks: Iterable[int]) -> None:
        """One more reference to each of `blocks` (cached blocks a sequence starts with)."""
        for block in blocks:
            if self._refs[block] == 0:
                self.prefix.busy(block)
            self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less to each of `blocks`, last first (so a sequence's deepest cached
        blocks become the oldest idle ones: evicted before the blocks they follow). A block
        nobody references stays cached (evictable) if it is, else it is free."""
        for block in reversed(blocks):
            assert self._refs[block] > 0, f"block {block} released more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self.prefix.cached(block):
                    self.prefix.idle(block)
                else:
                    self._free.append(block)

    def cache_block(self, parent: int | None, tokens: Sequence[int], block: int) -> int:
        """Keep `block` (full, holding `tokens` after cached block `parent`) in the prefix cache;
        returns the block to use for it from now on: `block`, or an equal cached one (then one
        reference moves from `block`, released, to it)."""
        cached = self.prefix.insert(parent, tokens, block)
        if cached != block:
            self.share([cached])
            self.release([block])
        return cached

    def clear_cache(self) -> None:
        """Forget every cached block (after a change of numerics, say): idle ones become free."""
        self._free.extend(self.prefix.clear())

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's keys and values, in every layer."""
        a, b = source * BLOCK, destination * BLOCK
        for store in (self.keys, self.values):
            for layer in store:
                layer[:, b : b + BLOCK] = layer[:, a : a + BLOCK]


class PagedKV:
    """One sequence's KV cache in a `BlockPool` (see the module docstring). `tokens`: the ids at
    positions 0..length-1 as its owner wrote them (`note_tokens`), which name its full blocks in
    the prefix cache."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.length = 0
        self.tokens: list[int] = []
        self.blocks: list[int] = []  # logical block -> pool block
        self._shared = 0  # leading blocks that are cached (shared, never written)
        self._table: np.ndarray | None = None

    # -- what the C layers read --------------------------------------------------------------
    @property
    def keys(self) -> list[torch.Tensor]:
        return self.pool.keys

    @property
    def values(self) -> list[torch.Tensor]:
        return self.pool.values

    @property
    def pool_blocks(self) -> int:
        return self.pool.blocks

    @property
    def block_table(self) -> np.ndarray:
        """[blocks] int64: the pool block of each logical block."""
        if self._table is None:
            self._table = np.array(self.blocks, dtype=np.int64)
        return self._table

    @property
    def capacity(self) -> int:
        return len(self.blocks) * BLOCK

    # -- growing and shrinking ---------------------------------------------------------------------
    def reserve(self, positions: int) -> None:
        """Blocks for logical slots 0..positions-1 (PoolExhausted if the pool cannot give them)."""
        missing = -(-positions // BLOCK) - len(self.blocks)
        if missing > 0:
            self.blocks += self.pool.allocate(missing)
            self._table = None

    def note_tokens(self, start: int, ids: Sequence[int]) -> None:
        """The ids written at positions start..start+len(ids)-1 (before `length` moves past them)."""
        del self.tokens[start:]
        self.tokens.extend(ids)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions. Where that reaches back into shared (cached)
        blocks, which must never be written, the blocks past `length` are given back and the
        shared block holding position `length` is replaced by a private copy (copy on write)."""
        assert 0 <= length <= self.length, f"cannot crop a cache of {self.length} positions to {length}"
        if self._shared * BLOCK > length:
            keep = -(-length // BLOCK)  # blocks holding positions 0..length-1
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]
            self._shared = min(self._shared, keep)
            if self._shared * BLOCK > length:  # the last kept block is shared and will be written
                private = self.pool.allocate(1)[0]
                self.pool.copy_block(self.blocks[-1], private)
                self.pool.release([self.blocks[-1]])
                self.blocks[-1] = private
                self._shared -= 1
            self._table = None
        self.length = length
        del self.tokens[length:]

    @torch.inference_mode()
    def keep_slots(self, start: int, slots: Sequence[int]) -> None:
        """After a tree of drafts was written past the first `start` positions: keep the entries of
        logical `slots` (its accepted path) as positions start.., as `StaticKV.keep_slots` does."""
        moved = [(start + j, slot) for j, slot in enumerate(slots) if slot != start + j]
        if moved:
            table = self.block_table
            physical = lambda s: int(table[s // BLOCK]) * BLOCK + s % BLOCK  # noqa: E731
            destinations = torch.tensor([physical(d) for d, _ in moved])
            sources = torch.tensor([physical(s) for _, s in moved])
            for store in (self.pool.keys, self.pool.values):
                for layer in store:
                    layer[:, destinations] = layer[:, sources]
        self.length = start + len(slots)

    # -- the prefix cache --------------------------------------------------------------------------
    def start_from_cache(self, tokens: Sequence[int]) -> int:
        """For an empty sequence about to compute `tokens`: share the cached blocks they start
        with and return how many positions need no computing (at most len(tokens) - 1: the last
        token is always computed, for its logits; a last block that is all cached is then
        copied, not written)."""
        assert self.length == 0 and not self.blocks, "start_from_cache is for an empty sequence"
        if not self.pool.prefix_cache:
            return 0
        found = self.pool.prefix.match(tokens)
        if not found:
            self._copy_tail(tokens)
            return self.length
        self.pool.share(found)
        self.blocks, self._shared, self._table = list(found), len(found), None
        self.length = len(found) * BLOCK
        self.tokens = list(tokens[: self.length])
        if self.length == len(tokens):
            self.crop(self.length - 1)  # the last token is recomputed in a private copy of its block
            return self.length
        self._copy_tail(tokens)
        return self.length

    def _copy_tail(self, tokens: Sequence[int]) -> None:
        """After the shared full blocks: the cached block (a tail, or a full block that goes on
        differently) that serves most of what follows in `tokens` (never its last token), copied
        into a block of this sequence's own. Without a block to copy into (every one referenced),
        nothing is copied: a cache lookup never fails a start, the positions are computed."""
        tail = self.pool.prefix.match_leading(self.blocks[-1] if self.blocks else None,
                                              tokens[self.length : len(tokens) - 1])
        if tail is None:
            return
        source, count = tail
        try:
            block = self.pool.allocate(1)[0]  # may be the tail itself, evicted: its bits are still there
        except PoolExhausted:
            return
        if block != source:
            self.pool.copy_block(source, block)
        self.blocks.append(block)
        self._table = None
        self.length += count
        self.tokens = list(tokens[: self.length])

    def _cache_tail(self) -> None:
        """Offer the prefix cache the committed positions past the last full block, where every
        block before them is cached (their chain names the tail)."""
        committed = min(self.length, len(self.tokens))
        full, count = divmod(committed, BLOCK)
        if not self.pool.prefix_cache or not count or self._shared != full or len(self.blocks) <= full:
            return
        parent = self.blocks[full - 1] if full else None
        if parent is not None and not self.pool.prefix.cached(parent):
            return  # the cache was cleared under this sequence
        self.pool.prefix.insert_tail(parent, self.tokens[full * BLOCK : committed], self.blocks[full])

    def cache_full_blocks(self) -> None:
        """Put the full blocks below `length` (committed positions: their tokens are final) into
        the prefix cache; from then on they are shared and never written."""
        if not self.pool.prefix_cache:
            return
        full = min(self.length, len(self.tokens)) // BLOCK
        while self._shared < full:
            index = self._shared
            parent = self.blocks[index - 1] if index else None
            if parent is not None and not self.pool.prefix.cached(parent):
                return  # the cache was cleared under this sequence: its later blocks stay private
            block = self.pool.cache_block(parent, self.tokens[index * BLOCK : (index + 1) * BLOCK], self.blocks[index])
            if block != self.blocks[index]:
                self.blocks[index] = block
                self._table = None
            self._shared += 1

    def release(self) -> None:
        """End the sequence: cache its full blocks and its tail (the committed positions of its
        last, partial block), give every block back."""
        self.cache_full_blocks()
        self._cache_tail()
        self.pool.release(self.blocks)
        self.blocks, self._shared, self._table, self.length, self.tokens = [], 0, None, 0, []
