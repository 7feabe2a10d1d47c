"""The batch's scheduler: which waiting request starts, what each may hold of the KV pools, and
how one step's rows are shared.

Owns the one rule for KV memory, used by the batch engine and through it by `generate_many`,
`stream_many` and the server:

- **A request's need** (`kv_positions`, `Claim`): the most positions its sequence can ever hold
  in a pool: its prompt, every token it may generate, and for a drafter with scratch rows of its
  own (a draft model's beams) their slots. Computed here and nowhere else. A verify never writes
  past it: the engine cuts a step's drafts to what the claim leaves (`draft_room`, `fits`).
- **Refusal** (`never_fits`): a request whose need in some pool exceeds that pool could never
  run, and is refused when submitted, with the reason. Every other request is queued: it may
  wait, it is never refused for being second.
- **Admission** (`admission_cost`, `admissible`): first come, first served. The request at the
  head of the queue starts when every pool it writes can give it its whole need on top of what
  the running requests may still take (`outstanding`: their needs minus the blocks they hold).
  Blocks it shares from the prefix cache cost nothing where another sequence already holds them;
  cached blocks nobody holds still count, since sharing takes them out of the evictable set.

  So every running request's future blocks are covered at every moment: a step never runs out
  of KV memory, nothing is ever preempted or recomputed, and a request that fits the pool alone
  always completes, having waited at most for the requests ahead of it. (vLLM admits
  optimistically and preempts under pressure; a full reservation trades some concurrency when
  memory is tight, where budgets are far above what requests generate, for that guarantee. The
  server sizes the budget of a request that names none to what the pool holds.)
- **A step's rows** (`row_share`, `draft_room`): verify rows of the decoding requests first (a
  quarter of the rows kept for prompt chunks while a prompt waits), then prompt chunks, first
  come first served, within `max_rows`.

Pure: it decides from counts (`PoolCounts`: a pool's size and free blocks) and sizes; it knows
nothing of tensors, models or the pool's data structures, so `tests/test_scheduler.py` proves
its invariants against a simulated pool of N blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


def blocks_for(positions: int, block: int) -> int:
    """Blocks of `block` positions that hold `positions` positions."""
    return -(-positions // block)


def kv_positions(prompt_tokens: int, max_new_tokens: int, scratch: int = 0) -> int:
    """The most positions a request's sequence can hold: the prompt and every token it may
    generate (the cache holds the context but its last token; a verify of k drafts writes the
    last committed token and the drafts, which the budget bounds: `draft_room`), plus `scratch`
    slots a drafter writes past the context (a draft model's beams)."""
    return prompt_tokens + max_new_tokens + scratch


def shareable_positions(prompt_tokens: int, block: int) -> int:
    """Positions of a prompt that a request with the same prompt can take from the prefix
    cache once another has computed them: the full blocks before the one holding its last
    token (which is always computed, for its logits)."""
    return (prompt_tokens - 1) // block * block


@dataclass(frozen=True)
class PoolCounts:
    """What the scheduler reads of a block pool: its size and the blocks it can hand out now
    (free, or cached and unreferenced: evictable), in blocks of `block` positions."""

    blocks: int
    free: int
    block: int


@dataclass
class Claim:
    """A request's need in one pool: `positions` at most (`kv_positions`), i.e. `blocks` blocks;
    `held` is how many blocks its sequence holds now (the engine keeps it current)."""

    pool: object  # the pool's identity (the engine's BlockPool; tests' stand-ins)
    positions: int
    block: int
    held: int = 0

    @property
    def blocks(self) -> int:
        return blocks_for(self.positions, self.block)

    @property
    def outstanding(self) -> int:
        """Blocks it may still take from the pool."""
        return max(0, self.blocks - self.held)


def never_fits(claims: Iterable[Claim], pools: dict) -> str | None:
    """Why a request with these claims could never run (its need in a pool exceeds the pool,
    even empty), or None. `pools`: pool -> PoolCounts."""
    for claim in claims:
        size = pools[claim.pool].blocks
        if claim.blocks > size:
            return (f"it needs {claim.blocks} blocks of KV memory ({claim.positions} positions in blocks of "
                    f"{claim.block}) and the pool holds {size}")
    return None


def admission_cost(claim: Claim, shared_busy: int) -> int:
    """Blocks a starting request takes from a pool's free blocks over its life: its need, less
    the blocks it shares that another sequence holds already (`shared_busy`; cached blocks
    nobody holds cost one each, as they leave the evictable set, and a private copy of a shared
    block the request must write costs one: `kv_pool.PagedKV.start_cost` counts both)."""
    return claim.blocks - shared_busy


def outstanding(running: Iterable[Claim], pool: object) -> int:
    """Blocks the running requests may still take from `pool`."""
    return sum(claim.outstanding for claim in running if claim.pool is pool)


def admissible(costs: dict, running: Sequence[Claim], pools: dict) -> bool:
    """Whether a request whose start costs `costs` (pool -> blocks, `admission_cost`) fits every
    pool on top of the running requests' outstanding blocks."""
    return all(cost <= pools[pool].free - outstanding(running, pool) for pool, cost in costs.items())


def row_share(max_rows: int, decoding: int, prefilling: bool) -> int:
    """Draft tokens each of `decoding` requests may verify this step: an equal share of the
    rows, less each one's committed token (three quarters of the rows while a prompt waits for
    its chunks)."""
    budget = max_rows * 3 // 4 if prefilling else max_rows
    return max(0, budget // max(1, decoding) - 1)


def draft_room(share: int, tokens_left: int) -> int:
    """Most draft tokens a request may verify this step: its share of the rows, and never past
    its token budget (`tokens_left` it may still generate; a step commits the drafts and one
    token more), which also keeps a chain of drafts inside its claim."""
    return max(0, min(share, tokens_left - 1))


def fits(end: int, claim_positions: int) -> bool:
    """Whether a verify whose rows reach slot `end` (a tree's scratch slots included) stays
    inside the request's claim."""
    return end <= claim_positions
