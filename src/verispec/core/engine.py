"""The decode loop: draft -> verify -> accept -> roll back, one request at a time.

Owns the five phases of DESIGN.md, the stopping rules on token ids (EOS, max_new_tokens) and the
timing of prefill and decode. Knows nothing of tokenizers or text: stop strings are applied by the
text layer above, which simply stops iterating. The autoregressive baseline is this same loop with
a drafter that proposes nothing, so every method shares one code path and `ar` is the oracle.

`decode` is a generator: it yields the tokens committed by each step (never a token past EOS or
the budget, even when the target accepted more in the same step) and fills `stats` as it goes.
Time spent by the consumer between yields is not counted in the stats.

What a step does once its verify forward has run (the rule's verdict, `settle`, the drafter's and
the controller's feedback, the stats, `apply_stops`, the log-probabilities) is `Decoding.accept`,
and the token after a prefill is `Decoding.first`: the batch (`batch.BatchEngine`) calls the same
two on each of its requests, so one request decodes the same alone or in a batch.

A tree of drafts (`Draft.parents`) goes through the same loop: verified in one
`Target.forward_tree`, its accepted path then kept in the cache with `Target.keep_path`; on a
target that cannot verify trees (`Target.verifies_trees`) the tree's primary branch is verified
as a linear draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import torch

from ..target import lazy_logits
from .acceptance import Verdict
from ..target.shared_forward import Steps, run_alone
from .control import Controller
from .drafters.base import EMPTY_DRAFT, Draft, Drafter
from ..errors import ConfigError
from .sampling import SamplingConfig
from .stats import GenerationStats


class Verifier(Protocol):
    """What the loop needs of a target: a `model.Target`, or one of its sequences (`TargetSequence`)."""

    device: torch.device
    verifies_trees: bool
    max_length: int

    def reset(self) -> None: ...
    def forward(self, tokens: Sequence[int], last_only: bool = False, lazy: bool = False): ...
    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], lazy: bool = False): ...
    def keep_path(self, rows: Sequence[int]) -> None: ...
    def crop(self, length: int) -> None: ...


# A rule gets the target's logits [k+1, vocab] as a tensor, or as `lazy_logits.LazyRows` if it says
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


@dataclass
class Logprobs:
    """Where a request's log-probabilities go when it asks for them: per committed token, in
    order, (its logprob, the `top` most probable (id, logprob) pairs), from the target's own
    logits row that chose it: the model's distribution before temperature, top-k and top-p (what
    vLLM reports by default). A step's entries are recorded after stop tokens and the budget cut
    its tokens: one entry per output token."""

    top: int = 0
    entries: list = field(default_factory=list)

    def record(self, rows: "torch.Tensor", tokens: Sequence[int]) -> None:
        """rows [n, vocab]: row i the logits that token i was chosen from."""
        logprobs = torch.log_softmax(rows.float(), dim=-1)  # [n, vocab]
        chosen = logprobs[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()
        if self.top:
            values, indices = logprobs.topk(self.top, dim=-1)  # [n, top]
            tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
        else:
            tops = [[] for _ in tokens]
        self.entries += list(zip(chosen, tops))


def check_prompt(prompt: Sequence[int], max_new_tokens: int, max_length: int) -> None:
    """Refuse an empty prompt, or one that leaves the token budget no room in the model's context."""
    if not prompt:
        raise ConfigError("the prompt is empty: at least one token is needed")
    if len(prompt) + max_new_tokens > max_length:
        raise ConfigError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's context of {max_length} tokens"
        )


@dataclass(eq=False)
class Decoding:
    """One request's state in a decode loop (`decode`, or a job of `batch.BatchEngine`), and the
    two ways a forward's logits become committed tokens. `context`: the prompt, then every
    committed token (the list its drafter began with); `generator`: the rule's sampling generator
    (on the target's device); `logprobs`: where the committed tokens' log-probabilities go, if
    asked for."""

    target: Verifier
    recipe: Recipe
    config: DecodeConfig
    stats: GenerationStats
    context: list[int]
    generator: torch.Generator
    logprobs: Logprobs | None = None

    def first(self, logits: torch.Tensor) -> tuple[list[int], str]:
        """The token after the prefill, from the prompt's last logits [1, vocab] (the rule on no
        draft); returns the committed tokens and the stop reason ("" while it goes on)."""
        drafter, _, rule = self.recipe
        committed = [rule(EMPTY_DRAFT, logits, self.config.sampling, self.generator).next_token]
        drafter.commit(committed, 0)
        self.stats.target_forwards += 1
        return self._commit(committed, logits)

    def accept(self, draft: Draft, logits, verify_started: float, draft_s: float) -> tuple[list[int], str]:
        """Phases 3-5 of a step, after the verify forward of `draft` gave `logits` [k+1, vocab]
        (or `LazyRows`): the rule's verdict, `settle` (the cache and the drafter keep what was
        accepted), the controller's feedback (the verify's seconds count from `verify_started`,
        a `time.perf_counter()` value, to the verdict: the rule's reads may run the head), the
        stats, the stops. Returns the committed tokens and the stop reason ("" while it goes on)."""
        drafter, controller, rule = self.recipe
        verdict = rule(draft, logits, self.config.sampling, self.generator)
        verify_s = time.perf_counter() - verify_started
        rows = None
        if self.logprobs is not None:  # the rows that chose the committed tokens (read before the cache moves)
            path = range(verdict.n_accepted) if draft.parents is None else verdict.path
            rows = torch.stack([logits[row] for row in [0, *(i + 1 for i in path)]])
        committed = settle(self.target, drafter, draft, verdict, len(self.context))
        if not getattr(drafter, "forced_step", False):  # a grammar's forced text says nothing of the drafter
            controller.observe(len(draft), verdict.n_accepted, draft.confidence, verify_s, draft_s)
        self.stats.record_step(len(draft), verdict.n_accepted)
        return self._commit(committed, rows)

    def _commit(self, committed: list[int], rows) -> tuple[list[int], str]:
        """The step's tokens, then the stop token that a rule knows comes next whatever the logits
        (`certain_end`: a grammar that allows nothing else; not when log-probabilities are asked
        for, they need its row), cut at a stop token or the budget (`apply_stops`), their
        log-probabilities recorded (rows [n, vocab]: row i chose token i), added to the context."""
        certain_end = getattr(self.recipe.rule, "certain_end", None)
        if certain_end is not None and self.logprobs is None and committed[-1] not in self.config.stop_token_ids:
            end = certain_end()
            if end is not None and end in self.config.stop_token_ids:  # the forward that would pick it is saved
                committed = [*committed, end]
        committed, reason = apply_stops(committed, self.stats.new_tokens, self.config)
        if self.logprobs is not None:
            self.logprobs.record(rows[: len(committed)], committed)
        self.context += committed
        self.stats.new_tokens += len(committed)
        if reason:
            self.stats.stop_reason = reason
        return committed, reason


def decode(
    target: Verifier,
    recipe: Recipe,
    prompt: Sequence[int],
    config: DecodeConfig,
    stats: GenerationStats,
    logprobs: Logprobs | None = None,
) -> Iterator[list[int]]:
    """Generate after `prompt`; yield the committed tokens of each step (and record their
    log-probabilities in `logprobs`, if given)."""
    check_prompt(prompt, config.max_new_tokens, target.max_length)
    drafter, controller, rule = recipe
    generator = config.sampling.generator(device=target.device)  # where the target's logits are
    state = Decoding(target, recipe, config, stats, list(prompt), generator, logprobs)
    stats.prompt_tokens = len(prompt)
    try:
        started = time.perf_counter()
        target.reset()
        drafter.begin(state.context)
        committed, reason = state.first(target.forward(state.context, last_only=True))  # [1, vocab]
        stats.prefill_s = time.perf_counter() - started

        while True:
            yield committed
            if reason:
                return
            started = time.perf_counter()
            # 0-1. how far to draft, and the draft worth verifying
            draft = next_draft(drafter, controller, state.context, config.max_new_tokens - stats.new_tokens - 1,
                               target.verifies_trees)
            draft_s = time.perf_counter() - started
            # 2. verify: the last committed token (not yet in the cache) and the draft, one forward
            #    (a tree of drafts: every branch in the same forward, the committed token its root)
            #    (`lazy`: a rule that reads rows in order may get them as `LazyRows`, the rows after
            #    the first few run through the layers and the head only if the rule reads them)
            verify_started = time.perf_counter()
            tokens, parents = verify_tokens(state.context, draft)
            lazy = getattr(rule, "reads_rows_in_order", False) and lazy_logits.worth_deferring(draft.confidence)
            if parents is None:
                logits = target.forward(tokens, lazy=lazy)  # [k+1, vocab]
            else:
                logits = target.forward_tree(tokens, parents, lazy=lazy)  # [k+1, vocab]
            # 3-5. accept n drafts and one token from the target, roll back, learn
            committed, reason = state.accept(draft, logits, verify_started, draft_s)
            stats.decode_s += time.perf_counter() - started
    finally:
        close_drafter(drafter)


def next_draft(drafter: Drafter, controller: Controller, context: Sequence[int], room: int,
               verifies_trees: bool, cut: bool = True) -> Draft:
    """Phases 0 and 1 of a step: how far to draft (the controller's length, never past `room`,
    the tokens left in the budget after the one the target adds), then the draft (the
    controller may stop it token by token), cut to the prefix worth verifying (unless `cut` is
    False: the batch cuts its sequences' drafts together); a drawn draft is verified whole
    (`Draft.drawn`): its stop rule is `keep`, decided before each token is drawn. A tree
    becomes its primary branch where the target verifies linear drafts only."""
    return run_alone(drafting(drafter, controller, context, room, verifies_trees, cut))


def drafting(drafter: Drafter, controller: Controller, context: Sequence[int], room: int,
             verifies_trees: bool, cut: bool = True) -> Steps[Draft]:
    """`next_draft` as steps: a drafter that feeds a draft model paging its KV (`proposing`)
    yields that model's rows (`shared_forward.Part`), which the batch runs for many requests at
    once; any other drafter proposes without yielding. Under a grammar (`constraint`): where the
    next tokens are forced (`ConstrainedDrafter.forced_draft`) the draft starts with those, up to
    `room`, always kept, then the drafter's own draft after them where it can draft past
    uncommitted tokens (`continue_forced`), else nothing; and the text forced after the whole of
    a linear deterministic draft joins it (`forced_after`), before the controller's cut."""
    forced_draft = getattr(drafter, "forced_draft", None)  # a constrained drafter (`constraint`)
    lead = forced_draft(room) if forced_draft is not None else None  # drafted at no cost, nearly always accepted
    if lead is not None:
        more = getattr(drafter, "continue_forced", None)
        k = min(controller.next_length(), room - len(lead)) if more is not None else 0
        if k <= 0:
            return lead
        draft = lead.followed_by(more(context, lead, k, controller.keep))
    else:
        k = min(controller.next_length(), room)
        proposing = getattr(drafter, "proposing", None)
        if k <= 0:
            draft = EMPTY_DRAFT
        elif proposing is not None:
            draft = yield from proposing(context, k, controller.keep)
        else:
            draft = drafter.propose(context, k, controller.keep)
        assert len(draft) <= max(k, 0), f"drafter proposed {len(draft)} tokens for k={k}"
    kept = 0 if lead is None else len(lead)
    after = getattr(drafter, "forced_after", None)
    if after is not None and len(draft) > kept and draft.parents is None and not draft.drawn:
        draft = draft.followed_by(after(draft, room - len(draft)))
    if cut and not draft.drawn:
        draft = draft.prefix(max(kept, controller.cut(draft.confidence, len(draft))))
    if draft.parents is not None and not verifies_trees:
        draft = draft.primary()
    return draft


def verify_tokens(context: Sequence[int], draft: Draft) -> tuple[list[int], list[int] | None]:
    """What phase 2 runs: the last committed token (not yet in the cache) and the draft, with
    each row's parent for a tree (-1: the committed token; None for a linear draft)."""
    tokens = [context[-1], *draft.tokens.tolist()]
    parents = None if draft.parents is None else [-1, *(draft.parents + 1).tolist()]
    return tokens, parents


def settle(target: "Verifier", drafter: Drafter, draft: Draft, verdict: Verdict, context_length: int) -> list[int]:
    """Phase 4: keep the cache of the context and the accepted drafts (a tree's accepted path
    moved to its positions), roll the drafter back; returns the committed tokens (the accepted
    drafts and the target's own token)."""
    n = verdict.n_accepted
    if draft.parents is None:
        target.crop(context_length + n)
        accepted = draft.tokens[:n].tolist()
    else:
        target.keep_path([0, *(i + 1 for i in verdict.path)])
        accepted = draft.tokens[list(verdict.path)].tolist()
    committed = [*accepted, verdict.next_token]
    drafter.commit(committed, len(draft))
    return committed


def close_drafter(drafter: Drafter) -> None:
    """End a request's drafter: release what it holds beyond itself (a draft model's sequence)."""
    close = getattr(drafter, "close", None)
    if close is not None:
        close()


def apply_stops(committed: list[int], generated: int, config: DecodeConfig) -> tuple[list[int], str]:
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
