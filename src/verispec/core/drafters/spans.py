"""Longest-match copying for ANPD: token streams, and where each short n-gram of them ended.

Owns `SpanIndex`: the token streams of requests (the current one, and with ANPD's memory across
requests the earlier ones too) and an index from every `key`-token n-gram to the most recent
positions where it ended. `longest(stream)` finds, among those positions, the one whose preceding
tokens agree with the end of a stream for the longest run (compared backwards, up to `max_back`
tokens), so that a draft can copy what followed it. N-gram tables see at most max_n - 1 tokens of
context; this sees up to `max_back`, which is what tells a copy of text seen before (a function
being rewritten, a conversation re-sent) from a coincidental short match, and the drafter trusts
the copy according to that length. SuffixDecoding's suffix trees find the same longest match;
this keeps a bounded list of candidate positions per key instead of a tree.

Cost: indexing a token is one dict update; a look-up compares at most `per_key` candidates
backwards, O(per_key * max_back) token comparisons. Bounds: at most `max_tokens` tokens over all
streams (the oldest other stream out first; index entries that point into a stream that is gone
are skipped when met), at most `max_keys` keys (least recently written out), and `per_key`
positions per key (the most recent).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import count
from typing import Sequence

from ...errors import ConfigError


@dataclass(frozen=True)
class Span:
    """A match: `stream[start:]` followed `length` tokens equal to the end of the stream looked up."""

    stream: array  # of int32 token ids
    start: int
    length: int
    other: bool  # found in another stream than the one looked up (an earlier request)

    def tokens(self, k: int) -> list[int]:
        """The first k tokens that followed the match (fewer where its stream ends)."""
        return self.stream[self.start : self.start + k].tolist()


class SpanIndex:
    """Token streams and the index of their `key`-token n-grams (pure: no torch, no model)."""

    def __init__(self, key: int = 4, per_key: int = 8, max_back: int = 32, max_tokens: int = 1 << 18,
                 max_keys: int = 1 << 16):
        if not (1 <= key <= max_back) or per_key < 1 or max_tokens < 1 or max_keys < 1:
            raise ConfigError(f"span index bounds need 1 <= key <= max_back and positive limits, got key={key}, "
                              f"per_key={per_key}, max_back={max_back}, max_tokens={max_tokens}, max_keys={max_keys}")
        self.key, self.per_key, self.max_back = key, per_key, max_back
        self.max_tokens, self.max_keys = max_tokens, max_keys
        self._streams: OrderedDict[int, array] = OrderedDict()  # oldest first; int32 token ids
        # key (the n-gram's int32 bytes) -> its last `per_key` ends, each stream << 32 | end
        self._ends: OrderedDict[bytes, list[int]] = OrderedDict()
        self._ids = count()
        self._total = 0

    @property
    def tokens_held(self) -> int:
        return self._total

    @property
    def keys_held(self) -> int:
        return len(self._ends)

    def new_stream(self) -> int:
        """An empty stream; returns its id for `extend` and `longest`."""
        stream = next(self._ids)
        self._streams[stream] = array("i")
        return stream

    def extend(self, stream: int, tokens: Sequence[int]) -> None:
        """Append tokens to a stream and index the n-gram that each of them ends."""
        tokens_of = self._streams.get(stream)
        if tokens_of is None:  # evicted: nothing more is indexed for it
            return
        for token in tokens:
            tokens_of.append(int(token))
            if len(tokens_of) >= self.key:
                key = tokens_of[-self.key :].tobytes()
                ends = self._ends.get(key)
                if ends is None:
                    ends = self._ends[key] = []
                    if len(self._ends) > self.max_keys:
                        self._ends.popitem(last=False)
                else:
                    self._ends.move_to_end(key)
                    if len(ends) == self.per_key:
                        del ends[0]
                ends.append(stream << 32 | len(tokens_of))
        self._total += len(tokens)
        while self._total > self.max_tokens and len(self._streams) > 1:
            oldest = next(iter(self._streams))
            if oldest == stream:  # never the stream being written: the next oldest goes
                oldest = next(s for s in self._streams if s != stream)
            self._total -= len(self._streams.pop(oldest))

    def longest(self, stream: int, ahead: Sequence[int] = ()) -> Span | None:
        """The indexed position whose preceding tokens match the end of `stream` longest (at least
        `key` tokens, at most `max_back`), with tokens after it; ties go to the most recent. None
        when the stream's last `key` tokens were never seen followed by anything. `ahead`: tokens
        taken as following the stream for this look-up only (not indexed)."""
        tail = self._streams.get(stream)
        if tail is not None and ahead:
            tail = tail[-self.max_back :] + array("i", ahead)
        if tail is None or len(tail) < self.key:
            return None
        ends = self._ends.get(tail[-self.key :].tobytes())
        best: Span | None = None
        for packed in reversed(ends or ()):
            source, end = packed >> 32, packed & 0xFFFFFFFF
            tokens = self._streams.get(source)
            if tokens is None or end >= len(tokens):  # stream gone, or nothing after the match yet
                continue
            length = self.key
            limit = min(self.max_back, len(tail), end)
            while length < limit and tokens[end - length - 1] == tail[-length - 1]:
                length += 1
            if best is None or length > best.length:
                best = Span(tokens, end, length, source != stream)
        return best
