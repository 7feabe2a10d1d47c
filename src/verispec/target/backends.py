"""How a target's decoder runs: one backend object per way of running it.

Owns the `Backend` interface and its implementations, and `SequenceState`, what one sequence
holds on a backend. A backend owns every sequence's KV cache and computes over it:

  new_state()                         an empty sequence (a fresh KV cache; `reset` reuses one)
  release(state)                      its KV memory given back
  length(state) / crop(state, n)      positions in the cache / roll back to the first n
  forward(state, ids, last_only, lazy)   ids [1, n] appended -> logits [n or 1, vocab]
  hidden_states(state, ids)           ids [1, n] appended -> final-normed states [n, hidden]
  forward_tree(state, tokens, parents, lazy) -> logits [m, vocab]; keep_path(state, rows)
  verifies_trees, pages_kv, pool, forward_parts(parts)   (the paged backend's batch)

`model.Target` holds a model's identity (config, tokenizer, LM head) and one backend;
`sequence.TargetSequence` calls its backend for everything and never asks which one it is. An
exit layer's residual stream (EESD) is kept in the state (`capture_layer`, `captures`) by every
backend. The implementations:

- `TorchBackend`: transformers' own forward on any device, a DynamicCache per sequence; trees and
  beams under custom attention masks (`torch_path`).
- `CompiledBackend`: the same, with the `torch.compile`d one-token CUDA step over one static cache
  (`device.CompiledStep`; one sequence at a time).
- `StaticBackend`: a decoder of the fast path (`runtime.fastpath.FastDecoder`: its own layer loop,
  prepacked or block-kernel linears, C layers where they exist) over a contiguous `StaticKV` per
  sequence.
- `PagedBackend`: a decoder whose every layer runs in C over paged KV (`runtime.kv_pool`): every
  sequence's blocks in one pool, the exact prefix cache, and many sequences' rows in one forward
  (`forward_parts`); each row's logits are the bits it gets alone (batch invariance).

A new way of running the target is one more class here (or a decoder with `FastDecoder`'s
`embed`/`run`/`run_rows`/`norm` for the decoder backends), chosen in `model.Target`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import lazy_logits, torch_path
from .shared_forward import Part, wanted_rows
from .hf_cache import cache_length, crop_to, new_cache
from ..runtime.static_kv import StaticKV, Tree
from .lazy_logits import LazyRows
from ..runtime.kv_pool import PagedKV
from ..runtime.rows import Rows

# Numerics whose C layers are batch-invariant at every width (`DecoderBackend.reuses_drafted`)
BATCH_INVARIANT_NUMERICS = ("int8", "gguf")


@dataclass
class SequenceState:
    """One sequence on a backend: its KV cache, the exit-layer capture, the last tree's placement."""

    cache: object = None
    capture_layer: int = 0  # keep the residual stream after this many layers (0: none)
    captures: list = field(default_factory=list)  # [(first position, states [n, hidden])], by position
    tree: tuple[int, list[int], list[int]] | None = None  # the last forward_tree's (start, slots, ids)
    recording: object = None  # what a `recorder.StateRecorder` kept of this sequence's rows
    # An early-exit draft's rows of layers 0..capture_layer-1, already in the cache: (their first
    # position, their tokens, the residual stream after those layers [m, hidden]); see `offer_drafted`
    drafted: tuple[int, list[int], torch.Tensor] | None = None

    def keep_capture(self, start: int, states: torch.Tensor | None) -> None:
        """The residual stream of positions start.. (captured by a forward): rows captured at or
        past `start` earlier were rolled back and go first. Captures are ordered by position and
        do not overlap, so only the last ones can be affected: O(1) a step."""
        if states is None:
            return
        while self.captures and self.captures[-1][0] >= start:
            self.captures.pop()
        if self.captures:
            position, kept = self.captures[-1]
            if position + kept.shape[0] > start:
                self.captures[-1] = (position, kept[: start - position])
        self.captures.append((start, states))

    def offer_drafted(self, start: int, tokens: Sequence[int], states: torch.Tensor) -> None:
        """A drafter ran layers 0..capture_layer-1 for `tokens` at positions start.. in this
        sequence's cache (past its length), leaving their residual stream `states` [m, hidden]:
        the next forward from `start` may take them instead of recomputing (`take_drafted`)."""
        assert states.shape[0] == len(tokens), "one state per drafted token"
        self.drafted = (start, list(tokens), states) if len(tokens) else None

    def take_drafted(self, start: int, ids: Sequence[int]) -> torch.Tensor | None:
        """The offered states of the longest prefix of `ids` (a forward from position `start`)
        whose tokens are the drafted ones at the same positions: [j, hidden], or None. What is
        left of the offer stays for the forward that continues it (a verify run in two parts)
        only if every row of this one matched; any other forward, and any crop, ends the offer."""
        offer, self.drafted = self.drafted, None
        if offer is None or offer[0] != start:
            return None
        _, tokens, states = offer
        j = 0
        while j < min(len(ids), len(tokens)) and ids[j] == tokens[j]:
            j += 1
        if j == len(ids) and j < len(tokens):
            self.drafted = (start + j, tokens[j:], states[j:])
        return states[:j] if j else None

    def exit_states(self, low: int, high: int, hidden: int, device) -> torch.Tensor:
        """The captured residual stream of positions [low, high): [high - low, hidden]; forgets
        what lies before `low` (an early-exit drafter consumes positions in order)."""
        self.captures = [(p, t) for p, t in self.captures if p + t.shape[0] > low]
        rows = [t[max(0, low - p) : high - p] for p, t in self.captures if p < high]
        states = torch.cat(rows) if rows else torch.empty(0, hidden, device=device)
        assert states.shape[0] == high - low, f"positions {low}..{high} were not captured"
        return states


class Backend:
    """The interface (see the module docstring). `target` gives the LM head and the device."""

    verifies_trees = True
    pages_kv = False
    pool = None

    def __init__(self, target):
        self.target = target

    def new_state(self, previous: SequenceState | None = None) -> SequenceState:
        raise NotImplementedError

    def release(self, state: SequenceState) -> None:
        """Give the sequence's KV memory back (a no-op where it is not shared)."""

    def length(self, state: SequenceState) -> int:
        raise NotImplementedError

    def crop(self, state: SequenceState, length: int) -> None:
        raise NotImplementedError

    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool, lazy: bool):
        raise NotImplementedError

    def hidden_states(self, state: SequenceState, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_tree(self, state: SequenceState, tokens: Sequence[int], parents: Sequence[int], lazy: bool):
        raise NotImplementedError

    def keep_path(self, state: SequenceState, rows: Sequence[int]) -> None:
        raise NotImplementedError

    def forward_parts(self, parts: list[Part]) -> list:
        raise NotImplementedError(f"{type(self).__name__} runs one sequence per forward")


# -- transformers' own forward ---------------------------------------------------------------------

class TorchBackend(Backend):
    """transformers' forward through the model's own modules, a DynamicCache per sequence."""

    def __init__(self, target):
        super().__init__(target)
        self.verifies_trees = torch_path.verifies_trees(target.model)

    def new_state(self, previous: SequenceState | None = None) -> SequenceState:
        return SequenceState(new_cache(self.target.model))

    def _cache(self, state: SequenceState):
        return state.cache

    def length(self, state: SequenceState) -> int:
        return cache_length(state.cache)

    def crop(self, state: SequenceState, length: int) -> None:
        crop_to(state.cache, length)

    def _append(self, state: SequenceState, ids: torch.Tensor, tree: Tree, logits: int | None):
        """ids [n] placed by `tree` through the model over the sequence's cache -> its output
        (`torch_path.through`), keeping the exit layer's states."""
        target = self.target
        out, captured = torch_path.through(target.model, target.decoder_body, target.head, self._cache(state), ids,
                                           tree, capture=state.capture_layer, logits=logits)
        if tree.slots is None:
            state.keep_capture(int(tree.positions[0]), captured)
        self._appended(ids.shape[0])
        return out

    def _appended(self, n: int) -> None:
        """`n` rows went into the cache (the compiled step moves its own length)."""

    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool, lazy: bool):
        start = self.length(state)
        tree = torch_path.contiguous(start, ids.shape[1], self.target.device)
        return self.target.ready(self._append(state, ids[0], tree, 1 if last_only else 0))

    def hidden_states(self, state: SequenceState, ids: torch.Tensor) -> torch.Tensor:
        start = self.length(state)
        return self._append(state, ids[0], torch_path.contiguous(start, ids.shape[1], self.target.device), None)

    def forward_tree(self, state: SequenceState, tokens: Sequence[int], parents: Sequence[int], lazy: bool):
        """The rows appended in row order, each at its depth's position under a custom mask."""
        assert not state.capture_layer, "tree verification does not capture exit states"
        torch_path.parts(self.target.model, "tree verification")
        start = self.length(state)
        tree = torch_path.append_tree(start, parents, self.target.device)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.target.device)  # [m]
        state.tree = (start, list(range(len(tokens))), list(tokens))
        return self.target.ready(self._append(state, ids, tree, 0))

    def keep_path(self, state: SequenceState, rows: Sequence[int]) -> None:
        start, slots, _ = state.tree
        torch_path.keep_rows(self._cache(state), start, len(slots), rows)
        self._kept(start + len(rows))
        state.tree = None

    def _kept(self, length: int) -> None:
        """A tree's path was kept: the cache now holds `length` positions."""


class CompiledBackend(TorchBackend):
    """`TorchBackend` with the compiled one-token CUDA step (`device.CompiledStep`) over its
    static cache, which every sequence of the target shares (one request at a time)."""

    def __init__(self, target, step):
        super().__init__(target)
        self.step = step

    def new_state(self, previous: SequenceState | None = None) -> SequenceState:
        self.step.crop(0)
        return SequenceState(self.step.cache)

    def length(self, state: SequenceState) -> int:
        return self.step.length

    def crop(self, state: SequenceState, length: int) -> None:
        self.step.crop(length)

    def _appended(self, n: int) -> None:
        self.step.length += n

    def _kept(self, length: int) -> None:
        self.step.length = length

    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool, lazy: bool):
        """The compiled step, unless exit states are captured (hooks do not run in a CUDA graph)."""
        if state.capture_layer:
            return super().forward(state, ids, last_only, lazy)
        return self.target.ready(self.step.forward(ids, last_only))


# -- the fast path's decoders ------------------------------------------------------------------

class DecoderBackend(Backend):
    """A decoder of the fast path (`FastDecoder`'s interface: `embed`, `run`, `norm`) over the
    caches its subclass makes; the LM head is the target's."""

    def __init__(self, target, decoder):
        super().__init__(target)
        self.decoder = decoder

    def length(self, state: SequenceState) -> int:
        return state.cache.length

    def crop(self, state: SequenceState, length: int) -> None:
        state.drafted = None
        state.cache.crop(length)

    def reuses_drafted(self) -> bool:
        """Whether a forward may take a draft's rows of the first layers as they are
        (`SequenceState.take_drafted`): where the layers are batch-invariant, the drafter's rows
        and the keys they wrote are the bits this forward would compute."""
        return self.batch_invariant()

    def batch_invariant(self) -> bool:
        """Whether every layer runs in C in numerics where a row's result does not depend on the
        rows sharing its call, at any width (int8 activations, or a GGUF file's blocks). (The
        fp32 block path is not: its C layers' sums depend on the width, by about 1e-5.)"""
        decoder = self.decoder
        return (decoder.use_native and decoder.native_layers == len(decoder.layers)
                and decoder.numerics in BATCH_INVARIANT_NUMERICS)

    def _before_write(self, state: SequenceState) -> None:
        """A forward is about to write past the cache's length."""

    def _wrote(self, state: SequenceState, start: int, ids: Sequence[int]) -> None:
        """`ids` now sit at positions start.. of the cache."""

    @torch.inference_mode()
    def hidden_states(self, state: SequenceState, ids: torch.Tensor) -> torch.Tensor:
        decoder, cache = self.decoder, state.cache
        start, n = cache.length, ids.shape[1]
        self._before_write(state)
        x = decoder.embed(ids[0])  # [n, hidden]
        if state.capture_layer:
            first = range(state.capture_layer)
            drafted = None
            if state.drafted is not None:  # a draft's rows were offered (no list made otherwise)
                if self.reuses_drafted():
                    drafted = state.take_drafted(start, ids[0].tolist())
                else:
                    state.drafted = None
            if drafted is None:
                rope: dict = {}  # rotary tables, computed once for both halves
                x = decoder.run(x, start, cache, first, rope=rope)
            else:  # the draft's rows of the first layers (and their keys) are already there: the rest only
                j = drafted.shape[0]
                rope = {}
                x = torch.cat([drafted, decoder.run(x[j:], start + j, cache, first)]) if j < n else drafted
            state.keep_capture(start, x)
            x = decoder.run(x, start, cache, range(state.capture_layer, len(decoder.layers)), rope=rope)
        else:
            x = decoder.run(x, start, cache)
        self._wrote(state, start, ids[0].tolist())
        cache.length = start + n
        return decoder.norm(x)

    @torch.inference_mode()
    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool, lazy: bool):
        target = self.target
        if lazy and not last_only and target.batch_invariant(ids.shape[1], layers=True):
            return self._staged(state, ids)
        hidden = self.hidden_states(state, ids)  # [n, hidden]
        return target.head(hidden[-1:]) if last_only else target.logits(hidden, lazy)

    def _staged(self, state: SequenceState, ids: torch.Tensor) -> LazyRows:
        """A verify of `ids` [1, n] in two parts (`_in_two_parts`): the first `lazy_logits.FIRST`
        tokens now, the rest only when a rule reads one of their rows. The same bits as one
        forward: the C layers and the int8 head are batch-invariant, and the rest's positions see
        the first part's keys in the cache."""
        start = state.cache.length
        head = self.target.head
        return self._in_two_parts(ids.shape[1], lambda begin, end: head(self.hidden_states(state, ids[:, begin:end])),
                                  lambda begin: state.cache.length == start + begin)

    def _in_two_parts(self, n: int, part: Callable[[int, int], torch.Tensor],
                      unmoved: Callable[[int], bool]) -> LazyRows:
        """`LazyRows` of n rows whose chunks are `part(begin, end)` -> [end - begin, vocab]: the
        first computed now, the rest when a rule first reads one of its rows, which it must do
        before the cache moves (`unmoved(begin)`)."""
        first = part(0, lazy_logits.FIRST)  # [FIRST, vocab]

        def compute(begin: int, end: int) -> torch.Tensor:
            if begin == 0:
                return first
            assert unmoved(begin), "a staged verify's rows are read before the cache moves"
            with torch.inference_mode():  # called by the rule, after the forward returned
                return part(begin, end)

        return LazyRows(n, compute, (self.target.vocab_size,), self.target.device, torch.float32)

    @torch.inference_mode()
    def forward_tree(self, state: SequenceState, tokens: Sequence[int], parents: Sequence[int], lazy: bool):
        """The tree placed by `Tree.of_parents` (the primary branch at its positions, the other
        rows in scratch slots); where every layer is in C and `lazy`, staged as a linear verify is."""
        assert not state.capture_layer, "tree verification does not capture exit states"
        state.drafted = None
        target, decoder, cache = self.target, self.decoder, state.cache
        start = cache.length
        self._before_write(state)
        tree = Tree.of_parents(start, parents, target.device)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=target.device)  # [m]
        state.tree = (start, tree.slots.tolist(), list(tokens))
        if lazy and target.batch_invariant(len(tokens), layers=True):
            pending = state.tree

            def part(begin: int, end: int) -> torch.Tensor:  # -> [end - begin, vocab]
                x = decoder.run(decoder.embed(ids[begin:end]), start, cache, tree=tree.rows(begin, end))
                return target.head(decoder.norm(x))

            # unmoved: no other tree ran and no path was kept since (`keep_path` grows the cache)
            return self._in_two_parts(len(tokens), part,
                                      lambda begin: state.tree is pending and cache.length == start)
        x = decoder.run(decoder.embed(ids), start, cache, tree=tree)
        return target.logits(decoder.norm(x), lazy)

    def keep_path(self, state: SequenceState, rows: Sequence[int]) -> None:
        """Keep `rows` (a path down the last tree) as the next positions: entries in scratch
        slots are copied to their positions."""
        start, slots, ids = state.tree
        assert state.cache.length == start, "keep_path must follow the forward_tree it keeps a path of"
        self._wrote(state, start, [ids[row] for row in rows])
        state.cache.keep_slots(start, [slots[row] for row in rows])


class StaticBackend(DecoderBackend):
    """A fast-path decoder over a contiguous `StaticKV` per sequence (reused across requests)."""

    def new_state(self, previous: SequenceState | None = None) -> SequenceState:
        if previous is not None and isinstance(previous.cache, StaticKV):
            previous.cache.crop(0)  # reuse the allocation
            return SequenceState(previous.cache)
        return SequenceState(self.decoder.new_cache())


class PagedBackend(DecoderBackend):
    """A decoder whose layers all run in C over paged KV in one block pool (see the module
    docstring). A sequence notes the tokens at its positions so that its full blocks enter the
    prefix cache (before each write, when every position below its length is committed, and when
    released); a prefill asking for the last row's logits only starts from the cached blocks its
    prompt begins with: the same bits, since a cached position holds what recomputing it writes."""

    pages_kv = True

    def __init__(self, target, decoder, make_pool: Callable[[], object]):
        super().__init__(target, decoder)
        self._make_pool = make_pool
        self._pool = None

    @property
    def pool(self):
        """The block pool, made at first use (`make_pool`, from the target's `kv_memory`)."""
        if self._pool is None:
            self._pool = self._make_pool()
        return self._pool

    def drop_pool(self) -> None:
        """Forget the pool (its size changes); no sequence may hold blocks of it."""
        self._pool = None

    @property
    def has_pool(self) -> bool:
        return self._pool is not None

    def new_state(self, previous: SequenceState | None = None) -> SequenceState:
        return SequenceState(PagedKV(self.pool))

    def release(self, state: SequenceState) -> None:
        state.cache.release()

    def _before_write(self, state: SequenceState) -> None:
        state.cache.cache_full_blocks()

    def _wrote(self, state: SequenceState, start: int, ids: Sequence[int]) -> None:
        state.cache.note_tokens(start, ids)

    def forward(self, state: SequenceState, ids: torch.Tensor, last_only: bool, lazy: bool):
        if last_only and state.cache.length == 0 and not state.capture_layer:
            skip = state.cache.start_from_cache(ids[0].tolist())
            ids = ids[:, skip:]
        return super().forward(state, ids, last_only, lazy)

    @torch.inference_mode()
    def forward_parts(self, parts: list[Part]) -> list:
        """One forward over several paged sequences' rows (see `shared_forward`); with a
        `recorder.StateRecorder` attached to the target (and batch-invariant layers), the
        contiguous parts' rows are kept in it."""
        decoder = self.decoder
        assert parts and all(part.sequence.backend is self for part in parts)
        assert len({id(part.sequence) for part in parts}) == len(parts), "one part per sequence"
        recorder = self.target.recorder if self.batch_invariant() else None
        placed = [self.prepare(part) for part in parts]
        ids = torch.tensor([token for part in parts for token in part.tokens], dtype=torch.long)  # [N]
        rows = Rows.concat([rows for _, rows in placed])
        x, done, exits = decoder.embed(ids), 0, {}  # x [N, hidden]
        for layer in recorder.layers if recorder is not None else ():
            x = decoder.run_rows(x, rows, self.pool, range(done, layer))
            exits[layer], done = x.clone(), layer  # [N, hidden] (the next layers write x in place)
        x = decoder.run_rows(x, rows, self.pool, range(done, len(decoder.layers)))  # [N, hidden]
        wanted = wanted_rows(parts)
        flat = [row for rows_of_part in wanted for row in rows_of_part]
        logits = self.target.head(decoder.norm(x[flat])) if flat else None  # [len(flat), vocab]
        results, offset, row = [], 0, 0
        for part, (tree, _), rows_of_part in zip(parts, placed, wanted):
            state, n = part.sequence.state, len(part.tokens)
            if part.parents is None:
                if recorder is not None:
                    recorder.write(state, state.cache.length, part.tokens,
                                   {layer: kept[row : row + n] for layer, kept in exits.items()},
                                   decoder.norm(x[row : row + n]))
                if part.prefix_cache:
                    self._wrote(state, state.cache.length, list(part.tokens))
                state.cache.length += n
            else:
                state.tree = (state.cache.length, tree.slots.tolist(), list(part.tokens))
            results.append(logits[offset : offset + len(rows_of_part)] if rows_of_part else None)
            offset += len(rows_of_part)
            row += n
        return results

    def prepare(self, part: Part):
        """Place `part`'s rows after its sequence's cache, blocks reserved (may raise
        `kv_pool.PoolExhausted` before anything is written), and describe them for the C layers."""
        state = part.sequence.state
        state.drafted = None  # a batched forward runs every layer for its rows
        cache = state.cache
        start, n = cache.length, len(part.tokens)
        if part.prefix_cache:
            self._before_write(state)
        if part.parents is None:
            tree = Tree.contiguous(start, n)
        else:
            assert len(part.parents) == n, "one parent per token"
            tree = Tree.of_parents(start, part.parents)
        cache.reserve(tree.end)
        return tree, tree.c_rows(cache.block_table, cache.pool_blocks)
