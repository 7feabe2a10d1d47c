"""The decode loop: draft -> verify -> accept -> roll back, one request at a time.

Owns the five phases of DESIGN.md, the stopping rules on token ids (EOS, max_new_tokens) and the
timing of prefill and decode. Knows nothing of tokenizers or text: stop strings are applied by the
text layer above, which simply stops iterating. The autoregressive baseline is this same loop with
a drafter that proposes nothing, so every method shares one code path and `ar` is the oracle.

`decode` is a generator: it yields the tokens committed by each step (never a token past EOS or
the budget, even when the target accepted more in the same step) and fills `stats` as it goes.
Time spent by the consumer between yields is not counted in the stats.

A tree of drafts (`Draft.parents`) goes through the same loop: verified in one
`Target.forward_tree`, its accepted path then kept in the cache with `Target.keep_path`; on a
target that cannot verify trees (`Target.verifies_trees`) the tree's primary branch is verified
as a linear draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import torch

from . import lazy_rows
from .acceptance import Verdict
from .control import Controller
from .drafters.base import EMPTY_DRAFT, Draft, Drafter
from .errors import ConfigError
from .sampling import SamplingConfig
from .stats import GenerationStats

if TYPE_CHECKING:  # the loop needs only the Target interface (reset, forward, crop, device, trees)
    from .model import Target

# A rule gets the target's logits [k+1, vocab] as a tensor, or as `lazy_rows.LazyRows` if it says
# it reads rows in order and stops at a rejection (an attribute `reads_rows_in_order = True`).
Rule = Callable[[Draft, torch.Tensor, SamplingConfig, torch.Generator], Verdict]


class Recipe(NamedTuple):
    """What a method plugs into the loop."""

    drafter: Drafter
    controller: Controller
    rule: Rule


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


def decode(
    target: Target,
    recipe: Recipe,
    prompt: Sequence[int],
    config: DecodeConfig,
    stats: GenerationStats,
) -> Iterator[list[int]]:
    """Generate after `prompt`; yield the committed tokens of each step."""
    if not prompt:
        raise ConfigError("the prompt is empty: at least one token is needed")
    if len(prompt) + config.max_new_tokens > target.max_length:
        raise ConfigError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the "
            f"model's context of {target.max_length} tokens"
        )
    drafter, controller, rule = recipe
    generator = config.sampling.generator(device=target.device)  # where the target's logits are
    stats.prompt_tokens = len(prompt)
    context = list(prompt)

    started = time.perf_counter()
    target.reset()
    drafter.begin(context)
    logits = target.forward(context, last_only=True)  # [1, vocab]
    committed = [rule(EMPTY_DRAFT, logits, config.sampling, generator).next_token]
    drafter.commit(committed, 0)
    stats.target_forwards += 1
    stats.prefill_s = time.perf_counter() - started

    while True:
        committed, stats.stop_reason = _apply_stops(committed, stats.new_tokens, config)
        context += committed
        stats.new_tokens += len(committed)
        yield committed
        if stats.stop_reason:
            return
        started = time.perf_counter()
        # 0. how far to draft: never past the token budget (a step commits drafts + 1)
        k = min(controller.next_length(), config.max_new_tokens - stats.new_tokens - 1)
        # 1. propose (the controller may stop it token by token), keep the prefix worth verifying;
        #    a drawn draft is verified whole (`Draft.drawn`): its stop rule is `keep`, decided
        #    before each token is drawn
        draft = drafter.propose(context, k, controller.keep) if k > 0 else EMPTY_DRAFT
        assert len(draft) <= max(k, 0), f"drafter proposed {len(draft)} tokens for k={k}"
        if not draft.drawn:
            draft = draft.prefix(controller.cut(draft.confidence, len(draft)))
        if draft.parents is not None and not target.verifies_trees:
            draft = draft.primary()  # this target verifies linear drafts only: the primary branch
        draft_s = time.perf_counter() - started
        # 2. verify: the last committed token (not yet in the cache) and the draft, one forward
        #    (a tree of drafts: every branch in the same forward, the committed token its root)
        #    (`lazy`: a rule that reads rows in order may get them as `LazyRows`, the rows after
        #    the first few run through the layers and the head only if the rule reads them)
        verify_started = time.perf_counter()
        tokens = [context[-1], *draft.tokens.tolist()]
        lazy = getattr(rule, "reads_rows_in_order", False) and lazy_rows.worth_deferring(draft.confidence)
        if draft.parents is None:
            logits = target.forward(tokens, lazy=lazy)  # [k+1, vocab]
        else:
            logits = target.forward_tree(tokens, [-1, *(draft.parents + 1).tolist()], lazy=lazy)  # [k+1, vocab]
        # 3. accept n drafts, then one token from the target
        verdict = rule(draft, logits, config.sampling, generator)
        verify_s = time.perf_counter() - verify_started  # the rule's reads included: they may run the head
        n = verdict.n_accepted
        # 4. commit: keep the cache of context + accepted drafts (a tree's accepted path moved
        #    to its positions); roll the drafter back
        if draft.parents is None:
            target.crop(len(context) + n)
            accepted = draft.tokens[:n].tolist()
        else:
            target.keep_path([0, *(i + 1 for i in verdict.path)])
            accepted = draft.tokens[list(verdict.path)].tolist()
        committed = [*accepted, verdict.next_token]
        drafter.commit(committed, len(draft))
        # 5. update controller and stats
        controller.observe(len(draft), n, draft.confidence, verify_s, draft_s)
        stats.record_step(len(draft), n)
        stats.decode_s += time.perf_counter() - started


def _apply_stops(committed: list[int], generated: int, config: DecodeConfig) -> tuple[list[int], str]:
    """Cut a step's tokens at the first stop token (kept) or at the token budget."""
    for i, token in enumerate(committed):
        if token in config.stop_token_ids:
            committed, reason = committed[: i + 1], "eos"
            break
    else:
        reason = ""
    room = config.max_new_tokens - generated
    if len(committed) >= room:
        return committed[:room], reason or "length"
    return committed, reason
