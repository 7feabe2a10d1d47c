"""The drafter protocol and the draft it returns.

A drafter proposes tokens that the target then verifies. It owns its own per-request state
(n-gram tables, its KV cache, an exit head's cache) and nothing else; the engine calls, per
request, `begin` once, then per step `propose` and `commit`, and `close` (if it has one) at the end.

Also owns the one switch for what drafters keep across requests on a target
(`switch_off_memory`): ANPD's n-gram memory and SuffixDecoding's tree of earlier outputs both
read it, so a server can promise that no request's drafts depend on another's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from typing import Callable, Protocol, Sequence

import torch

# Token ids live on the host whatever the target's device: the loop branches on them (what to
# verify, what was accepted) and feeds them back as Python ints, so ids made on a GPU would cost
# a transfer each way. Probabilities (q, q_tokens) live where the logits they came from are.
HOST = torch.device("cpu")

MEMORY_OFF = "memory-across-requests-off"  # Target.attachments key: True once switched off


def switch_off_memory(attachments: dict) -> None:
    """No memory across requests on this target (its `attachments`), whatever a request's options
    say: ANPD drafts from the request's own tables only (`ngram.shared_memory` gives None) and
    SuffixDecoding keeps no global tree (`suffix.shared_store`: max_cached_requests 0)."""
    attachments[MEMORY_OFF] = True


def memory_switched_off(attachments: dict) -> bool:
    return bool(attachments.get(MEMORY_OFF))


def recently_used(stores: dict, key, make: Callable[[], object], limit: int):
    """`stores[key]`, made by `make()` if absent, now the most recently used of at most `limit`
    (the dict's insertion order is the use order; the least recently used go first)."""
    store = stores.pop(key, None)
    if store is None:
        store = make()
    stores[key] = store
    while len(stores) > limit:
        del stores[next(iter(stores))]
    return store


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for one verification step.

    tokens: [k] token ids on the host (`HOST`; k may be 0: nothing to propose, the step is
        autoregressive).
    q: [k, vocab] probabilities each token was drawn from (on the target's device), or None for
        deterministic drafters.
    q_tokens: [k] probability of each drafted token along the draft's own path (MTAD's beam
        drafts, where q of the chosen beam is known per token but not as a full row), or None.
    confidence: per-token confidence in [0, 1] (e.g. a draft head's top-1 probability), used by
        calibrated draft-length controllers; empty when the drafter has none.
    parents: [k] long on the host, for a tree of drafts (deterministic only): token i follows
        token parents[i] (< i: topological order), or the last committed token for -1; None (the
        usual case) for a linear draft, where token i follows token i - 1. A tree's primary
        branch is token 0, then each token's first child. For a tree, `confidence[i]` is the
        ratio of token i's path probability (that the target accepts the whole path to it) to
        token i - 1's, tokens ordered by decreasing path probability: prefix products are then
        the path probabilities, so a controller that sizes a linear draft by the survival of its
        prefixes (`cut`, `keep`) sizes a tree by its most probable tokens, and `prefix(n)` keeps
        the n most probable (ancestors come first).
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    q_tokens: torch.Tensor | None = None
    confidence: tuple[float, ...] = field(default=())
    parents: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.tokens.dim() == 1 and self.tokens.dtype == torch.long, "tokens must be [k] long"
        k = self.tokens.shape[0]
        assert self.q is None or (self.q.dim() == 2 and self.q.shape[0] == k), "q must be [k, vocab]"
        assert self.q_tokens is None or self.q_tokens.shape == (k,), "q_tokens must be [k]"
        if self.parents is not None:
            assert not self.drawn, "a tree of drafts is deterministic (q = None)"
            assert self.parents.shape == (k,) and self.parents.dtype == torch.long, "parents must be [k] long"
            assert all(-1 <= p < i for i, p in enumerate(self.parents.tolist())), "parents must precede their children"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def drawn(self) -> bool:
        """Whether the tokens were drawn at random from a draft distribution (q or q_tokens):
        such a draft must be verified as proposed, since a cut chosen after seeing later tokens
        would make whether token j is verified depend on what was drawn at j."""
        return self.q is not None or self.q_tokens is not None

    def prefix(self, n: int) -> "Draft":
        """The first n tokens of this draft (itself when n covers it); of a tree, its n first
        (most probable) tokens, a linear draft if they form a chain."""
        if n >= len(self):
            return self
        if self.parents is not None:
            return Draft.tree(self.tokens[:n].tolist(), self.parents[:n].tolist(), self.confidence[:n])
        return Draft(
            self.tokens[:n],
            None if self.q is None else self.q[:n],
            None if self.q_tokens is None else self.q_tokens[:n],
            self.confidence[:n],
        )

    def primary(self) -> "Draft":
        """A tree's primary branch (token 0, then each token's first child) as a linear draft,
        each token's confidence its own (its path probability over its parent's); a linear draft
        is its own."""
        if self.parents is None:
            return self
        path = [0]  # token 0 has no earlier parent: it follows the committed tokens
        for i, parent in enumerate(self.parents.tolist()):
            if i and parent == path[-1]:  # the first child of the branch's last token
                path.append(i)
        if not self.confidence:
            return Draft(self.tokens[path])
        survival = list(accumulate(self.confidence, mul))  # path probability of each token
        confidence = tuple(survival[i] / (survival[path[j - 1]] if j else 1.0) for j, i in enumerate(path))
        return Draft(self.tokens[path], confidence=confidence)

    def followed_by(self, other: "Draft") -> "Draft":
        """This draft's tokens, then `other`'s (both linear and deterministic)."""
        assert self.parents is None is other.parents and not (self.drawn or other.drawn), "linear, deterministic drafts only"
        if not len(other):
            return self
        return Draft(torch.cat([self.tokens, other.tokens]), confidence=self.confidence + other.confidence)

    @staticmethod
    def of(tokens: Sequence[int]) -> "Draft":
        """A deterministic draft (q = None) from a list of ids."""
        return Draft(torch.tensor(list(tokens), dtype=torch.long, device=HOST))

    @staticmethod
    def tree(tokens: Sequence[int], parents: Sequence[int], confidence: Sequence[float] = ()) -> "Draft":
        """A deterministic tree of drafts (see `parents` and `confidence`); a linear draft when the
        tokens form a chain (each one's parent the one before it)."""
        chain = all(parent == i - 1 for i, parent in enumerate(parents))
        ids = torch.tensor(list(tokens), dtype=torch.long, device=HOST)
        links = None if chain else torch.tensor(list(parents), dtype=torch.long, device=HOST)
        return Draft(ids, confidence=tuple(confidence), parents=links)


EMPTY_DRAFT = Draft(torch.empty(0, dtype=torch.long, device=HOST))


def own_outcome(committed: Sequence[int], n_proposed: int, ahead: int) -> tuple[int, int] | None:
    """(proposed, accepted) of a drafter's own tokens in a step whose draft began with `ahead`
    uncommitted tokens before them (`propose_ahead`; 0 for a plain `propose`): `committed` and
    n_proposed count from the step's start. None where those `ahead` tokens were not all accepted
    (the drafter's own were then never judged)."""
    accepted = len(committed) - 1 - ahead
    return None if accepted < 0 else (max(0, n_proposed - ahead), accepted)

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

    # Optional: `close()`, called once when the request ends, for a drafter that holds something
    # beyond itself (a draft model's KV sequence; `engine.close_drafter`).
    # Optional: `propose_ahead(context, ahead, k, keep)`, a linear deterministic draft to follow
    # `context` and then `ahead`, tokens drafted before it that are not committed (a grammar's
    # forced text, `constraint`); `commit` then gets the whole draft's length, `ahead` included.


class NullDrafter:
    """Proposes nothing: with it the engine decodes autoregressively (the `ar` method)."""

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        return EMPTY_DRAFT

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        pass
