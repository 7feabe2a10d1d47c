"""sps and mtad: auxiliary-model drafting, beam sampling, the joint rule, cache consistency.

Statistical tests use Pearson's chi-square against the exact distribution of the first three
generated tokens of a micro Llama (8-token vocabulary), with a false-positive rate of
ALPHA = 1e-4 per test; seeds are fixed, so each test is deterministic.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import helpers
from verispec.core.acceptance import joint_likelihood
from verispec.bench.aggregate import repeated_ngrams
from verispec.core.drafters.draft_model import AuxLM, BeamDrafter, OutputNgrams, beam_step, check_same_tokenizer, tree_for_beams
from verispec.errors import ConfigError
from verispec.runtime.static_kv import Tree
from verispec.core.methods import MethodOptions, build, parse_variant
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig

ALPHA = 1e-4
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def first_tokens(target, method, options, sampling, seeds):
    outcomes, drafted, accepted = [], 0, 0
    for seed in range(seeds):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed)
        ids, stats, _ = helpers.run(target, build(method, target, options, config), PROMPT, 5, config)
        outcomes.append(tuple(ids[:3]))
        drafted += stats.drafted
        accepted += stats.accepted
    return outcomes, drafted, accepted



@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_sps_with_a_draft_model_equals_ar(arch, tmp_path):
    target = helpers.make_target(arch, seed=1, init=0.3)
    helpers.make_model(helpers.make_config(arch, init=0.3), seed=9).save_pretrained(tmp_path)
    helpers.char_tokenizer().save_pretrained(tmp_path)
    options = MethodOptions(draft_model=str(tmp_path))
    accepted = drafted = 0
    for prompt_seed in (0, 1):
        prompt = helpers.repetitive_prompt(target.vocab_size, prompt_seed, period=5, repeats=4)
        reference = helpers.run(target, build("ar", target), prompt, 30)[0]
        for controller in ("constant:4", "constant:1", "beta-ts:6"):
            opts = MethodOptions(draft_model=str(tmp_path), controller=controller)
            ids, stats, _ = helpers.run(target, build("sps", target, opts), prompt, 30)
            assert ids == reference, controller
            drafted += stats.drafted
            accepted += stats.accepted
    assert drafted > 0 and options.draft_model == str(tmp_path)


@pytest.mark.long
def test_sps_is_lossless_under_sampling(micro, micro_draft):
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, 3, sampling)
    outcomes, drafted, accepted = first_tokens(micro, "sps", MethodOptions(draft_model=str(micro_draft)), sampling, 500)
    assert 0 < accepted < drafted
    helpers.assert_fits(outcomes, exact, "sps")


@pytest.mark.long
def test_mtad_with_an_impassable_tau_is_autoregressive_sampling(micro, micro_draft):
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, 3, sampling)
    options = MethodOptions(draft_model=str(micro_draft), tau=1e30)
    outcomes, drafted, accepted = first_tokens(micro, "mtad", options, sampling, 500)
    assert drafted > 0 and accepted == 0
    helpers.assert_fits(outcomes, exact, "mtad tau=1e30")


def test_mtad_with_a_tiny_tau_accepts_every_draft(micro, micro_draft):
    sampling = SamplingConfig(temperature=1.0)  # no top-k/top-p: every token has p > 0
    options = MethodOptions(draft_model=str(micro_draft), tau=1e-30)
    _, drafted, accepted = first_tokens(micro, "mtad", options, sampling, 20)
    assert drafted > 0 and accepted == drafted


def test_mtad_defaults_and_greedy_refusal(micro, micro_draft):
    from verispec.api import sampling_for

    config = sampling_for("mtad")
    assert (config.temperature, config.top_k, config.top_p) == (1.0, 10, 0.9)
    assert sampling_for("anpd").greedy
    with pytest.raises(ConfigError, match="temperature"):
        build("mtad", micro, MethodOptions(draft_model=str(micro_draft)), SamplingConfig(temperature=0.0))


def test_beam_step_draws_distinct_pairs_with_normalised_weights():
    generator = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(3, 10, generator=generator), -1)
    log_weights = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))
    parents, tokens, new, token_q = beam_step(log_weights, q, 4, generator)
    pairs = list(zip(parents.tolist(), tokens.tolist()))
    assert len(set(pairs)) == 4
    assert float(torch.logsumexp(new, 0)) == pytest.approx(0.0, abs=1e-12)
    expected = torch.tensor([math.log(float(math.exp(log_weights[p]) * q[p, t])) for p, t in pairs], dtype=torch.float64)
    assert torch.allclose(new, expected - torch.logsumexp(expected, 0))
    assert torch.allclose(token_q, q[parents, tokens])
    # taking every pair returns all of them
    parents, tokens, _, _ = beam_step(log_weights, q, 30, generator)
    assert len(set(zip(parents.tolist(), tokens.tolist()))) == 30


def test_beam_step_single_draw_follows_weight_times_q():
    generator = torch.Generator().manual_seed(1)
    q = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    weights = torch.tensor([0.6, 0.4], dtype=torch.float64)
    joint = {(b, t): float(weights[b] * q[b, t]) for b in range(2) for t in range(3)}
    counts = Counter()
    for _ in range(6000):
        parents, tokens, _, _ = beam_step(torch.log(weights), q, 1, generator)
        counts[(int(parents[0]), int(tokens[0]))] += 1
    statistic, pvalue, df = helpers.chi_square_pvalue(counts, joint)
    assert pvalue > ALPHA


def test_beam_step_draws_only_allowed_pairs_naming_banned_tokens_by_target_id():
    class MappedLM:  # a draft vocabulary of 3 columns holding target ids 10, 11, 12
        vocab, vocab_size = torch.tensor([10, 11, 12]), 20

    q = torch.full((2, 3), 1 / 3)
    log_weights = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    parents, tokens, new, _ = beam_step(log_weights, q, 6, torch.Generator().manual_seed(0),
                                        [{11}, {10, 12}], MappedLM())
    assert sorted(zip(parents.tolist(), tokens.tolist())) == [(0, 0), (0, 2), (1, 1)]
    assert float(torch.logsumexp(new, 0)) == pytest.approx(0.0, abs=1e-12)
    none = beam_step(log_weights, q, 6, torch.Generator(), [{10, 11, 12}, {10, 11, 12}], MappedLM())
    assert len(none[0]) == 0


def test_joint_rule_longest_passing_prefix_ties_and_l0():
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.5, 0.5], [0.5, 0.5]])
    draft = torch.tensor([0, 0, 1])
    q = torch.tensor([0.9, 0.9, 0.05])
    # log ratios: 0, log(1/9), log(10): prefix sums 0, -2.197, 0.105 -> with tau 1 (log 0) the
    # longest passing prefix is L = 3 even though L = 1 and 2 fail: not the first failure
    assert joint_likelihood(draft, q, p, 1.0 - 1e-9, generator).n_accepted == 3
    # ties do not pass: the sum must exceed log tau strictly
    assert joint_likelihood(draft[:1], q[:1], p[:2], 1.0, generator).n_accepted == 0
    # nothing passes -> L = 0, and the token comes from p_1
    verdict = joint_likelihood(torch.tensor([1]), torch.tensor([0.99]), torch.tensor([[1.0, 0.0], [0.5, 0.5]]), 0.5, generator)
    assert verdict == type(verdict)(0, 0)


def test_tree_placement_matches_contiguous_paths(micro_draft):
    """W beam paths run as a tree over scratch slots give the logits each path gets when run
    alone and contiguously (the cache consistency beams rely on)."""
    draft = Target(helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=5), None, "draft")
    target = Target(helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=0), None, "target")
    lm = AuxLM(draft, target)
    lm.begin(PROMPT)
    context = PROMPT
    lm.sync(context)
    paths = [[]] * 3
    first = torch.tensor([4, 5, 6])
    tree = tree_for_beams(len(context), 1, 3, paths, [])
    tree_logits = lm.extend(first, tree)
    paths = [[s] for s in tree.slots.tolist()]
    second = torch.tensor([7, 1, 2])
    tree2 = tree_for_beams(len(context), 2, 3, paths, [len(context)] * 3)
    tree_logits2 = lm.extend(second, tree2)
    for b in range(3):
        fresh = draft.model(input_ids=torch.tensor([context + [int(first[b])]])).logits[0, -1]
        torch.testing.assert_close(tree_logits[b], fresh[:8], rtol=1e-4, atol=1e-5)
        fresh2 = draft.model(input_ids=torch.tensor([context + [int(first[b]), int(second[b])]])).logits[0, -1]
        torch.testing.assert_close(tree_logits2[b], fresh2[:8], rtol=1e-4, atol=1e-5)


class CheckedAuxLM(AuxLM):
    """An AuxLM that checks, at every sync, that its cached state gives the logits of a fresh
    forward over the whole context (crop then re-feed equals fresh)."""

    checks = 0

    def sync(self, context):
        logits = super().sync(context)
        fresh = self.model.model(input_ids=torch.tensor([list(context)])).logits[0, -1, : self.vocab_size]
        torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-5)
        CheckedAuxLM.checks += 1
        return logits


@pytest.mark.parametrize("beams", [1, 3])
def test_draft_model_cache_is_consistent_after_every_step(micro, beams):
    draft = Target(helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=5), None, "draft")
    sampling = SamplingConfig(temperature=1.0, seed=3)
    from verispec.core.acceptance import verify_joint, verify_lossless
    from verispec.core.control import ConstantLength
    from verispec.core.drafters.draft_model import SampledDrafter
    from verispec.core.engine import Recipe

    CheckedAuxLM.checks = 0
    for seed in range(5):
        config = SamplingConfig(1.0, seed=seed)
        sps = Recipe(SampledDrafter(CheckedAuxLM(draft, micro), config), ConstantLength(3), verify_lossless)
        helpers.run(micro, sps, PROMPT, 12, config)
        mtad = Recipe(BeamDrafter(CheckedAuxLM(draft, micro), beams, config), ConstantLength(3), verify_joint(0.5))
        helpers.run(micro, mtad, PROMPT, 12, config)
    assert CheckedAuxLM.checks > 20


def test_a_draft_model_with_another_tokenizer_is_refused(char_tokenizer):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(97 + i): i for i in range(len(char_tokenizer))}
    other = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    other.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    other_tokenizer = PreTrainedTokenizerFast(tokenizer_object=other)
    model = helpers.make_model(helpers.make_config("llama", vocab_size=len(char_tokenizer)), seed=0)
    target = Target(model, char_tokenizer, "target")
    draft = Target(model, other_tokenizer, "draft")
    with pytest.raises(ConfigError, match="tokenizer"):
        check_same_tokenizer(draft, target)


def test_output_ngrams_bans_exactly_the_tokens_that_would_repeat_an_ngram_of_the_output():
    rng = random.Random(0)
    for _ in range(400):
        n = rng.choice([1, 2, 3, 4])
        prompt = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        output = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        path = [rng.randrange(4) for _ in range(rng.randrange(0, 4))]
        context = prompt + output
        index = OutputNgrams(n)
        index.begin(len(prompt))
        index.update(context[: rng.randrange(len(prompt), len(context) + 1)])  # commits arrive in pieces
        index.update(context)
        seq = output + path  # brute force: every n-gram of the output and the path, none from the prompt
        grams = {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}
        last = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
        expected = {t for t in range(4) if len(seq) >= n - 1 and last + (t,) in grams}
        assert index.banned(context, path) == expected, (n, prompt, output, path)


class LoopLM:
    """A stub draft model that wants the next token of the cycle 0 1 2 after each token (q about
    0.9), so that its likeliest beams repeat an output that already loops."""

    vocab, vocab_size, device = None, 5, torch.device("cpu")

    def begin(self, prompt): pass
    def end_draft(self): pass
    def keep(self, m): pass

    def sync(self, context):
        return self._logits([context[-1]])[0]

    def extend(self, tokens, tree):
        return self._logits(tokens.tolist())

    @staticmethod
    def _logits(last):  # [n, 5]
        rows = torch.zeros(len(last), 5)
        for i, token in enumerate(last):
            rows[i, (token + 1) % 3] = 4.0
        return rows


LOOPING_OUTPUT = [0, 1, 2, 0, 1, 2, 0]


def loop_drafts(no_repeat_ngram, seeds, top_k=0, k=6):
    prompt = [4, 3]
    drafts = []
    for seed in range(seeds):
        drafter = BeamDrafter(LoopLM(), 4, SamplingConfig(temperature=1.0, top_k=top_k, seed=seed), no_repeat_ngram)
        drafter.begin(prompt)
        drafts.append(drafter.propose(prompt + LOOPING_OUTPUT, k).tokens.tolist())
    return drafts


def test_beams_under_the_no_repeat_constraint_never_repeat_an_output_ngram():
    free = loop_drafts(0, 20)
    before = repeated_ngrams(LOOPING_OUTPUT)[0]
    assert any(repeated_ngrams(LOOPING_OUTPUT + d)[0] > before for d in free)  # unconstrained beams loop
    for n in (2, 3, 4):
        for draft in loop_drafts(n, 20):
            assert len(draft) == 6
            assert repeated_ngrams(LOOPING_OUTPUT + draft, n)[0] == repeated_ngrams(LOOPING_OUTPUT, n)[0], (n, draft)


def test_a_draft_ends_where_every_allowed_token_is_banned():
    # top-k 1 leaves one candidate per beam: after "... 2 0" the loop wants 1, and "0 1" is in the output
    assert loop_drafts(2, 1, top_k=1) == [[]]
    assert loop_drafts(0, 1, top_k=1) == [[1, 2, 0, 1, 2, 0]]


def test_mtad_no_repeat_ngram_is_a_validated_option(micro, micro_draft):
    assert parse_variant("mtad/no_repeat_ngram=4")[2] == {"no_repeat_ngram": 4}
    for bad in (-1, True, 2.0):
        with pytest.raises(ConfigError, match="no_repeat_ngram"):
            MethodOptions(no_repeat_ngram=bad)
    options = MethodOptions(draft_model=str(micro_draft), no_repeat_ngram=3, tau=1e-30)
    assert build("mtad", micro, options, SamplingConfig(temperature=1.0)).drafter._ngrams.n == 3
    _, drafted, accepted = first_tokens(micro, "mtad", options, SamplingConfig(temperature=1.0), 10)
    assert drafted > 0 and accepted == drafted


@pytest.mark.long
def test_a_draft_vocabulary_keeps_sps_lossless_under_sampling(micro, micro_draft):
    """The draft model's head over 4 of the 8 tokens: its drafts never leave them (q is zero
    outside), and sps still follows ar's distribution exactly."""
    from verispec.target.head import VocabularyHead

    sampling = SamplingConfig(temperature=1.0)
    options = MethodOptions(draft_model=str(micro_draft), draft_vocab=4)
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, 3, sampling)
    outcomes, drafted, accepted = first_tokens(micro, "sps", options, sampling, 500)
    draft = micro.attachments[("draft-model", str(micro_draft), 4)]
    assert isinstance(draft.head, VocabularyHead)
    allowed = set(draft.head.ids.tolist())
    assert len(allowed) < 8
    logits = draft.head(torch.randn(3, draft.config.hidden_size))
    assert torch.isinf(logits[:, [i for i in range(8) if i not in allowed]]).all()
    assert torch.isfinite(logits[:, sorted(allowed)]).all()
    assert 0 < accepted < drafted
    helpers.assert_fits(outcomes, exact, "sps draft_vocab=4")


@pytest.mark.long
def test_greedy_sps_with_a_draft_vocabulary_equals_ar(tmp_path):
    target = helpers.make_target("qwen2", seed=1, init=0.3)
    helpers.make_model(helpers.make_config("qwen2", init=0.3), seed=9).save_pretrained(tmp_path)
    helpers.char_tokenizer().save_pretrained(tmp_path)
    prompt = helpers.repetitive_prompt(target.vocab_size, 0, period=5, repeats=4)
    reference = helpers.run(target, build("ar", target), prompt, 30)[0]
    options = MethodOptions(draft_model=str(tmp_path), draft_vocab=target.vocab_size // 2, controller="constant:4")
    ids, stats, _ = helpers.run(target, build("sps", target, options), prompt, 30)
    assert ids == reference and stats.drafted > 0
