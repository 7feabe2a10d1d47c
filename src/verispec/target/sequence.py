"""One sequence on a target: the per-request forward interface the engine and drafters use.

Owns `TargetSequence`: what one request holds on a loaded `model.Target` -- its state on the
target's backend (`backends.SequenceState`: its KV cache, the residual stream captured for an
early-exit drafter, the last tree of drafts) -- and the calls that run the model over it:
`reset`, `forward`, `crop`, `forward_tree`, `keep_path`, `hidden_states`, `exit_states`,
`capture_exit`. Each is its backend's (`backends`): a sequence never asks which backend it runs
on. Several sequences of one target live side by side (the batch engine's requests, a draft
model per request); a `Target` has one of its own for the single-request API (`Target.forward`
and friends are its). Everything about the model itself (its head, pool, tokenizer, facts,
attachments) is the target's: a sequence reads it through attribute delegation, so drafters
take a sequence wherever they took a target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from .backends import SequenceState

if TYPE_CHECKING:
    from .lazy_logits import LazyRows


class TargetSequence:
    """One request's state on `target` (see the module docstring). Call `reset()` before each
    request and `release()` when it ends (a paged sequence gives its blocks back)."""

    def __init__(self, target):
        self.target = target
        self.backend = target.backend  # the one its state is on (chosen again at each reset)
        self.state: SequenceState | None = None

    def __getattr__(self, name: str):
        """The target's attributes (backend, head, facts, attachments): a sequence is used
        wherever a target is."""
        if name in ("target", "state", "backend"):  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.target, name)

    # -- the request's life ---------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new request: an empty KV cache, no exit-layer capture."""
        previous = self.state if self.backend is self.target.backend else None
        self.release()
        self.backend = self.target.backend
        self.state = self.backend.new_state(previous)

    def release(self) -> None:
        """End the request: its KV memory goes back where it is shared (a paged cache's blocks,
        its full ones to the prefix cache)."""
        if self.state is not None:
            self.backend.release(self.state)
            self.state = None

    @property
    def cache(self):
        """Its KV cache (the backend's kind), or None before `reset`."""
        return None if self.state is None else self.state.cache

    @property
    def paged(self) -> bool:
        """Whether its KV cache sits in the target's block pool."""
        return self.state is not None and self.backend.pages_kv

    @property
    def length(self) -> int:
        """Positions currently in the cache."""
        return self.backend.length(self.state)

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` positions."""
        self.backend.crop(self.state, length)

    # -- forwards ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], last_only: bool = False, lazy: bool = False) -> "torch.Tensor | LazyRows":
        """Append `tokens` to the cache; return logits [n, vocab] (or [1, vocab] if last_only).
        lazy=True may return them as `LazyRows` (the LM head run on the rows a rule reads), where
        that gives the same bits (`Target.logits`). On an empty paged sequence, last_only starts
        from the prefix cache's blocks."""
        assert self.state is not None, "call reset() before forward()"
        assert len(tokens) > 0, "forward needs at least one token"
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.target.device)  # [1, n]
        return self.backend.forward(self.state, ids, last_only, lazy)

    @torch.inference_mode()
    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], lazy: bool = False) -> "torch.Tensor | LazyRows":
        """Run a tree of tokens after the cache in one forward; return logits [m, vocab], row i
        the distribution after row i's path. Row i is a child of row parents[i] (< i) or, for
        -1, follows the cache (the engine's root: the last committed token). Each row's logits
        are those its position would get in a contiguous forward of its path (bit for bit on
        the C layers, which are batch-invariant; to float32 rounding on PyTorch's layers). The
        cache's length is left alone: `keep_path` then keeps one path."""
        assert len(tokens) == len(parents) > 0, "one parent per token"
        return self.backend.forward_tree(self.state, tokens, parents, lazy)

    def keep_path(self, rows: Sequence[int]) -> None:
        """After `forward_tree`: keep `rows` (a path down the tree, from a -1 row, in order) as the
        cache's next positions and drop every other row."""
        self.backend.keep_path(self.state, rows)

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-normed decoder states of `ids` [1, n] -> [n, hidden], appended to the cache.
        With an exit layer set (`capture_exit`), also keeps the residual stream after that many
        layers, for `exit_states`."""
        return self.backend.hidden_states(self.state, ids)

    # -- exit-layer capture (early-exit drafters) -----------------------------------------------
    def exit_states(self, low: int, high: int) -> torch.Tensor:
        """The captured residual stream of positions [low, high): [high - low, hidden]; forgets
        what lies before `low` (an early-exit drafter consumes positions in order)."""
        return self.state.exit_states(low, high, self.target.config.hidden_size, self.target.device)

    def offer_drafted(self, start: int, tokens: Sequence[int], states: torch.Tensor) -> None:
        """An early-exit drafter ran the first `capture_exit` layers for `tokens` at positions
        start.. of this cache, with residual stream `states` [m, hidden]: the verify that follows
        takes those rows instead of recomputing them where the layers are batch-invariant
        (`backends.SequenceState.offer_drafted`)."""
        self.state.offer_drafted(start, tokens, states)

    def capture_exit(self, layer: int) -> None:
        """Keep the residual stream after `layer` layers of every forward (for early-exit
        drafters). Cleared by `reset()`."""
        self.state.capture_layer = layer
