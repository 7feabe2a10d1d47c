"""Drafting from the context itself: ANPD's multi-level n-gram tables and prompt lookup.

ANPD (Ou et al., NAACL 2024 industry track) keeps, for every n in min_n..max_n, a table from the
last n-1 tokens to the token that followed them, built from the prompt and updated online with
every committed token. A draft is made by repeated look-up: query the table of the largest n whose
key matches the end of the context, append the prediction, and query again, falling back level by
level down to n = min_n; the draft ends at the first miss or after k tokens.

Long matches (`spans.SpanIndex`, `NgramConfig.span_min`): n-gram tables see only the last
max_n - 1 tokens. Where the context's end also occurred earlier (in this request, or with the
memory below in an earlier one) preceded by at least `span_min` equal tokens, the draft copies
what followed the longest such occurrence instead of chaining look-ups, and each copied token's
confidence kind is the length of the match behind it: text being repeated (code being edited,
a conversation re-sent) is told from a coincidental 4-token match, and drafted as far as it
keeps being accepted.

Which continuation wins when a key was followed by several tokens: the most frequent one; ties go
to the most recently seen (an observation that reaches the best count takes the lead).

Cost and memory: an update touches one key per level and a look-up at most one per level, so both
are O(max_n) = O(1) per token. Memory is bounded two ways: each level keeps at most `max_keys`
keys, evicting the least recently updated (an LRU over writes), and each key keeps at most
`max_candidates` continuation counts, evicting the least frequent non-leading one. The drafter
holds only the last max_n - 1 tokens of the context, not the context.

Memory across requests (`NgramMemory`, on unless `MethodOptions.ngram_memory` is False): one
more set of the same tables per target and n-gram config (`shared_memory`, kept in
`Target.attachments`, so the library, the benchmark and the server all share it), filled with
every earlier and current request's prompt and committed tokens. Each request indexes into it
through a tail of its own, so no n-gram spans two requests. For each draft token the drafter
takes the memory's prediction where it matches a longer n-gram than the request's own tables (or
they miss): text seen before, e.g. the code being edited again, is followed by the longer
context it was seen with; ties go to the request's own tables. The memory also holds the token
streams of the requests for long matches (`NgramMemory.spans`). The memory's tokens and the long
matches carry confidence kinds of their own (`AnpdDrafter`), so the adaptive controller learns
separately how far to trust them, and what it learns of those kinds is kept with the memory
(`NgramMemory.outcomes`), for the next requests. Cost: one more look-up per level, for a token
the own tables do not match at the largest n, and one more update per level for each token
indexed: still O(max_n) per token. Bounds: MEMORY_MAX_KEYS keys per level, with the tables' LRU
over writes and per-key candidate cap; MEMORY_MAX_TOKENS tokens of streams (oldest request out);
at most MEMORY_STORES configs per target (least recently used out).
`base.switch_off_memory` turns it off for a whole target (the server's --no-ngram-memory).

Tree drafts (`AnpdDrafter(tree=N)`, the method option `tree`): the draft branches where the
tables offer several next tokens (a key's other continuations, shorter keys' and the memory's
winners: `tree_options`), grown best first by path probability up to N tokens, and the
target verifies every branch in one forward (`Draft.parents`; see `AnpdDrafter`). Where a long
match is found, its copy is drafted as a single path instead (within the same node budget).

Privacy, in a server: outputs never depend on the memory (every drafted token is verified by
the target, so each output is exactly `ar`'s), but speed does. One user's prompts and outputs
shape the drafts, hence the latency, of another user's request: a client that times its
requests can probe whether some text was seen recently (a timing side channel). Serve with
--no-ngram-memory where users must not learn anything about each other's traffic.

Prompt lookup (`prompt_lookup`, the `pld` baseline) has transformers' semantics: for n from
max_ngram down to 1, find the earliest earlier occurrence of the trailing n-gram and copy what
followed it. It rescans the context on every call (O(context) per step), as the original does.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from typing import Sequence

import numpy as np
import torch

from ...errors import ConfigError
from .base import HOST, Draft, Keep, keep_all, kept_prefix, memory_switched_off, own_outcome, recently_used
from .spans import Span, SpanIndex
from .text_copy import MAX_TAIL, TextCopy

SPAN_KEY = 4  # tokens of the n-grams a long match is looked up by (`SpanIndex.key`)
SPAN_MAX_BACK = 32  # the longest match measured (`SpanIndex.max_back`)
SPAN_BUCKETS = (4, 6, 8, 12, 16, 24, 32)  # match lengths grouped into confidence kinds
# Long-match kinds start from Beta(1 + 2, 1) (mean 0.75), not Beta(1, 1): a copy after 8 or more
# matching tokens was accepted 93-99% of the time (scripts/replay_drafts.py over 16 code-edit and
# 26 Spec-Bench greedy answers), and at 0.5 a fresh request cut its first copies to a token or two.
SPAN_PRIOR_ACCEPTED = 2
# A tree's alternatives (every option after a node but the first) start from Beta(1, 1 + 4) (mean
# 1/6), not Beta(1, 1): in offline replays of 8-node trees (scripts/replay_drafts.py's answers),
# alternatives below an accepted node carried the target's token 9.5% of the time on 26 Spec-Bench
# answers and 11% on 16 code-edit ones, and at 0.5 a fresh request's trees spent their budget on
# bushy, shallow branches. Priors of 2, 4 and 8 rejections replayed within 1% of each other.
ALTERNATIVE_PRIOR_REJECTED = 4
COPY_TAIL = MAX_TAIL + 1  # context tokens a text copy reads: its longest tail and the token before


def text_kind(chars: int, position: int) -> tuple:
    """The confidence kind of draft token `position` (0-based) of a text copy whose match was
    `chars` characters long (both capped: 4 and 3)."""
    return ("text", (min(chars, 4), min(position, 3)), False)


@dataclass
class _Continuations:
    """Counts of the tokens that followed one key, and the current winner."""

    counts: dict[int, int]
    best: int
    best_count: int


class NgramTables:
    """Multi-level n-gram continuation tables (pure: no torch, no model)."""

    def __init__(self, max_n: int = 5, min_n: int = 2, max_keys: int = 1 << 16, max_candidates: int = 8):
        if not (2 <= min_n <= max_n):
            raise ConfigError(f"n-gram orders need 2 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_keys < 1 or max_candidates < 1:
            raise ConfigError("max_keys and max_candidates must be >= 1")
        self.max_n, self.min_n = max_n, min_n
        self.max_keys, self.max_candidates = max_keys, max_candidates
        # level n maps a key of n-1 tokens to its continuations; insertion order = LRU order.
        self._levels: dict[int, OrderedDict[tuple[int, ...], _Continuations]] = {
            n: OrderedDict() for n in range(max_n, min_n - 1, -1)
        }
        self._tail: deque[int] = deque(maxlen=max_n - 1)

    def __len__(self) -> int:
        """Total number of keys over all levels."""
        return sum(len(level) for level in self._levels.values())

    def new_tail(self) -> deque[int]:
        """An empty tail for `extend`: one per stream of tokens indexed into these tables."""
        return deque(maxlen=self.max_n - 1)

    def extend(self, tokens: Sequence[int], tail: deque[int] | None = None) -> None:
        """Index each token as the continuation of the n-1 tokens before it, for every level.

        tail: the stream's own last tokens (from `new_tail`; updated in place), for tables that
        index several streams, e.g. the requests of an `NgramMemory`; default: the tables' own."""
        stream_tail = self._tail if tail is None else tail
        for token in tokens:
            token = int(token)
            before = tuple(stream_tail)
            for n, level in self._levels.items():
                if len(before) >= n - 1:
                    self._observe(level, before[len(before) - (n - 1) :], token)
            stream_tail.append(token)

    def _observe(self, level: OrderedDict, key: tuple[int, ...], token: int) -> None:
        entry = level.get(key)
        if entry is None:
            level[key] = _Continuations({token: 1}, token, 1)
            if len(level) > self.max_keys:
                level.popitem(last=False)
            return
        level.move_to_end(key)
        counts = entry.counts
        if token not in counts and len(counts) >= self.max_candidates:
            others = [t for t in counts if t != entry.best]
            if others:
                del counts[min(others, key=counts.__getitem__)]
            else:  # max_candidates == 1: the newcomer replaces the leader
                counts.clear()
                entry.best_count = 0
        counts[token] = counts.get(token, 0) + 1
        if counts[token] >= entry.best_count:  # ties go to the most recent observation
            entry.best, entry.best_count = token, counts[token]

    def lookup(self, tail: Sequence[int]) -> int | None:
        """The predicted next token after `tail`, from the largest n that matches, or None."""
        match = self.match(tail)
        return None if match is None else match.token

    def match(self, tail: Sequence[int], remembered: bool = False) -> "Match | None":
        """Like `lookup`, also saying which level matched and how often the winner was seen
        (`remembered` is passed through to the match)."""
        for n, level in self._levels.items():
            if len(tail) >= n - 1:
                entry = level.get(tuple(tail[len(tail) - (n - 1) :]))
                if entry is not None:
                    return Match(entry.best, n, entry.best_count, remembered)
        return None

    def candidates(self, tail: Sequence[int], n: int, remembered: bool = False) -> list["Match"]:
        """Every token that followed `tail`'s last n - 1 tokens (level n), as matches: the winner
        (what `match` gives there) first, then the others by decreasing count; [] on a miss."""
        if len(tail) < n - 1 or n not in self._levels:
            return []
        entry = self._levels[n].get(tuple(tail[len(tail) - (n - 1) :]))
        if entry is None:
            return []
        others = sorted((t for t in entry.counts if t != entry.best), key=lambda t: -entry.counts[t])
        return [Match(t, n, entry.counts[t], remembered) for t in (entry.best, *others)]

    @property
    def tail(self) -> list[int]:
        """The last max_n - 1 tokens indexed (what a draft continues)."""
        return list(self._tail)

    def draft(self, k: int) -> list[int]:
        """Up to k tokens by repeated look-up, starting from the indexed context's end."""
        return [m.token for m in self.draft_matches(k)]

    def draft_matches(self, k: int, fallback: "NgramTables | None" = None,
                      ahead: Sequence[int] = ()) -> list["Match"]:
        """Like `draft`, with the match behind each token. `fallback` (same orders, e.g. the
        memory across requests) is asked too; its match is taken where it matched a longer
        n-gram than these tables (or these miss), and says `remembered`. `ahead`: tokens taken
        as following the indexed ones (not indexed): the draft continues them."""
        tail = [*self._tail, *ahead][-(self.max_n - 1) :]
        drafted: list[Match] = []
        while len(drafted) < k:
            match = self.match(tail)
            if fallback is not None and (match is None or match.n < self.max_n):
                other = fallback.match(tail, remembered=True)
                if other is not None and (match is None or other.n > match.n):
                    match = other
            if match is None:
                break
            drafted.append(match)
            tail.append(match.token)
            del tail[0 : max(0, len(tail) - (self.max_n - 1))]
        return drafted


def tree_options(own: NgramTables, memory: NgramTables | None, tail: Sequence[int]) -> list["Match"]:
    """The continuations a tree offers after `tail`, likeliest source first: every token that
    followed the longest matching key (the request's own tables before the memory at equal n),
    then the winner of each shorter or other matching key, from the largest n down; each token
    once. The first is the token a linear draft takes (`NgramTables.draft_matches`)."""
    options: list[Match] = []
    seen: set[int] = set()
    for n in range(own.max_n, own.min_n - 1, -1):
        for tables, remembered in ((own, False), (memory, True)):
            if tables is None:
                continue
            found = tables.candidates(tail, n, remembered)
            for match in found if not options else found[:1]:
                if match.token not in seen:
                    seen.add(match.token)
                    options.append(match)
    return options


@dataclass(frozen=True)
class Match:
    """A table hit: the predicted token, the n of the level that matched, the winner's count,
    and whether it came from the memory across requests rather than the request's own tables."""

    token: int
    n: int
    count: int
    remembered: bool = False


@dataclass(frozen=True)
class NgramConfig:
    """ANPD drafter options: n-gram orders, the memory bounds of the tables, and the shortest
    match that a draft copies from (`span_min` tokens; 0: no long-match copies)."""

    max_n: int = 5
    min_n: int = 2
    max_keys: int = 1 << 16
    max_candidates: int = 8
    span_min: int = 8

    def __post_init__(self) -> None:
        NgramTables(self.max_n, self.min_n, self.max_keys, self.max_candidates)  # validates
        if isinstance(self.span_min, bool) or not isinstance(self.span_min, int) or not (
                self.span_min == 0 or SPAN_KEY <= self.span_min <= SPAN_MAX_BACK):
            raise ConfigError(f"span_min must be 0 (off) or an integer from {SPAN_KEY} to {SPAN_MAX_BACK}, "
                              f"got {self.span_min!r}")


# Memory across requests, per target and n-gram config. At ~470 bytes a key (measured with
# tracemalloc on the default tables), 2^15 keys on each of the 4 levels of max_n = 5 cap one
# store near 60 MiB, small beside the default model's weights, while holding the n-grams of
# roughly the last 32k distinct token contexts on each level: about a hundred requests of 300
# tokens. Half the per-request tables' bound: one request never needs more than its own hold.
MEMORY_MAX_KEYS = 1 << 15
# Tokens of the requests' streams for long matches (`SpanIndex`), whose index keeps its default 2^16
# most recently written 4-grams: ~21 MiB at both bounds (tracemalloc, random 600-token requests).
MEMORY_MAX_TOKENS = 1 << 18
MEMORY_STORES = 4  # configs (e.g. ngram_max_n values) with a store on one target; LRU beyond
MEMORY_ATTACHMENT = "ngram-memory"  # Target.attachments key: {NgramConfig: NgramMemory}


class NgramMemory:
    """A bounded store of n-grams from the requests served on one target (see the module
    docstring): `NgramTables` of MEMORY_MAX_KEYS keys per level, into which each request indexes
    its prompt and committed tokens through a tail of its own (`new_tail`, `index`); the requests'
    token streams for long matches (`spans`, written by the drafters); and what the drafters
    learned of the remembered and long-match confidence kinds (`outcomes`: kind -> [accepted,
    rejected])."""

    def __init__(self, config: NgramConfig, max_keys: int | None = None, max_tokens: int = MEMORY_MAX_TOKENS):
        self.config = config
        max_keys = MEMORY_MAX_KEYS if max_keys is None else max_keys
        self.tables = NgramTables(config.max_n, config.min_n, max_keys, config.max_candidates)
        self.spans = new_span_index(max_tokens)
        self.outcomes: dict[tuple, list[int]] = {}

    def __len__(self) -> int:
        """Total number of keys over all levels."""
        return len(self.tables)

    def new_tail(self) -> deque[int]:
        """A request's tail: where its n-grams start, so none spans two requests."""
        return self.tables.new_tail()

    def index(self, tail: deque[int], tokens: Sequence[int]) -> None:
        self.tables.extend(tokens, tail)


def new_span_index(max_tokens: int = MEMORY_MAX_TOKENS) -> SpanIndex:
    return SpanIndex(SPAN_KEY, max_back=SPAN_MAX_BACK, max_tokens=max_tokens)


def span_kind(length: int, other: bool) -> tuple:
    """The confidence kind of a token copied after a match of `length` tokens (grouped by
    SPAN_BUCKETS) found in another request (`other`) or this one."""
    return ("span", max(b for b in SPAN_BUCKETS if b <= length), other)


def shared_memory(attachments: dict, config: NgramConfig) -> NgramMemory | None:
    """The memory for `config` kept in a target's `attachments` (created empty on first use;
    at most MEMORY_STORES configs, least recently used out), or None when the target's memory
    is switched off (`base.switch_off_memory`). Only the thread that owns the target may call it."""
    if memory_switched_off(attachments):
        return None
    return recently_used(attachments.setdefault(MEMORY_ATTACHMENT, {}), config, lambda: NgramMemory(config),
                         MEMORY_STORES)


class AnpdDrafter:
    """ANPD: drafts from n-gram tables built from the prompt and every committed token, and,
    where those miss at every level, from the memory across requests (`memory`; None: none).

    Each drafted token carries a confidence: the running acceptance rate, in this request, of
    earlier draft tokens that came from the same kind of match (the level n and the winner's
    count, capped at 3, and whether it came from the memory), as the mean of a
    Beta(1 + accepted, 1 + rejected) posterior. Only tokens whose predecessors were all accepted
    are counted, so it estimates P(accepted | the draft so far was accepted), which is what the
    adaptive controller needs. The memory's kinds are separate from the request's own: text
    seen in other requests may be far less (or more) predictive than the request's own.

    Long matches (`NgramConfig.span_min` > 0): where the end of the request's token stream
    occurred before, in it or (with the memory) in an earlier request, preceded by at least
    span_min equal tokens, the draft is the continuation of the longest such occurrence (`Span`),
    and token j of it has the kind of a match of length + j tokens (`span_kind`). With the memory,
    the outcomes of long-match and remembered kinds are the memory's (`NgramMemory.outcomes`),
    learned over the requests; the others are this request's.

    `outcomes`: a dict shared by several drafters that draft side by side (requests of one batch,
    `verispec.integrations.vllm`) pools what they learn of the request's own kinds there, instead
    of each request starting from the prior (None, the default: per request, reset by `begin`).

    Trees (`tree` > 0: a node budget): the draft branches where the tables offer several next
    tokens. Best first: from the context's end, the candidate with the largest path probability
    (the product of the confidences down its path) joins the tree, its own continuations
    (`tree_options`: every token that followed the longest matching key, then the winners of the
    shorter keys and of the memory's) become candidates, and so on until min(k, tree) tokens.
    Alternatives to the first option carry kinds of their own (with their rank, 1 or 2 and
    beyond, starting from a sceptical prior: ALTERNATIVE_PRIOR_REJECTED), learned like the
    winners': a child of a node on the accepted path counts as accepted when it carries the
    target's token there. Tokens come ordered by decreasing path probability (`Draft.parents`,
    `Draft.confidence`), so the primary branch is the linear draft whenever the winners are the
    likeliest children.
    """

    def __init__(self, config: NgramConfig = NgramConfig(), memory: NgramMemory | None = None, tree: int = 0,
                 outcomes: dict[tuple, list[int]] | None = None, copier: TextCopy | None = None):
        if memory is not None and memory.config != config:
            raise ConfigError(f"the memory's n-gram config {memory.config} differs from the drafter's {config}")
        if isinstance(tree, bool) or not isinstance(tree, int) or tree < 0:
            raise ConfigError(f"the tree's node budget must be an integer >= 0, got {tree!r}")
        self.config = config
        self.memory = memory
        self.tree = tree
        self.copier = copier  # drafts from the prompt's text where every n-gram level misses
        self.tables = self._new_tables()
        self._memory_tail: deque[int] | None = None
        self._spans: SpanIndex | None = None  # the memory's, or this request's own
        self._stream = -1  # this request's stream in `_spans`
        self._outcomes: dict[tuple, list[int]] = {}  # kind -> [accepted, rejected]
        self._pooled = outcomes  # where the request's own kinds are learned, if not per request
        self._last_kinds: list[tuple] = []  # confidence kinds of the last linear draft's tokens
        self._ahead = 0  # tokens the last draft continued that were not committed (`propose_ahead`)
        self._last_tree: tuple[list[int], list[int], list[tuple]] | None = None  # tokens, parents, kinds

    @classmethod
    def for_target(cls, attachments: dict, config: NgramConfig, memory: bool = True, tree: int = 0,
                   tokenizer=None) -> "AnpdDrafter":
        """A drafter using the memory kept in a target's `attachments` (`shared_memory`) when
        `memory` is True and the target has not switched it off; `tree`: its node budget; with
        the target's `tokenizer`, text copies where the tables miss (`TextCopy`)."""
        return cls(config, shared_memory(attachments, config) if memory else None, tree,
                   copier=TextCopy.for_tokenizer(tokenizer))

    def _new_tables(self) -> NgramTables:
        c = self.config
        return NgramTables(c.max_n, c.min_n, c.max_keys, c.max_candidates)

    def begin(self, prompt: Sequence[int]) -> None:
        self.tables = self._new_tables()
        self.tables.extend(prompt)
        if self.memory is not None:
            self._memory_tail = self.memory.new_tail()
            self.memory.index(self._memory_tail, prompt)
        if self.config.span_min:
            self._spans = self.memory.spans if self.memory is not None else new_span_index()
            self._stream = self._spans.new_stream()
            self._spans.extend(self._stream, prompt)
        self._outcomes = {} if self._pooled is None else self._pooled
        self._last_kinds, self._last_tree, self._ahead = [], None, 0
        if self.copier is not None:
            self.copier.begin(prompt)

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        span = self._long_match()
        if self.tree:
            k = min(k, self.tree)
            if span is None:
                return self._propose_tree(k, keep)
        tokens, confidence = self._propose_path(span, k, keep, tail=context[-COPY_TAIL:])
        return Draft(torch.tensor(tokens, dtype=torch.long, device=HOST), confidence=confidence)

    def propose_ahead(self, context: Sequence[int], ahead: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        """Up to k tokens on one path after `context` and then `ahead`, tokens not committed yet
        (a grammar's forced text, drafted before these); `commit` follows with the step's
        committed tokens and the whole draft's length, `ahead` included, and learns from the
        tokens after `ahead` only."""
        tail = [*context[-COPY_TAIL:], *ahead][-COPY_TAIL:]
        tokens, confidence = self._propose_path(self._long_match(ahead), k, keep, ahead, tail)
        self._ahead = len(ahead)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=HOST), confidence=confidence)

    def propose_ids(self, k: int, keep: Keep = keep_all) -> tuple[list[int], tuple[float, ...]]:
        """The linear draft `propose` makes, as plain ids and confidences (no tensor), for
        callers that batch drafts themselves (`verispec.integrations.vllm`); `commit` follows
        as after `propose`. Linear drafts only (tree = 0)."""
        if self.tree:
            raise ConfigError("propose_ids makes linear drafts: this drafter drafts trees (tree > 0)")
        return self._propose_path(self._long_match(), k, keep)

    def _propose_path(self, span: Span | None, k: int, keep: Keep, ahead: Sequence[int] = (),
                      tail: Sequence[int] = ()) -> tuple[list[int], tuple[float, ...]]:
        """Up to k tokens on one path: the copy after a long match, else chained look-ups (after
        `ahead`, uncommitted tokens that come first), else the prompt's text after the text of
        `tail`, the last tokens before the draft (`TextCopy`)."""
        if span is not None:  # a long match is copied as a single path, trees or not
            tokens = span.tokens(k)
            kinds = [span_kind(span.length + j, span.other) for j in range(len(tokens))]
        else:
            fallback = None if self.memory is None else self.memory.tables
            matches = self.tables.draft_matches(k, fallback, ahead)
            tokens = [m.token for m in matches]
            kinds = [(m.n, min(m.count, 3), m.remembered) for m in matches]
            if not tokens and self.copier is not None and tail:
                tokens, chars = self.copier.draft(tail, k)
                kinds = [text_kind(chars, j) for j in range(len(tokens))]
        confidence = tuple(self._confidence(kind) for kind in kinds)
        n = kept_prefix(confidence, keep)
        self._last_kinds = kinds[:n]
        return tokens[:n], confidence[:n]

    def _long_match(self, ahead: Sequence[int] = ()) -> Span | None:
        """The longest earlier occurrence of the stream's end (then `ahead`), if at least span_min
        tokens long."""
        if self._spans is None:
            return None
        span = self._spans.longest(self._stream, ahead)
        return span if span is not None and span.length >= self.config.span_min else None

    def _propose_tree(self, budget: int, keep: Keep) -> Draft:
        """Up to `budget` tokens as a tree, best first (see the class docstring)."""
        fallback = None if self.memory is None else self.memory.tables
        tokens: list[int] = []
        parents: list[int] = []
        kinds: list[tuple] = []
        reach: list[float] = []  # path probability of each token
        frontier: list = []  # heap of (-path probability, order, parent, token, kind, tail)
        order = count()

        def expand(parent: int, tail: list[int], probability: float) -> None:
            for rank, match in enumerate(tree_options(self.tables, fallback, tail)):
                kind = (match.n, min(match.count, 3), match.remembered) + ((min(rank, 2),) if rank else ())
                heapq.heappush(frontier, (-probability * self._confidence(kind), next(order), parent, match.token,
                                          kind, tail))

        expand(-1, self.tables.tail, 1.0)
        while frontier and len(tokens) < budget:
            negative, _, parent, token, kind, tail = heapq.heappop(frontier)
            tokens.append(token)
            parents.append(parent)
            kinds.append(kind)
            reach.append(-negative)
            longer = tail + [token]
            expand(len(tokens) - 1, longer[max(0, len(longer) - (self.config.max_n - 1)) :], -negative)
        # popped in order of decreasing path probability (a child is never likelier than its parent)
        confidence = [r / (reach[i - 1] if i else 1.0) for i, r in enumerate(reach)]
        n = kept_prefix(confidence, keep)
        self._last_tree = (tokens[:n], parents[:n], kinds[:n])
        return Draft.tree(tokens[:n], parents[:n], confidence[:n])

    def _outcomes_of(self, kind: tuple) -> dict[tuple, list[int]]:
        """Where the outcomes of `kind` are kept: the memory's for long-match and remembered kinds
        (when there is a memory), else this request's."""
        shared = kind[0] == "span" or kind[2]
        return self.memory.outcomes if shared and self.memory is not None else self._outcomes

    def _confidence(self, kind: tuple) -> float:
        """The mean of the kind's Beta posterior; for a long match's copy, at least the confidence
        of a shorter match's (a match of 24 tokens holds one of 12: while a copy goes on, each
        token's match grows into a longer bucket, which would otherwise start again from the
        prior and hold the draft back)."""
        accepted, rejected = self._outcomes_of(kind).get(kind, (0, 0))
        if kind[0] == "span":
            own = (1 + accepted + SPAN_PRIOR_ACCEPTED) / (2 + accepted + rejected + SPAN_PRIOR_ACCEPTED)
            shorter = [bucket for bucket in SPAN_BUCKETS if bucket < kind[1]]
            return max(own, self._confidence(("span", shorter[-1], kind[2]))) if shorter else own
        if len(kind) > 3:  # a tree's alternative to the likeliest continuation
            rejected += ALTERNATIVE_PRIOR_REJECTED
        return (1 + accepted) / (2 + accepted + rejected)

    def _learn(self, kind: tuple, accepted: bool) -> None:
        self._outcomes_of(kind).setdefault(kind, [0, 0])[0 if accepted else 1] += 1

    def _learn_tree(self, committed: Sequence[int]) -> None:
        """Outcomes of the last tree: down the committed path, every child of a node on it (the
        root included) is accepted if it carries the target's token there, else rejected."""
        tokens, parents, kinds = self._last_tree
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(i)
        node = -1
        for j, token in enumerate(committed):
            step = None
            for child in children.get(node, ()):
                hit = tokens[child] == token
                self._learn(kinds[child], hit)
                step = child if hit else step
            if step is None or j == len(committed) - 1:
                break
            node = step

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        if self._last_tree is not None:
            self._learn_tree(committed)
        outcome = own_outcome(committed, n_proposed, self._ahead)
        if outcome is not None:
            proposed, accepted = outcome
            for i, kind in enumerate(self._last_kinds[:proposed][: accepted + 1]):
                self._learn(kind, i < accepted)
        self._last_kinds, self._last_tree, self._ahead = [], None, 0
        self.tables.extend(committed)
        if self.memory is not None:
            self.memory.index(self._memory_tail, committed)
        if self._spans is not None:
            self._spans.extend(self._stream, committed)


def prompt_lookup(context: Sequence[int], max_ngram: int, k: int) -> list[int]:
    """Prompt lookup: for n = max_ngram..1, the tokens (at most k) that followed the earliest
    earlier occurrence of the context's trailing n-gram; [] if none occurs."""
    tokens = np.asarray(context, dtype=np.int64)
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_ngram, length - 1), 0, -1):
        # windows[i] = tokens[i:i+n] for starts i < length - n (excludes the trailing n-gram).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [length-n, n]
        matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if matches.size:
            start = int(matches[0]) + n
            return tokens[start : start + k].tolist()
    return []


class PromptLookupDrafter:
    """The `pld` baseline: prompt lookup over the whole context at every step."""

    def __init__(self, max_ngram: int = 3):
        if max_ngram < 1:
            raise ConfigError(f"prompt lookup needs max_ngram >= 1, got {max_ngram}")
        self.max_ngram = max_ngram

    def begin(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        tokens = prompt_lookup(context, self.max_ngram, k)
        return Draft.of(tokens[: kept_prefix([None] * len(tokens), keep)])

    def propose_ahead(self, context: Sequence[int], ahead: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        """`propose` after `context` and then `ahead` (uncommitted tokens drafted before these)."""
        return self.propose([*context, *ahead], k, keep)

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        pass
