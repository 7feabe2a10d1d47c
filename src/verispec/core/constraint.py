"""Constrained decoding kept exact: the grammar's mask inside the decode loop.

Owns the pure interface the loop uses (`Matcher`: which tokens the grammar allows next, consume,
roll back, the forced continuation) and `constrain`, which wraps a method's recipe so that every
method decodes under a constraint with the same loop (`engine.decode` alone, `batch.BatchEngine`
for many). Which library compiles grammars into a `Matcher` is the request layer's business
(`request/grammar.py`); nothing here knows it.

The reference is constrained `ar`: the target's logits with the tokens the grammar forbids set to
-inf, then greedy or sampling as usual. The wrappers keep every lossless method equal to it:

- the drafter's draft is cut before the verify at the first token the grammar rejects (the draft
  is walked through the matcher, which is then rolled back); a tree keeps the nodes whose paths
  the grammar accepts;
- a draft drawn at random (q) that left the grammar at token j is verified up to j, and the token
  after it is drawn as speculative sampling draws it once token j is rejected (it would be:
  its masked target probability is 0): from norm(max(p_j - q_j, 0)), so the output still follows
  the masked distribution exactly;
- the rule sees each verified row masked by the grammar's state after the draft tokens before it;
- after the verdict the matcher consumes the committed tokens; where it is then complete and
  allows a single token (the end of sequence), the loop commits that token without a forward
  (`ConstrainedRule.certain_end`: the masked distribution is all on it), unless log-probabilities
  are asked for;
- where the grammar allows a single continuation (forced text), the draft is its tokens, at no
  drafting cost, verified as any draft: the masked target nearly always takes them (the mask
  still allows other tokenizations of the same text, and the last token may merge with what
  follows). A drafter that can draft after uncommitted tokens (`propose_ahead`: the n-gram
  and suffix drafters) continues the forced text in the same draft, cut at the grammar as any
  draft, and the text the grammar forces after the whole of its draft joins it too (a value
  copied up to its closing quote, then the next key); the controller then prices the whole
  width. Other drafters draft nothing else in a forced step (their protocol follows committed
  tokens only), their drafts come in the steps between. `ar` drafts nothing (its controller's
  length is 0), so constrained `ar` stays the reference.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .acceptance import Verdict, residual_distribution
from .drafters.base import HOST, Draft, Drafter, Keep, keep_all
from .engine import Recipe, Rule
from .sampling import SamplingConfig, probabilities, sample
from .stats import GenerationStats


class Matcher(Protocol):
    """One request's grammar state (what `request/grammar.py` makes)."""

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next: bool [vocab] on the host."""

    def consume(self, tokens: Sequence[int]) -> int:
        """Advance by as many of `tokens` as the grammar accepts; returns how many."""

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""

    def forced(self) -> list[int]:
        """Tokens of the text the grammar forces next (its only continuation), possibly none;
        every prefix valid in the grammar."""

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing but the end of sequence."""


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] with -inf where allowed [n, vocab_g] (bool, host) is False; logits
    columns past vocab_g (padding rows of the head) are forbidden too. Returns [n, vocab]."""
    n, vocab = logits.shape
    width = allowed.shape[-1]
    if width > vocab:
        allowed = allowed[:, :vocab]
    elif width < vocab:
        allowed = torch.cat([allowed, torch.zeros(n, vocab - width, dtype=torch.bool, device=HOST)], dim=1)
    return torch.where(allowed.to(logits.device), logits, float("-inf"))  # [n, vocab]


def valid_prefix(matcher: Matcher, tokens: Sequence[int]) -> int:
    """How many leading `tokens` the grammar accepts from its state (left unchanged)."""
    n = matcher.consume(tokens)
    matcher.rollback(n)
    return n


def row_masks(matcher: Matcher, draft: Draft) -> torch.Tensor:
    """The grammar's mask for each verified row, bool [k+1, vocab_g]: row 0 from the matcher's
    state, row 1 + i after draft token i's path (the tokens must all be valid). Matcher unchanged."""
    tokens = draft.tokens.tolist()
    parents = list(range(-1, len(tokens) - 1)) if draft.parents is None else draft.parents.tolist()
    masks = [matcher.allowed()]
    for i in range(len(tokens)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path_tokens = [tokens[j] for j in reversed(path)]
        consumed = matcher.consume(path_tokens)
        assert consumed == len(path_tokens), "a verified draft token left the grammar"
        masks.append(matcher.allowed())
        matcher.rollback(consumed)
    return torch.stack(masks)


class ConstraintState:
    """What the two wrappers of one request share: its matcher, where its stats count forced
    tokens, and the drawn token cut off this step's draft (its index, id and q row [vocab])."""

    def __init__(self, matcher: Matcher, stats: GenerationStats | None, force: bool):
        self.matcher, self.stats, self.force = matcher, stats, force
        self.cut_drawn: tuple[int, int, torch.Tensor] | None = None
        self.forced_now = 0  # tokens of this step's draft that the grammar forced (set as each step drafts)
        self.forced_tail = (0, 0)  # (first row, count) of forced tokens after the drafter's own, if any

    def forced_accepted(self, n_accepted: int) -> int:
        """How many of the first n_accepted draft tokens of this step were forced text."""
        start, count = self.forced_tail
        return min(self.forced_now, n_accepted) + max(0, min(n_accepted, start + count) - start)

    def forced(self, limit: int) -> list[int]:
        if not self.force or limit <= 0 or self.matcher.stopped:
            return []
        return self.matcher.forced()[:limit]


class ConstrainedDrafter:
    """A drafter under a grammar: forced tokens when there are, else the inner drafter's draft
    cut at the grammar. Everything else (a draft model's sequence, its KV claims, `close`) is the
    inner drafter's."""

    def __init__(self, inner: Drafter, state: ConstraintState):
        self.inner, self.state = inner, state
        self._asked = False  # whether the inner drafter proposed this step
        if hasattr(inner, "proposing"):
            self.proposing = self._proposing
        if hasattr(inner, "propose_ahead"):
            self.continue_forced = self._continue_forced
            self.forced_after = self._forced_after

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def begin(self, prompt: Sequence[int]) -> None:
        self.inner.begin(prompt)

    def forced_draft(self, room: int) -> Draft | None:
        """This step's forced tokens (at most `room`) as a draft, None where the grammar forces
        nothing (`engine.drafting` asks before the controller's length: they cost nothing)."""
        forced = self.state.forced(room)
        self.state.forced_now, self.state.forced_tail = len(forced), (0, 0)
        if not forced:
            return None
        return Draft(torch.tensor(forced, dtype=torch.long, device=HOST), confidence=(1.0,) * len(forced))

    def _continue_forced(self, context: Sequence[int], forced: Draft, k: int, keep: Keep = keep_all) -> Draft:
        """The inner drafter's draft after this step's forced tokens (`forced_draft`), cut at the
        grammar from the state those tokens lead to (the matcher is left as it was)."""
        self._asked = True
        ahead = forced.tokens.tolist()
        draft = self.inner.propose_ahead(context, ahead, k, keep)
        consumed = self.state.matcher.consume(ahead)
        try:
            return draft.prefix(valid_prefix(self.state.matcher, draft.tokens.tolist()))
        finally:
            self.state.matcher.rollback(consumed)

    def _forced_after(self, draft: Draft, room: int) -> Draft:
        """The text the grammar forces after all of `draft` (a linear draft it accepts), at most
        `room` tokens; recorded as this step's forced tail (the matcher is left as it was)."""
        tokens = draft.tokens.tolist()
        consumed = self.state.matcher.consume(tokens)
        try:
            forced = self.state.forced(room) if consumed == len(tokens) else []
        finally:
            self.state.matcher.rollback(consumed)
        self.state.forced_tail = (len(tokens), len(forced))
        return Draft(torch.tensor(forced, dtype=torch.long, device=HOST), confidence=(1.0,) * len(forced))

    @property
    def forced_step(self) -> bool:
        """This step's draft holds forced text (its controller learns nothing from it)."""
        return self.state.forced_now > 0 or self.state.forced_tail[1] > 0

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        self._asked = True
        return self.cut(self.inner.propose(context, k, keep))

    def _proposing(self, context: Sequence[int], k: int, keep: Keep = keep_all):
        """`propose` as steps, where the inner drafter has them (`engine.drafting`)."""
        self._asked = True
        draft = yield from self.inner.proposing(context, k, keep)
        return self.cut(draft)

    def cut(self, draft: Draft) -> Draft:
        """The draft cut before its first token the grammar rejects (a tree: its nodes on paths
        the grammar accepts); a drawn draft remembers the token cut off and its q row."""
        if not len(draft):
            return draft
        if draft.parents is not None:
            return self._cut_tree(draft)
        tokens = draft.tokens.tolist()
        n = valid_prefix(self.state.matcher, tokens)
        if n < len(tokens) and draft.q is not None:
            self.state.cut_drawn = (n, tokens[n], draft.q[n])
        return draft.prefix(n) if n < len(tokens) else draft

    def _cut_tree(self, draft: Draft) -> Draft:
        """A tree without the nodes whose path leaves the grammar (their descendants go too)."""
        tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
        kept: dict[int, int] = {}  # old index -> new index
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            if parent >= 0 and parent not in kept:
                continue
            path = [token]
            node = parent
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            if valid_prefix(self.state.matcher, path[::-1]) == len(path):
                kept[i] = len(kept)
        if len(kept) == len(tokens):
            return draft
        order = list(kept)
        confidence = [draft.confidence[i] for i in order] if draft.confidence else []
        return Draft.tree([tokens[i] for i in order], [kept.get(parents[i], -1) for i in order], confidence)

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        self.inner.commit(committed, n_proposed if self._asked else 0)
        self._asked = False


class ConstrainedRule:
    """A rule under a grammar: each verified row masked by the grammar's state before it, the
    inner rule's verdict on the masked rows, then the matcher advanced by the committed tokens."""

    def __init__(self, inner: Rule, state: ConstraintState):
        self.inner, self.state = inner, state

    def __call__(self, draft: Draft, logits: torch.Tensor, sampling: SamplingConfig,
                 generator: torch.Generator) -> Verdict:
        state = self.state
        masked = mask_logits(logits, row_masks(state.matcher, draft))  # [k+1, vocab]
        verdict = self.inner(draft, masked, sampling, generator)
        cut = state.cut_drawn
        if cut is not None and not sampling.greedy and verdict.n_accepted == len(draft) == cut[0]:
            # the drawn token at this row left the grammar: speculative sampling rejects it
            p = probabilities(masked[len(draft)].unsqueeze(0), sampling)[0]  # [vocab]
            verdict = Verdict(verdict.n_accepted, sample(residual_distribution(p, cut[2]), generator), verdict.path)
        state.cut_drawn = None
        if state.stats is not None:  # those accepted (a batch may have cut the draft)
            state.stats.forced += state.forced_accepted(verdict.n_accepted)
        self._advance(draft, verdict)
        return verdict

    def certain_end(self) -> int | None:
        """The token that comes next whatever the logits, where the grammar is complete and allows
        a single token (its end of sequence): the masked distribution is all on it, so greedy and
        sampled constrained `ar` both take it; None otherwise."""
        matcher = self.state.matcher
        if not matcher.stopped:
            return None
        allowed = matcher.allowed().nonzero().flatten()
        return int(allowed[0]) if len(allowed) == 1 else None

    def _advance(self, draft: Draft, verdict: Verdict) -> None:
        """The matcher consumes the accepted drafts and the target's token (past the end of the
        grammar nothing more is consumed: the end-of-sequence token has stopped the request)."""
        if draft.parents is None:
            accepted = draft.tokens[: verdict.n_accepted].tolist()
        else:
            accepted = draft.tokens[list(verdict.path)].tolist()
        committed = [*accepted, verdict.next_token]
        consumed = self.state.matcher.consume(committed)
        if consumed < len(committed) and not self.state.matcher.stopped:
            raise AssertionError(f"the grammar rejected committed token {committed[consumed]}")


def constrain(recipe: Recipe, matcher: Matcher, stats: GenerationStats | None = None,
              force: bool = True) -> Recipe:
    """`recipe` decoding under `matcher`'s grammar (see the module docstring); `force`: forced
    tokens become drafts (where the method drafts at all)."""
    drafter, controller, rule = recipe
    state = ConstraintState(matcher, stats, force)
    return Recipe(ConstrainedDrafter(drafter, state), controller, ConstrainedRule(rule, state))
