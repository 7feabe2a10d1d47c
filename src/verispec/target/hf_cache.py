"""transformers' KV caches and their rollback: DynamicCache (the eager PyTorch path) and
StaticCache (the compiled CUDA decode step, `device.CompiledStep`). The runtime's own caches
(`StaticKV`, `Tree`) are `runtime.static_kv`'s.

A `transformers` DynamicCache built from the model's config holds one layer per decoder layer;
Gemma 3's sliding-window layers keep only the last `sliding_window - 1` positions. Speculative
decoding appends k+1 positions and must then drop the rejected ones, which a sliding layer can
only do if it kept what fell out of its window in the meantime: `new_cache` gives it sliding
layers (`RollbackSlidingLayer`) that keep every position appended since the last rollback and
hand all of them to attention (the mask hides what lies outside a row's window), and `crop_to`
drops the rejected positions and trims every sliding layer back to its window. Keeping them all
until the rollback is what lets rows that are not one contiguous continuation (MTAD's beams,
appended step after step past scratch rows) still see their whole window (`torch_path`). After
`crop_to(cache, n)` the cache is exactly the cache of the first n positions (tested: crop then
re-feed gives the logits of a fresh forward). transformers' StaticCache (the compiled CUDA step)
gets a full-length layer for each sliding-window layer (`new_static_cache`): its own sliding
layers are ring buffers, whose overwritten positions a rollback could not bring back.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer


class RollbackSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window DynamicCache layer that can be rolled back: it records the positions it
    is given until the next crop (which trims it to its last `sliding_window - 1` positions), and
    returns all of them to attention, sizing the mask to match (`get_mask_sizes`: the keys
    returned are the last `kept + query` positions)."""

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.record_past = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value states [b, heads, q, head_dim] appended; returns every kept position's."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys returned, position of the first) for a forward of `query_length` positions."""
        kept = self.keys.shape[-2] if self.is_initialized else 0
        return kept + query_length, self.cumulative_length - kept

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -`tokens_to_remove` positions and trim to the window (nothing to do
        before the first forward)."""
        if self.is_initialized:
            super().crop(tokens_to_remove)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for `model` whose sliding-window layers can be rolled back."""
    cache = DynamicCache(config=model.config)
    cache.layers = [RollbackSlidingLayer(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
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


def new_static_cache(model: PreTrainedModel, capacity: int):
    """transformers' StaticCache of `capacity` positions for `model`, or the reason it cannot be
    made (a str). Its sliding-window layers are full-length layers: transformers' own are ring
    buffers, so what a rejected draft pushed out of the window would be lost; in a full-length
    layer a rollback moves the length, and the sliding-window mask (built from positions) hides
    what lies outside each row's window."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    try:
        cache = StaticCache(config=model.config, max_cache_len=capacity)  # allocated at the first forward
    except Exception as error:  # an architecture transformers has no static cache for
        return f"no static cache for {type(model).__name__} ({error})"
    if any(not isinstance(layer, StaticLayer) for layer in cache.layers):
        return "layers other than attention layers (a static cache of them cannot be rolled back)"
    cache.layers = [StaticLayer(max_cache_len=capacity) if isinstance(layer, StaticSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def set_static_length(cache, length: int) -> None:
    """Make a StaticCache (full-attention layers) hold its first `length` positions: each layer's
    length tensor is set in place (a CUDA graph keeps reading the same addresses); entries past it
    are stale and masked out, and the next write overwrites them."""
    with torch.inference_mode():  # the tensors were made under inference mode (the forward's); so is this update
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)
