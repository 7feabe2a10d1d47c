"""The `suffix` method (SuffixDecoding through arctic-inference): outputs equal `ar`'s, greedy
and (in distribution and seed by seed) sampled; the tree-to-path reduction; the request life
cycle on the shared cache; bad knobs refused; a clean error when the package is missing.

Tests that need arctic-inference skip when it is not installed (`make suffix` builds it; CI may
not); the reduction, the knobs and the missing-package error run without it.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter

import pytest
import torch

import helpers
from verispec import api
from verispec.core.acceptance import verify_lossless
from verispec.core.control import ConstantLength
from verispec.core.drafters import suffix
from verispec.core.drafters.suffix import SuffixConfig, SuffixDrafter, best_path, conditional_probs, shared_store
from verispec.core.engine import Recipe
from verispec.errors import ConfigError
from verispec.core.drafters.base import switch_off_memory
from verispec.core.methods import MethodOptions, build, method_names, parse_variant, with_settings
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig

pytestmark = pytest.mark.long  # end to end; left out by make test-quick

ALPHA = 1e-4


def needs_arctic():
    pytest.importorskip("arctic_inference.suffix_decoding", reason="arctic-inference not built (make suffix)")


def stores(target: Target) -> list[suffix.SuffixStore]:
    return list(target.attachments.get(suffix.ATTACHMENT, {}).values())


# -- without the package ---------------------------------------------------------------------------

def test_missing_package_is_a_clean_config_error(monkeypatch):
    # None in sys.modules makes `import` raise ImportError, as if the package were absent.
    monkeypatch.setitem(sys.modules, "arctic_inference", None)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    target = helpers.make_target("llama")
    assert "suffix" in method_names()  # listed whether or not it can run
    for attempt in (lambda: build("suffix", target),
                    lambda: api.generate(target, [1, 2, 3], "suffix", max_new_tokens=4)):
        with pytest.raises(ConfigError) as error:
            attempt()
        assert str(error.value).startswith("the suffix method needs arctic-inference: run `make suffix`")
    assert not stores(target)


def test_best_path_of_a_hand_made_tree():
    #   root 0 (.6) -> 2 (.3), 3 (.3) -> 4 (.25)       sums: 0-2 .9, 0-3-4 1.15
    #   root 1 (.4) -> 5 (.4) -> 6 (.4) -> 7 (.35)     sum: 1.55, the best, though root 0 is likelier
    parents = [-1, -1, 0, 0, 3, 1, 5, 6]
    probs = [0.6, 0.4, 0.3, 0.3, 0.25, 0.4, 0.4, 0.35]
    assert best_path(parents, probs) == [1, 5, 6, 7]
    assert conditional_probs([1, 5, 6, 7], parents, probs) == pytest.approx([0.4, 1.0, 1.0, 0.875])
    # without the long branch, the best path goes through node 3 (deeper), not node 2
    assert best_path(parents[:5], probs[:5]) == [0, 3, 4]
    # ties go to the node listed first; a chain comes back whole; nothing gives nothing
    assert best_path([-1, 0, 0], [1.0, 0.5, 0.5]) == [0, 1]
    assert best_path([-1, -1], [0.5, 0.5]) == [0]
    assert best_path([-1, 0, 1, 2], [1.0, 1.0, 0.5, 0.2]) == [0, 1, 2, 3]
    assert best_path([], []) == []
    with pytest.raises(ValueError):
        best_path([-1, 2, 0], [1.0, 0.5, 0.5])  # a parent after its child
    with pytest.raises(ValueError):
        best_path([-1, 0], [1.0])


@pytest.mark.parametrize("knobs", [dict(max_tree_depth=0), dict(max_tree_depth=2.5), dict(max_tree_depth=True),
                                   dict(max_cached_requests=-2), dict(max_cached_requests=2**31),
                                   dict(max_spec_factor=0), dict(max_spec_factor="1"), dict(min_token_prob=-0.1),
                                   dict(min_token_prob=1.5), dict(tree="yes")])
def test_bad_knobs_are_refused(knobs):
    with pytest.raises(ConfigError):
        SuffixConfig(**knobs)


@pytest.mark.parametrize("make", [lambda: MethodOptions(draft_length=0), lambda: MethodOptions(controller="adaptive:0"),
                                  lambda: MethodOptions(controller="nonsense"),
                                  lambda: parse_variant("suffix/constant:x"),
                                  lambda: parse_variant("suffix/max_tree_depth=0"),
                                  lambda: parse_variant(f"suffix/max_tree_depth={suffix.MAX_TREE_DEPTH + 1}"),
                                  lambda: parse_variant("suffix/max_tree_depth=x"),
                                  lambda: parse_variant("suffix/max_spec_factor=0"),
                                  lambda: parse_variant("suffix/min_token_prob=1.5"),
                                  lambda: parse_variant("suffix/max_cached_requests=-2"),
                                  lambda: parse_variant("anpd/max_spec_factor=2"),  # a suffix option
                                  lambda: parse_variant("pld/max_cached_requests=0"),
                                  # memory off and a size for it: one would be ignored
                                  lambda: parse_variant("suffix/ngram_memory=false/max_cached_requests=5"),
                                  lambda: with_settings("suffix/max_spec_factor=2", MethodOptions(max_spec_factor=3.0))])
def test_bad_method_options_are_refused(make):
    with pytest.raises(ConfigError):
        make()


# -- with the package ------------------------------------------------------------------------------

def run_requests(target, prompts, options=MethodOptions(), max_new=40):
    """ar and suffix on each prompt in turn, on one target; asserts equal outputs; suffix stats."""
    out = []
    for prompt in prompts:
        ar = helpers.run(target, build("ar", target), prompt, max_new)[0]
        ids, stats, _ = helpers.run(target, build("suffix", target, options), prompt, max_new)
        assert ids == ar, (prompt, options)
        out.append(stats)
    return out


@pytest.mark.parametrize("arch", helpers.ARCHITECTURES)
def test_greedy_suffix_equals_ar(arch):
    needs_arctic()
    target = helpers.make_target(arch)
    prompts = [helpers.repetitive_prompt(128, seed) for seed in range(3)] + [helpers.repetitive_prompt(128, 0)]
    for options in (MethodOptions(), MethodOptions(draft_length=3), MethodOptions(controller="adaptive")):
        stats = run_requests(target, prompts, options)
        assert sum(s.drafted for s in stats) > 0, options
        if options.controller is None:  # constant (adaptive cuts by measured time: it may not reject)
            assert sum(s.accepted for s in stats) > 0 and any(s.accepted < s.drafted for s in stats), options
    assert len(stores(target)) == 1  # one cache per target, shared by the requests
    # the tree mode, reduced to its best path, is lossless too
    drafter = SuffixDrafter.for_target(target.attachments, SuffixConfig(tree=True))
    for prompt in prompts:
        ar = helpers.run(target, build("ar", target), prompt, 40)[0]
        assert helpers.run(target, Recipe(drafter, ConstantLength(8), verify_lossless), prompt, 40)[0] == ar


def test_the_global_cache_drafts_from_earlier_outputs():
    needs_arctic()
    target = helpers.make_target("llama")
    prompts = [torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8)]
    options = MethodOptions(controller="constant:24")
    first = run_requests(target, prompts, options, max_new=60)
    store = stores(target)[0]
    assert len(store.cache.cached_requests) == 2
    again = run_requests(target, prompts, options, max_new=60)
    for before, after in zip(first, again):
        assert after.accepted > before.accepted and after.accepted >= 0.7 * after.new_tokens, (before, after)
    # without the global tree (prompt trees only) the repeat gains nothing
    fresh = helpers.make_target("llama")
    shared_store(fresh.attachments, SuffixConfig(max_cached_requests=0))
    drafter = lambda: SuffixDrafter.for_target(fresh.attachments, SuffixConfig(max_cached_requests=0))  # noqa: E731
    runs = [helpers.run(fresh, Recipe(drafter(), ConstantLength(24), verify_lossless), p, 60)[1]
            for p in prompts + prompts]
    assert [s.accepted for s in runs[:2]] == [s.accepted for s in runs[2:]]


def test_method_settings_reach_the_cache():
    """suffix/KEY=VALUE sets the cache's knobs; a smaller spec factor drafts less on the same
    requests (the knob reaches `speculate`), with the same outputs."""
    needs_arctic()
    name, options = with_settings("suffix/max_tree_depth=8/max_spec_factor=0.5/min_token_prob=0.3/max_cached_requests=2")
    target = helpers.make_target("llama")
    store = build(name, target, options).drafter.store
    assert store.config == SuffixConfig(max_tree_depth=8, max_cached_requests=2, max_spec_factor=0.5,
                                        min_token_prob=0.3)
    assert (store.cache.max_tree_depth, store.cache.max_cached_requests) == (8, 2)
    prompts = [helpers.repetitive_prompt(128, seed) for seed in range(2)]
    drafted = {}
    for spec in ("suffix/constant:24", "suffix/constant:24/max_spec_factor=0.25"):
        name, options = with_settings(spec)
        drafted[spec] = sum(s.drafted for s in run_requests(helpers.make_target("llama"), prompts, options))
    assert 0 < drafted["suffix/constant:24/max_spec_factor=0.25"] < drafted["suffix/constant:24"], drafted


@pytest.mark.parametrize("switch", ["option", "target"])
def test_without_memory_there_is_no_global_tree(switch):
    """ngram_memory=false, or a target whose memory is switched off (the server's
    --no-ngram-memory, whatever the request asks), keeps no earlier output: the same requests
    again draft exactly as the first time."""
    needs_arctic()
    target = helpers.make_target("llama")
    prompts = [torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8)]
    options = MethodOptions(controller="constant:24")
    if switch == "option":
        options = MethodOptions(controller="constant:24", ngram_memory=False)
    else:
        switch_off_memory(target.attachments)
    first = run_requests(target, prompts, options, max_new=60)
    again = run_requests(target, prompts, options, max_new=60)
    assert [s.accepted for s in again] == [s.accepted for s in first]
    assert [store.config.max_cached_requests for store in stores(target)] == [0]
    assert not stores(target)[0].cache.cached_requests


def test_stores_are_bounded():
    needs_arctic()
    attachments: dict = {}
    for depth in range(1, suffix.MAX_STORES + 3):
        last = shared_store(attachments, SuffixConfig(max_tree_depth=depth))
    assert len(attachments[suffix.ATTACHMENT]) == suffix.MAX_STORES
    assert shared_store(attachments, SuffixConfig(max_tree_depth=suffix.MAX_STORES + 2)) is last


def test_requests_are_stopped():
    needs_arctic()
    target = helpers.make_target("llama")
    prompt = helpers.repetitive_prompt(128, 1)
    store = shared_store(target.attachments)
    # a drafter that begins again stops its previous request
    drafter = SuffixDrafter(store)
    drafter.begin(prompt)
    first = drafter.request
    drafter.begin(prompt)
    assert first not in store.cache.active_requests and drafter.request in store.cache.active_requests
    assert first in store.cache.cached_requests  # its output stays in the global cache
    # a collected drafter's request is stopped at the next begin on the store
    del drafter
    gc.collect()
    for _ in range(3):
        helpers.run(target, build("suffix", target), prompt, 10)
        gc.collect()
    keep = SuffixDrafter(store)
    keep.begin(prompt)
    assert list(store.cache.active_requests) == [keep.request]
    assert len(store.cache.cached_requests) == 6


def test_active_requests_are_bounded(monkeypatch):
    needs_arctic()
    monkeypatch.setattr(suffix, "MAX_ACTIVE", 2)
    store = suffix.SuffixStore()
    prompt = [1, 2, 3, 4] * 4
    drafters = [SuffixDrafter(store) for _ in range(3)]
    for d in drafters:
        d.begin(prompt)
    assert len(store.cache.active_requests) == 2 and drafters[0].request not in store.cache.active_requests
    assert len(drafters[0].propose(prompt, 4)) == 0  # stopped: drafts nothing, raises nothing
    drafters[0].commit([1], 0)
    assert list(drafters[1].propose(prompt[:-1], 4).tokens) == [4, 1, 2, 3]
    draft = drafters[1].propose(prompt, 3)
    assert len(draft) == 3 and len(draft.confidence) == 3 and all(0 < c <= 1 for c in draft.confidence)


def test_tree_speculation_reduces_to_a_path_of_the_tree():
    needs_arctic()
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24)
    cache.start_request("r", [5, 1, 2, 3, 4, 5, 1, 2, 9, 9, 5, 1, 2, 3, 7, 5, 1, 2, 3, 4])
    tree = cache.speculate("r", [8, 5, 1, 2], max_spec_tokens=8, min_token_prob=0.1, use_tree_spec=True)
    assert len(tree.token_ids) > len(set(tree.parents)) - 1  # a real tree: some node has two children
    path = best_path(tree.parents, tree.probs)
    tokens = [tree.token_ids[i] for i in path]
    assert tokens[:2] == [3, 4]  # the most frequent continuation of 5 1 2, then of 5 1 2 3
    assert all(tree.parents[b] == a for a, b in zip(path, path[1:])) and tree.parents[path[0]] == -1
    chain = cache.speculate("r", [8, 5, 1, 2], max_spec_tokens=8, min_token_prob=0.1, use_tree_spec=False)
    assert best_path(chain.parents, chain.probs) == list(range(len(chain.token_ids)))


def test_sampled_suffix_is_lossless():
    needs_arctic()
    vocab, prompt, length, max_new, seeds = 8, [1, 2, 3, 1, 2, 3, 1, 2], 3, 6, 300
    micro = Target(helpers.make_model(helpers.micro_llama_config(vocab, init=0.3), seed=0), None, name="micro")
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(micro.model, prompt, length, sampling)
    for options in (MethodOptions(), MethodOptions(controller="adaptive:4")):
        outcomes, same, accepted, drafted = [], 0, 0, 0
        for seed in range(seeds):
            config = SamplingConfig(sampling.temperature, seed=seed)
            ar = helpers.run(micro, build("ar", micro), prompt, max_new, config)[0]
            ids, stats, _ = helpers.run(micro, build("suffix", micro, options, config), prompt, max_new, config)
            outcomes.append(tuple(ids[:length]))
            same += ids == ar
            accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        if options.controller is None:  # constant (adaptive cuts by measured time: it may not draft)
            assert 0.02 * seeds < accepted < drafted, (accepted, drafted)  # both outcomes seen
        statistic, pvalue, df = helpers.chi_square_pvalue(Counter(outcomes), exact)
        assert pvalue > ALPHA, f"{options}: chi2={statistic:.1f}, df={df}, p={pvalue:.2e}"
        assert same >= 0.995 * seeds, f"{options}: only {same}/{seeds} seeds reproduce ar"


def test_bench_gives_each_method_and_repeat_its_own_suffix_cache(tmp_path):
    """As for ANPD's memory: in the benchmark a suffix variant never drafts from the warm-up's,
    another variant's or an earlier repeat's outputs (its first prompt drafts as from an empty
    cache), while its later prompts draft from its own earlier outputs."""
    needs_arctic()
    from test_ngram_memory import _bench, text_target

    from verispec.bench.datasets import Question

    target = text_target()
    questions = [Question(i, "c", "the cat sat on the mat " * 2) for i in range(3)]
    methods = ["suffix", "suffix/constant:12"]
    records = _bench(target, tmp_path, methods, questions, repeats=2)
    by = {(r["question_id"], r["method"], r["repeat"]): r for r in records}
    firsts = {by[(0, method, repeat)]["accepted"] for method in methods for repeat in (0, 1)}
    assert len(firsts) == 1, firsts
    for method in methods:
        for repeat in (0, 1):
            assert by[(2, method, repeat)]["accepted"] > by[(0, method, repeat)]["accepted"], (method, repeat)
    assert suffix.ATTACHMENT not in target.attachments  # restored as it was
