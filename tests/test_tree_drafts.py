"""Trees of drafts: several continuations verified in one target forward (`Target.forward_tree`),
the longest branch the target agrees with accepted (`acceptance.tree_match`), the accepted
path's keys and values kept at its positions (`Target.keep_path`), and ANPD's tree drafts
(`anpd/tree=N`).

- Placement (`static_kv.Tree.of_parents`): the primary branch at its own positions, the other rows
  in scratch slots past them, each row seeing the cache, its ancestors and itself.
- Exactness on the C layers (int8 numerics, batch-invariant): every row's logits are bit for bit
  those a linear verification of its path gives the same position, for contexts within one
  chunk of 64 keys, across a chunk boundary and past two, through sliding windows, at 1 and 2
  threads; beam placements (MTAD's) too. On the PyTorch layers, which are not batch-invariant
  (a row's attention output depends on the other rows of its forward), to float32 rounding.
- The rule: greedy walks the argmax, sampling draws once per committed token (so a seed gives
  `ar`'s own sample); a chain is the linear rules' case.
- The loop: greedy `anpd` with trees equals `ar` on every architecture and path, with steps
  where a branch other than the primary one wins; after such a step the next step's logits are
  `ar`'s (bit for bit on the C layers): the accepted path's keys and values were moved into place.
  The PyTorch path (transformers' forward, every eager path) verifies trees under a custom
  attention mask (`torch_path`); a target whose model it cannot take apart verifies the primary
  branch alone.
- Sampling (long): seeded runs reproduce `ar`'s samples, and unseeded ones follow `ar`'s exact
  distribution (chi-square on a micro Llama); a broken multi-branch rule fails the same test.
- Options: bad node budgets and tree options on other methods are refused before any model loads.
- The real model (slow): greedy `anpd` with trees equals `ar`.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import helpers
from verispec.core.acceptance import Verdict, argmax, greedy_match, sampled_match, tree_match, verify_lossless
from verispec.runtime.static_kv import Tree
from verispec.core.control import ConstantLength
from verispec.core.drafters.base import EMPTY_DRAFT, Draft
from verispec.core.drafters.ngram import AnpdDrafter, NgramConfig
from verispec.core.engine import Recipe
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build, parse_variant
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig, probabilities, sample

# A root (the last committed token) and branches of depth 1 to 5, some off other branches.
PARENTS = [-1, 0, 1, 2, 0, 4, 1, 6, 0, 8, 9, 3, 11, 12, 12]


def int8_target(arch: str, seed: int = 0) -> Target:
    """A tiny block-exact target whose whole forward (chunks up to 64 rows) runs in C, int8."""
    model = helpers.make_model(helpers.make_config(arch), seed)
    target = Target(model, None, name=f"tiny-{arch}-int8", fast=True, blocks=helpers.blockify(model), numerics="int8")
    assert target.decoder.native_layers == len(target.decoder.layers)
    return target


def path_to(parents, row: int) -> list[int]:
    """Rows from a -1 row down to `row`."""
    path = []
    while row >= 0:
        path.append(row)
        row = parents[row]
    return path[::-1]


def primary_rows(parents) -> list[int]:
    """Row 0, then each row's first child."""
    rows = [0]
    for i, parent in enumerate(parents):
        if i and parent == rows[-1]:
            rows.append(i)
    return rows


def tokens(count: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def tree_and_linear(target: Target, context: list[int], ids: list[int], parents: list[int]):
    """Logits of the tree `ids`/`parents` after `context`, and of each row's path verified
    linearly after the same context: ([m, vocab], [m rows of [vocab]])."""
    target.reset()
    for token in context:  # one token at a time, as `ar` fills the cache
        target.forward([token])
    length = target.length
    tree = target.forward_tree(ids, parents)
    linear = []
    for row in range(len(ids)):
        target.crop(length)
        linear.append(target.forward([ids[r] for r in path_to(parents, row)])[-1])
    return tree, linear


# -- placement --------------------------------------------------------------------------------

def test_placement_of_a_tree():
    parents = [-1, 0, 1, 0, 3, 1]  # primary: rows 0, 1, 2; row 3 a second child of 0, 5 of 1
    tree = Tree.of_parents(10, parents)
    assert tree.positions.tolist() == [10, 11, 12, 11, 12, 12]
    # primary rows at their positions; the others in scratch slots past the deepest position (12)
    assert tree.slots.tolist() == [10, 11, 12, 13, 14, 15]
    assert tree.visible.shape == (6, 16)
    assert tree.slot_positions[13:].tolist() == [11, 12, 12] and tree.slot_positions[:13].tolist() == list(range(13))
    for row, parent in enumerate(parents):
        seen = set(tree.visible[row].nonzero().flatten().tolist())
        assert seen == set(range(10)) | {int(tree.slots[r]) for r in path_to(parents, row)}, row
    # a deeper secondary branch: scratch slots in row order, ancestors always at lower slots
    tree = Tree.of_parents(3, [-1, 0, 0, 2, 3])
    assert tree.slots.tolist() == [3, 4, 7, 8, 9] and tree.positions.tolist() == [3, 4, 4, 5, 6]
    with pytest.raises(AssertionError):
        Tree.of_parents(3, [-1, 1, 0])  # a parent after its child


def test_keeping_a_path_moves_scratch_entries_to_their_positions():
    from verispec.runtime.static_kv import StaticKV

    cache = StaticKV(2, 1, 2, torch.float32, capacity=16)  # rounded up to a whole block
    for layer in range(2):
        slots = torch.arange(cache.capacity, dtype=torch.float32)
        cache.keys[layer][0] = torch.stack([slots, slots + 100 * layer], 1)
        cache.values[layer][0] = -cache.keys[layer][0]
    before = [k.clone() for k in cache.keys]
    cache.length = 5
    cache.keep_slots(5, [5, 6, 11, 12])  # the primary branch for two tokens, then scratch slots
    assert cache.length == 9
    for layer in range(2):
        kept = cache.keys[layer][0, 5:9, 0].tolist()
        assert kept == [5.0, 6.0, 11.0, 12.0]
        assert torch.equal(cache.keys[layer][0, :7], before[layer][0, :7])  # nothing else moved
        assert torch.equal(cache.values[layer][0, 5:9], -cache.keys[layer][0, 5:9])


# -- exactness of the verification ----------------------------------------------------------------

@pytest.mark.parametrize("arch", helpers.FAST_ARCHITECTURES)
@pytest.mark.parametrize("context", [6, 61, 130])
def test_tree_rows_equal_linear_verification_bit_for_bit_on_the_c_layers(arch, context):
    """Contexts of 6 (one chunk of keys, shorter than the sliding window of 8 as the tree grows
    past it), 61 (the tree crosses the 64-key chunk boundary) and 130 (three chunks)."""
    target = int8_target(arch, seed=context)
    ids = tokens(len(PARENTS), seed=context + 1)
    for threads in (1, 2):
        tree, linear = helpers.with_threads(threads, lambda: tree_and_linear(target, tokens(context, context), ids, PARENTS))
        for row, reference in enumerate(linear):
            assert torch.equal(tree[row], reference), (threads, row)


def test_beam_placements_equal_contiguous_runs_bit_for_bit():
    """MTAD's placement (beams side by side in scratch slots, `drafters.draft_model.tree_for_beams`): each
    beam's rows equal the same tokens run contiguously after the context, bit for bit."""
    from verispec.core.drafters.draft_model import tree_for_beams

    target = int8_target("gemma3", seed=3)
    fast = target.decoder
    context, width = 62, 3
    ids = torch.tensor(tokens(context, 3))
    beams = [tokens(3, 10 + b) for b in range(width)]
    cache = fast.new_cache(128)
    fast.hidden_states(ids, cache)
    paths: list[list[int]] = [[] for _ in range(width)]
    placed = []
    for step in range(1, 4):
        tree = tree_for_beams(context, step, width, paths, [context + i // width for i in range(width * (step - 1))])
        placed.append(fast.run(fast.embed(torch.tensor([beam[step - 1] for beam in beams])), context, cache, tree=tree))
        paths = [path + [int(tree.slots[b])] for b, path in enumerate(paths)]
    for b, beam in enumerate(beams):
        alone = fast.new_cache(128)
        fast.hidden_states(ids, alone)
        contiguous = fast.run(fast.embed(torch.tensor(beam)), context, alone)  # [3, hidden]
        for step in range(3):
            assert torch.equal(placed[step][b], contiguous[step]), (b, step)


def test_beam_steps_of_different_widths_are_placed_without_overlap_and_run_exactly():
    """A beam step may have fewer beams than the next (top-p left fewer tokens with probability):
    each step's slots follow the earlier steps' slots, the slots' positions say which step they
    hold, and every beam's rows still equal its path run contiguously, bit for bit. (Placing a
    step at step * width slots, as if widths never changed, gave scratch slots the wrong positions
    and the C layer refused the tree.)"""
    from verispec.core.drafters.draft_model import tree_for_beams

    target = int8_target("gemma3", seed=3)
    fast = target.decoder
    context = 62
    ids = torch.tensor(tokens(context, 3))
    cache = fast.new_cache(128)
    fast.hidden_states(ids, cache)
    steps = [([4, 9, 3], [-1, -1, -1]), ([5, 6], [0, 2]), ([8, 1, 2], [0, 1, 1])]  # (tokens, parent beam) per step
    paths: list[list[int]] = [[] for _ in range(3)]
    histories: list[list[int]] = [[] for _ in range(3)]
    earlier: list[int] = []
    placed = []
    for step, (ids_step, parents) in enumerate(steps, start=1):
        if step > 1:
            paths = [paths[p] + [slots[p]] for p in parents]
            histories = [histories[p] for p in parents]
        histories = [history + [token] for history, token in zip(histories, ids_step)]
        tree = tree_for_beams(context, step, len(ids_step), paths, earlier=earlier)
        assert len(set(tree.slots.tolist()) & {s for path in paths for s in path}) == 0  # no slot reused
        earlier += [context + step - 1] * len(ids_step)
        placed.append(fast.run(fast.embed(torch.tensor(ids_step)), context, cache, tree=tree))
        slots = tree.slots.tolist()
    for b, history in enumerate(histories):
        alone = fast.new_cache(128)
        fast.hidden_states(ids, alone)
        contiguous = fast.run(fast.embed(torch.tensor(history)), context, alone)  # [3, hidden]
        assert torch.equal(placed[-1][b], contiguous[-1]), b


@pytest.mark.parametrize("path", ["llama", "gemma3", "qwen2", "gemma3-blocks"])
def test_tree_rows_match_linear_verification_on_the_pytorch_layers(path):
    """The PyTorch layers (the fast path without C layers) verify trees with one attention call
    over every slot and a mask: the same math, to float32 rounding (no placement could give
    linear-verify bits there: a row's attention output depends on the other rows of its call)."""
    target = helpers.make_target_for_path(path, seed=2)
    target.decoder.use_native = False
    try:
        ids = tokens(len(PARENTS), seed=7)
        tree, linear = tree_and_linear(target, tokens(23, 6), ids, PARENTS)
    finally:
        target.decoder.use_native = True
    for row, reference in enumerate(linear):
        assert (tree[row] - reference).abs().max().item() <= 1e-5 * max(reference.abs().max().item(), 1.0), row
        assert argmax(tree[row]) == argmax(reference), row


def test_a_tree_whose_rows_do_not_see_their_whole_path_is_refused():
    """The C attention reads a row's keys as consecutive positions ending at its own (its path);
    a mask that hides an ancestor cannot be read so and is refused, not computed."""
    target = int8_target("llama", seed=1)
    fast = target.decoder
    cache = fast.new_cache(64)
    fast.hidden_states(torch.tensor(tokens(10, 1)), cache)
    tree = Tree.of_parents(10, [-1, 0, 0, 2])
    broken = tree.visible.clone()
    broken[3, int(tree.slots[2])] = False  # row 3 no longer sees its parent
    before = [k.clone() for k in cache.keys]
    with pytest.raises(ValueError, match="consecutive positions"):
        fast.run(fast.embed(torch.tensor(tokens(4, 2))), 10, cache,
                 tree=Tree(tree.positions, tree.slots, broken, tree.slot_positions))
    assert all(torch.equal(k, b) for k, b in zip(cache.keys, before))


# -- the rule ------------------------------------------------------------------------------------

def test_tree_match_walks_the_targets_choices():
    # draft: 0:A=1 (root child), 1:B=2 (child of 0), 2:C=3 (root child), 3:D=4 (child of 2), 4:E=5 (child of 3)
    draft, parents = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, 0, -1, 2, 3])
    rows = torch.zeros(6, 8)
    choices = {0: 3, 3: 4, 4: 7}  # the target picks 3 at the root, 4 after it, then 7 (no child)
    for row, token in choices.items():
        rows[row, token] = 1.0
    picked = []

    def pick(row):
        picked.append(row)
        return argmax(row)

    assert tree_match(draft, parents, rows, pick) == Verdict(2, 7, (2, 3))
    assert len(picked) == 3  # one pick per committed token: rows off the path are never read
    rows[0] = 0.0
    rows[0, 6] = 1.0  # no root child carries the target's token
    assert tree_match(draft, parents, rows, argmax) == Verdict(0, 6, ())
    # every node accepted down to a leaf: the token after it comes from the leaf's row
    rows[0] = rows[4] = 0.0
    rows[0, 3] = rows[4, 5] = rows[5, 2] = 1.0
    assert tree_match(draft, parents, rows, argmax) == Verdict(3, 2, (2, 3, 4))


def test_on_a_chain_tree_match_is_the_linear_rules():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        k = trial % 5
        logits = torch.randn(k + 1, 6, generator=generator) * 3
        draft = torch.randint(0, 6, (k,), generator=generator)
        if trial % 3 == 0 and k:
            draft[: k // 2 + 1] = logits[: k // 2 + 1].argmax(-1)  # an accepted prefix
        chain = torch.arange(k) - 1
        greedy = greedy_match(draft, logits)
        assert tree_match(draft, chain, logits, argmax) == Verdict(greedy.n_accepted, greedy.next_token,
                                                                    tuple(range(greedy.n_accepted)))
        p = torch.softmax(logits, -1)
        linear = sampled_match(draft, p, torch.Generator().manual_seed(trial))
        tree = tree_match(draft, chain, p, lambda row, g=torch.Generator().manual_seed(trial): sample(row, g))
        assert (tree.n_accepted, tree.next_token) == (linear.n_accepted, linear.next_token)


def test_sampled_tree_verification_draws_once_per_committed_token():
    """So that with a seed a tree gives `ar`'s sample: the k-th committed token is the k-th draw."""
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    draft = Draft.tree([0, 1, 2, 3, 4], [-1, -1, -1, -1, -1])  # every token a child of the root
    for seed in range(30):
        verdict = verify_lossless(draft, logits, sampling, torch.Generator().manual_seed(seed))
        generator = torch.Generator().manual_seed(seed)
        first = sample(probabilities(logits, sampling)[0], generator)
        assert verdict.path == (first,)  # token t is child t: accepted whatever it is
        assert verdict.next_token == sample(probabilities(logits, sampling)[1 + first], generator)


def test_tree_drafts():
    tree = Draft.tree([5, 6, 7, 8], [-1, 0, -1, 1], (0.9, 0.8, 0.7, 0.5))
    assert tree.parents.tolist() == [-1, 0, -1, 1] and not tree.drawn
    assert Draft.tree([5, 6, 7], [-1, 0, 1]).parents is None  # a chain is a linear draft
    assert tree.prefix(3).parents.tolist() == [-1, 0, -1]
    assert tree.prefix(2).parents is None and tree.prefix(2).tokens.tolist() == [5, 6]
    primary = tree.primary()  # rows 0, 1, 3; confidences: path probabilities over the parent's
    assert primary.parents is None and primary.tokens.tolist() == [5, 6, 8]
    assert primary.confidence == pytest.approx((0.9, 0.8, 0.7 * 0.5))
    assert Draft.of([1, 2]).primary().tokens.tolist() == [1, 2]
    with pytest.raises(AssertionError):
        Draft.tree([5, 6], [1, -1])  # a parent after its child
    with pytest.raises(AssertionError):
        Draft(torch.tensor([5, 6]), q=torch.ones(2, 3) / 3, parents=torch.tensor([-1, -1]))  # drawn


# -- ANPD's trees --------------------------------------------------------------------------------

def test_anpd_branches_where_the_tables_offer_several_tokens():
    prompt = [1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 8, 1, 2]  # after (1, 2): 3 twice, 4 once
    drafter = AnpdDrafter(NgramConfig(), tree=6)
    drafter.begin(prompt)
    draft = drafter.propose(prompt, 16)
    assert len(draft) == 6 and draft.parents is not None
    parents, ids = draft.parents.tolist(), draft.tokens.tolist()
    assert [ids[i] for i, p in enumerate(parents) if p == -1] == [3, 4]  # the winner first, then the other
    # the primary branch is the linear draft (the winners' chain)
    linear = AnpdDrafter(NgramConfig())
    linear.begin(prompt)
    primary = draft.primary().tokens.tolist()
    assert primary == linear.propose(prompt, len(primary)).tokens.tolist()
    # tokens come by decreasing path probability: prefix products of the confidences never grow
    survival = torch.tensor(draft.confidence).cumprod(0)
    assert all(0 < c <= 1 for c in draft.confidence) and bool((survival[1:] <= survival[:-1]).all())
    # the budget: min(k, tree)
    assert len(drafter.propose(prompt, 3)) == 3
    # learning: the target took the alternative 4, then 8, then 5
    drafter.propose(prompt, 16)
    drafter.commit([4, 8, 5], 6)
    alternative = next(kind for kind in drafter._outcomes if len(kind) == 4)
    assert drafter._outcomes[alternative] == [1, 0]
    winner_at_root = (3, 2, False)  # level 3, count 2, the request's own tables
    assert drafter._outcomes[winner_at_root] == [0, 1]


def primary_wins_and_others(recipe: Recipe):
    """`recipe` with its rule wrapped to count tree steps won by a branch other than the primary."""
    counts = Counter()

    def rule(draft, logits, sampling, generator):
        verdict = recipe.rule(draft, logits, sampling, generator)
        if draft.parents is not None:
            counts["trees"] += 1
            primary = primary_rows(draft.parents.tolist())
            counts["other branch"] += not set(verdict.path) <= set(primary)
        return verdict

    return recipe._replace(rule=rule), counts


def branching_prompt(seed: int) -> list[int]:
    """A motif repeated with variations: keys followed by several tokens."""
    motif = tokens(5, seed)
    return motif * 2 + motif[:3] + tokens(2, seed + 50) + motif * 2 + motif[:2] + tokens(1, seed + 60) + motif


def test_greedy_anpd_with_trees_equals_ar_on_every_path(tiny_targets):
    counts = Counter()
    targets = {path: tiny_targets[path] for path in helpers.PATHS}
    targets.update({f"{arch}-int8": int8_target(arch) for arch in helpers.FAST_ARCHITECTURES})
    for name, target in targets.items():
        for seed in (0, 1, 2):
            prompt = branching_prompt(seed)
            reference = helpers.run(target, build("ar", target), prompt, 40)[0]
            for options in (MethodOptions(tree=8), MethodOptions(tree=8, controller="constant:8"),
                            MethodOptions(tree=3, controller="constant:16", ngram_max_n=3)):
                recipe, seen = primary_wins_and_others(build("anpd", target, options))
                ids, stats, _ = helpers.run(target, recipe, prompt, 40)
                assert ids == reference, (name, seed, options)
                assert stats.target_forwards == 1 + sum(stats.accepted_histogram)
                if target.verifies_trees:
                    counts.update(seen)
                else:
                    assert not seen["trees"], name  # the eager forward: single-path drafts
    assert counts["trees"] > 50 and counts["other branch"] > 5, counts  # not vacuous


def test_staged_tree_verifies_keep_anpds_output_ars(monkeypatch):
    """Trees of 9 rows on the int8 C layers are verified in two parts (`Target._staged_tree`):
    the output stays `ar`'s, whether a walk stops in the first part or reads the second."""
    parts = Counter()
    rows = Tree.rows
    monkeypatch.setattr(Tree, "rows", lambda self, begin, end: parts.update([begin > 0]) or rows(self, begin, end))
    for arch in helpers.FAST_ARCHITECTURES:
        target = int8_target(arch, seed=3)
        for seed in (0, 1):
            prompt = sum((branching_prompt(seed * 10 + s) for s in range(4)), [])
            reference = helpers.run(target, build("ar", target), prompt, 40)[0]
            options = MethodOptions(tree=8, controller="constant:8")
            assert helpers.run(target, build("anpd", target, options), prompt, 40)[0] == reference, (arch, seed)
    assert parts[False] >= 20 and parts[True] >= 2, parts  # first parts, and second parts read (39 and 4)


def test_staged_sampled_tree_verifies_draw_what_whole_ones_draw(monkeypatch):
    """Under seeded sampling (`sampled_match` along the tree, through `LazyRows.map`), a staged
    tree verify commits what one whole forward of the tree commits: the rows are the same bits,
    so the same draws. (Whole trees follow `ar`'s distribution:
    test_tree_verification_follows_ars_distribution.)"""
    parts = Counter()
    rows = Tree.rows
    monkeypatch.setattr(Tree, "rows", lambda self, begin, end: parts.update([begin > 0]) or rows(self, begin, end))
    sampling = SamplingConfig(temperature=0.3, top_k=5, seed=5)  # near-greedy: second parts get read
    options = MethodOptions(tree=8, controller="constant:8")
    for arch in helpers.FAST_ARCHITECTURES:
        target = int8_target(arch, seed=3)
        prompt = sum((branching_prompt(s) for s in range(4)), [])
        outputs = []
        for staged in (True, False):
            monkeypatch.setattr(verify_lossless, "reads_rows_in_order", staged)
            outputs.append(helpers.run(target, build("anpd", target, options, sampling), prompt, 40, sampling)[0])
        assert outputs[0] == outputs[1], arch
    assert parts[False] >= 10 and parts[True] >= 2, parts  # staged trees ran, some read their second part


class TreeScript:
    """Proposes one fixed tree at the first step after the prefill, made from the true
    continuation (`make(truth)` -> (tokens, parents)), and nothing after."""

    def __init__(self, reference: list[int], make):
        self.reference, self.make = reference, make
        self.trees = 0

    def begin(self, prompt):
        self.prompt_length, self.trees = len(prompt), 0

    def propose(self, context, k, keep=None):
        if self.trees:
            return EMPTY_DRAFT
        self.trees += 1
        done = len(context) - self.prompt_length
        ids, parents = self.make(self.reference[done:])
        return Draft.tree(ids, parents)

    def commit(self, committed, n_proposed):
        pass


def _wrong(token: int, vocab: int = 128) -> int:
    return (token + 1) % vocab


# secondary branch wins at the root; primary wins then a second child of it; a third-level switch
SCRIPTS = {
    "root": lambda t: ([_wrong(t[0]), t[1], t[2], t[0], t[1], t[2]], [-1, 0, 1, -1, 3, 4]),
    "depth 1": lambda t: ([t[0], _wrong(t[1]), t[1], t[2], t[3]], [-1, 0, 0, 2, 3]),
    "depth 2": lambda t: ([t[0], t[1], _wrong(t[2]), _wrong(t[1]), t[2]], [-1, 0, 1, 0, 1]),
    # 9 rows with the root: a staged verify on the C layers, the winning branch from row 4 on (its
    # second part), run after the first part wrote the rows it does not see
    "second part": lambda t: ([_wrong(t[0]), t[1], t[2], t[0], t[1], t[2], t[3], _wrong(t[4])],
                              [-1, 0, 1, -1, 3, 4, 5, 6]),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("path,context", [("gemma3-int8", 14), ("llama-int8", 14), ("qwen2", 14), ("gemma3-blocks", 14),
                                          ("gemma3-int8", 300), ("gemma3-eager", 14), ("qwen2-eager", 14),
                                          ("gpt2-eager", 14)])
def test_after_another_branch_wins_the_next_step_is_ars(tiny_targets, path, context, script):
    """The KV commit: a step where a branch other than the primary one wins moves its keys and
    values to their positions; every later forward's logits are then `ar`'s, bit for bit on the
    C layers (int8), to float32 rounding elsewhere, and the output is `ar`'s. Contexts of 14 (the
    tree runs past the sliding window of 8) and 300 (the cache has grown inside a forward)."""
    arch, _, kind = path.partition("-")
    target = int8_target(arch, seed=4) if kind == "int8" else tiny_targets[path]
    prompt = (branching_prompt(4) * 9)[:context]
    expected: list[torch.Tensor] = []  # ar's logits at each step
    original = target.forward

    def recording(ids, last_only=False, lazy=False):
        out = original(ids, last_only)  # a tensor: ar's steps are one row
        expected.append(out[-1])
        return out

    target.forward = recording
    try:
        reference = helpers.run(target, build("ar", target), prompt, 12)[0]
        drafter = TreeScript(reference, SCRIPTS[script])
        got: list[torch.Tensor] = []

        def recording_tree(ids, last_only=False, lazy=False):
            out = original(ids, last_only)
            got.append(out[0])  # a one-token step after the tree: ar's next position
            return out

        target.forward = recording_tree
        ids, stats, steps = helpers.run(target, Recipe(drafter, ConstantLength(8), verify_lossless), prompt, 12)
    finally:
        del target.forward
    assert ids == reference
    accepted = {"root": 3, "depth 1": 4, "depth 2": 3, "second part": 4}[script]
    assert len(steps[1]) == accepted + 1 and stats.accepted == accepted  # the other branch won
    later = expected[1 + accepted + 1 :]  # ar's logits after the tree step's tokens
    assert len(got) == 1 + len(later)  # the prefill, then one-token steps
    for mine, reference_row in zip(got[1:], later):
        if kind == "int8":
            assert torch.equal(mine, reference_row)
        else:
            assert (mine - reference_row).abs().max().item() <= 1e-5 * max(reference_row.abs().max().item(), 1.0)


def neox_target() -> Target:
    """A model the PyTorch path does not take apart (GPT-NeoX): it verifies no trees."""
    return Target(helpers.make_model(helpers.neox_config(), seed=3), None, name="tiny-neox", fast=False)


def test_a_target_without_tree_verification_checks_the_primary_branch():
    target = neox_target()
    assert not target.verifies_trees
    prompt = branching_prompt(1)
    reference = helpers.run(target, build("ar", target), prompt, 10)[0]
    drafter = TreeScript(reference, lambda t: ([t[0], t[1], _wrong(t[0])], [-1, 0, -1]))
    verified = []

    def rule(draft, logits, sampling, generator):
        verified.append(draft)
        return verify_lossless(draft, logits, sampling, generator)

    ids, stats, _ = helpers.run(target, Recipe(drafter, ConstantLength(4), rule), prompt, 10)
    assert ids == reference and stats.accepted == 2
    assert verified[1].parents is None and verified[1].tokens.tolist() == reference[1:3]


def test_anpd_drafts_single_paths_where_trees_cannot_be_verified(tiny_targets, capsys):
    target = neox_target()
    recipe = build("anpd", target, MethodOptions(tree=8))
    assert recipe.drafter.tree == 0
    assert "cannot verify trees of drafts (its architecture 'gpt_neox' is not one of" in capsys.readouterr().err
    build("anpd", target, MethodOptions(tree=8))
    assert capsys.readouterr().err == ""  # said once per target
    assert build("anpd", tiny_targets["qwen2"], MethodOptions(tree=8)).drafter.tree == 8
    assert build("anpd", tiny_targets["qwen2-eager"], MethodOptions(tree=8)).drafter.tree == 8  # the PyTorch path


# -- options ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1, 64, 2.5, "8", True])
def test_bad_node_budgets_are_refused(value):
    with pytest.raises(ConfigError, match="tree must be an integer from 0"):
        MethodOptions(tree=value)


def test_tree_options_are_checked(tiny_targets):
    assert parse_variant("anpd/tree=8") == ("anpd", None, {"tree": 8})
    assert parse_variant("anpd/constant:8/tree=8") == ("anpd", "constant:8", {"tree": 8})
    for spec, message in [("anpd/tree=x", "tree must be an integer"), ("anpd/tree=99", "from 0 .off. to 63"),
                          ("pld/tree=4", "tree is an anpd option"), ("anpd/tree=-2", "from 0")]:
        with pytest.raises(ConfigError, match=message):
            parse_variant(spec)
    with pytest.raises(ConfigError, match="anpd option"):
        build("pld", tiny_targets["llama"], MethodOptions(tree=4))
    build("ar", tiny_targets["llama"], MethodOptions(tree=4))  # ar drafts nothing, whatever the options


def test_the_library_takes_a_method_with_settings(tiny_targets):
    """`generate(target, prompt, "anpd/constant:8/tree=8")` is anpd with those options (the
    request `generate` and `stream` make; tiny targets have no tokenizer for the text)."""
    from verispec.api import make_request

    target, prompt = tiny_targets["llama"], branching_prompt(0)
    request = make_request(target, prompt, "anpd/constant:8/tree=8", max_new_tokens=24)
    assert request.method == "anpd" and request.options == MethodOptions(controller="constant:8", tree=8)
    reference = helpers.run(target, build("ar", target), prompt, 24)[0]
    ids, stats, _ = helpers.run(target, build(request.method, target, request.options), prompt, 24)
    assert ids == reference and len(stats.accepted_per_position) == 8  # trees of up to 8 tokens
    with pytest.raises(ConfigError, match="tree is given twice, as 4 and as 8"):
        make_request(target, prompt, "anpd/tree=8", options=MethodOptions(tree=4))
    # settings that do not go together are refused with the request, before anything runs
    with pytest.raises(ConfigError, match="an anpd option"):
        make_request(target, prompt, "pld", options=MethodOptions(tree=4))
    with pytest.raises(ConfigError, match="adaptive controller .* would bias sps's sampled drafts"):
        make_request(target, prompt, "sps/adaptive", temperature=1.0)


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-m", "pld", "--tree", "4"], "--tree is used only by anpd, not by pld"),
    (["generate", "hi", "--tree", "-1"], "tree must be an integer from 0 (off) to 63"),
    (["generate", "hi", "--tree", "100"], "tree must be an integer from 0 (off) to 63"),
    (["bench", "--methods", "ar,pld/tree=2"], "tree is an anpd option"),
])
def test_the_cli_refuses_bad_tree_options_before_loading(monkeypatch, tmp_path, args, message):
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, args, message)


# -- sampling (statistical) -----------------------------------------------------------------------

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3, 6, 1, 2]  # after (1, 2): 3, 4 and 5, so ANPD branches at once
LENGTH = 3


@pytest.fixture(scope="module")
def micro() -> Target:
    target = Target(helpers.make_model(helpers.micro_llama_config(VOCAB, init=0.3), seed=0), None, name="micro")
    assert target.verifies_trees
    return target


class LikelyTree:
    """Deterministic trees from the exact law: at each of the first LENGTH positions the two most
    likely tokens, each followed by its own two most likely, and so on (up to the budget)."""

    def __init__(self, exact: dict, budget: int = 6):
        self.budget = budget
        self.table: dict = {}
        for outcome, probability in exact.items():
            for cut in range(LENGTH):
                key = (outcome[:cut], outcome[cut])
                self.table[key] = self.table.get(key, 0.0) + probability

    def begin(self, prompt):
        self.prompt_length = len(prompt)

    def _likely(self, generated: tuple) -> list[int]:
        options = {t: self.table.get((generated, t), 0.0) for t in range(VOCAB)}
        return sorted((t for t in options if options[t] > 0), key=lambda t: -options[t])[:2]

    def propose(self, context, k, keep=None):
        frontier = [(tuple(context[self.prompt_length:]), -1)]
        ids, parents = [], []
        while frontier and len(ids) < min(k, self.budget):
            generated, parent = frontier.pop(0)
            for token in self._likely(generated):
                if len(ids) < min(k, self.budget):
                    ids.append(token)
                    parents.append(parent)
                    frontier.append((generated + (token,), len(ids) - 1))
        return Draft.tree(ids, parents) if ids else EMPTY_DRAFT

    def commit(self, committed, n_proposed):
        pass


def broken_tree_rule(draft, logits, sampling, generator):
    """A plausible bug: a fresh draw for each child in turn (several tries per position), which
    favours tokens that have a branch."""
    p = probabilities(logits, sampling)
    if draft.parents is None:
        return verify_lossless(draft, logits, sampling, generator)
    parents, ids = draft.parents.tolist(), draft.tokens.tolist()
    node, path = -1, []
    while True:
        children = [i for i, parent in enumerate(parents) if parent == node]
        chosen = None
        for child in children:
            if sample(p[node + 1], generator) == ids[child]:
                chosen = child
                break
        if chosen is None:
            return Verdict(len(path), sample(p[node + 1], generator), tuple(path))
        path.append(chosen)
        node = chosen


def sampled_outcomes(target, make_recipe, sampling: SamplingConfig, runs: int, seeded: bool):
    outcomes, other = [], Counter()
    for run in range(runs):
        config = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, run if seeded else None)
        recipe, seen = primary_wins_and_others(make_recipe())
        ids, _, _ = helpers.run(target, recipe, PROMPT, LENGTH + 2, config)
        outcomes.append(tuple(ids[:LENGTH]))
        other.update(seen)
    return outcomes, other


@pytest.mark.long
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)])
def test_tree_verification_follows_ars_distribution(micro, sampling):
    exact = helpers.exact_sequence_distribution(micro.model, PROMPT, LENGTH, sampling)
    runs = 500
    ar, _ = sampled_outcomes(micro, lambda: build("ar", micro), sampling, runs, seeded=True)
    helpers.assert_fits(ar, exact, "ar")
    recipes = {
        "likely tree": lambda: Recipe(LikelyTree(exact), ConstantLength(6), verify_lossless),
        # no long-match copies: every run re-sends PROMPT, which the memory would copy as a single path
        "anpd tree": lambda: build("anpd", micro, MethodOptions(tree=6, controller="constant:6", span_min=0), sampling),
    }
    for label, make_recipe in recipes.items():
        # with a seed: one draw per committed token, so ar's own sample (up to float rounding)
        outcomes, seen = sampled_outcomes(micro, make_recipe, sampling, runs, seeded=True)
        assert seen["other branch"] > 0.05 * runs, (label, seen)  # secondary branches do win
        same = sum(a == b for a, b in zip(ar, outcomes))
        assert same >= 0.995 * runs, f"{label}: only {same}/{runs} seeds reproduce ar"
        helpers.assert_fits(outcomes, exact, label)
        # without a seed, as users call it
        outcomes, _ = sampled_outcomes(micro, make_recipe, sampling, runs, seeded=False)
        helpers.assert_fits(outcomes, exact, f"{label}, unseeded")
    # negative control: the test has the power to see a rule that retries at a branch
    broken, _ = sampled_outcomes(micro, lambda: Recipe(LikelyTree(exact), ConstantLength(6), broken_tree_rule),
                                 sampling, runs, seeded=True)
    _, pvalue, _ = helpers.chi_square_pvalue(Counter(broken), exact)
    assert pvalue < 1e-4, "the chi-square test lacks the power to see a biased tree rule"


# -- the real model ------------------------------------------------------------------------------

@pytest.mark.slow
def test_greedy_anpd_with_trees_equals_ar_on_the_default_model():
    import verispec

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target = verispec.load(None, dtype="float32")
        assert target.verifies_trees and target.numerics == "gguf"
        prompt = ("Repeat the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
                  "Again: apple, banana, cherry, date, elderberry, fig, grape.\nAgain: apple, banana, cherry,")
        ar = verispec.generate(target, prompt, method="ar", max_new_tokens=48)
        for options in (MethodOptions(tree=8), MethodOptions(tree=8, controller="constant:8"),
                        MethodOptions(tree=8, controller="constant:8", span_min=0)):  # trees, not copies
            result = verispec.generate(target, prompt, method="anpd", max_new_tokens=48, options=options)
            assert result.token_ids == ar.token_ids, options
            assert result.stats.accepted > 0
    finally:
        torch.set_num_threads(threads)
