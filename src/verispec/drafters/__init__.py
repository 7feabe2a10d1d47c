"""Draft sources, one per module, behind the protocol in `base`.

- `base`: `Draft`, the `Drafter` protocol, `NullDrafter` (autoregressive decoding).
- `ngram`: ANPD's multi-level n-gram tables and prompt lookup.
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
