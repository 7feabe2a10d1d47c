"""Batch invariance of the block-kernel forward in int8 numerics: a position's logits do not
depend on how many positions share its forward, nor on the thread count.

This is what makes a verify exact against `ar` without relying on luck: the target scores k
drafted tokens in one forward of width k + 1, and each position must get the bits a one-token
step would give it. Checked on the tiny block-exact architectures (`helpers.blockify`, the
default model's mix of weight formats) through the whole forward (C layers, final norm, LM
head), past the sliding window and across several chunks of keys of the C attention, at widths
1 to 64 and 1 to 3 threads; and through the engine (speculative methods equal `ar`).
"""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target

CONTEXT = 70  # prompt length: the widths below reach positions past two chunks of 64 keys
WIDTHS = (2, 3, 4, 5, 8, 13, 16, 31, 64)


def int8_target(arch: str, seed: int = 0) -> Target:
    model = helpers.make_model(helpers.make_config(arch), seed)
    target = Target(model, None, name=f"tiny-{arch}-int8", fast=True, blocks=helpers.blockify(model), numerics="int8")
    assert target.numerics == "int8" and target.decoder.native_layers == len(target.decoder.layers)
    return target


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(0, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_at_a_time(target: Target, prompt: list[int], rest: list[int]) -> torch.Tensor:
    """Logits [len(rest), vocab] of `rest` fed one token per forward after `prompt`."""
    target.reset()
    target.forward(prompt)
    return torch.cat([target.forward([token]) for token in rest])


@pytest.fixture(scope="module", params=helpers.FAST_ARCHITECTURES)
def arch(request):
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
def test_each_positions_logits_are_the_same_at_every_width(arch, threads):
    target = int8_target(arch)
    sequence = tokens(CONTEXT + max(WIDTHS), seed=1)
    prompt, rest = sequence[:CONTEXT], sequence[CONTEXT:]
    single = helpers.with_threads(threads, lambda: one_at_a_time(target, prompt, rest))  # [64, vocab]
    for width in WIDTHS:
        def together():
            target.crop(CONTEXT)
            return target.forward(rest[:width])
        assert torch.equal(helpers.with_threads(threads, together), single[:width]), width
    # a width-w forward starting mid-way (rows from other positions) also agrees
    target.crop(CONTEXT + 5)
    assert torch.equal(helpers.with_threads(threads, lambda: target.forward(rest[5:21])), single[5:21])


def test_logits_do_not_depend_on_the_thread_count(arch):
    target = int8_target(arch, seed=2)
    sequence = tokens(CONTEXT + 20, seed=2)
    prompt, rest = sequence[:CONTEXT], sequence[CONTEXT:]
    steps = [helpers.with_threads(threads, lambda: one_at_a_time(target, prompt, rest)) for threads in (1, 2, 3)]
    assert torch.equal(steps[0], steps[1]) and torch.equal(steps[0], steps[2])

    def verify():
        target.crop(CONTEXT)
        return target.forward(rest)
    wide = [helpers.with_threads(threads, verify) for threads in (1, 2, 3)]
    assert all(torch.equal(w, steps[0]) for w in wide)


def test_fp32_numerics_differ_at_wide_widths_and_switching_back_restores_int8(arch):
    """The control: with float32 activations the same comparison fails for some width of 4 or
    more (the fp32 kernel groups rows differently); `numerics` switches every linear and C layer."""
    target = int8_target(arch, seed=3)
    sequence = tokens(CONTEXT + 16, seed=3)
    prompt, rest = sequence[:CONTEXT], sequence[CONTEXT:]
    int8_single = one_at_a_time(target, prompt, rest)
    target.decoder.numerics = "fp32"
    assert target.numerics == "fp32"
    single = one_at_a_time(target, prompt, rest)
    assert not torch.equal(single, int8_single)
    target.crop(CONTEXT)
    assert not torch.equal(target.forward(rest), single)
    target.decoder.numerics = "int8"
    target.reset()  # the prompt's keys too were computed in the numerics of their forward
    target.forward(prompt)
    assert torch.equal(target.forward(rest), int8_single)


def test_the_c_attention_does_not_depend_on_threads_for_one_token():
    """One-token steps (the fast path's decode): the C attention's split of the keys is fixed by
    key position, so 1, 2, 3 and 5 threads give the same bits, before and past several chunks
    of keys and the sliding window."""
    target = int8_target("gemma3", seed=4)
    sequence = tokens(150, seed=4)
    runs = [helpers.with_threads(threads, lambda: one_at_a_time(target, sequence[:1], sequence[1:])) for threads in (1, 2, 3, 5)]
    assert all(torch.equal(run, runs[0]) for run in runs[1:])


def _tree(context: int, beams: int, depth: int):
    from verispec.runtime.static_kv import Tree

    n = beams * depth
    positions = torch.tensor([context + step for _ in range(beams) for step in range(depth)])
    visible = torch.zeros(n, context + n, dtype=torch.bool)
    visible[:, :context] = True
    for beam in range(beams):
        for step in range(depth):
            visible[beam * depth + step, context + beam * depth : context + beam * depth + step + 1] = True
    return Tree(positions, torch.arange(context, context + n), visible, torch.cat([torch.arange(context), positions]))


def test_a_tree_of_drafts_does_not_depend_on_threads(arch):
    """Trees (beams side by side in scratch slots): the same bits at 1, 2 and 3 threads (and the
    bits of the same tokens run contiguously: tests/test_tree_drafts.py)."""
    target = int8_target(arch, seed=5)
    fast = target.decoder
    context = 90
    ids, drafts = torch.tensor(tokens(context, 5)), torch.tensor(tokens(12, 6))
    tree = _tree(context, 3, 4)

    def run():
        cache = fast.new_cache(128)
        fast.hidden_states(ids, cache)
        return fast.run(fast.embed(drafts), context, cache, tree=tree)
    results = [helpers.with_threads(threads, run) for threads in (1, 2, 3)]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_speculative_methods_equal_ar_on_int8_numerics(arch):
    """Lossless under the same numerics: pld, anpd and scripted drafters (all accepted, partly,
    none) give `ar`'s tokens on the int8 target, with verifies of up to 9 tokens."""
    target = int8_target(arch, seed=1)
    prompt = helpers.repetitive_prompt(target.vocab_size, 3, period=5, repeats=4)
    reference, stats, _ = helpers.run(target, build("ar", target), prompt, 40)
    assert stats.target_forwards == 40
    accepted = 0
    for method, options in [("pld", MethodOptions()), ("anpd", MethodOptions(controller="constant:8"))]:
        ids, stats, _ = helpers.run(target, build(method, target, options), prompt, 40)
        assert ids == reference, method
        accepted += stats.accepted
    for mode in ("all", "partial", "none", "random"):
        drafter = helpers.ScriptedDrafter(reference, mode, target.vocab_size, right=2, seed=1)
        ids, stats, _ = helpers.run(target, helpers.scripted_recipe(drafter, 8), prompt, 40)
        assert ids == reference, mode
        assert stats.accepted == drafter.expected_accepted
        accepted += stats.accepted
    assert accepted > 0


def test_the_portable_build_gives_the_simd_builds_logits(arch, monkeypatch):
    """The instruction set does not change a bit either: the whole forward (one-token steps,
    verify widths, a prompt in C) on the forced portable build equals the best build this CPU
    runs, and the VNNI code run emulated (`blockmm.TEST_BUILDS`). The portable build's C layers
    repeat the vector paths' operations lane by lane: FMA chains, the vectorised exp, the int8
    kernel's lanes."""
    from verispec.runtime import blockmm

    best = blockmm.supported_variants()[0]
    assert best != "portable", "this CPU runs no SIMD build: nothing to compare"
    emulated = [name for name in blockmm.TEST_BUILDS if blockmm.load_variant(name)[0] is not None]
    assert emulated, "x86 CI runs AVX2, so the VNNI paths run emulated"
    sequence = tokens(150, seed=8)
    results = []
    for variant in (best, *emulated, "portable"):
        found, why = blockmm.load_variant(variant)
        assert found is not None, why
        monkeypatch.setitem(blockmm._state, "kernel", (found, None))
        target = int8_target(arch, seed=8)
        assert target.decoder.kernel_isa == variant
        def run():
            target.reset()
            prompt = target.forward(sequence[:60])  # 60 rows: the prompt runs in C too
            steps = [target.forward([token]) for token in sequence[60:75]]
            return torch.cat([prompt, *steps, target.forward(sequence[75:91])])
        results.append(helpers.with_threads(2, run))
    for variant, result in zip((best, *emulated), results):
        assert torch.equal(result, results[-1]), variant
