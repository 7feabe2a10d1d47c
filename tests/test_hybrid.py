"""The hybrid drafter: its cost model, its choice between the n-gram and the model draft, and
its exactness (greedy equal to ar; sampled following ar's distribution)."""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.core.drafters.base import Draft
from verispec.core.drafters.hybrid import HybridDrafter, ModelAcceptance, best_model_length, expected_tokens
from verispec.core.methods import MethodOptions, build
from verispec.core.sampling import SamplingConfig


def test_expected_tokens_of_a_draft():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1.75)


def test_the_best_model_length_weighs_acceptance_against_cost():
    assert best_model_length(0.0, 0.1, 8) == (0, 1.0)  # nothing accepted: no draft
    assert best_model_length(0.9, 1.0, 8)[0] == 0  # a draft step as dear as the target's never pays
    length, rate = best_model_length(0.9, 0.1, 16)
    assert 4 <= length <= 16 and rate > 2.0
    assert best_model_length(0.95, 0.05, 16)[0] > best_model_length(0.6, 0.05, 16)[0]


class _Stub:
    def __init__(self, draft):
        self.draft, self.commits, self.proposed_with = draft, [], None

    def begin(self, prompt):
        pass

    def propose(self, context, k, keep):
        self.proposed_with = k
        return self.draft

    def proposing(self, context, k, keep):
        self.proposed_with = k
        return self.draft
        yield  # a generator, as SampledDrafter.proposing is

    def commit(self, committed, n_proposed):
        self.commits.append(n_proposed)


def _draft(tokens, confidence):
    return Draft(torch.tensor(tokens, dtype=torch.long), confidence=tuple(confidence))


@pytest.mark.parametrize("confidence,cost,source", [
    ([0.95, 0.95, 0.95, 0.95], 0.45, "ngram"),  # a confident copy beats a dear draft model
    ([0.2], 0.05, "model"),  # a weak n-gram guess loses to a cheap, good draft model
    ([], 0.05, "model"),  # no n-gram match at all
])
def test_the_draft_expected_to_pay_more_is_verified(confidence, cost, source):
    ngram = _Stub(_draft(list(range(len(confidence))), confidence))
    model = _Stub(_draft([7, 8], [0.9, 0.9]))
    drafter = HybridDrafter(ngram, model, cost)
    draft = drafter.propose([1, 2, 3], 8)
    assert draft is (ngram.draft if source == "ngram" else model.draft)
    drafter.commit([9], len(draft.tokens))
    assert (ngram.commits, model.commits) == (([len(draft.tokens)], [0]) if source == "ngram"
                                              else ([0], [len(draft.tokens)]))


def test_model_drafts_teach_the_acceptance():
    model = _Stub(_draft([7, 8, 9, 10], [0.9] * 4))
    drafter = HybridDrafter(_Stub(_draft([], [])), model, 0.05)
    before = drafter.model_acceptance
    drafter.propose([1], 8)
    drafter.commit([5], 4)  # none of the 4 accepted
    assert drafter.model_acceptance < before


def test_what_model_drafts_earned_carries_over_to_the_next_request():
    """Requests sharing a target share one `ModelAcceptance`: after a request whose model drafts
    were all rejected, the next one drafts with the model far less often than a fresh one would."""
    shared = ModelAcceptance()
    first = HybridDrafter(_Stub(_draft([], [])), _Stub(_draft([7, 8], [0.9, 0.9])), 0.2, shared)
    for _ in range(40):
        draft = first.propose([1], 2)
        first.commit([5], len(draft.tokens))  # nothing accepted
    assert shared.mean < 0.1

    def model_share(acceptance: ModelAcceptance) -> float:
        """The share of 500 new requests that take the model's draft at their first step."""
        chosen = 0
        for _ in range(500):
            model = _Stub(_draft([7, 8], [0.9, 0.9]))
            chosen += HybridDrafter(_Stub(_draft([], [])), model, 0.2, acceptance).propose([1], 2) is model.draft
        return chosen / 500

    assert model_share(ModelAcceptance()) > 0.9  # the prior: model drafts are tried
    assert 0 < model_share(shared) < 0.1  # now rarely, but still now and then (Thompson draws)


def test_a_request_that_leaves_the_model_out_does_not_begin_it_and_may_share_forwards():
    class Begun(_Stub):
        begun = 0
        in_target_sequence = True  # as an exit head: its verifies keep its states

        def begin(self, prompt):
            self.begun += 1

        def kv_claims(self, prompt_tokens, max_new_tokens):
            return ["claim"]

    # a request the model sits out does not begin it (an exit head's verifies keep no states)
    poor = ModelAcceptance(64.0, 2.0)  # 2 of 64 drafted tokens accepted
    model = Begun(_draft([7, 8], [0.9, 0.9]))
    for _ in range(20):
        HybridDrafter(_Stub(_draft([], [])), model, 0.2, poor).begin([1])
    assert model.begun < 5
    fresh = Begun(_draft([7, 8], [0.9, 0.9]))
    taking_part = HybridDrafter(_Stub(_draft([], [])), fresh, 0.2)
    assert taking_part.in_target_sequence and taking_part.kv_claims(8, 8) == ["claim"]
    taking_part.begin([1])
    assert fresh.begun == 1
    # ... and where it sits out, the request may share the batch's forwards and claims nothing for it
    sitting_out = HybridDrafter(_Stub(_draft([], [])), Begun(_draft([7], [0.9])), 0.2, poor)
    assert not sitting_out.in_target_sequence and sitting_out.kv_claims(8, 8) == []


def test_build_shares_the_acceptance_per_target_and_draft_model(tmp_path):
    target = helpers.make_target("llama", seed=1)
    for directory in (tmp_path / "a", tmp_path / "b"):
        helpers.make_model(helpers.make_config("llama"), seed=9).save_pretrained(directory)
        helpers.char_tokenizer().save_pretrained(directory)
    first, second, other = (build("hybrid", target, MethodOptions(draft_model=str(tmp_path / name)))
                            for name in ("a", "a", "b"))
    assert first.drafter.acceptance is second.drafter.acceptance
    assert other.drafter.acceptance is not first.drafter.acceptance


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_hybrid_equals_ar(arch, tmp_path, monkeypatch):
    import verispec.core.methods as methods

    monkeypatch.setattr(methods, "draft_cost", lambda target, lm: 0.05)  # tiny models: as if the draft were cheap
    target = helpers.make_target(arch, seed=1, init=0.3)
    helpers.make_model(helpers.make_config(arch, init=0.3), seed=9).save_pretrained(tmp_path)
    helpers.char_tokenizer().save_pretrained(tmp_path)
    used = set()
    for prompt_seed in (0, 1):
        prompt = helpers.repetitive_prompt(target.vocab_size, prompt_seed, period=5, repeats=4)
        reference = helpers.run(target, build("ar", target), prompt, 30)[0]
        recipe = build("hybrid", target, MethodOptions(draft_model=str(tmp_path)))
        sources = []
        original = recipe.drafter.commit

        def spy(committed, n_proposed, original=original, drafter=recipe.drafter):
            sources.append(drafter._source)
            original(committed, n_proposed)

        recipe.drafter.commit = spy
        ids, stats, _ = helpers.run(target, recipe, prompt, 30)
        assert ids == reference
        used |= set(sources)
    assert {"ngram", "model"} <= used  # both kinds of draft were verified


@pytest.mark.long
def test_hybrid_is_lossless_under_sampling(micro, micro_draft, monkeypatch):
    import verispec.core.methods as methods

    monkeypatch.setattr(methods, "draft_cost", lambda target, lm: 0.05)
    monkeypatch.setattr(ModelAcceptance, "draw", lambda self: 0.9)  # the model drafts in every request
    sampling = SamplingConfig(temperature=1.0)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    exact = helpers.exact_sequence_distribution(micro.model, prompt, 3, sampling)
    outcomes, drafted, accepted = [], 0, 0
    for seed in range(500):
        config = SamplingConfig(1.0, 0, 1.0, seed)
        recipe = build("hybrid", micro, MethodOptions(draft_model=str(micro_draft)), config)
        ids, stats, _ = helpers.run(micro, recipe, prompt, 5, config)
        outcomes.append(tuple(ids[:3]))
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted
    helpers.assert_fits(outcomes, exact, "hybrid")


def test_an_ngram_draft_is_cut_where_wider_verifies_stop_paying():
    from verispec.core.control import CostModel

    costs = CostModel()
    for width in range(1, 18):  # a machine where each extra row costs 0.3 of a step
        for _ in range(3):
            costs.observe(width, 1.0 + 0.3 * (width - 1))
    ngram = _Stub(_draft(list(range(8)), [0.95, 0.95, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3]))
    drafter = HybridDrafter(ngram, _Stub(_draft([], [])), 1.0)  # a model draft never pays here
    drafter.measure_with(costs)
    assert len(drafter.propose([1], 8).tokens) == 2
    drafter.measure_with(CostModel())  # the optimistic prior: wide verifies nearly free
    assert len(drafter.propose([1], 8).tokens) > 2


def test_the_measured_controller_feeds_the_hybrid_its_costs(tmp_path):
    target = helpers.make_target("llama", seed=1, init=0.3)
    helpers.make_model(helpers.make_config("llama", init=0.3), seed=9).save_pretrained(tmp_path)
    helpers.char_tokenizer().save_pretrained(tmp_path)
    recipe = build("hybrid", target, MethodOptions(draft_model=str(tmp_path)))
    assert repr(recipe.controller).startswith("measured:")
    assert recipe.drafter.costs is recipe.controller.cost
    recipe.controller.observe(3, 0, (), 0.02, 0.0)
    assert recipe.drafter.costs.seconds == {4: 0.02}
