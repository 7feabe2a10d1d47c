"""Long-match copying for ANPD (`drafters.spans.SpanIndex`, `NgramConfig.span_min`): the index
finds the longest earlier match (checked against a brute-force search), stays within its bounds,
and the drafter copies after a long match where the n-gram tables would predict otherwise, with
confidence kinds by match length whose outcomes the memory keeps across requests. Outputs stay
`ar`'s (the memory's tests and the equivalence suite run ANPD with long matches on by default)."""

from __future__ import annotations

import random

import pytest

import helpers
from verispec.core.drafters.ngram import MEMORY_ATTACHMENT, AnpdDrafter, NgramConfig, NgramMemory, span_kind
from verispec.core.drafters.spans import SpanIndex
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build, parse_variant


def brute_longest(streams: dict[int, list[int]], stream: int, key: int, max_back: int):
    """(length, source, end) of the longest match, ties to the latest-indexed position, by search."""
    tail = streams[stream]
    best = None
    for order, (source, end) in enumerate((s, e) for s, tokens in streams.items() for e in range(key, len(tokens) + 1)):
        tokens = streams[source]
        if end >= len(tokens) or tokens[end - key : end] != tail[-key:]:
            continue
        length = key
        while length < min(max_back, len(tail), end) and tokens[end - length - 1] == tail[-length - 1]:
            length += 1
        best = max(best or (0, 0, 0, 0), (length, order, source, end))
    return None if best is None else best[::2][:1] + best[2:]


@pytest.mark.parametrize("seed", range(6))
def test_longest_equals_a_brute_force_search(seed):
    rng = random.Random(seed)
    index = SpanIndex(key=2, per_key=1000, max_back=12)
    streams: dict[int, list[int]] = {}
    for _ in range(3):
        stream = index.new_stream()
        streams[stream] = []
        for _ in range(rng.randrange(20, 80)):
            token = rng.randrange(4)  # a small vocabulary: many matches, of many lengths
            index.extend(stream, [token])
            streams[stream].append(token)
            found = index.longest(stream)
            expected = brute_longest(streams, stream, 2, 12)
            if expected is None:
                assert found is None
                continue
            length, source, end = expected
            assert (found.length, found.start, found.other) == (length, end, source != stream)
            assert found.stream is index._streams[source]


@pytest.mark.parametrize("seed", range(4))
def test_a_look_up_ahead_matches_as_if_the_tokens_followed_and_indexes_nothing(seed):
    """`longest(stream, ahead)`: the longest match of the stream followed by `ahead` (searched by
    brute force), without indexing `ahead`."""
    rng = random.Random(seed)
    index = SpanIndex(key=2, per_key=1000, max_back=12)
    stream = index.new_stream()
    tokens = [rng.randrange(4) for _ in range(60)]
    index.extend(stream, tokens)
    for _ in range(30):
        ahead = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
        tail = tokens + ahead
        expected = None  # (length, end), ties to the most recent
        for end in range(2, len(tokens)):
            if tokens[end - 2 : end] != tail[-2:]:
                continue
            length = 2
            while length < min(12, end) and tokens[end - length - 1] == tail[-length - 1]:
                length += 1
            if expected is None or length >= expected[0]:
                expected = (length, end)
        found = index.longest(stream, ahead)
        assert (None if found is None else (found.length, found.start)) == expected
    assert index.tokens_held == len(tokens) and list(index._streams[stream]) == tokens


def test_ties_go_to_the_most_recent_occurrence():
    index = SpanIndex(key=2)
    stream = index.new_stream()
    index.extend(stream, [1, 2, 3, 9, 1, 2, 4, 9, 1, 2])
    found = index.longest(stream)
    assert found.length == 3 and found.tokens(2) == [4, 9]  # "9 1 2" twice: the later one wins


def test_bounds_hold_over_many_streams():
    rng = random.Random(0)
    index = SpanIndex(key=3, per_key=2, max_tokens=500, max_keys=200)
    for _ in range(40):
        stream = index.new_stream()
        for _ in range(5):
            index.extend(stream, [rng.randrange(50) for _ in range(12)])
            assert index.tokens_held <= 500 and index.keys_held <= 200
            assert all(len(ends) <= 2 for ends in index._ends.values())
            index.longest(stream)  # entries into evicted streams are skipped, not followed
    assert index.tokens_held > 400  # evicts whole old streams only as needed


def test_a_stream_being_written_is_never_evicted():
    index = SpanIndex(key=2, max_tokens=10)
    old, current = index.new_stream(), index.new_stream()
    index.extend(old, [1, 2, 3])
    index.extend(current, list(range(20, 40)))  # alone above the bound: the old stream goes
    assert index.tokens_held == 20 and index.longest(current) is None
    index.extend(current, [20, 21])
    assert index.longest(current).tokens(1) == [22]


def long_match_context() -> tuple[list[int], int, int]:
    """A context whose end (the last 16 tokens) occurred before followed by `copied`, while its
    last 4 tokens were followed far more often by `frequent`, which n-gram tables predict."""
    phrase = list(range(100, 116))
    copied, frequent = 7, 8
    context = phrase + [copied] + (phrase[-4:] + [frequent, 50]) * 3 + phrase
    return context, copied, frequent


def test_the_drafter_copies_after_a_long_match_where_the_tables_predict_otherwise():
    context, copied, frequent = long_match_context()
    with_spans, without = AnpdDrafter(NgramConfig()), AnpdDrafter(NgramConfig(span_min=0))
    for drafter in (with_spans, without):
        drafter.begin(context)
    assert without.propose(context, 4).tokens.tolist()[0] == frequent
    draft = with_spans.propose(context, 4)
    assert draft.tokens.tolist() == [copied, *context[17:20]]  # what followed the phrase, copied
    assert with_spans._last_kinds == [span_kind(16 + j, False) for j in range(4)]


def test_no_copy_below_span_min():
    context, copied, frequent = long_match_context()
    drafter = AnpdDrafter(NgramConfig(span_min=20))  # the match is 16 tokens long
    drafter.begin(context)
    assert drafter.propose(context, 4).tokens.tolist()[0] == frequent


def test_the_memory_copies_from_an_earlier_request_and_keeps_what_it_learned():
    memory = NgramMemory(NgramConfig())
    first = AnpdDrafter(NgramConfig(), memory)
    answer = list(range(200, 240))
    first.begin([1, 2, 3])
    first.commit(answer, 0)
    second = AnpdDrafter(NgramConfig(), memory)
    second.begin([9] + answer[:12])
    draft = second.propose([9] + answer[:12], 6)
    assert draft.tokens.tolist() == answer[12:18]
    kind = span_kind(12, True)
    assert second._last_kinds[0] == kind
    prior = draft.confidence[0]
    second.commit(answer[12:18] + [0], 6)  # all six accepted
    assert memory.outcomes[kind] == [4, 0]  # the copies at match lengths 12..15 share a kind
    assert memory.outcomes[span_kind(16, True)] == [2, 0]
    third = AnpdDrafter(NgramConfig(), memory)  # a later request starts from what was learned
    third.begin([9] + answer[:12])
    assert third.propose([9] + answer[:12], 6).confidence[0] > prior
    alone = AnpdDrafter(NgramConfig())  # without the memory: nothing learned elsewhere
    alone.begin([9] + answer[:12] + [5] + answer[:12])
    assert alone.propose([], 1).confidence[0] == pytest.approx(prior)


def test_options_are_validated():
    for bad in (3, 33, -1, True, 8.0):
        with pytest.raises(ConfigError, match="span_min"):
            NgramConfig(span_min=bad)
    with pytest.raises(ConfigError, match="span_min"):
        MethodOptions(span_min=2)
    assert parse_variant("anpd/span_min=0")[2] == {"span_min": 0}
    with pytest.raises(ConfigError, match="an anpd/hybrid option"):
        parse_variant("pld/span_min=8")
    with pytest.raises(ConfigError, match="integer"):
        parse_variant("anpd/span_min=x")


@pytest.mark.parametrize("span_min", [0, 4])
def test_outputs_equal_ar_with_and_without_long_matches(span_min):
    target = helpers.make_target_for_path("llama", seed=0)
    prompt = helpers.repetitive_prompt(128, 3, period=6, repeats=4)
    expected, _, _ = helpers.run(target, build("ar", target), prompt, 40)
    options = MethodOptions(span_min=span_min, controller="constant:8")
    for _ in range(2):  # the second request also copies from the first, through the memory
        ids, stats, _ = helpers.run(target, build("anpd", target, options), prompt, 40)
        assert ids == expected and stats.new_tokens == stats.target_forwards + stats.accepted
    copies = [kind for kind in target.attachments[MEMORY_ATTACHMENT][NgramConfig(span_min=span_min)].outcomes
              if kind[0] == "span"]
    assert bool(copies) == bool(span_min)  # the copies were drafted (and only where switched on)


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-m", "pld", "--span-min", "8"], "--span-min is used only by anpd, hybrid, not by pld"),
    (["generate", "hi", "--span-min", "3"], "span_min must be 0 (off) or an integer from 4 to 32"),
    (["bench", "--methods", "ar,anpd/span_min=40"], "span_min must be 0 (off) or an integer from 4 to 32"),
])
def test_the_cli_refuses_bad_span_options_before_loading(monkeypatch, tmp_path, args, message):
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, args, message)


def test_the_option_reaches_the_drafter():
    target = helpers.make_target_for_path("llama", seed=0)
    for span_min in (0, 12):
        drafter = build("anpd", target, MethodOptions(span_min=span_min)).drafter
        assert drafter.config.span_min == span_min


def test_a_tree_drafter_copies_a_long_match_as_a_single_path_within_its_budget():
    context, copied, frequent = long_match_context()
    drafter = AnpdDrafter(NgramConfig(), tree=3)
    drafter.begin(context)
    draft = drafter.propose(context, 8)
    assert draft.tokens.tolist() == [copied, *context[17:19]] and draft.parents is None
    drafter.commit([copied, context[17], 0], 3)  # two accepted: outcomes learned as a linear draft's
    assert drafter._outcomes[span_kind(16, False)] == [2, 1]  # match lengths 16..18 share a kind
    no_spans = AnpdDrafter(NgramConfig(span_min=0), tree=3)
    no_spans.begin(context)
    assert no_spans.propose(context, 8).parents is not None  # elsewhere: a tree from the tables
