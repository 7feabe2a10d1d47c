"""One sequence on a target: its KV cache and the per-request forward interface the engine uses.

Owns `TargetSequence`: what one request holds on a loaded `model.Target` -- its KV cache (a paged
sequence in the target's block pool on the C layers, a contiguous `StaticKV` on the fast path's
PyTorch layers, transformers' cache on its own forward), the residual stream captured for an
early-exit drafter, the slots of the last tree of drafts -- and the calls that run the model
over it: `reset`, `forward`, `crop`, `forward_tree`, `keep_path`, `hidden_states`,
`exit_states`, `capture_exit`. Several sequences of one target live side by side (the batch
engine's requests, a draft model per request); a `Target` has one of its own for the
single-request API (`Target.forward` and friends are its). Everything about the model itself
(its layers, head, pool, tokenizer, facts, attachments) is the target's: a sequence reads it
through attribute delegation, so drafters take a sequence wherever they took a target.

A paged sequence (`kv_pool.PagedKV`) notes the tokens at its positions, so that its full blocks
enter the target's prefix cache (at the start of each forward, when every position below its
length is committed, and when it is released), and a prefill that asks only for the last row's
logits (`forward(prompt, last_only=True)` on an empty sequence) starts from the cached blocks
its prompt begins with. The logits are the same bits either way: the C layers are
batch-invariant, so a cached position holds what recomputing it would write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import lazy_rows, torch_path
from .cache import StaticKV, Tree, cache_length, crop_to, new_cache
from .lazy_rows import LazyRows
from .runtime.kv_pool import PagedKV

if TYPE_CHECKING:
    from .model import Target


class TargetSequence:
    """One request's state on `target` (see the module docstring). Call `reset()` before each
    request and `release()` when it ends (a paged sequence gives its blocks back)."""

    def __init__(self, target: "Target"):
        self.target = target
        self.cache = None
        self._capture_layer = 0
        self._captures: list[tuple[int, torch.Tensor]] = []
        self._tree_slots: tuple[int, list[int]] | None = None  # the last forward_tree's start and slots
        self._tree_ids: list[int] = []  # and its tokens

    def __getattr__(self, name: str):
        """The target's attributes (model, fast path, head, facts, attachments): a sequence is
        used wherever a target is."""
        if name == "target":  # not set yet (during unpickling or a failed __init__)
            raise AttributeError(name)
        return getattr(self.target, name)

    # -- the request's life ---------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new request: an empty KV cache, no exit-layer capture."""
        self.release()
        self._capture_layer = 0
        self._captures = []
        target = self.target
        if target._step is not None:
            target._step.crop(0)
            self.cache = target._step.cache
        elif target._fast is None:
            self.cache = new_cache(target.model)
        elif target.pages_kv:
            self.cache = PagedKV(target.pool)
        elif isinstance(self.cache, StaticKV):
            self.cache.crop(0)  # reuse the allocation
        else:
            self.cache = target._fast.new_cache()

    def release(self) -> None:
        """End the request: a paged cache gives its blocks back (its full ones to the prefix cache)."""
        if isinstance(self.cache, PagedKV):
            self.cache.release()
            self.cache = None

    @property
    def paged(self) -> bool:
        return isinstance(self.cache, PagedKV)

    @property
    def length(self) -> int:
        """Positions currently in the cache."""
        if self.target._step is not None:
            return self.target._step.length
        return self.cache.length if self.target._fast is not None else cache_length(self.cache)

    def crop(self, length: int) -> None:
        """Roll the cache back to its first `length` positions."""
        if self.target._step is not None:
            self.target._step.crop(length)
        elif self.target._fast is not None:
            self.cache.crop(length)
        else:
            crop_to(self.cache, length)

    # -- forwards ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], last_only: bool = False, lazy: bool = False) -> "torch.Tensor | LazyRows":
        """Append `tokens` to the cache; return logits [n, vocab] (or [1, vocab] if last_only).
        lazy=True may return them as `LazyRows` (the LM head run on the rows a rule reads), where
        that gives the same bits (`Target._logits`). On an empty paged sequence, last_only
        starts from the prefix cache's blocks (see the module docstring)."""
        assert self.cache is not None, "call reset() before forward()"
        assert len(tokens) > 0, "forward needs at least one token"
        target = self.target
        if last_only and self.paged and self.cache.length == 0 and not self._capture_layer:
            skip = self.cache.start_from_cache(tokens)
            tokens = tokens[skip:]
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=target.device)  # [1, n]
        if target._fast is None:  # the PyTorch path: transformers' forward, or the compiled step
            return torch_path.forward(self, ids, last_only)
        if lazy and not last_only and target._batch_invariant(ids.shape[1], layers=True):
            return self._staged(ids)
        hidden = self.hidden_states(ids)  # [n, hidden]
        return target._head(hidden[-1:]) if last_only else target._logits(hidden, lazy)

    def _staged(self, ids: torch.Tensor) -> LazyRows:
        """A verify forward of `ids` [1, n] in two parts (`_in_two_parts`): the first
        `lazy_rows.FIRST` tokens run now (appended to the cache, their logits computed), the
        rest only when a rule reads one of their rows (appended then, after the first part). A
        rule that stops at a rejection within the first part never pays the layers or the head
        for the rest. The same bits as one forward: the C layers and the int8 head are
        batch-invariant, and the rest's positions see the first part's keys in the cache."""
        start = self.cache.length
        head = self.target._head
        return self._in_two_parts(ids.shape[1], lambda begin, end: head(self.hidden_states(ids[:, begin:end])),
                                  lambda begin: self.cache.length == start + begin)

    def _in_two_parts(self, n: int, part: Callable[[int, int], torch.Tensor],
                      unmoved: Callable[[int], bool]) -> LazyRows:
        """`LazyRows` of n rows whose chunks are `part(begin, end)` -> [end - begin, vocab]: the
        first computed now, the rest when a rule first reads one of its rows, which it must do
        before the cache moves (`unmoved(begin)`: the cache is as the first part left it)."""
        first = part(0, lazy_rows.FIRST)  # [FIRST, vocab]

        def compute(begin: int, end: int) -> torch.Tensor:
            if begin == 0:
                return first
            assert unmoved(begin), "a staged verify's rows are read before the cache moves"
            with torch.inference_mode():  # called by the rule, after the forward returned
                return part(begin, end)

        return LazyRows(n, compute, (self.target.vocab_size,), self.target.device, torch.float32)

    @torch.inference_mode()
    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], lazy: bool = False) -> "torch.Tensor | LazyRows":
        """Run a tree of tokens after the cache in one forward; return logits [m, vocab], row i
        the distribution after row i's path. Row i is a child of row parents[i] (< i) or, for
        -1, follows the cache (the engine's root: the last committed token). Placement:
        `Tree.of_parents` (the primary branch at its own positions, the other rows in scratch
        slots). Each row's logits are those its position would get in a contiguous forward of
        its path (bit for bit on the C layers, which are batch-invariant; to float32 rounding on
        the PyTorch layers, which are not). The cache's length is left alone: `keep_path` then
        keeps one path. `lazy`: as in `forward`; where every layer is in C, the tree is staged
        as a linear verify is: rows 0..FIRST-1 run now, the others through the layers and the
        head only if a rule reads one of their rows (`_staged_tree`)."""
        target = self.target
        fast = target._fast
        assert not self._capture_layer, "tree verification does not capture exit states"
        assert len(tokens) == len(parents) > 0, "one parent per token"
        if fast is None:  # the PyTorch path: rows appended in order under a custom mask
            return torch_path.forward_tree(self, tokens, parents)
        start = self.cache.length
        self._prepare_write()
        tree = Tree.of_parents(start, parents, target.device)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=target.device)  # [m]
        self._tree_slots, self._tree_ids = (start, tree.slots.tolist()), list(tokens)
        if lazy and target._batch_invariant(len(tokens), layers=True):
            return self._staged_tree(ids, tree, start)
        x = fast.run(fast.embed(ids), start, self.cache, tree=tree)
        return target._logits(fast.norm(x), lazy)

    def _staged_tree(self, ids: torch.Tensor, tree: Tree, start: int) -> LazyRows:
        """A tree verify of `ids` [m] placed by `tree`, in two parts (`_in_two_parts`): rows
        0..FIRST-1 now, the rest when a rule first reads one of them. The rows come by decreasing
        path probability with every ancestor before its children, so a walk that stops in the
        first rows never pays for the others. The same bits as one call: each row is computed
        on its own through the C layers and the int8 head, and the rest's rows see their
        ancestors' keys and values, which the first part wrote to their slots (`Tree.rows`)."""
        tree_slots = self._tree_slots  # this tree's, set by forward_tree
        fast, head = self.target._fast, self.target._head

        def part(begin: int, end: int) -> torch.Tensor:  # -> [end - begin, vocab]
            x = fast.run(fast.embed(ids[begin:end]), start, self.cache, tree=tree.rows(begin, end))
            return head(fast.norm(x))

        # unmoved: no other tree ran and no path was kept since (`keep_path` grows the cache)
        return self._in_two_parts(ids.shape[0], part,
                                  lambda begin: self._tree_slots is tree_slots and self.cache.length == start)

    def keep_path(self, rows: Sequence[int]) -> None:
        """After `forward_tree`: keep `rows` (a path down the tree, from a -1 row, in order) as the
        cache's next positions and drop every other row: the keys and values of a row held in a
        scratch slot are copied to its position (a primary-branch row is already there;
        `StaticKV.keep_slots`, `PagedKV.keep_slots`)."""
        if self.target._fast is None:
            return torch_path.keep_tree(self, rows)
        start, slots = self._tree_slots
        assert self.cache.length == start, "keep_path must follow the forward_tree it keeps a path of"
        if self.paged:
            self.cache.note_tokens(start, [self._tree_ids[row] for row in rows])
        self.cache.keep_slots(start, [slots[row] for row in rows])

    def _prepare_write(self) -> None:
        """Before a forward writes past the cache's length: on a paged cache, every position
        below the length is committed, so its full blocks enter the prefix cache now."""
        if self.paged:
            self.cache.cache_full_blocks()

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        """Final-normed decoder states of `ids` [1, n] -> [n, hidden], appended to the cache.
        With an exit layer set (`capture_exit`), also keeps the residual stream after that many
        layers, for `exit_states`."""
        target = self.target
        fast = target._fast
        if fast is None:
            return torch_path.hidden_states(self, ids)
        start, n = self.cache.length, ids.shape[1]
        self._prepare_write()
        x = fast.embed(ids[0])  # [n, hidden]
        if self._capture_layer:
            rope: dict = {}  # rotary tables, computed once for both halves
            x = fast.run(x, start, self.cache, range(self._capture_layer), rope=rope)
            self._trim_captures(start)
            self._captures.append((start, x))
            x = fast.run(x, start, self.cache, range(self._capture_layer, len(fast.layers)), rope=rope)
        else:
            x = fast.run(x, start, self.cache)
        if self.paged:
            self.cache.note_tokens(start, ids[0].tolist())
        self.cache.length = start + n
        return fast.norm(x)

    # -- exit-layer capture (early-exit drafters) -----------------------------------------------
    def _trim_captures(self, start: int) -> None:
        """Drop captured rows at positions >= `start` (rolled back before this forward). Captures
        are ordered by position and do not overlap, so only the last ones can be affected: a
        step costs O(1), not O(captures)."""
        while self._captures and self._captures[-1][0] >= start:
            self._captures.pop()
        if self._captures:
            position, states = self._captures[-1]
            if position + states.shape[0] > start:
                self._captures[-1] = (position, states[: start - position])

    def exit_states(self, low: int, high: int) -> torch.Tensor:
        """The captured residual stream of positions [low, high): [high - low, hidden]; forgets
        what lies before `low` (an early-exit drafter consumes positions in order)."""
        self._captures = [(p, t) for p, t in self._captures if p + t.shape[0] > low]
        rows = [t[max(0, low - p) : high - p] for p, t in self._captures if p < high]
        states = torch.cat(rows) if rows else torch.empty(0, self.target.config.hidden_size, device=self.target.device)
        assert states.shape[0] == high - low, f"positions {low}..{high} were not captured"
        return states

    def capture_exit(self, layer: int) -> None:
        """Keep the residual stream after `layer` layers of every forward (for early-exit
        drafters; on the PyTorch path through a forward hook, `torch_path`). Cleared by `reset()`."""
        self._capture_layer = layer
