"""SuffixDecoding (Oliaro et al., 2024; Snowflake ArcticInference, offered as `suffix` by vLLM
and SGLang): model-free drafts from suffix trees, through the `arctic-inference` package
(`arctic_inference.suffix_decoding.SuffixDecodingCache`, C++; optional: `make suffix`).

The cache keeps two kinds of suffix tree: one per active request over its prompt and what it has
generated so far, and one global tree over the outputs of earlier requests (at most
`max_cached_requests` of them, oldest out first). Each step it matches the longest suffix of the
context it can in either tree and proposes the continuation seen most often after it, each token
with an estimated probability (its count over its parent's along the path). A draft is at most
`max_spec_factor * match length` tokens long and stops where the estimate falls under
`min_token_prob`; the trees are `max_tree_depth` deep. The defaults are vLLM's
(`suffix_decoding_*`: depth 24, 10000 cached requests, factor 1.0, min probability 0.1); each
is a method setting (`suffix/max_spec_factor=2/min_token_prob=0.2`, `SuffixConfig`).

Memory across requests: the global tree. `suffix/ngram_memory=false` (the switch ANPD's memory
has) means no global tree (max_cached_requests 0: each request drafts from its own prompt and
output only), and so does a target whose memory is switched off (`base.switch_off_memory`, the
server's --no-ngram-memory), whatever the request asks.

Tree to path: the library can return a tree of candidates (`use_tree_spec`), but our engine
verifies one path per step, so a draft is reduced to one path (`best_path`): the path whose
summed estimated probabilities (= the expected number of accepted tokens under the tree's own
estimates) is highest. By default (`SuffixConfig.tree = False`, as vLLM calls it) the library
itself already builds a single path by following the most frequent child at each node, which
spends the whole token budget on that path; `best_path` then returns it unchanged. With
`tree = True` the budget is spread over the tree and `best_path` picks the best branch. Its
trees are not verified as trees (ANPD's are): with these defaults a whole tree of 8 tokens
committed 0.6% more tokens per forward than its single path in an offline replay of 26
Spec-Bench greedy answers (2.349 against 2.336), too little for the wider verify.

Outputs are exactly `ar`'s: drafts are deterministic (q = None) and go through the engine's
lossless rules (greedy match, or sampled match under sampling).

Confidence (`Draft.confidence`, for the `adaptive` controller): the estimated probability that
a token is accepted given that the draft before it was, learned online per target and cached
knobs (`SuffixStore`): drafted tokens are grouped by the tree's own conditional probability
(5 bins) and the match length (1, 2, 3-4, 5-8, 9+), and each group keeps a Beta posterior of
its acceptance whose prior (weight 2) is centred on the tree's probability. Only tokens whose
predecessors were all accepted are counted, as for ANPD.

Method defaults (`methods.METHODS`): K = 24 with the `constant` controller. K = 24 is vLLM's
default for suffix (num_speculative_tokens = max tree depth): the library already sizes each
draft by its match length and token probabilities, so K is a cap. Measured on the embedded
default model (greedy, 128 new tokens, 7 bench prompts (4 code-edit, 3 builtin) after one
warm-up request, one cache per variant, 2 busy cores): constant:24 28.8 tok/s, adaptive:24 27.5,
adaptive:16 26.8, constant:8 26.3, constant:12 26.1, adaptive:8 25.3, `ar` 17.9; a rerun of
the first two in the other order gave adaptive:24 28.7, constant:24 27.0, `ar` 21.1. The
suffix variants differ by less than that noise; constant was chosen because its steps need no
timing (the same drafts on every machine), as in vLLM. `--controller adaptive` uses the
confidences below.

Sharing and ending requests: one `SuffixStore` (the cache, its request ids, the confidence
posteriors) per target and knobs, kept in `Target.attachments`, so the library, the benchmark
and the server share what earlier requests generated. Only the thread that owns the target may
use it (as for every attachment). Each `begin` starts a new request id and feeds the prompt;
each `commit` appends the committed tokens to the request's tree and its global-cache entry.
The drafter protocol has no end hook, so a request is stopped (its prompt tree freed; its output
stays in the global cache) (a) when the same drafter begins another request, (b) after its
drafter is garbage-collected: a `weakref.finalize` queues its id, and the store stops queued ids
at the next `begin` on the target, on the owner thread (never from the collector), and (c) past
MAX_ACTIVE active requests, oldest first (a drafter whose request was stopped that way drafts
nothing more). Output tokens past a stop token may reach the cache in the last step (the engine
commits whole steps before cutting them); they are the target's own tokens, and harmless.

Privacy, in a server: as with ANPD's memory, other users' outputs shape the drafts, hence the
latency (never the output) of a request, unless the memory is switched off.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ...errors import ConfigError
from ..sampling import is_integer, is_number
from .base import EMPTY_DRAFT, HOST, Draft, Keep, keep_all, kept_prefix, memory_switched_off, own_outcome, recently_used

MISSING = "the suffix method needs arctic-inference: run `make suffix`"
ATTACHMENT = "suffix-cache"  # Target.attachments key: {SuffixConfig: SuffixStore}
MAX_ACTIVE = 256  # active requests per store before the oldest are stopped
MAX_STORES = 4  # configs with a store on one target (a server's requests may each bring others); LRU beyond
# Deepest tree allowed: a suffix tree holds up to depth nodes per token it indexes, so the depth
# bounds what one request's settings can make the cache hold (vLLM's default is 24).
MAX_TREE_DEPTH = 256
PROBABILITY_BINS = 5
MATCH_BOUNDS = (1, 2, 4, 8)  # match-length groups: 1, 2, 3-4, 5-8, 9+
PRIOR_WEIGHT = 2.0


def cache_class():
    """`SuffixDecodingCache`, or a ConfigError saying how to get it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as error:  # not installed, or its extension does not load
        raise ConfigError(f"{MISSING} ({error})") from None
    return SuffixDecodingCache


@dataclass(frozen=True)
class SuffixConfig:
    """The cache's and the speculation's knobs (vLLM's defaults)."""

    max_tree_depth: int = 24
    max_cached_requests: int = 10000  # 0: no global tree (prompt trees only); -1: unbounded
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    tree: bool = False  # ask the library for a tree and keep its best path (see the docstring)

    def __post_init__(self) -> None:
        if not is_integer(self.max_tree_depth) or not 1 <= self.max_tree_depth <= MAX_TREE_DEPTH:
            raise ConfigError(f"max_tree_depth must be an integer from 1 to {MAX_TREE_DEPTH}, got {self.max_tree_depth!r}")
        if not is_integer(self.max_cached_requests) or not -1 <= self.max_cached_requests <= 0x7FFFFFFF:
            raise ConfigError(f"max_cached_requests must be an integer in -1..2^31-1, got {self.max_cached_requests!r}")
        if not is_number(self.max_spec_factor) or not self.max_spec_factor > 0:
            raise ConfigError(f"max_spec_factor must be > 0, got {self.max_spec_factor!r}")
        if not is_number(self.min_token_prob) or not 0 <= self.min_token_prob <= 1:
            raise ConfigError(f"min_token_prob must be in [0, 1], got {self.min_token_prob!r}")
        if not isinstance(self.tree, bool):
            raise ConfigError(f"tree must be true or false, got {self.tree!r}")


def best_path(parents: Sequence[int], probs: Sequence[float]) -> list[int]:
    """Indices of the root-to-leaf path of a draft tree with the highest sum of `probs` (each a
    node's estimated probability of being reached, so the sum is the expected number of accepted
    tokens). parents[i] is the index of node i's parent (-1 for a root) and precedes i. Ties go
    to the node listed first. A chain (parents[i] == i - 1) comes back whole."""
    n = len(parents)
    if len(probs) != n:
        raise ValueError(f"{n} parents but {len(probs)} probabilities")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}: parents must precede their children")
    score = [float(p) for p in probs]  # best sum from node i down to a leaf
    best_child = [-1] * n
    for i in range(n - 1, -1, -1):  # children come after their parent: finished before it
        if best_child[i] >= 0:
            score[i] += score[best_child[i]]
        parent = parents[i]
        # siblings are seen last to first, so on a tie the one listed first wins
        if parent >= 0 and (best_child[parent] < 0 or score[i] >= score[best_child[parent]]):
            best_child[parent] = i
    roots = [i for i in range(n) if parents[i] < 0]
    if not roots:
        return []
    node = max(roots, key=lambda r: (score[r], -r))
    path = []
    while node >= 0:
        path.append(node)
        node = best_child[node]
    return path


def conditional_probs(path: Sequence[int], parents: Sequence[int], probs: Sequence[float]) -> list[float]:
    """Each path token's probability given its parent (the tree's probabilities are of reaching
    a node; a root's parent counts as 1), clamped to [0, 1]."""
    out = []
    for i in path:
        parent = parents[i]
        above = float(probs[parent]) if parent >= 0 else 1.0
        out.append(min(max(float(probs[i]) / above, 0.0), 1.0) if above > 0 else 0.0)
    return out


def _kind(probability: float, match_len: int) -> tuple[int, int]:
    return min(int(probability * PROBABILITY_BINS), PROBABILITY_BINS - 1), sum(match_len > b for b in MATCH_BOUNDS)


class SuffixStore:
    """One `SuffixDecodingCache` with its request ids, the ids waiting to be stopped, and the
    confidence posteriors; one per target and `SuffixConfig` (`shared_store`)."""

    def __init__(self, config: SuffixConfig = SuffixConfig()):
        self.config = config
        self.cache = cache_class()(max_tree_depth=config.max_tree_depth,
                                   max_cached_requests=config.max_cached_requests)
        self._ids = itertools.count()
        self.finished: deque[int] = deque()  # ids of dropped drafters (appended by finalizers)
        self._outcomes: dict[tuple[int, int], list[int]] = {}  # kind -> [accepted, rejected]

    def start(self, prompt: Sequence[int]) -> int:
        """A new request's id, its prompt in its own tree; first stops the finished requests and,
        past MAX_ACTIVE, the oldest active ones."""
        while self.finished:
            self.stop(self.finished.popleft())
        active = self.cache.active_requests
        while len(active) >= MAX_ACTIVE:
            self.stop(next(iter(active)))
        request = next(self._ids)
        self.cache.start_request(request, list(prompt))
        return request

    def stop(self, request: int) -> None:
        if request in self.cache.active_requests:
            self.cache.stop_request(request)

    def active(self, request: int | None) -> bool:
        return request is not None and request in self.cache.active_requests

    def confidence(self, kind: tuple[int, int], probability: float) -> float:
        """The posterior mean of acceptance for a token of this kind and tree probability."""
        accepted, rejected = self._outcomes.get(kind, (0, 0))
        return (accepted + PRIOR_WEIGHT * probability) / (accepted + rejected + PRIOR_WEIGHT)

    def learn(self, kinds: Sequence[tuple[int, int]], n_accepted: int) -> None:
        """Record which verified tokens were accepted: kinds[:n_accepted] were, kinds[n_accepted]
        (if verified) was not; later ones were never judged."""
        for i, kind in enumerate(kinds[: n_accepted + 1]):
            outcome = self._outcomes.setdefault(kind, [0, 0])
            outcome[0 if i < n_accepted else 1] += 1


def shared_store(attachments: dict, config: SuffixConfig = SuffixConfig()) -> SuffixStore:
    """The store for `config` in a target's `attachments` (created on first use; at most
    MAX_STORES configs, least recently used out), without a global tree (max_cached_requests 0)
    where the target's memory across requests is switched off."""
    if memory_switched_off(attachments):
        config = replace(config, max_cached_requests=0)
    return recently_used(attachments.setdefault(ATTACHMENT, {}), config, lambda: SuffixStore(config), MAX_STORES)


class SuffixDrafter:
    """Drafts with SuffixDecoding from a (shared) `SuffixStore`; see the module docstring."""

    def __init__(self, store: SuffixStore):
        self.store = store
        self.request: int | None = None
        self._finalizer: weakref.finalize | None = None
        self._kinds: list[tuple[int, int]] = []
        self._ahead = 0  # tokens the last draft continued that were not committed (`propose_ahead`)

    @classmethod
    def for_target(cls, attachments: dict, config: SuffixConfig = SuffixConfig()) -> "SuffixDrafter":
        return cls(shared_store(attachments, config))

    def begin(self, prompt: Sequence[int]) -> None:
        if self._finalizer is not None:  # this drafter's previous request ends here
            self._finalizer.detach()
            self.store.stop(self.request)
        self.request = self.store.start(prompt)
        # On collection, only queue the id: the store stops it on its owner's thread.
        self._finalizer = weakref.finalize(self, self.store.finished.append, self.request)
        self._kinds = []

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        self._kinds, self._ahead = [], 0
        if k <= 0 or not self.store.active(self.request):
            return EMPTY_DRAFT
        config = self.store.config
        tree = self.store.cache.speculate(
            self.request, list(context[-config.max_tree_depth:]), max_spec_tokens=k,
            max_spec_factor=config.max_spec_factor, min_token_prob=config.min_token_prob,
            use_tree_spec=config.tree)
        path = best_path(tree.parents, tree.probs)[:k]
        if not path:
            return EMPTY_DRAFT
        conditional = conditional_probs(path, tree.parents, tree.probs)
        kinds = [_kind(p, tree.match_len) for p in conditional]
        confidence = tuple(self.store.confidence(kind, p) for kind, p in zip(kinds, conditional))
        n = kept_prefix(confidence, keep)
        self._kinds = kinds[:n]
        return Draft(torch.tensor([tree.token_ids[i] for i in path[:n]], dtype=torch.long, device=HOST),
                     confidence=confidence[:n])

    def propose_ahead(self, context: Sequence[int], ahead: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        """`propose` after `context` and then `ahead`, tokens not committed yet (a grammar's forced
        text, drafted before these); `commit` learns from the tokens after `ahead` only."""
        draft = self.propose([*context, *ahead], k, keep)
        self._ahead = len(ahead)
        return draft

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        outcome = own_outcome(committed, n_proposed, self._ahead)
        if outcome is not None:
            proposed, accepted = outcome
            self.store.learn(self._kinds[:proposed], accepted)
        self._kinds, self._ahead = [], 0
        if self.store.active(self.request):
            self.store.cache.add_active_response(self.request, list(committed))
