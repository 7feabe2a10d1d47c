"""Greedy equivalence, the central correctness test (DESIGN.md, "Correctness").

For each architecture (Llama, Gemma 3 with a sliding window of 8, Qwen2 with a sliding layer,
GPT-2), in float32:
- the engine's `ar` output equals transformers' `generate(do_sample=False)`;
- `pld` and `anpd` (built by `verispec.core.methods.build`) equal `ar`, and their drafts are actually
  accepted sometimes (asserted via GenerationStats, so the test cannot pass vacuously);
- a scripted drafter forcing all-accepted, none-accepted, partly-accepted and random outcomes
  equals `ar`, and the engine accepts exactly as many drafts as the script says it must.

Prompts are a random motif repeated (20 tokens, longer than the sliding window), and generation
runs 40 tokens past it.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.core.methods import MethodOptions, build

NEW_TOKENS = 40
PROMPT_SEEDS = (0, 1)
_AR_CACHE: dict = {}


def prompt_for(seed: int, vocab: int = 128) -> list[int]:
    return helpers.repetitive_prompt(vocab, seed, period=5, repeats=4)


def ar_output(target, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    key = (target.name, tuple(prompt), new_tokens)
    if key not in _AR_CACHE:
        ids, stats, _ = helpers.run(target, build("ar", target), prompt, new_tokens)
        assert stats.drafted == 0 and stats.target_forwards == new_tokens
        _AR_CACHE[key] = ids
    return _AR_CACHE[key]


@pytest.mark.parametrize("prompt_seed", PROMPT_SEEDS)
def test_ar_equals_transformers_generate(arch_target, prompt_seed):
    prompt = prompt_for(prompt_seed)
    expected = helpers.hf_greedy(arch_target.model, prompt, NEW_TOKENS)
    # Exact equality across differently shaped float32 forwards needs no near-ties on the path:
    # the top-2 logit gap must dwarf float32 rounding (~1e-6 here). If this fails, pick a seed.
    with torch.inference_mode():
        logits = arch_target.model(input_ids=torch.tensor([prompt + expected])).logits[0, len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    assert ar_output(arch_target, prompt) == expected


def test_ngram_methods_equal_ar_and_accept_drafts(arch_target):
    accepted = {"pld": 0, "anpd-constant": 0}
    for prompt_seed in PROMPT_SEEDS:
        prompt = prompt_for(prompt_seed)
        reference = ar_output(arch_target, prompt)
        for label, method, options in [
            ("pld", "pld", MethodOptions()),
            ("pld-k3", "pld", MethodOptions(draft_length=3)),
            ("anpd", "anpd", MethodOptions()),  # the method's default (adaptive) controller
            ("anpd-constant", "anpd", MethodOptions(controller="constant:8")),
            ("anpd-n3", "anpd", MethodOptions(controller="constant:4", ngram_max_n=3)),
        ]:
            ids, stats, _ = helpers.run(arch_target, build(method, arch_target, options), prompt, NEW_TOKENS)
            assert ids == reference, f"{label} differs from ar (prompt seed {prompt_seed})"
            assert stats.new_tokens == NEW_TOKENS
            assert stats.target_forwards == 1 + sum(stats.accepted_histogram)
            assert stats.new_tokens == stats.target_forwards + stats.accepted
            if label in accepted:
                accepted[label] += stats.accepted
    # Non-vacuous: the drafts were accepted at least sometimes on these repetitive prompts.
    assert accepted["pld"] > 0, accepted
    assert accepted["anpd-constant"] > 0, accepted


@pytest.mark.parametrize("mode,k", [("all", 4), ("all", 7), ("none", 4), ("partial", 5), ("random", 6)])
def test_scripted_drafter_equals_ar(arch_target, mode, k):
    for prompt_seed in PROMPT_SEEDS:
        prompt = prompt_for(prompt_seed)
        reference = ar_output(arch_target, prompt)
        drafter = helpers.ScriptedDrafter(reference, mode, arch_target.vocab_size, right=2, seed=prompt_seed)
        ids, stats, steps = helpers.run(arch_target, helpers.scripted_recipe(drafter, k), prompt, NEW_TOKENS)
        assert ids == reference, f"mode {mode}, k {k}, prompt seed {prompt_seed}"
        # The engine accepted exactly the true prefix of every draft, no more, no less.
        assert stats.accepted == drafter.expected_accepted
        assert stats.drafted == sum(len(p) for p in drafter.proposed) > 0
        if mode == "all":
            assert stats.accepted == stats.drafted
            assert max(len(s) for s in steps) == k + 1
        if mode == "none":
            assert stats.accepted == 0
            assert all(len(s) == 1 for s in steps)
        # The drafter was told exactly what was committed and how much it had proposed.
        assert [c for c, _, _ in drafter.commits] == steps
        assert all(reported == proposed for _, reported, proposed in drafter.commits)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "gemma3-blocks", "qwen2-blocks", "gemma3-eager", "qwen2-eager"])
@pytest.mark.parametrize("mode", ["all", "partial", "none"])
def test_sliding_window_crossed_inside_one_verification(tiny_targets, arch, mode):
    """A 5-token prompt (window 8): the first 7-token draft makes one verification forward run
    across the window boundary; in partial/none mode the crossing part is then rejected and
    rolled back."""
    target = tiny_targets[arch]
    prompt = [3, 17, 3, 17, 3]
    reference = helpers.hf_greedy(target.model, prompt, 30)
    assert ar_output(target, prompt, 30) == reference
    drafter = helpers.ScriptedDrafter(reference, mode, target.vocab_size, right=2)
    ids, stats, steps = helpers.run(target, helpers.scripted_recipe(drafter, 7), prompt, 30)
    assert ids == reference
    assert stats.accepted == drafter.expected_accepted
    assert len(drafter.proposed[0]) == 7  # the first verification covered positions 5..12


def test_ar_equals_generate_on_a_more_peaked_model():
    """A second set of weights per architecture (init 0.3: sharper, more varied outputs, so drafts
    are mostly rejected) through pld and a random scripted drafter."""
    for path in helpers.PATHS:
        target = helpers.make_target_for_path(path, seed=1, init=0.3)
        arch = path
        prompt = prompt_for(2)
        reference = helpers.hf_greedy(target.model, prompt, 24)
        assert helpers.run(target, build("ar", target), prompt, 24)[0] == reference, arch
        assert helpers.run(target, build("pld", target), prompt, 24)[0] == reference, arch
        drafter = helpers.ScriptedDrafter(reference, "random", target.vocab_size, seed=5)
        ids, stats, _ = helpers.run(target, helpers.scripted_recipe(drafter, 5), prompt, 24)
        assert ids == reference, arch
        assert stats.accepted == drafter.expected_accepted
