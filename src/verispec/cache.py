"""The only KV-cache rollback code: transformers' DynamicCache (eager path) and `StaticKV` (fast path).

A `transformers` DynamicCache built from the model's config holds one layer per decoder layer;
Gemma 3's sliding-window layers keep only the last `sliding_window - 1` positions. Speculative
decoding appends k+1 positions and must then drop the rejected ones, which a sliding layer can
only do if it kept what fell out of its window in the meantime: `new_cache` turns on that
recording, and `crop_to` drops the rejected positions and trims every sliding layer back to its
window. After `crop_to(cache, n)` the cache is exactly the cache of the first n positions
(tested: crop then re-feed gives the logits of a fresh forward).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for `model` whose sliding-window layers can be rolled back."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Number of positions the cache represents (sliding layers count positions, not entries)."""
    return cache.get_seq_length()


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of `cache` and drop the rest."""
    current = cache_length(cache)
    assert 0 <= length <= current, f"cannot crop a cache of {current} positions to {length}"
    # crop(-n) removes n positions; crop(0) still trims sliding layers back to their window.
    cache.crop(length - current)


class StaticKV:
    """A preallocated KV cache for the fast path: rollback only moves `length`.

    keys[i] / values[i]: [kv_heads, capacity, head_dim] for layer i. Positions >= `length` hold
    stale entries that the next write overwrites; readers only see [low, high) ranges they ask
    for. Sliding-window layers keep every position (attention restricts itself to the window),
    so a rollback never needs what fell out of a window. The capacity doubles when a write would
    exceed it (a copy, amortised O(1) per token).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256):
        self.length = 0
        self.keys = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(kv_heads, capacity, head_dim, dtype=dtype) for _ in range(layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reserve(self, positions: int) -> None:
        """Make room for `positions` positions (doubling, keeping the contents)."""
        if positions <= self.capacity:
            return
        capacity = max(positions, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                new = torch.zeros(old.shape[0], capacity, old.shape[2], dtype=old.dtype)
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
