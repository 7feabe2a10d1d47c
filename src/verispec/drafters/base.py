"""The drafter protocol and the draft it returns.

A drafter proposes tokens that the target then verifies. It owns its own per-request state
(n-gram tables, its KV cache, an exit head's cache) and nothing else; the engine calls, per
request, `begin` once, then per step `propose` and `commit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for one verification step.

    tokens: [k] token ids (k may be 0: nothing to propose, the step is autoregressive).
    q: [k, vocab] probabilities each token was drawn from, or None for deterministic drafters.
    q_tokens: [k] probability of each drafted token along the draft's own path (MTAD's beam
        drafts, where q of the chosen beam is known per token but not as a full row), or None.
    confidence: per-token confidence in [0, 1] (e.g. a draft head's top-1 probability), used by
        calibrated draft-length controllers; empty when the drafter has none.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    q_tokens: torch.Tensor | None = None
    confidence: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1 and self.tokens.dtype == torch.long, "tokens must be [k] long"
        k = self.tokens.shape[0]
        assert self.q is None or (self.q.dim() == 2 and self.q.shape[0] == k), "q must be [k, vocab]"
        assert self.q_tokens is None or self.q_tokens.shape == (k,), "q_tokens must be [k]"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def drawn(self) -> bool:
        """Whether the tokens were drawn at random from a draft distribution (q or q_tokens):
        such a draft must be verified as proposed, since a cut chosen after seeing later tokens
        would make whether token j is verified depend on what was drawn at j."""
        return self.q is not None or self.q_tokens is not None

    def prefix(self, n: int) -> "Draft":
        """The first n tokens of this draft (itself when n covers it)."""
        if n >= len(self):
            return self
        return Draft(
            self.tokens[:n],
            None if self.q is None else self.q[:n],
            None if self.q_tokens is None else self.q_tokens[:n],
            self.confidence[:n],
        )

    @staticmethod
    def of(tokens: Sequence[int]) -> "Draft":
        """A deterministic draft (q = None) from a list of ids."""
        return Draft(torch.tensor(list(tokens), dtype=torch.long))


EMPTY_DRAFT = Draft(torch.empty(0, dtype=torch.long))

# keep(j, confidence): j tokens drafted so far, the last with this confidence (None when j = 0):
# draft another one?
Keep = Callable[[int, "float | None"], bool]


def keep_all(j: int, confidence: float | None) -> bool:
    return True


def kept_prefix(confidence: Sequence[float | None], keep: Keep) -> int:
    """How many leading tokens of an already-made draft `keep` lets through, asking token by
    token (for drafters whose tokens cost nothing to make, such as n-gram drafts)."""
    previous = None
    for j, c in enumerate(confidence):
        if not keep(j, previous):
            return j
        previous = c
    return len(confidence)


class Drafter(Protocol):
    """What the engine needs from a draft source."""

    def begin(self, prompt: Sequence[int]) -> None:
        """Build per-request state from the prompt ids."""

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        """Propose up to k tokens to follow `context` (prompt + committed tokens), asking
        `keep` before each token whether to go on."""

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        """Learn the tokens committed this step (the accepted draft prefix plus the target's
        token) and roll back whatever state was built for the rejected rest of the draft."""


class NullDrafter:
    """Proposes nothing: with it the engine decodes autoregressively (the `ar` method)."""

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        return EMPTY_DRAFT

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        pass
