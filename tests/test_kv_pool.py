"""Paged KV memory (`runtime.kv_pool`): the block pool's accounting, the prefix cache's exact
matching and eviction, a sequence's copy on write, and a long run of random requests after
which every block is free again. Pure bookkeeping on a tiny pool (no model)."""

from __future__ import annotations

import random

import pytest
import torch

from verispec.runtime.kv_pool import BlockPool, PagedKV, PoolExhausted, block_bytes
from verispec.runtime.rows import BLOCK


def tiny_pool(blocks: int, prefix_cache: bool = True) -> BlockPool:
    return BlockPool(layers=2, kv_heads=1, head_dim=4, blocks=blocks, prefix_cache=prefix_cache)


def fill(sequence: PagedKV, tokens: list[int]) -> None:
    """What a forward does to the cache: reserve, write each position's keys (its token as the
    value, so that tests can read what a block holds), note the tokens, move the length."""
    start = sequence.length
    sequence.reserve(start + len(tokens))
    table = sequence.block_table
    for j, token in enumerate(tokens):
        slot = int(table[(start + j) // BLOCK]) * BLOCK + (start + j) % BLOCK
        for store in (sequence.pool.keys, sequence.pool.values):
            for layer in store:
                layer[:, slot] = float(token)
    sequence.note_tokens(start, tokens)
    sequence.length = start + len(tokens)


def held(sequence: PagedKV) -> list[int]:
    """The token each position's keys hold (layer 0)."""
    table = sequence.block_table
    return [int(sequence.pool.keys[0][0, int(table[p // BLOCK]) * BLOCK + p % BLOCK, 0]) for p in range(sequence.length)]


def test_budget_and_block_size():
    assert block_bytes(18, 1, 256) == 2 * 18 * BLOCK * 256 * 4  # the default model: 36 KiB a position
    pool = BlockPool.for_budget(2, 1, 4, budget_bytes=10 * block_bytes(2, 1, 4))
    assert pool.blocks == 10 and pool.free_blocks == 10
    with pytest.raises(PoolExhausted, match="holds no block"):
        BlockPool.for_budget(2, 1, 4, budget_bytes=100)


def test_exhaustion_is_an_error_that_takes_nothing():
    pool = tiny_pool(3)
    taken = pool.allocate(2)
    with pytest.raises(PoolExhausted, match="2 more blocks"):
        pool.allocate(2)
    assert pool.free_blocks == 1 and pool.used_blocks == 2
    pool.release(taken)
    assert pool.free_blocks == 3 and pool.used_blocks == 0
    sequence = PagedKV(pool)
    with pytest.raises(PoolExhausted):
        sequence.reserve(4 * BLOCK)
    assert sequence.blocks == [] and pool.free_blocks == 3


def test_freed_blocks_are_reused_most_recent_first():
    pool = tiny_pool(8)
    first = pool.allocate(3)
    pool.release(first)
    assert sorted(pool.allocate(3)) == sorted(first)  # warm memory before untouched memory


def test_a_second_sequence_shares_the_cached_blocks_of_a_common_prefix():
    pool = tiny_pool(16)
    prompt = list(range(1, 2 * BLOCK + 11))  # two full blocks and 10 tokens
    one = PagedKV(pool)
    fill(one, prompt)
    one.release()
    assert len(pool.prefix) == 3 and pool.used_blocks == 0 and pool.prefix.evictable == 3  # with its tail
    two = PagedKV(pool)
    other = prompt[:BLOCK] + [999] + prompt[BLOCK + 1 :]  # the second block differs in one token
    assert two.start_from_cache(other) == BLOCK
    assert two.blocks == [one_block := pool.prefix.match(prompt[:BLOCK])[0]]
    assert pool.references(one_block) == 1 and pool.prefix.evictable == 2
    fill(two, other[BLOCK:])
    assert held(two) == other
    two.release()
    assert pool.used_blocks == 0


def test_a_prompt_cached_whole_recomputes_its_last_token_in_a_copy():
    pool = tiny_pool(8)
    prompt = list(range(1, 2 * BLOCK + 1))  # exactly two blocks
    one = PagedKV(pool)
    fill(one, prompt)
    one.release()
    cached = pool.prefix.match(prompt)
    two = PagedKV(pool)
    assert two.start_from_cache(prompt) == 2 * BLOCK - 1
    assert two.blocks[0] == cached[0] and two.blocks[1] != cached[1]  # the last block is a private copy
    assert held(two) == prompt[:-1]
    before = pool.keys[0][:, cached[1] * BLOCK : (cached[1] + 1) * BLOCK].clone()
    fill(two, [777])  # rewriting the last position touches the copy only
    assert torch.equal(pool.keys[0][:, cached[1] * BLOCK : (cached[1] + 1) * BLOCK], before)
    assert held(two) == prompt[:-1] + [777]
    two.release()
    assert pool.used_blocks == 0


def test_rolling_back_into_shared_blocks_copies_before_writing():
    pool = tiny_pool(8)
    prompt = list(range(1, 3 * BLOCK + 1))
    one = PagedKV(pool)
    fill(one, prompt)
    one.cache_full_blocks()  # three shared blocks, still held by `one`
    two = PagedKV(pool)
    two.start_from_cache(prompt + [5])
    snapshot = [k.clone() for k in pool.keys]
    two.crop(BLOCK + 3)  # back into the second shared block
    fill(two, [9] * 20)
    assert held(two) == prompt[: BLOCK + 3] + [9] * 20
    assert held(one) == prompt  # the shared blocks were never written
    for block in one.blocks:
        assert torch.equal(pool.keys[0][:, block * BLOCK : (block + 1) * BLOCK],
                           snapshot[0][:, block * BLOCK : (block + 1) * BLOCK])
    one.release()
    two.release()
    assert pool.used_blocks == 0


def test_eviction_takes_the_least_recently_used_leaves_first():
    pool = tiny_pool(4)
    a, b = [1] * BLOCK + [2] * BLOCK, [1] * BLOCK + [3] * BLOCK  # a common first block
    for tokens in (a, b):
        sequence = PagedKV(pool)
        fill(sequence, tokens)
        sequence.release()
    assert len(pool.prefix) == 3 and pool.free_blocks == 4
    taken = pool.allocate(2)  # one free block, then the oldest idle leaf: a's second block
    assert pool.prefix.match(a) == pool.prefix.match(a)[:1] and len(pool.prefix.match(b)) == 2
    pool.release(taken)
    pool.allocate(4)  # the two free blocks, then b's leaf, then the shared first block
    assert len(pool.prefix) == 0


def test_identical_blocks_computed_twice_are_cached_once():
    pool = tiny_pool(8)
    tokens = list(range(BLOCK + 5))
    one, two = PagedKV(pool), PagedKV(pool)
    fill(one, tokens)
    fill(two, tokens)  # computed side by side, neither knowing of the other
    one.cache_full_blocks()
    two.cache_full_blocks()  # the same tokens: two switches to one's block and frees its own
    assert one.blocks[0] == two.blocks[0] and pool.references(one.blocks[0]) == 2
    assert pool.used_blocks == 3
    one.release()
    two.release()
    assert pool.used_blocks == 0 and len(pool.prefix) == 2  # the block, and one tail of the 5 tokens after it


def test_without_the_prefix_cache_nothing_is_kept():
    pool = tiny_pool(8, prefix_cache=False)
    sequence = PagedKV(pool)
    fill(sequence, list(range(2 * BLOCK)))
    sequence.release()
    assert len(pool.prefix) == 0 and pool.free_blocks == 8
    assert PagedKV(pool).start_from_cache(list(range(2 * BLOCK))) == 0


def test_a_thousand_random_requests_leave_every_block_free():
    """Requests of random lengths from a few shared prefixes, some rolled back (rejected drafts),
    some cancelled half-way, some refused when the pool is full: afterwards nothing is held."""
    rng = random.Random(0)
    pool = tiny_pool(12)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(10, 3 * BLOCK))] for _ in range(5)]
    live: list[tuple[PagedKV, list[int]]] = []
    refused = 0
    for _ in range(1000):
        if live and (len(live) > 4 or rng.random() < 0.4):
            sequence, expected = live.pop(rng.randrange(len(live)))
            assert held(sequence) == expected
            sequence.release()
            continue
        sequence = PagedKV(pool)
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
        try:
            start = sequence.start_from_cache(prompt)
            fill(sequence, prompt[start:])
            for _ in range(rng.randrange(4)):  # decode steps: a verify, then a rollback
                before = sequence.length
                fill(sequence, [rng.randrange(1000) for _ in range(rng.randrange(1, 9))])
                sequence.crop(before + rng.randrange(sequence.length - before + 1))
        except PoolExhausted:
            refused += 1
            sequence.release()
            continue
        live.append((sequence, list(sequence.tokens)))
    for sequence, expected in live:
        assert held(sequence) == expected
        sequence.release()
    assert pool.used_blocks == 0 and pool.free_blocks == pool.blocks
    assert refused > 0 and pool.prefix.hit_tokens > 0  # the run did exercise both


@pytest.mark.parametrize("full_blocks", [0, 2])
def test_a_prompt_that_goes_on_from_a_cached_tail_copies_it_instead_of_recomputing(full_blocks):
    """The committed positions of a sequence's last, partial block are kept (its tail); a later
    sequence whose tokens go on with them copies the block into one of its own (it writes the
    rest), never its last token; the cached tail is never written."""
    pool = tiny_pool(8)
    prompt = list(range(1, full_blocks * BLOCK + 11))
    one = PagedKV(pool)
    fill(one, prompt)
    tail = one.blocks[full_blocks]
    one.release()
    assert pool.prefix.cached(tail) and pool.used_blocks == 0
    before = pool.keys[0][:, tail * BLOCK : (tail + 1) * BLOCK].clone()
    two = PagedKV(pool)
    turn = prompt + [500, 501, 502]  # the next turn of a chat: what was computed, then more
    assert two.start_from_cache(turn) == len(prompt)
    assert two.blocks[full_blocks] != tail and held(two) == prompt
    fill(two, turn[len(prompt) :])
    assert held(two) == turn
    assert torch.equal(pool.keys[0][:, tail * BLOCK : (tail + 1) * BLOCK], before)
    three = PagedKV(pool)
    assert three.start_from_cache(prompt) == len(prompt) - 1  # the same prompt: its last token is recomputed
    assert held(three) == prompt[:-1]
    shorter = PagedKV(pool)  # a tail's leading positions serve a prompt that leaves it early
    assert shorter.start_from_cache(prompt[: full_blocks * BLOCK + 5] + [900]) == full_blocks * BLOCK + 5
    assert held(shorter) == prompt[: full_blocks * BLOCK + 5]
    for sequence in (two, three, shorter):
        sequence.release()
    assert pool.used_blocks == 0


def test_tails_are_evicted_before_the_blocks_they_follow_and_with_the_cache():
    pool = tiny_pool(3)
    one = PagedKV(pool)
    fill(one, list(range(1, BLOCK + 11)))  # a full block and a tail of 10
    one.release()
    assert len(pool.prefix) == 2 and pool.free_blocks == 3
    taken = pool.allocate(2)  # the free block, then the oldest idle one: the tail, before its block
    assert len(pool.prefix) == 1 and pool.prefix.match(list(range(1, BLOCK + 1)))
    pool.release(taken)
    pool.allocate(3)
    assert len(pool.prefix) == 0
    pool.release(list(range(3)))
    two = PagedKV(pool)
    fill(two, [7] * 10)
    two.release()
    pool.clear_cache()
    assert len(pool.prefix) == 0 and pool.free_blocks == 3 and pool.used_blocks == 0


def test_a_prompt_that_ends_inside_a_block_another_sequence_filled_further_copies_its_start():
    """A repeated prompt whose first answer ran past its block: the block is cached full, and the
    prompt's positions at its start are copied from it."""
    pool = tiny_pool(8)
    prompt = list(range(1, BLOCK + 21))
    one = PagedKV(pool)
    fill(one, prompt + list(range(300, 360)))  # the answer fills the second block and more
    one.release()
    two = PagedKV(pool)
    assert two.start_from_cache(prompt + [999]) == len(prompt)
    assert held(two) == prompt
    two.release()
    assert pool.used_blocks == 0


def test_a_tail_is_copied_even_when_it_is_the_only_block_left():
    """No free block: the one block to take is the idle tail itself, evicted and kept in place
    (its bits are still there), so the start still skips the positions it holds."""
    pool = tiny_pool(2)
    other = PagedKV(pool)
    fill(other, [5])  # holds the other block
    one = PagedKV(pool)
    fill(one, list(range(1, 11)))
    tail = one.blocks[0]
    one.release()
    assert pool.free_blocks == 1 and pool.prefix.cached(tail)
    two = PagedKV(pool)
    assert two.start_from_cache(list(range(1, 11)) + [42]) == 10
    assert two.blocks == [tail] and not pool.prefix.cached(tail) and pool.free_blocks == 0
    assert held(two) == list(range(1, 11))
    for sequence in (two, other):
        sequence.release()
    assert pool.used_blocks == 0


def test_a_start_with_no_block_to_copy_into_shares_what_it_can_and_never_fails():
    """Every block referenced: the cached full block whose start a prompt shares cannot be copied
    (no block to copy into), so the start shares the whole blocks it can and computes the rest
    (it used to raise PoolExhausted from the lookup)."""
    pool = tiny_pool(3)
    prompt = list(range(1, 2 * BLOCK + 11))
    alive = PagedKV(pool)
    fill(alive, prompt)
    alive.cache_full_blocks()  # its two full blocks cached, still referenced; all 3 blocks held
    assert pool.free_blocks == 0
    two = PagedKV(pool)
    assert two.start_from_cache(prompt[: BLOCK + 10] + [999]) == BLOCK
    assert two.blocks == alive.blocks[:1] and held(two) == prompt[:BLOCK]
    two.release()
    alive.release()
    assert pool.used_blocks == 0
