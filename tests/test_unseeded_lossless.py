"""Sampled methods without a seed, as users call them: `methods.build` and the decode loop, one
fresh recipe per request, many requests with an identical context.

Without a seed every request must draw its drafts afresh: a draft that is a fixed function of
the context is not a sample from the q that speculative sampling divides by, and the committed
token then follows min(1, p(d)/q(d)) instead of p. The seeded tests elsewhere cannot see that
(every seed gives other draws), so these tests use no seed at all.

The checked position is the second generated token: the first comes from the prompt's forward,
the second is the first one verified against a draft (`max_new_tokens` = 3 leaves room for a
one-token draft there). Its joint law with the first token is computed exactly by enumeration
on a micro Llama (8-token vocabulary) and compared by Pearson's chi-square (`helpers.assert_fits`); its alpha = 1e-4 is the
false-positive rate of each test (the draws are unseeded, so a correct implementation fails a
test with that probability per run).

Also here: a controller that cuts a drawn draft after seeing it (a biased rule the engine must not
apply), and draft models whose vocabulary is padded to another size than the target's.
"""

from __future__ import annotations


import pytest
import torch

import helpers
from verispec.core.acceptance import verify_lossless
from verispec.core.control import ConstantLength
from verispec.core.drafters.base import Draft
from verispec.core.drafters.early_exit import ExitHead, save_head
from verispec.core.engine import Recipe
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.target.loading import load
from verispec.core.sampling import SamplingConfig, probabilities

pytestmark = pytest.mark.long

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
REQUESTS = 600
SAMPLING = SamplingConfig(temperature=1.0)  # no seed: fresh entropy per request


@pytest.fixture(scope="module")
def micro() -> Target:
    return Target(helpers.make_model(helpers.micro_llama_config(VOCAB, init=0.3), seed=0), None, name="micro")


@pytest.fixture(scope="module")
def exact(micro) -> dict:
    return helpers.exact_sequence_distribution(micro.model, PROMPT, 2, SAMPLING)


def save_draft_model(path, vocab: int, seed: int = 5):
    helpers.make_model(helpers.micro_llama_config(vocab, init=0.3), seed=seed).save_pretrained(path)
    helpers.char_tokenizer().save_pretrained(path)  # loading needs one; ids are compared by vocab size here
    return str(path)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory) -> str:
    return save_draft_model(tmp_path_factory.mktemp("draft"), VOCAB)


@pytest.fixture(scope="module")
def head_dir(micro, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("head")
    head = ExitHead(micro.model, 1, list(range(6)))  # q is zero on 2 of the 8 tokens
    save_head(head, head.spec(micro.model, "micro"), path, dtype=torch.float32)
    return str(path)


def unseeded_requests(target, make_recipe, requests: int = REQUESTS, new_tokens: int = 3):
    """The first two generated tokens of `requests` unseeded requests, and drafted/accepted."""
    outcomes, drafted, accepted = [], 0, 0
    for _ in range(requests):
        ids, stats, _ = helpers.run(target, make_recipe(), PROMPT, new_tokens, SAMPLING)
        outcomes.append(tuple(ids[:2]))
        drafted += stats.drafted
        accepted += stats.accepted
    return outcomes, drafted, accepted



@pytest.mark.parametrize("method", ["sps", "eesd"])
def test_unseeded_model_drafting_is_lossless_across_requests(micro, exact, draft_model, head_dir, method):
    options = {
        "sps": MethodOptions(draft_model=draft_model),  # its default controller
        "eesd": MethodOptions(exit_head=head_dir, controller="constant:2"),  # always drafts here
    }[method]
    outcomes, drafted, accepted = unseeded_requests(micro, lambda: build(method, micro, options, SAMPLING))
    assert 0.9 * REQUESTS <= drafted and 0 < accepted < drafted, (drafted, accepted)  # both paths taken
    helpers.assert_fits(outcomes, exact, method)


def test_unseeded_mtad_draws_its_beams_afresh(micro, draft_model):
    """MTAD is approximate by design; its own claim here: with one beam and a threshold every
    draft passes, the first drafted token is an ancestral sample of the draft model's warped q
    (after the target's first token), request after request."""
    options = MethodOptions(draft_model=draft_model, beams=1, tau=1e-30, controller="constant:1")
    outcomes, drafted, accepted = unseeded_requests(micro, lambda: build("mtad", micro, options, SAMPLING))
    assert drafted == accepted == REQUESTS
    draft = load(draft_model, "float32", fast=False)
    first = helpers.exact_sequence_distribution(micro.model, PROMPT, 1, SAMPLING)
    law = {}
    with torch.inference_mode():
        for (token,), p in first.items():
            logits = draft.model(input_ids=torch.tensor([PROMPT + [token]])).logits[0, -1:]  # [1, vocab]
            for second, q in enumerate(probabilities(logits.float(), SAMPLING)[0].double().tolist()):
                if q > 0:
                    law[(token, second)] = p * q
    helpers.assert_fits(outcomes, law, "mtad")


class PeekingCut(ConstantLength):
    """A rule that decides after drafting: keep the first token only when the second one's
    confidence is high, i.e. depending on what was drawn at the first position."""

    def cut(self, confidence, proposed):
        return proposed if len(confidence) > 1 and confidence[1] > 0.5 else 0


class ConfidenceRevealsTheDraw:
    """Draws tokens from a fixed q; the second token's confidence says whether the first was
    token 4 (as any confidence that depends on the drawn prefix can). Kept only then, token 4
    is verified more often than q draws it: at the checked position, where the target gives it
    about 0.09 in the likeliest context, it would be committed about twice as often as p says."""

    def __init__(self):
        self.generator = SAMPLING.generator(1)
        self.q = torch.full((VOCAB,), 0.85 / 7).index_fill_(0, torch.tensor([4]), 0.15)  # [vocab]

    def begin(self, prompt):
        pass

    def propose(self, context, k, keep):
        n = min(k, 2)  # two at the checked position (the test leaves room for them)
        tokens = torch.multinomial(self.q, n, replacement=True, generator=self.generator)  # [n]
        confidence = (0.5, 0.9 if int(tokens[0]) == 4 else 0.1)[:n]
        return Draft(tokens, q=self.q.expand(n, -1).clone(), confidence=confidence)

    def commit(self, committed, n_proposed):
        pass


def test_a_cut_after_drawing_is_not_applied_to_drawn_drafts(micro, exact):
    outcomes, drafted, _ = unseeded_requests(
        micro, lambda: Recipe(ConfidenceRevealsTheDraw(), PeekingCut(2), verify_lossless), 1500, new_tokens=4)
    assert drafted > 0
    helpers.assert_fits(outcomes, exact, "peeking cut")


@pytest.mark.parametrize("method", ["sps", "eesd", "mtad"])
def test_adaptive_is_refused_for_drawn_drafts_under_sampling(micro, draft_model, head_dir, method):
    options = MethodOptions(draft_model=None if method == "eesd" else draft_model,
                            exit_head=head_dir if method == "eesd" else None, controller="adaptive")
    with pytest.raises(ConfigError, match="adaptive controller"):
        build(method, micro, options, SAMPLING)
    if method != "mtad":  # greedy drafts are deterministic: a cut is fine there
        build(method, micro, options, SamplingConfig())


@pytest.mark.parametrize("draft_vocab", [6, 12])
def test_a_draft_model_with_a_padded_vocabulary(micro, exact, tmp_path, draft_vocab):
    """Vocabularies of 6 (the target's ids 6 and 7 are then padding to the draft model) and 12
    (the draft pads): sampling runs, stays lossless, and q never puts mass past the smaller
    vocabulary; greedy equals ar."""
    options = MethodOptions(draft_model=save_draft_model(tmp_path, draft_vocab))
    greedy = helpers.run(micro, build("sps", micro, options), PROMPT, 12)[0]
    assert greedy == helpers.run(micro, build("ar", micro), PROMPT, 12)[0]

    recipe = build("sps", micro, options, SAMPLING)
    recipe.drafter.begin(PROMPT)
    draft = recipe.drafter.propose(PROMPT + [0], 3)
    assert draft.q.shape == (3, VOCAB) and float(draft.q[:, min(draft_vocab, VOCAB):].sum()) == 0.0

    outcomes, drafted, accepted = unseeded_requests(micro, lambda: build("sps", micro, options, SAMPLING), 400)
    assert 0 < accepted < drafted
    helpers.assert_fits(outcomes, exact, f"draft vocabulary {draft_vocab}")


def paged_micro(seed: int) -> Target:
    """The micro Llama on int8 numerics: its sequences page their KV, so it batches."""
    model = helpers.make_model(helpers.micro_llama_config(VOCAB, init=0.3), seed=seed)
    target = Target(model, None, name=f"micro-int8-{seed}", fast=True, blocks=helpers.blockify(model), numerics="int8")
    assert target.pages_kv
    return target


def own_law(target: Target, prompt: list[int], sampling: SamplingConfig) -> dict:
    """The exact law of the first two tokens `ar` samples on `target`'s own numerics."""
    sequence, law = target.new_sequence(), {}
    sequence.reset()
    first = probabilities(sequence.forward(prompt, last_only=True), sampling)[0]  # [V]
    for a in range(VOCAB):
        sequence.reset()
        second = probabilities(sequence.forward([*prompt, a], last_only=True), sampling)[0]  # [V]
        law.update({(a, b): float(first[a] * second[b]) for b in range(VOCAB)})
    sequence.release()
    return law


def test_unseeded_sps_in_a_batch_with_its_draft_rows_batched_is_lossless(monkeypatch):
    """The server's path (`batch.BatchEngine`, one fresh recipe per request on a sequence of its
    own): many unseeded sps requests decoded together, their draft model's rows run in shared
    forwards (a draft model that pages its KV), each verify in the target's shared forward.
    Drafts are not sized for the load here, so that every request drafts; sizing decides before
    drafting, from costs and past acceptance only, so it cannot bias a draw."""
    from verispec.core.batch import BatchEngine
    from verispec.core.engine import DecodeConfig
    from verispec.core.stats import GenerationStats

    monkeypatch.setattr(BatchEngine, "_model_draft_rooms", lambda self, jobs: {})

    target, draft = paged_micro(0), paged_micro(5)
    calls = []
    forward_parts = draft.backend.forward_parts
    draft.backend.forward_parts = lambda parts: calls.append(len(parts)) or forward_parts(parts)
    options = MethodOptions(draft_model=draft)  # its default controller
    engine, outputs, stats = BatchEngine(target), {}, []
    for _ in range(REQUESTS):
        sequence = target.new_sequence()
        stats.append(GenerationStats(method="sps"))
        job = engine.submit(PROMPT, build("sps", sequence, options, SAMPLING), DecodeConfig(3, SAMPLING), stats[-1],
                            sequence=sequence)
        outputs[job.id] = []
    while not engine.idle:
        for job, committed in engine.step():
            assert job.error is None, job.error
            outputs[job.id] += committed
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    assert 0.9 * REQUESTS <= drafted and 0 < accepted < drafted, (drafted, accepted)  # both paths taken
    assert max(calls) > 1  # the drafts were drawn in shared forwards of the draft model
    helpers.assert_fits([tuple(ids[:2]) for ids in outputs.values()], own_law(target, PROMPT, SAMPLING),
                        "sps in a batch")
