"""The states a target's batched forwards compute, kept while a recorder is attached.

Owns `StateRecorder`: attached to a target (`recording`), it keeps, for every sequence whose rows
run through the paged backend's shared forward (`backends.PagedBackend.forward_parts`, the path
of `generate_many` and the server), each position's token, its residual stream after each of
`layers` and its final-normed state, in bfloat16 on the host. train-exit attaches one while the
target writes its corpus, so that the forwards that wrote the text also label it, instead of a
second pass over the corpus (`train.exit_head.document_labels`).

Why these are the labels a separate pass computes: the paged backend records only where its
layers are batch-invariant (`DecoderBackend.batch_invariant`: C layers on int8 or a GGUF file's
blocks), where a position's states do not depend on which rows share its forward, so they are
the bits a pass over the same tokens computes (tests/test_corpus.py checks it).

A sequence's record is usable for labelling only if it holds every position from 0 on (`take`).
One that started from the prefix cache (`recording` turns it off while attached), ran elsewhere
(an unbatched job, a tree of drafts) or skipped positions has a gap, and its text is labelled by
the pass instead. A row written again (a draft rejected and rolled back, the position computed
anew) replaces what was kept from its position on.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch


@dataclass
class Recorded:
    """One sequence's states, positions 0..T-1: `tokens` [T], `exits` {layer: [T, hidden]} (the
    residual stream after that many layers), `final` [T, hidden] (final-normed), bfloat16."""

    tokens: list[int]
    exits: dict[int, torch.Tensor]
    final: torch.Tensor


@dataclass
class _Stream:
    """What one sequence wrote, in order: chunks (first position, {layer: rows}, final rows)."""

    tokens: list[int] = field(default_factory=list)
    chunks: list[tuple[int, dict[int, torch.Tensor], torch.Tensor]] = field(default_factory=list)
    gap: bool = False  # a position was never recorded (prefix cache, a tree, another path)

    def write(self, start: int, tokens: Sequence[int], exits: dict[int, torch.Tensor], final: torch.Tensor) -> None:
        if start > len(self.tokens):
            self.gap = True
        elif start < len(self.tokens):  # rolled back: what was kept from `start` on is replaced
            del self.tokens[start:]
            while self.chunks and self.chunks[-1][0] >= start:
                self.chunks.pop()
            if self.chunks:
                first, kept, kept_final = self.chunks[-1]
                keep = start - first
                self.chunks[-1] = (first, {n: rows[:keep] for n, rows in kept.items()}, kept_final[:keep])
        self.tokens.extend(int(t) for t in tokens)
        self.chunks.append((start, exits, final))

    def recorded(self) -> Recorded:
        layers = self.chunks[0][1].keys() if self.chunks else ()
        return Recorded(list(self.tokens), {n: torch.cat([chunk[1][n] for chunk in self.chunks]) for n in layers},
                        torch.cat([chunk[2] for chunk in self.chunks]))


class StateRecorder:
    """Keeps every batched forward's rows per sequence while attached (see the module docstring).
    `layers`: the exit layers whose residual streams are kept (each in 1..layers - 1)."""

    def __init__(self, layers: Sequence[int]):
        self.layers = tuple(sorted(set(int(n) for n in layers)))
        self._streams: list[_Stream] = []

    def write(self, state, start: int, tokens: Sequence[int], exits: dict[int, torch.Tensor],
              final: torch.Tensor) -> None:
        """Rows of `state`'s sequence at positions start.. (a contiguous part of a forward):
        tokens [n], exits {layer: [n, hidden]}, final [n, hidden]."""
        stream = state.recording
        if stream is None:
            stream = state.recording = _Stream()
            self._streams.append(stream)
        stream.write(start, tokens, {n: rows.to(torch.bfloat16) for n, rows in exits.items()},
                     final.to(torch.bfloat16))

    def take(self, ids: Sequence[int]) -> Recorded | None:
        """The states of positions 0..len(ids) - 2 at least (a sequence's last token is never fed
        back), from a record without gaps whose tokens are the start of `ids`; at most len(ids)
        positions. The record is forgotten (its memory freed once the caller lets go). None: no
        such record."""
        ids = [int(t) for t in ids]
        for index in range(len(self._streams) - 1, -1, -1):
            stream = self._streams[index]
            n = len(stream.tokens)
            if not stream.gap and stream.chunks and len(ids) - 1 <= n and stream.tokens[: len(ids)] == ids[:n]:
                del self._streams[index]
                recorded = stream.recorded()
                keep = min(n, len(ids))
                return Recorded(recorded.tokens[:keep], {k: v[:keep] for k, v in recorded.exits.items()},
                                recorded.final[:keep])
        return None


@contextmanager
def recording(target, recorder: StateRecorder) -> Iterator[StateRecorder]:
    """`recorder` attached to `target` (its prefix cache off meanwhile, so that every prompt is
    computed from position 0); both restored on exit."""
    cached = target.prefix_cache
    target.prefix_cache = False
    target.recorder = recorder
    try:
        yield recorder
    finally:
        target.recorder = None
        target.prefix_cache = cached
