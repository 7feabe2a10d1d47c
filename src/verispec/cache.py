"""The only KV-cache rollback code.

A `transformers` DynamicCache built from the model's config holds one layer per decoder layer;
Gemma 3's sliding-window layers keep only the last `sliding_window - 1` positions. Speculative
decoding appends k+1 positions and must then drop the rejected ones, which a sliding layer can
only do if it kept what fell out of its window in the meantime: `new_cache` turns on that
recording, and `crop_to` drops the rejected positions and trims every sliding layer back to its
window. After `crop_to(cache, n)` the cache is exactly the cache of the first n positions
(tested: crop then re-feed gives the logits of a fresh forward).
"""

from __future__ import annotations

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
