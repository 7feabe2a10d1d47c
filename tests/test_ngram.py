"""ANPD's n-gram tables and prompt lookup, as pure algorithms (no model)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.core.drafters.ngram import (AnpdDrafter, NgramConfig, NgramTables, PromptLookupDrafter, prompt_lookup,
                                    tree_options)
from verispec.errors import ConfigError

# derandomize: the same examples on every run (CI must be deterministic); no example database.
PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# -- reference implementations (slow, obviously correct) ---------------------------------------

def followers(stream: list[int], key: tuple[int, ...]) -> list[int]:
    """Every token that followed an occurrence of `key` in `stream`, in stream order."""
    n = len(key)
    return [stream[i + n] for i in range(len(stream) - n) if tuple(stream[i : i + n]) == key]


def winner(tokens: list[int]) -> int:
    """Most frequent; among the most frequent, the one whose last occurrence is latest (it reached
    the top count most recently)."""
    counts = Counter(tokens)
    top = max(counts.values())
    last_seen = {token: i for i, token in enumerate(tokens)}
    return max((t for t in counts if counts[t] == top), key=last_seen.__getitem__)


def reference_lookup(stream: list[int], tail: list[int], max_n: int, min_n: int) -> int | None:
    for n in range(max_n, min_n - 1, -1):
        if len(tail) >= n - 1:
            seen = followers(stream, tuple(tail[len(tail) - (n - 1) :]))
            if seen:
                return winner(seen)
    return None


def reference_prompt_lookup(context: list[int], max_ngram: int, k: int) -> list[int]:
    """transformers' prompt lookup: earliest earlier match of the trailing n-gram, n from
    max_ngram down to 1; a match must leave at least one token after it."""
    length = len(context)
    if k <= 0:
        return []
    for n in range(min(max_ngram, length - 1), 0, -1):
        trailing = context[-n:]
        for start in range(length - n):  # excludes the trailing n-gram itself (start = length - n)
            if context[start : start + n] == trailing:
                return context[start + n : start + n + k]
    return []


# -- NgramTables: hand-built cases ---------------------------------------------------------------

def test_most_frequent_continuation_wins():
    tables = NgramTables(max_n=2, min_n=2)
    tables.extend([7, 1, 7, 2, 7, 1, 7, 3])
    assert tables.lookup([7]) == 1  # 1 followed 7 twice, 2 and 3 once


def test_ties_go_to_the_most_recent():
    tables = NgramTables(max_n=2, min_n=2)
    tables.extend([7, 1, 7, 2])
    assert tables.lookup([7]) == 2
    tables.extend([7, 1])  # 1 reaches count 2 first and leads
    assert tables.lookup([7]) == 1
    tables.extend([7, 2])  # 2 reaches count 2 later: ties go to the most recent
    assert tables.lookup([7]) == 2


def test_largest_n_first_with_fallback():
    tables = NgramTables(max_n=3, min_n=2)
    # bigram 5 -> 9 (twice), trigram (4, 5) -> 6 (once)
    tables.extend([4, 5, 6, 0, 5, 9, 1, 5, 9])
    assert tables.lookup([4, 5]) == 6  # the trigram key matches: it wins over the bigram's count
    assert tables.lookup([8, 5]) == 9  # no trigram (8, 5): fall back to the bigram
    assert tables.lookup([5]) == 9  # too short for a trigram key
    assert tables.lookup([3]) is None  # nothing at any level
    assert tables.lookup([]) is None


def test_draft_by_repeated_lookup():
    tables = NgramTables(max_n=3, min_n=2)
    tables.extend([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert tables.draft(5) == [3, 4, 1, 2, 3]
    assert tables.draft(0) == []
    assert tables.draft(2) == [3, 4]


def test_draft_stops_at_the_first_miss():
    tables = NgramTables(max_n=2, min_n=2)
    tables.extend([1, 2, 3, 1])  # 1 -> 2 -> 3 -> 1 ...; after 3 comes 1
    assert tables.draft(6) == [2, 3, 1, 2, 3, 1]
    tables = NgramTables(max_n=2, min_n=2)
    tables.extend([1, 2, 3])  # 3 was never followed by anything
    assert tables.draft(4) == []
    tables.extend([1, 2])
    assert tables.draft(4) == [3, 1, 2, 3]


def test_a_separate_tail_keeps_streams_apart():
    tables = NgramTables(max_n=3, min_n=2)
    one, two = tables.new_tail(), tables.new_tail()
    tables.extend([1, 2], one)
    tables.extend([8, 9], two)
    tables.extend([3], one)
    assert tables.lookup([1, 2]) == 3 and tables.lookup([2]) == 3  # 1, 2, 3 as one stream
    assert tables.lookup([9]) is None and tables.lookup([8]) == 9  # 9 was followed by nothing
    assert len(tables) == 1 + 3  # keys (1, 2); (1,), (2,), (8,): nothing spans the streams
    assert tables.draft(3) == []  # the tables' own tail saw none of it


def test_draft_falls_back_token_by_token_where_every_level_misses():
    own = NgramTables(max_n=3, min_n=2)
    own.extend([1, 2, 7, 5, 6, 1, 2])  # own: 2 -> 7 -> 5 -> 6 -> 1 -> 2 ...; nothing after 9
    fallback = NgramTables(max_n=3, min_n=2)
    fallback.extend([2, 9, 9, 9, 4])  # 2 -> 9 (unused: own matches); 9 -> 9 (twice); 9, 9 -> 4
    matches = own.draft_matches(3, fallback)
    assert [m.token for m in matches] == [7, 5, 6] and not any(m.remembered for m in matches)
    own.extend([8, 9])  # own: 9 never followed by anything; [8, 9] neither
    matches = own.draft_matches(4, fallback)
    assert [(m.token, m.remembered, m.n) for m in matches] == [(9, True, 2), (4, True, 3)]  # then 4: a miss
    assert own.draft_matches(4) == []  # no fallback: the old behaviour


def test_len_counts_keys_over_all_levels():
    tables = NgramTables(max_n=3, min_n=2)
    tables.extend([1, 2, 3])
    # bigram keys (1,), (2,); trigram key (1, 2)
    assert len(tables) == 3


def test_max_keys_evicts_least_recently_updated():
    tables = NgramTables(max_n=2, min_n=2, max_keys=2)
    tables.extend([1, 10, 2, 20])  # keys (1,), (10,), (2,) -> (1,) evicted once a third key appears
    assert tables.lookup([1]) is None
    assert tables.lookup([10]) == 2 and tables.lookup([2]) == 20
    tables.extend([10, 3])  # key (20,) written, then (10,) updated (moved to most recent)...
    # writes since: (20,)->10, (10,)->3: (2,) is now least recently updated and evicted
    assert tables.lookup([2]) is None
    assert tables.lookup([10]) is not None and tables.lookup([20]) == 10
    assert len(tables) <= 2


def test_max_candidates_evicts_the_least_frequent_non_leader():
    tables = NgramTables(max_n=2, min_n=2, max_candidates=2)
    tables.extend([0, 5, 0, 5, 0, 6, 0, 7])  # 5 twice (leader), then 6, then 7 evicts 6
    assert tables.lookup([0]) == 5
    tables.extend([0, 7])  # 7 now has 2 = 5's count, and is more recent
    assert tables.lookup([0]) == 7
    tables.extend([0, 6])  # 6 was evicted: it restarts at 1 (evicting 5, the weakest non-leader)
    assert tables.lookup([0]) == 7


def test_max_candidates_one_keeps_a_single_continuation():
    tables = NgramTables(max_n=2, min_n=2, max_candidates=1)
    tables.extend([1, 2, 1, 3])
    assert tables.lookup([1]) in (2, 3)


@pytest.mark.parametrize("kwargs", [dict(min_n=1), dict(max_n=2, min_n=3), dict(max_keys=0),
                                    dict(max_candidates=0)])
def test_invalid_orders_and_bounds_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        NgramTables(**kwargs)
    with pytest.raises(ConfigError):
        NgramConfig(**kwargs)


# -- NgramTables: properties ----------------------------------------------------------------------

streams = st.lists(st.integers(0, 4), min_size=0, max_size=200)


@PROPERTY
@given(stream=streams, max_n=st.integers(2, 5), data=st.data())
def test_lookup_matches_the_reference_without_eviction(stream, max_n, data):
    min_n = data.draw(st.integers(2, max_n))
    tables = NgramTables(max_n=max_n, min_n=min_n)
    tables.extend(stream)
    for end in range(len(stream) + 1):
        for start in range(max(0, end - max_n), end + 1):
            tail = stream[start:end]
            assert tables.lookup(tail) == reference_lookup(stream, tail, max_n, min_n), (tail,)
    # the draft continues from the end of the stream by repeated reference lookups
    expected, tail = [], list(stream[-(max_n - 1):]) if max_n > 1 else []
    for _ in range(6):
        token = reference_lookup(stream, tail, max_n, min_n)
        if token is None:
            break
        expected.append(token)
        tail = (tail + [token])[-(max_n - 1):]
    assert tables.draft(6) == expected


@PROPERTY
@given(
    stream=st.lists(st.integers(0, 30), min_size=0, max_size=400),
    max_n=st.integers(2, 5),
    max_keys=st.integers(1, 12),
    max_candidates=st.integers(2, 4),
    chunks=st.integers(1, 5),
)
def test_bounded_memory_and_lookups_return_real_continuations(stream, max_n, max_keys, max_candidates, chunks):
    tables = NgramTables(max_n=max_n, min_n=2, max_keys=max_keys, max_candidates=max_candidates)
    size = max(1, len(stream) // chunks)
    for i in range(0, len(stream), size):  # extend in pieces, as the drafter does
        tables.extend(stream[i : i + size])
        assert len(tables) <= max_keys * (max_n - 1)
    for level in tables._levels.values():  # white-box: the bounds hold per level and per key
        assert len(level) <= max_keys
        for key, entry in level.items():
            assert len(entry.counts) <= max_candidates
            assert entry.counts[entry.best] == entry.best_count == max(entry.counts.values())
            assert entry.best in followers(stream, key)
    for end in range(1, len(stream) + 1):
        tail = stream[max(0, end - (max_n - 1)) : end]
        token = tables.lookup(tail)
        if token is not None:
            assert any(token in followers(stream, tuple(tail[len(tail) - (n - 1):]))
                       for n in range(2, max_n + 1) if len(tail) >= n - 1), (tail, token)


def test_bounded_memory_on_a_long_random_stream():
    import random

    rng = random.Random(0)
    tables = NgramTables(max_n=4, min_n=2, max_keys=64, max_candidates=3)
    for _ in range(50):
        tables.extend([rng.randrange(200) for _ in range(400)])
    assert len(tables) <= 64 * 3
    assert all(len(e.counts) <= 3 for level in tables._levels.values() for e in level.values())


# -- the ANPD drafter ---------------------------------------------------------------------------

def test_anpd_drafter_learns_from_prompt_and_commits():
    drafter = AnpdDrafter(NgramConfig(max_n=3))
    drafter.begin([1, 2, 3, 1, 2])
    draft = drafter.propose([1, 2, 3, 1, 2], 4)
    assert draft.tokens.tolist() == [3, 1, 2, 3]
    assert draft.q is None
    assert len(draft.confidence) == 4  # one per drafted token: the adaptive controller reads them
    assert all(0.0 < c < 1.0 for c in draft.confidence)
    drafter.commit([3, 9], n_proposed=4)  # accepted 3, then the target chose 9
    assert drafter.propose([1, 2, 3, 1, 2, 3, 9], 2).tokens.tolist() == []  # 9 never followed
    drafter.commit([1], n_proposed=0)
    assert drafter.tables.lookup([9]) == 1
    # begin() starts a fresh request: nothing of the previous one remains
    drafter.begin([5, 6])
    assert drafter.propose([5, 6], 3).tokens.tolist() == []
    assert drafter.tables.lookup([9]) is None


@pytest.mark.parametrize("span_min", [0, 4])
def test_anpd_drafts_ahead_of_uncommitted_tokens_as_if_they_were_committed(span_min):
    """`propose_ahead`: the draft that would follow once `ahead` is committed, the tables and the
    stream left as they were."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    drafter, twin = AnpdDrafter(NgramConfig(max_n=3, span_min=span_min)), AnpdDrafter(NgramConfig(max_n=3, span_min=span_min))
    drafter.begin(prompt)
    twin.begin(prompt)
    ahead = [3, 4, 5]
    twin.commit(ahead, n_proposed=0)
    keys = len(drafter.tables)
    draft = drafter.propose_ahead(prompt, ahead, 4)
    assert draft.tokens.tolist() == twin.propose(prompt + ahead, 4).tokens.tolist() == [6, 7, 8, 9]
    assert drafter.tables.tail == [1, 2] and len(drafter.tables) == keys  # nothing of `ahead` indexed
    assert drafter.propose(prompt, 2).tokens.tolist() == [3, 4]


def test_anpd_learns_from_its_own_tokens_after_the_ahead_only():
    """After `propose_ahead`, commit gets the step's committed tokens and the whole draft's
    length: the drafter's outcomes count its own tokens (two accepted, one rejected here), and
    nothing where the uncommitted tokens before them were not all accepted."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    config = NgramConfig(max_n=3, span_min=0)
    drafter = AnpdDrafter(config)
    drafter.begin(prompt)
    drafter.propose_ahead(prompt, [3, 4], 3)  # drafts 5, 6, 7
    drafter.commit([3, 4, 5, 6, 99], n_proposed=5)
    assert sum(a for a, _ in drafter._outcomes.values()) == 2 and sum(r for _, r in drafter._outcomes.values()) == 1
    fresh = AnpdDrafter(config)
    fresh.begin(prompt)
    fresh.propose_ahead(prompt, [3, 4], 3)
    fresh.commit([3, 77], n_proposed=5)  # the second uncommitted token was rejected: the draft was never judged
    assert fresh._outcomes == {}
    assert fresh.tables.tail == [3, 77]


def test_anpd_confidence_rises_while_drafts_are_accepted():
    """Confidence is the drafter's estimate of P(accepted); a run of accepted drafts of the same
    kind must raise it."""
    drafter = AnpdDrafter(NgramConfig(max_n=2, span_min=0))  # n-gram kinds only (no long-match copies)
    context = [4, 4]
    drafter.begin(context)
    confidences = []
    for _ in range(8):
        draft = drafter.propose(context, 1)
        assert draft.tokens.tolist() == [4]
        assert len(draft.confidence) == 1  # ANPD attaches a confidence to every drafted token
        confidences.append(draft.confidence[0])
        drafter.commit([4, 4], n_proposed=1)  # the draft was accepted, then 4 again
        context += [4, 4]
    assert confidences[-3] < confidences[-2] < confidences[-1] < 1.0


# -- prompt lookup -------------------------------------------------------------------------------

def test_prompt_lookup_earliest_match():
    context = [7, 8, 1, 7, 8, 2, 7, 8]
    assert prompt_lookup(context, max_ngram=2, k=3) == [1, 7, 8]  # earliest (7, 8) is at 0


def test_prompt_lookup_longest_n_first():
    # (9, 7, 8) occurs once, late; (7, 8) alone occurs earlier: the trigram match wins
    context = [7, 8, 1, 9, 7, 8, 2, 9, 7, 8]
    assert prompt_lookup(context, max_ngram=3, k=2) == [2, 9]
    assert prompt_lookup(context, max_ngram=2, k=2) == [1, 9]


def test_prompt_lookup_nothing_when_no_match():
    assert prompt_lookup([1, 2, 3, 4], max_ngram=3, k=5) == []
    assert prompt_lookup([1], max_ngram=3, k=5) == []
    assert prompt_lookup([1, 2, 1], max_ngram=3, k=0) == []


def test_prompt_lookup_excludes_the_trailing_ngram_itself():
    # the only occurrence of (5, 6) is the trailing one; the unigram (6,) occurs only there too
    assert prompt_lookup([1, 5, 6], max_ngram=2, k=3) == []
    # a repeated token: the trailing unigram (3,) matches its earlier copy, which is followed by
    # the trailing token itself
    assert prompt_lookup([3, 3], max_ngram=2, k=3) == [3]


def test_prompt_lookup_copies_up_to_k_and_to_the_end_of_context():
    context = [1, 2, 3, 4, 5, 1, 2]
    assert prompt_lookup(context, max_ngram=2, k=10) == [3, 4, 5, 1, 2]
    assert prompt_lookup(context, max_ngram=2, k=2) == [3, 4]


@PROPERTY
@given(context=st.lists(st.integers(0, 3), min_size=0, max_size=60), max_ngram=st.integers(1, 4),
       k=st.integers(0, 8))
def test_prompt_lookup_matches_reference(context, max_ngram, k):
    assert prompt_lookup(context, max_ngram, k) == reference_prompt_lookup(context, max_ngram, k)


def test_prompt_lookup_drafter():
    drafter = PromptLookupDrafter(max_ngram=2)
    drafter.begin([1, 2, 3, 1, 2])
    assert drafter.propose([1, 2, 3, 1, 2], 2).tokens.tolist() == [3, 1]
    with pytest.raises(ConfigError):
        PromptLookupDrafter(max_ngram=0)


# -- what a tree may branch into -------------------------------------------------------------------

def test_tree_options_offer_every_continuation_of_the_longest_key_then_other_keys_winners():
    own = NgramTables(max_n=4, min_n=2)
    # after (5, 6, 7): 1 twice, 2 once; after (6, 7) also 3 (twice, in another context); after (7,): 4 thrice
    own.extend([5, 6, 7, 1, 5, 6, 7, 1, 5, 6, 7, 2, 9, 6, 7, 3, 8, 6, 7, 3, 0, 7, 4, 0, 7, 4, 0, 7, 4])
    memory = NgramTables(max_n=4, min_n=2)
    memory.extend([5, 6, 7, 8, 5, 6, 7, 8, 0, 0, 7, 2])  # the memory's winner after (5, 6, 7): 8
    tail = [5, 6, 7]
    options = tree_options(own, memory, tail)
    # level 4, own: 1 then 2 (by count); level 4, memory: its winner 8; level 3: 3; level 2: 4
    assert [m.token for m in options] == [1, 2, 8, 3, 4]
    assert [(m.n, m.remembered) for m in options] == [(4, False), (4, False), (4, True), (3, False), (2, False)]
    assert [m.token for m in tree_options(own, None, tail)] == [1, 2, 3, 4]
    assert tree_options(NgramTables(max_n=4, min_n=2), None, tail) == []


@PROPERTY
@given(own_stream=st.lists(st.integers(0, 6), max_size=120), memory_stream=st.lists(st.integers(0, 6), max_size=120),
       tail=st.lists(st.integers(0, 6), min_size=0, max_size=4), max_n=st.integers(2, 5))
def test_a_trees_first_option_is_the_linear_drafts_token(own_stream, memory_stream, tail, max_n):
    own, memory = NgramTables(max_n=max_n, min_n=2), NgramTables(max_n=max_n, min_n=2)
    own_stream = own_stream + tail
    own.extend(own_stream)
    memory.extend(memory_stream)
    tail = own.tail
    linear = own.draft_matches(1, memory)
    options = tree_options(own, memory, tail)
    assert options[:1] == linear
    tokens = [m.token for m in options]
    assert len(tokens) == len(set(tokens))
    for m in options:  # each option really followed its key, in its own tables
        stream = memory_stream if m.remembered else own_stream
        assert m.token in followers(stream, tuple(tail[len(tail) - (m.n - 1):]))


def test_a_fresh_trees_alternatives_start_less_trusted_than_its_winners():
    """Alternatives held the target's token about a tenth of the time in replays: a fresh one
    starts well below a fresh winner (no evidence: even odds), and outcomes still move it."""
    drafter = AnpdDrafter(NgramConfig())
    drafter.begin([1, 2])
    winner, alternative = (3, 1, False), (3, 1, False, 1)
    assert drafter._confidence(winner) == 0.5
    assert drafter._confidence(alternative) < 0.25
    for _ in range(20):
        drafter._learn(alternative, True)
    assert drafter._confidence(alternative) > 0.75


def test_a_longer_matchs_copy_is_trusted_at_least_as_a_shorter_ones():
    """While a copy goes on, its tokens' matches grow into longer buckets: one never seen before
    starts from what the shorter ones earned, not from the prior, and its own outcomes still
    count where they say more."""
    from verispec.core.drafters.ngram import span_kind

    drafter = AnpdDrafter(NgramConfig())
    drafter.begin([1, 2])
    short, longer, longest = span_kind(8, False), span_kind(16, False), span_kind(32, False)
    fresh = drafter._confidence(longest)
    for _ in range(30):
        drafter._learn(short, True)
    assert drafter._confidence(short) > 0.95
    assert drafter._confidence(longer) == drafter._confidence(longest) == drafter._confidence(short) > fresh
    for _ in range(60):
        drafter._learn(longest, True)
    assert drafter._confidence(longest) > drafter._confidence(short)
    assert drafter._confidence(span_kind(4, False)) == fresh  # a shorter match gains nothing from longer ones
