"""Draft sources, one per module, behind the protocol in `base`.

- `base`: `Draft`, the `Drafter` protocol, `NullDrafter` (autoregressive decoding), and the
  switch for memory across requests (`switch_off_memory`).
- `ngram`: ANPD's multi-level n-gram tables (with `spans`: long-match copying) and prompt lookup.
- `suffix`: SuffixDecoding through arctic-inference.
- `early_exit`: EESD's exit head on the target's first layers.
- `model`: a draft model, one token at a time or MTAD's beams.
"""

from .base import EMPTY_DRAFT, Draft, Drafter, NullDrafter
from .ngram import AnpdDrafter, NgramConfig, NgramTables, PromptLookupDrafter, prompt_lookup

__all__ = [
    "AnpdDrafter",
    "Draft",
    "Drafter",
    "EMPTY_DRAFT",
    "NgramConfig",
    "NgramTables",
    "NullDrafter",
    "PromptLookupDrafter",
    "prompt_lookup",
]
