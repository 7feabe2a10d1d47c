"""Verify rows computed only when a rule reads them (`lazy_logits.LazyRows`, `Target.forward(lazy=True)`,
`Target.forward_tree(lazy=True)`).

A lazy verify must give the rules the same bits as one whole forward (it is exact because the C
layers and the int8 LM head are batch-invariant), run the tokens after the first chunk through
the layers and the head only when a rule reads one of their rows, and keep every lossless
method's output equal to `ar`'s, greedy and seeded sampled; where the forward is not
batch-invariant (fp32 numerics) it must not be lazy.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from test_batch_invariance import int8_target, tokens
from verispec.target import lazy_logits as lazy_logits
from verispec.core.acceptance import greedy_match, verify_lossless
from verispec.target.lazy_logits import LazyRows, materialize
from verispec.core.methods import build
from verispec.core.sampling import SamplingConfig


class CountingHead:
    """A head that records the row ranges it is called on."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.calls = weight, []

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls.append(hidden.shape[0])
        return hidden @ self.weight.T


def lazy_of(n: int, seed: int = 0) -> tuple[LazyRows, CountingHead, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(n, 6, generator=generator), torch.randn(11, 6, generator=generator)
    head = CountingHead(weight)
    return LazyRows.of_head(hidden, head, 11), head, hidden @ weight.T


def test_rows_are_computed_in_two_chunks_when_first_read():
    rows, head, expected = lazy_of(10)
    assert rows.shape == (10, 11) and rows.dim() == 2 and len(rows) == 10 and head.calls == []
    assert torch.equal(rows[2], expected[2]) and head.calls == [lazy_logits.FIRST]
    assert torch.equal(rows[0], expected[0]) and head.calls == [lazy_logits.FIRST]  # kept, not recomputed
    assert torch.equal(rows[-1], expected[9]) and head.calls == [lazy_logits.FIRST, 10 - lazy_logits.FIRST]
    assert torch.equal(rows.full(), expected) and len(head.calls) == 2
    with pytest.raises(IndexError):
        rows[10]
    with pytest.raises(TypeError):
        rows[1:3]


def test_full_and_map_compute_what_is_missing_and_keep_rows_aligned():
    rows, head, expected = lazy_of(9, seed=1)
    assert torch.equal(materialize(rows), expected) and head.calls == [lazy_logits.FIRST, 9 - lazy_logits.FIRST]
    rows, head, expected = lazy_of(9, seed=2)
    doubled = rows.map(lambda chunk: chunk * 2)
    assert torch.equal(doubled[5], expected[5] * 2) and torch.equal(doubled[1], expected[1] * 2)
    assert torch.equal(doubled.full(), expected * 2) and head.calls == [lazy_logits.FIRST, 9 - lazy_logits.FIRST]
    tensor = torch.ones(3, 2)
    assert materialize(tensor) is tensor


def test_greedy_match_stops_computing_at_the_first_rejection():
    rows, head, expected = lazy_of(12, seed=3)
    argmaxes = expected.argmax(-1).tolist()
    draft = torch.tensor([argmaxes[0], (argmaxes[1] + 1) % 11, *argmaxes[2:11]])  # rejected at row 1
    verdict = greedy_match(draft, rows)
    assert (verdict.n_accepted, verdict.next_token) == (1, argmaxes[1])
    assert head.calls == [lazy_logits.FIRST]  # rows 4..11 never computed
    rows, head, _ = lazy_of(12, seed=3)
    assert greedy_match(torch.tensor(argmaxes[:11]), rows).n_accepted == 11 and len(head.calls) == 2


def test_a_lazy_forward_gives_the_whole_forwards_bits_and_runs_the_rest_only_when_read():
    target = int8_target("gemma3", seed=5)
    sequence = tokens(40, seed=5)
    target.reset()
    target.forward(sequence[:20])
    whole = target.forward(sequence[20:32])  # [12, vocab]
    target.crop(20)
    lazy = target.forward(sequence[20:32], lazy=True)
    assert isinstance(lazy, LazyRows) and lazy.shape == whole.shape
    for i in (3, 0):
        assert torch.equal(lazy[i], whole[i]), i
    assert target.length == 20 + lazy_logits.FIRST  # the rest of the tokens have not run through the layers
    for i in (11, 7):
        assert torch.equal(lazy[i], whole[i]), i
    assert target.length == 32
    target.crop(20)
    assert isinstance(target.forward(sequence[20:20 + lazy_logits.MIN_ROWS - 1], lazy=True), torch.Tensor)  # too few rows
    target.numerics = "fp32"  # not batch-invariant: never lazy
    target.crop(20)
    assert isinstance(target.forward(sequence[20:32], lazy=True), torch.Tensor)


def test_a_lazy_tree_forward_gives_the_whole_trees_bits_and_runs_the_rest_only_when_read(monkeypatch):
    """A tree of 10 rows (the root, then branches), staged: the first 4 rows through the layers
    at once, the others only when read, each row bit for bit what the whole tree gives it."""
    target = int8_target("gemma3", seed=8)
    sequence = tokens(30, seed=8)
    ids = tokens(10, seed=9)
    parents = [-1, 0, 0, 1, 2, 3, 1, 6, 4, 8]  # rows 4.. hang below rows of the first part
    target.reset()
    target.forward(sequence)
    whole = target.forward_tree(ids, parents)  # [10, vocab]
    assert isinstance(whole, torch.Tensor) and target.length == 30
    rows_run: list[int] = []
    run = target.decoder.run
    monkeypatch.setattr(target.decoder, "run", lambda x, *a, **k: rows_run.append(x.shape[0]) or run(x, *a, **k))
    lazy = target.forward_tree(ids, parents, lazy=True)
    assert isinstance(lazy, LazyRows) and lazy.shape == whole.shape
    assert rows_run == [lazy_logits.FIRST]
    for i in (2, 0):
        assert torch.equal(lazy[i], whole[i]), i
    assert rows_run == [lazy_logits.FIRST]
    for i in (9, 5):
        assert torch.equal(lazy[i], whole[i]), i
    assert rows_run == [lazy_logits.FIRST, 10 - lazy_logits.FIRST]
    target.keep_path([0, 1, 3, 5])
    lazy = target.forward_tree(ids, parents, lazy=True)
    target.keep_path([0])
    with pytest.raises(AssertionError, match="before the cache moves"):
        lazy[7]
    target.crop(30)
    assert isinstance(target.forward_tree(ids[:7], parents[:7], lazy=True), torch.Tensor)  # too few rows
    target.numerics = "fp32"  # not batch-invariant: every row at once
    target.crop(30)
    assert isinstance(target.forward_tree(ids, parents, lazy=True), torch.Tensor)


def count_head_rows(target, monkeypatch) -> list[int]:
    """Record the rows of each call of the target's LM head (the real one, on the block kernel)."""
    from verispec.runtime.linear import BlockLinear

    calls: list[int] = []
    call = BlockLinear.__call__

    def counting(self, x):
        if self is target.head:
            calls.append(x.shape[0])
        return call(self, x)

    monkeypatch.setattr(BlockLinear, "__call__", counting)
    return calls


@pytest.mark.parametrize("mode", ["none", "partial", "all"])
def test_verifies_skip_the_head_after_a_rejection_and_outputs_stay_ars(mode, monkeypatch):
    """Scripted drafts of 9 on the int8 target: rejected ones run the head on the first chunk of
    4 rows only, accepted ones on every row; the output is `ar`'s either way."""
    target = int8_target("llama", seed=6)
    prompt = tokens(30, seed=6)
    reference = helpers.run(target, build("ar", target), prompt, 30)[0]
    drafter = helpers.ScriptedDrafter(reference, mode, target.vocab_size, right=2)
    calls = count_head_rows(target, monkeypatch)
    ids, stats, _ = helpers.run(target, helpers.scripted_recipe(drafter, 9), prompt, 30)
    assert ids == reference
    verify_calls = calls[1:]  # after the prefill's last row
    verifies = stats.target_forwards - 1
    wide = sum(1 for draft in drafter.proposed if len(draft) + 1 >= lazy_logits.MIN_ROWS)  # lazy verifies
    assert wide >= 2 and max(verify_calls) < lazy_logits.MIN_ROWS  # no wide verify ran the head on every row at once
    if mode == "all":  # every row read: the first chunk, then the rest
        assert len(verify_calls) == verifies + wide
    else:  # rejected within the first 4 rows: one call of 4 rows per wide verify
        assert len(verify_calls) == verifies and verify_calls.count(lazy_logits.FIRST) >= wide


def test_seeded_sampled_verification_draws_what_the_whole_head_draws(monkeypatch):
    """Deterministic drafts under sampling (`sampled_match` through `LazyRows.map`): with the same
    seed the lazy head commits the same tokens as the whole head, which commits `ar`'s."""
    target = int8_target("gemma3", seed=7)
    prompt = helpers.repetitive_prompt(target.vocab_size, seed=7, period=5, repeats=6)
    sampling = SamplingConfig(temperature=1.0, top_k=10, top_p=0.9, seed=3)
    calls = count_head_rows(target, monkeypatch)
    outputs = []
    for lazy in (True, False):
        monkeypatch.setattr(verify_lossless, "reads_rows_in_order", lazy)
        outputs.append(helpers.run(target, build("pld", target, sampling=sampling), prompt, 40, sampling)[0])
        if lazy:
            assert lazy_logits.FIRST in calls  # lazy verifies happened
    reference = helpers.run(target, build("ar", target, sampling=sampling), prompt, 40, sampling)[0]
    assert outputs[0] == outputs[1] == reference


def test_drafts_likely_accepted_whole_are_verified_in_one_part():
    """Deferring pays when the first chunk probably holds a rejection: drafts without confidences
    (prompt lookup) or with a low chance that their first 4 tokens all pass; not when it is high."""
    assert lazy_logits.worth_deferring(())
    assert lazy_logits.worth_deferring((0.9, 0.9))  # too short to tell: its verify is narrow anyway
    assert lazy_logits.worth_deferring((0.9, 0.8, 0.7, 0.9, 0.99))  # 0.45 that rows 4.. are read
    assert not lazy_logits.worth_deferring((0.95, 0.9, 0.9, 0.9, 0.1))  # 0.69
