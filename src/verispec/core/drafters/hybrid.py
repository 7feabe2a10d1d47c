"""The hybrid drafter: at each step the draft expected to pay most, ANPD's n-gram draft (free to
find) or a model's draft (a draft model or the EESD exit head; each of its tokens costs a step of
that model), each cut at the length that pays most.

The choice is a cost model in units of one target step. A verify of w tokens costs v(w) steps,
measured on this machine as the requests run (`control.CostModel`, fed by the `measured`
controller; before measurements its optimistic prior). An n-gram draft whose tokens ANPD expects
accepted with probabilities c_1..c_n (its per-kind estimates) gives 1 + sum_{j<=L} prod_{i<=j} c_i
tokens for v(L + 1). A model draft of L tokens accepted with probability a each (measured on this
target's model drafts) gives 1 + a + ... + a^L tokens for v(L + 1) plus L draft steps of
relative cost r (the draft's weight bytes per token over the target's: both steps are bound by
reading their weights). The higher rate wins. Exactness is the verify's: a draft is either
deterministic (the n-gram's, which may be cut after it is seen) or carries the q it was drawn
from (the model's, whose length is fixed before its first token is drawn).

The model's acceptance a is learned over a target's requests (`ModelAcceptance`, kept in the
target's attachments per draft model and head), not per request: a head whose drafts do not pay
on this machine stops costing each new request its first drafts. Each step draws a from its
Beta posterior (Thompson sampling), so a model found poor is still tried now and then, about as
often as the posterior says it may pay; the counts are capped (`MAX_WEIGHT` drafted tokens) so
the posterior stays wide enough to follow a change of text. The same draw decides, when a request
begins, whether the model takes part in it at all: where even its best length would not pay, the
request is ANPD's alone: an exit head does not make its verifies keep the exit layer's states
(measured on the 1.5B, that keeping cost about 3.5% of a step when nothing was drafted), and the
request may share the batch's forwards with others (`in_target_sequence`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from ...target.shared_forward import Steps, run_alone
from ..control import CostModel, best_draft_length
from .base import Draft, Keep, keep_all
from .draft_model import SampledDrafter
from .ngram import AnpdDrafter

PRIOR_ACCEPTANCE = 0.7  # a model draft's acceptance before any was verified
PRIOR_WEIGHT = 4.0  # ... counted as this many drafted tokens
MAX_MODEL_DRAFT = 16  # the longest model draft priced when a request begins
MAX_WEIGHT = 64.0  # drafted tokens the acceptance is counted over at most (older ones fade)


@dataclass
class ModelAcceptance:
    """How many of a draft model's tokens were verified and accepted (a Beta posterior, from a
    prior of PRIOR_ACCEPTANCE over PRIOR_WEIGHT tokens), shared by the requests on one target."""

    drafted: float = PRIOR_WEIGHT
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)  # the draws (speed only)

    @property
    def mean(self) -> float:
        return self.accepted / self.drafted

    def draw(self) -> float:
        return self.rng.betavariate(1 + self.accepted, 1 + self.drafted - self.accepted)

    def learn(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        if self.drafted > MAX_WEIGHT:
            scale = MAX_WEIGHT / self.drafted
            self.drafted, self.accepted = MAX_WEIGHT, self.accepted * scale


def expected_tokens(confidence: Sequence[float]) -> float:
    """Tokens a verify is expected to give for a draft accepted token by token with these
    probabilities: 1 (the verify's own) + sum_j prod_{i<=j} c_i."""
    total, run = 1.0, 1.0
    for c in confidence:
        run *= c
        total += run
    return total


def best_model_length(acceptance: float, cost: float, cap: int, verify=lambda width: 1.0) -> tuple[int, float]:
    """(L, tokens per target step) for the model draft length L in 0..cap that maximises
    (1 + a + ... + a^L) / (L r + v(L + 1)); L = 0 is no draft."""
    best, rate, gain = 0, 1.0 / verify(1), 1.0
    for length in range(1, cap + 1):
        gain += acceptance ** length
        candidate = gain / (length * cost + verify(length + 1))
        if candidate > rate:
            best, rate = length, candidate
    return best, rate


class HybridDrafter:
    """ANPD's draft where it is expected to pay more than the model's, else the model's."""

    def __init__(self, ngram: AnpdDrafter, model: SampledDrafter, model_cost: float,
                 acceptance: ModelAcceptance | None = None):
        self.ngram, self.model, self.model_cost = ngram, model, model_cost
        self.costs = CostModel()  # replaced by the measured controller's (`measure_with`)
        self.acceptance = acceptance if acceptance is not None else ModelAcceptance()
        self._source = None  # "ngram" or "model": whose draft this step verifies
        self._model_on: bool | None = None  # whether the model takes part in this request (`model_on`)

    def measure_with(self, costs: CostModel) -> None:
        """Price verify widths with `costs` (measured by the controller as the requests run)."""
        self.costs = costs

    @property
    def model_on(self) -> bool:
        """Whether the model takes part in this request: drawn once, the first time it is asked
        (when the request is admitted or begins), as whether its best draft length pays."""
        if self._model_on is None:
            length, _ = best_model_length(self.acceptance.draw(), self.model_cost, MAX_MODEL_DRAFT, self.costs.verify)
            self._model_on = length > 0
        return self._model_on

    def begin(self, prompt: Sequence[int]) -> None:
        self.ngram.begin(prompt)
        if self.model_on:
            self.model.begin(prompt)

    def close(self) -> None:
        if self.model_on:
            self.model.close()

    def kv_claims(self, prompt_tokens: int, max_new_tokens: int) -> list:
        return self.model.kv_claims(prompt_tokens, max_new_tokens) if self.model_on else []

    @property
    def in_target_sequence(self) -> bool:
        """An exit head that takes part needs its own verifies (they keep its states); a request
        that leaves it out can share the batch's forwards."""
        return self.model_on and self.model.in_target_sequence

    @property
    def draft_sequence(self):
        return self.model.draft_sequence

    @property
    def model_acceptance(self) -> float:
        return self.acceptance.mean

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        return run_alone(self.proposing(context, k, keep))

    def proposing(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Steps[Draft]:
        """`propose` as steps: only a model draft runs forwards (yielded as the model's parts)."""
        verify = self.costs.verify
        draft = self.ngram.propose(context, k, keep)
        confidence = draft.confidence[: len(draft.tokens)]
        cut = best_draft_length(confidence, lambda length: verify(length + 1))
        ngram_rate = expected_tokens(confidence[:cut]) / verify(cut + 1)
        length, model_rate = (best_model_length(self.acceptance.draw(), self.model_cost, k, verify)
                              if self.model_on else (0, 0.0))
        if length == 0 or (cut > 0 and ngram_rate >= model_rate):
            self._source = "ngram"
            return draft.prefix(cut) if cut < len(draft.tokens) else draft
        self._source = "model"

        def within(j: int, confidence: float | None) -> bool:
            return j < length and keep(j, confidence)

        return (yield from self.model.proposing(context, length, within))

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        by_model = self._source == "model"
        self.ngram.commit(committed, 0 if by_model else n_proposed)
        if self.model_on:
            self.model.commit(committed, n_proposed if by_model else 0)
        if by_model and n_proposed:
            self.acceptance.learn(n_proposed, min(len(committed) - 1, n_proposed))
        self._source = None
