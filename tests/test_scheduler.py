"""The batch scheduler (`verispec.core.scheduler`) and the batch engine that follows it, proven
against small pools with no model.

The pure rules first (a request's claim, refusal, admission cost, a step's rows); then
property tests that drive the real `BatchEngine` over a stand-in target: a real block pool
(`kv_pool.BlockPool` with one layer of one-float keys) whose "model" is a fixed function of
each row's token and position. Random mixes of prompts (lengths around and at multiples of
the block size, shared prompts, n copies of one prompt), token budgets, methods (linear and
tree drafts), stop tokens and cancellations, on pools from 1 block up, must hold the
invariants: a request that fits the pool alone completes (it may wait); one that never can is
refused at submit; a running job never holds more blocks than its claim, and the running
jobs' outstanding claims never exceed what the pool can give; nothing raises out of a step;
the engine ends within a bounded number of steps; every block is free when the batch is
empty. Outputs equal to solo runs on a real model: `tests/test_kv_pressure.py` and
`tests/test_batch.py`.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verispec.core import scheduler
from verispec.core.batch import BatchEngine
from verispec.target.backends import PagedBackend
from verispec.target.shared_forward import ALL, LAST
from verispec.runtime.static_kv import Tree
from verispec.core.engine import DecodeConfig
from verispec.core.methods import MethodOptions, build
from verispec.runtime.kv_pool import BlockPool, PoolExhausted
from verispec.runtime.rows import BLOCK
from verispec.core.scheduler import Claim, PoolCounts
from verispec.target.sequence import TargetSequence
from verispec.core.stats import GenerationStats

VOCAB = 16
EOS = 15


# -- the pure rules ------------------------------------------------------------------------------

def test_a_claim_is_the_prompt_and_the_budget_and_the_scratch():
    assert scheduler.kv_positions(11, 200) == 211
    assert scheduler.kv_positions(64, 60, scratch=45) == 169
    claim = Claim("pool", 129, BLOCK)
    assert claim.blocks == 3 and claim.outstanding == 3
    claim.held = 2
    assert claim.outstanding == 1
    claim.held = 5  # never negative
    assert claim.outstanding == 0


def test_only_a_claim_larger_than_the_whole_pool_is_refused():
    pools = {"p": PoolCounts(blocks=4, free=0, block=BLOCK)}  # nothing free now: still not refused
    assert scheduler.never_fits([Claim("p", 4 * BLOCK, BLOCK)], pools) is None
    why = scheduler.never_fits([Claim("p", 4 * BLOCK + 1, BLOCK)], pools)
    assert why is not None and "5 blocks" in why and "holds 4" in why


def test_admission_counts_outstanding_claims_and_shared_blocks():
    pools = {"p": PoolCounts(blocks=10, free=6, block=BLOCK)}
    running = [Claim("p", 5 * BLOCK, BLOCK, held=3), Claim("q", 9 * BLOCK, BLOCK)]  # 2 outstanding in p
    new = Claim("p", 5 * BLOCK, BLOCK)
    assert scheduler.admission_cost(new, shared_busy=0) == 5
    assert not scheduler.admissible({"p": 5}, running, pools)  # 5 > 6 - 2
    assert scheduler.admissible({"p": scheduler.admission_cost(new, shared_busy=1)}, running, pools)  # 4 <= 4


def test_a_steps_rows_are_shared_and_kept_within_the_budget():
    assert scheduler.row_share(256, 4, prefilling=False) == 63
    assert scheduler.row_share(256, 4, prefilling=True) == 47
    assert scheduler.row_share(8, 16, prefilling=False) == 0
    assert scheduler.draft_room(63, tokens_left=10) == 9
    assert scheduler.draft_room(63, tokens_left=1) == 0
    assert scheduler.fits(100, 100) and not scheduler.fits(101, 100)


# -- a stand-in target over a real block pool ------------------------------------------------------

class FakeBackend(PagedBackend):
    """The paged backend over a real `BlockPool` (one layer, one key/value head of one float per
    position) whose "model" is its target's `next_token`: no decoder, no C layers."""

    def forward_parts(self, parts):
        """What `PagedBackend.forward_parts` does to each sequence, with the stand-in's logits."""
        target = self.target
        target.forwards += 1
        results = []
        for part in parts:
            tree, _ = self.prepare(part)
            state, cache = part.sequence.state, part.sequence.cache
            rows = range(len(part.tokens)) if part.logits == ALL else [len(part.tokens) - 1] if part.logits == LAST else []
            logits = torch.full((len(rows), VOCAB), -1.0)
            for out, row in enumerate(rows):
                logits[out, target.next_token(part.tokens[row], int(tree.positions[row]))] = 1.0
            if part.parents is None:
                cache.note_tokens(cache.length, list(part.tokens))
                cache.length += len(part.tokens)
            else:
                state.tree = (cache.length, tree.slots.tolist(), list(part.tokens))
            results.append(logits if rows else None)
        return results


class FakeTarget:
    """What the batch engine uses of a target, over `FakeBackend`: the next token after token t
    at position p is (t + p) % (VOCAB - 1), or EOS where (t * 7 + p) % 97 == 0 and `eos` is on."""

    device = torch.device("cpu")
    name = "fake"
    verifies_trees = True
    pages_kv = True
    tokenizer = None

    def __init__(self, blocks: int, eos: bool = False, max_length: int = 4096):
        self.pool = BlockPool(layers=1, kv_heads=1, head_dim=1, blocks=blocks)
        self.backend = FakeBackend(self, None, lambda: self.pool)
        self.max_length, self.eos = max_length, eos
        self.vocab_size = VOCAB
        self.attachments: dict = {}
        self.forwards = 0

    def new_sequence(self) -> TargetSequence:
        return TargetSequence(self)

    def forward_parts(self, parts):
        return self.backend.forward_parts(parts)

    def next_token(self, token: int, position: int) -> int:
        if self.eos and (token * 7 + position) % 97 == 0:
            return EOS
        return (token + position) % (VOCAB - 1)


def alone(target: FakeTarget, prompt: list[int], max_new: int) -> list[int]:
    """The request's greedy output by the stand-in model's own rule."""
    out, token = [], prompt[-1]
    for i in range(max_new):
        token = target.next_token(token, len(prompt) + i - 1)
        out.append(token)
        if target.eos and token == EOS:
            break
    return out


def method_options(method: str) -> tuple[str, MethodOptions]:
    name, _, tree = method.partition("/tree=")
    return name, MethodOptions(tree=int(tree) if tree else 0)


request_strategy = st.tuples(
    st.sampled_from([1, 5, 63, 64, 65, 127, 128, 129, 192, 200]),  # prompt length
    st.integers(0, 3),  # which prompt text (shared texts give prefix hits)
    st.integers(1, 3),  # n copies of it
    st.integers(1, 150),  # max_new_tokens
    st.sampled_from(["ar", "pld", "anpd", "anpd/tree=8"]),
    st.one_of(st.none(), st.integers(1, 40)),  # cancelled after this many steps
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool_blocks=st.integers(1, 12), requests=st.lists(request_strategy, min_size=1, max_size=8),
       eos=st.booleans(), max_rows=st.sampled_from([16, 64, 256]), max_sequences=st.integers(1, 8))
def test_random_mixes_hold_every_invariant(pool_blocks, requests, eos, max_rows, max_sequences):
    target = FakeTarget(pool_blocks, eos=eos)
    engine = BatchEngine(target, max_rows=max_rows, max_sequences=max_sequences)
    texts = [[random.Random(seed).randrange(VOCAB - 1) for _ in range(256)] for seed in range(4)]
    jobs, refused = [], 0
    for length, text, copies, max_new, method, cancel_at in requests:
        prompt = texts[text][:length]
        name, options = method_options(method)
        config = DecodeConfig(max_new, stop_token_ids=frozenset({EOS}) if eos else frozenset())
        need = scheduler.blocks_for(scheduler.kv_positions(length, max_new), BLOCK)
        for _ in range(copies):
            sequence = target.new_sequence()
            recipe = build(name, sequence, options)
            if need > pool_blocks:
                with pytest.raises(PoolExhausted, match="can never fit"):
                    engine.submit(prompt, recipe, config, GenerationStats(method=name), sequence=sequence)
                refused += 1
                continue
            job = engine.submit(prompt, recipe, config, GenerationStats(method=name), sequence=sequence)
            jobs.append((job, prompt, max_new, cancel_at, []))
    bound = sum(max_new + -(-len(prompt) // 4) + 2 for _, prompt, max_new, _, _ in jobs)
    steps = 0
    while not engine.idle:
        steps += 1
        assert steps <= bound, "the engine did not end"
        for job, _, _, cancel_at, _ in jobs:
            if cancel_at is not None and steps == cancel_at:
                engine.cancel(job)
        for job, committed in engine.step():
            next(entry for entry in jobs if entry[0] is job)[4].extend(committed)
        pool = target.pool
        outstanding = 0
        for job in engine.running:
            for holding in job.holdings:
                claim = holding.refresh()
                assert claim.held <= claim.blocks, "a job holds more than its claim"
                outstanding += claim.outstanding
        assert outstanding <= pool.free_blocks, "the running jobs' claims exceed the pool"
    for job, prompt, max_new, cancel_at, tokens in jobs:
        assert job.done and job.error is None, job.error
        expected = alone(target, prompt, max_new)
        if job.finish_reason == "cancelled":
            assert tokens == expected[: len(tokens)]
        else:
            assert job.finish_reason in ("eos", "length") and tokens == expected
    assert target.pool.used_blocks == 0
    assert refused + len(jobs) == sum(copies for _, _, copies, _, _, _ in requests)


def test_a_job_waits_while_the_pool_is_held_and_starts_when_it_frees():
    """Two requests that each need the whole pool: the second waits for the first, then runs."""
    target = FakeTarget(blocks=2)
    engine = BatchEngine(target)
    prompt = list(range(10))
    first, second = (engine.submit(prompt, build("ar", target.new_sequence()), DecodeConfig(100),
                                   GenerationStats(method="ar")) for _ in range(2))
    engine.step()
    assert first in engine.running and second in engine.waiting
    while not first.done:
        engine.step()
        assert second.done or second in engine.waiting or second in engine.running
    while not engine.idle:
        engine.step()
    assert second.done and second.error is None and target.pool.used_blocks == 0


def test_blocks_held_outside_the_batch_fail_the_head_job_instead_of_hanging():
    target = FakeTarget(blocks=3)
    outside = target.new_sequence()
    outside.reset()
    outside.cache.reserve(2 * BLOCK)  # a single-request sequence that was never released
    engine = BatchEngine(target)
    job = engine.submit(list(range(10)), build("ar", target.new_sequence()), DecodeConfig(150),
                        GenerationStats(method="ar"))
    events = engine.step()
    assert job.done and isinstance(job.error, PoolExhausted) and "outside the batch" in str(job.error)
    assert (job, []) in events


def test_a_tree_draft_is_cut_to_stay_inside_its_claim():
    """A tree whose deepest path is off its primary branch takes more slots than rows
    (`Tree.span`); near the end of a request's budget it is cut until its verify fits."""
    from verispec.core.drafters.base import Draft

    target = FakeTarget(blocks=4)
    engine = BatchEngine(target)
    job = engine.submit([1] * 60, build("anpd", target.new_sequence(), MethodOptions(tree=8)), DecodeConfig(4),
                        GenerationStats(method="anpd"))
    job.sequence.reset()
    job.sequence.cache.reserve(60)
    job.sequence.cache.length = 61  # the prompt and two tokens: two left in a claim of 64 positions
    tree = Draft.tree([5, 6, 7], [-1, -1, 1])  # rows 0 and 1 follow the committed token; row 2 is deeper
    assert scheduler.kv_positions(60, 4) == 64
    assert Tree.span([-1, 0, 0, 2]) == 5  # 4 rows; the whole tree would reach slot 66
    cut = engine._within_claim(job, tree)
    assert 0 < len(cut) < len(tree) and 61 + Tree.span([-1, *(cut.parents + 1).tolist()]) <= 64
