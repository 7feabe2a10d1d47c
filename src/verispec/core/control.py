"""Draft-length controllers: how many tokens to draft, and how many of a draft to verify.

A controller is a small stateful policy consulted at three points of every step:
- `next_length()` before drafting: the most tokens the drafter may propose (K);
- `keep(j, confidence)` while drafting, before producing draft token j + 1: go on drafting,
  given that j tokens were drafted and the last one had this confidence (None when j = 0)?
  Drafters call it token by token, so a costly drafter never drafts a token it then drops;
- `cut(confidence, proposed)` after drafting: how many of the proposed tokens to verify (only
  for deterministic drafts: a draft drawn from q is verified whole, see `Draft.drawn`);
- `observe(drafted, accepted, confidence, verify_s, draft_s)` after verification, with the time
  of the target forward over drafted + 1 tokens and the time spent drafting.

Controllers know nothing of models; they are tested on synthetic acceptance streams.
`parse_controller` maps the CLI's `--controller` spec to one:

- `constant[:K]`: always K tokens (everything the drafter proposes, up to K).
- `heuristic[:K]`: transformers' rule for assisted generation: start at K, +2 after a fully
  accepted draft, -1 (not below 1) otherwise.
- `adaptive[:K]`: verifies the draft prefix that maximises the expected tokens per second,
  (1 + sum_{j<=L} prod_{i<=j} c_i) / cost(L), with c_i the drafter's confidences and cost(L)
  the measured time of drafting L tokens and verifying L + 1 (`CostModel`). Meant for drafters
  whose confidence is a calibrated acceptance estimate (ANPD's is). Its choice is a cut after
  drafting, so it is refused for drafts drawn from q under sampling (`methods.build`).
- `beta-ts[:K]`: Thompson sampling over a Beta(a, b) posterior of the per-token acceptance
  probability alpha. Before each draft token j + 1, draw theta_j ~ Beta(a, b) and go on while
  the geometric mean of the draws so far, (theta_1 ... theta_j)^(1/j), exceeds tau_j: the
  smallest alpha for which drafting at least j + 1 tokens maximises the expected tokens per
  second under the measured costs (`break_even_thresholds`: the cost ratio of a draft token to a
  target forward, and the verify cost by width). After each verification,
  a += accepted and b += 1 if a draft token was rejected (tokens after the first rejection are
  unobserved), both first multiplied by `decay` (default 0.98) so that the posterior tracks
  drift, but not below a + b = `floor` (default 10): decaying on every step, also on steps
  that drafted nothing, had flattened the posterior of a drafter that rarely pays until its
  draws cleared the threshold again, so it kept re-drafting at a loss after every pause; at ten
  observations' worth it still explores in proportion to how close the acceptance is to break-even.
  Prior Beta(1, 1).
- `calibrated-ts[:K]`: the same rule, but the draw after token j comes from a Beta posterior of
  the bin (10 equal bins of [0, 1]) that token j's confidence falls in, learned online from
  which tokens of each bin were accepted: the stop decision uses the drafter's confidence
  (an exit head's top-1 probability) calibrated online. Before the first token (no confidence
  yet) it uses an overall posterior, as beta-ts does.

The paper's exact priors and stopping rule could not be read here; these are the rules
implemented, with the defaults above.

Speculation under load (`RowCosts`, `allocate_drafts`): when many sequences share each forward
(`batch.BatchEngine`), a draft token costs one more row of a forward that is already wide, and
a per-sequence controller cannot see that. Each step the batch therefore cuts every sequence's
draft jointly, for the most expected tokens per second of the whole step (goodput): a step of R
rows takes about a + b R seconds (`RowCosts`, fitted online from the steps' measured times), and
draft token j of a sequence adds its survival (the product of its confidences up to j: the
chance that it is accepted) to the tokens the step commits. Rows go, most probable first, while
a row's survival exceeds the step's tokens per second times its cost b. One sequence alone
drafts about as its adaptive controller would; sixteen sharing a forward draft only tokens that
are very likely accepted. Drafts from a model cost the draft model's forwards too, and a drawn
draft cannot be cut once drawn: their length is set before drafting, for the step's goodput
under both models' fitted costs (`model_draft_length`). The same cut serves vLLM's batches
(`integrations.vllm`) under a cost table measured per batch size instead of the line.

Trace replay (`constant_trace_cost`, `threshold_trace_cost`, `oracle_trace_cost`): what a
controller would cost on a recorded greedy trace of a drafter's agreement with the target,
under given step costs, including the least cost any controller could reach with hindsight
(`scripts/early_exit_agreement.py --ceiling` replays the EESD head's traces).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..errors import ConfigError


class Controller(Protocol):
    def next_length(self) -> int:
        """Most tokens to draft in the next step (0 = decode one token autoregressively)."""

    def keep(self, j: int, confidence: float | None) -> bool:
        """Keep draft token j (1-based) and go on drafting?"""

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        """How many of `proposed` draft tokens to verify (0..proposed)."""

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float], verify_s: float,
                draft_s: float) -> None:
        """Learn from a step: `drafted` tokens verified, `accepted` kept; timings in seconds."""


class CostModel:
    """Measured cost of a step, relative to a one-token target forward.

    Verify: the seconds of a target forward by width (tokens), each width the median of its last
    `window` measurements, so that one slow forward (a page fault, another process) moves
    nothing: an average can let one outlier price a width out for good, since a width that is
    never chosen is never measured again; unmeasured widths are interpolated linearly between measured ones, and
    before any measurement the prior 1 + prior_slope * (w - 1) is used, deliberately optimistic
    so that wide forwards get tried and measured. A width measured fewer than `trusted` times
    costs at most what the other widths say (optimism until confirmed, for the same reason).
    Draft: seconds per drafted token, an average (0 until seen).
    `relative(L)` = (L * draft + verify(L + 1)) / verify(1).
    """

    def __init__(self, prior_slope: float = 0.05, smoothing: float = 0.2, window: int = 9, trusted: int = 3):
        self.prior_slope = prior_slope
        self.smoothing = smoothing  # of the draft cost's average
        self.trusted = trusted
        self.seconds: dict[int, float] = {}  # width -> median of its recent measurements
        self._recent: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.draft_per_token = 0.0
        self._draft_tokens = 0

    def observe(self, width: int, seconds: float, drafted: int = 0, draft_s: float = 0.0) -> None:
        if seconds > 0:
            recent = self._recent[width]
            recent.append(seconds)
            self.seconds[width] = statistics.median(recent)
        if drafted > 0 and draft_s > 0:
            self._draft_tokens += drafted
            weight = drafted / self._draft_tokens if self._draft_tokens < 50 else self.smoothing
            self.draft_per_token += weight * (draft_s / drafted - self.draft_per_token)

    def base(self) -> float | None:
        """Seconds of a one-token forward: measured, or estimated from the measured widths (the
        intercept of a least-squares line when two or more widths are known, else through the
        prior's slope); None before any measurement."""
        if 1 in self.seconds:
            return self.seconds[1]
        if not self.seconds:
            return None
        if len(self.seconds) == 1:
            (width, seconds), = self.seconds.items()
            return seconds / (1.0 + self.prior_slope * (width - 1))
        xs, ys = list(self.seconds), list(self.seconds.values())
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        intercept = mean_y - slope * (mean_x - 1)
        return max(intercept, min(ys) * 0.25)

    def verify(self, width: int) -> float:
        """Seconds of a target forward of `width` tokens, relative to width 1."""
        base = self.base()
        if base is None or width == 1:
            return 1.0 + self.prior_slope * (width - 1)
        measured = self.seconds.get(width)
        if measured is not None and len(self._recent[width]) >= self.trusted:
            return measured / base
        others = {w: s for w, s in self.seconds.items() if w != width}
        guess = self._between(width, {1: base, **others}, base)
        return guess if measured is None else min(measured / base, guess)

    def _between(self, width: int, known: dict[int, float], base: float) -> float:
        """Relative seconds at `width` interpolated between the known widths' (extrapolated with
        the prior's slope past the widest)."""
        below = max(w for w in known if w < width)
        above = [w for w in known if w > width]
        if not above:
            return known[below] / base + self.prior_slope * (width - below)
        upper = min(above)
        t = (width - below) / (upper - below)
        return ((1 - t) * known[below] + t * known[upper]) / base

    def draft_ratio(self) -> float:
        """Seconds of one draft token relative to a one-token target forward."""
        base = self.base()
        return self.draft_per_token / base if base else 0.0

    def relative(self, length: int) -> float:
        """Cost of drafting `length` tokens and verifying them, relative to one AR step."""
        return length * self.draft_ratio() + self.verify(length + 1)


@dataclass
class ControllerMemory:
    """What a controller learns that outlives one request: the measured costs and the acceptance
    posteriors. `methods.build` keeps one per target, method, options, sampling settings and
    controller spec, so each request starts from what the previous ones measured instead of
    re-learning (a fresh controller drafted in 41% of its first ten steps against 0-4% after
    seventy, on the EESD head). The objects are shared, not copied: updates land in place."""

    cost: CostModel = field(default_factory=CostModel)
    posterior: list[list[float]] | None = None  # set by the first Thompson controller that uses it


def best_draft_length(confidence: Sequence[float], relative_cost) -> int:
    """L in 0..len(confidence) maximising (1 + sum_{j<=L} prod_{i<=j} c_i) / relative_cost(L)."""
    best_length, best_rate = 0, 1.0 / relative_cost(0)
    expected, survive = 1.0, 1.0
    for length, c in enumerate(confidence, start=1):
        survive *= min(max(c, 0.0), 1.0)
        expected += survive
        rate = expected / relative_cost(length)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length


def break_even_thresholds(k: int, relative_cost, grid: int = 100) -> list[float]:
    """tau[j-1] for j = 1..k: the smallest per-token acceptance probability alpha (on a grid)
    under which the best draft length, with every token accepted with probability alpha, is at
    least j. 1.0 when no alpha < 1 makes j tokens worthwhile. Vectorised over the grid (it runs
    after every verification: the plain Python loop took ~0.3 ms, the vectorised one ~0.07)."""
    costs = np.array([relative_cost(length) for length in range(k + 1)])  # [k + 1]
    alphas = np.arange(grid + 1) / grid  # [grid + 1]
    expected = np.cumsum(alphas[:, None] ** np.arange(k + 1)[None, :], axis=1)  # [grid + 1, k + 1]
    best = np.argmax(expected / costs, axis=1)  # first maximum: ties go to the shorter draft
    thresholds = []
    for j in range(1, k + 1):
        reached = np.nonzero(best >= j)[0]
        thresholds.append(float(alphas[reached[0]]) if reached.size else 1.0)
    return thresholds


def agreement_runs(agreement: Sequence[bool]) -> list[int]:
    """run[t]: how many consecutive positions from t on the drafter's token equals the target's."""
    runs = [0] * (len(agreement) + 1)
    for t in range(len(agreement) - 1, -1, -1):
        runs[t] = runs[t + 1] + 1 if agreement[t] else 0
    return runs[:-1]


def _step_cost(drafted: int, verified: int, draft_cost: float, verify_cost) -> float:
    """A step that drafted `drafted` tokens and verified `verified` of them, relative to a
    one-token target forward: draft_cost per draft token, verify_cost(width) for the forward."""
    return drafted * draft_cost + verify_cost(verified + 1)


def constant_trace_cost(agreement: Sequence[bool], draft_cost: float, verify_cost, k: int) -> float:
    """Cost, in one-token target steps, of greedy speculative decoding of a recorded trace with a
    constant draft length k. agreement[t]: the drafter, given the target's tokens before position
    t, proposes the target's token at t (under greedy verification the drafter always sees the
    target's prefix, so a trace of the target's own continuation gives every step's outcome).
    Each step at t drafts min(k, tokens left - 1), keeps min(drafted, run[t]) and adds the
    target's token after them. draft_cost: one draft token relative to a one-token target
    forward; verify_cost(w): a forward of w tokens, relative (as in every trace function)."""
    runs, t, total = agreement_runs(agreement), 0, 0.0
    while t < len(agreement):
        drafted = min(k, len(agreement) - 1 - t)
        total += _step_cost(drafted, drafted, draft_cost, verify_cost)
        t += min(drafted, runs[t]) + 1
    return total


def threshold_trace_cost(agreement: Sequence[bool], confidence: Sequence[float], draft_cost: float, verify_cost,
                         threshold: float, max_length: int) -> float:
    """Cost of decoding a recorded trace (as in `constant_trace_cost`) with a confidence-threshold
    controller: each step drafts tokens while the drafter's top-1 probability for them
    (confidence[t]: at position t given the target's prefix) is at least `threshold`, up to
    max_length, and verifies those; a token below the threshold ends the draft and is dropped
    (`cut`), having cost its draft step. After a wrong draft token the recorded confidences are
    those of the target's prefix, not of the draft: an approximation that only changes how long a
    draft that will be rejected anyway goes on."""
    runs, t, total = agreement_runs(agreement), 0, 0.0
    while t < len(agreement):
        limit = min(max_length, len(agreement) - 1 - t)
        kept = 0
        while kept < limit and confidence[t + kept] >= threshold:
            kept += 1
        drafted = kept + (kept < limit)  # the token that stopped the draft was drafted too
        total += _step_cost(drafted, kept, draft_cost, verify_cost)
        t += min(kept, runs[t]) + 1
    return total


def oracle_trace_cost(agreement: Sequence[bool], draft_cost: float, verify_cost, max_length: int) -> float:
    """The least cost of decoding a recorded trace (as in `constant_trace_cost`) by any draft-length
    controller drafting at most max_length tokens a step, found with hindsight (dynamic programming
    over positions): no controller can beat it on that trace with that drafter and those costs.
    An optimal controller never drafts a token that will be rejected, so each step at t drafts
    some m <= run[t] and moves to t + m + 1."""
    n = len(agreement)
    runs = agreement_runs(agreement)
    best = [0.0] * (n + 1)
    for t in range(n - 1, -1, -1):
        best[t] = min(_step_cost(m, m, draft_cost, verify_cost) + best[t + m + 1]
                      for m in range(min(runs[t], max_length, n - 1 - t) + 1))
    return best[0]


class RowCosts:
    """A forward's seconds as a linear function of its rows, a + b R, fitted by least squares over
    the last `window` steps. Until the steps vary enough in width to tell b from a (or when the
    fit is not sensible), b is the prior share `prior_slope` of the one-row cost a."""

    def __init__(self, window: int = 64, prior_slope: float = 0.1):
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior_slope = prior_slope

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self._steps.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None before any step."""
        if not self._steps:
            return None
        rows = np.array([r for r, _ in self._steps], dtype=float)
        seconds = np.array([s for _, s in self._steps], dtype=float)
        if rows.max() - rows.min() >= 2 and len(rows) >= 4:
            b, a = np.polyfit(rows, seconds, 1)
            if a > 0 and b > 0:
                return float(a), float(b)
        # no usable slope: seconds = a (1 + prior_slope R) through the median point
        r, s = float(np.median(rows)), float(np.median(seconds))
        a = s / (1 + self.prior_slope * r)
        return a, a * self.prior_slope


def model_draft_length(rates: Sequence[float], k_max: int, costs: tuple[float, float],
                       draft_costs: tuple[float, float], rows: int, committed: float, catch_up: float = 0.0) -> int:
    """One draft length k for the sequences of a shared step that draft with a model, chosen
    before they draft (so it never biases a drawn draft): each draws k tokens in k rounds of
    the draft model, one forward over all of them a round (the first also catches up the
    tokens the last step accepted, about one more row each), and their k draft tokens join
    the target's forward. rates: each sequence's per-token acceptance estimate; costs: the
    target's step (a, b) and draft_costs the draft model's forward (a_d, b_d), each a + b R
    seconds for R rows (`RowCosts`); rows: the step's other rows (one per sequence, other
    drafts, prompt chunks); committed: the tokens the step commits without these drafts (one
    per sequence); catch_up: more draft-model rows the first round would carry (sequences that
    drafted nothing for a while must catch up, the caller's share of it charged to this step).
    Returns the k in 0..k_max of most expected tokens per second (ties to fewer),
    (committed + sum_i sum_{j<=k} rate_i^j) / (a + b (rows + n k) + k a_d + b_d (n (k + 1) + catch_up))."""
    a, b = costs
    a_d, b_d = draft_costs
    n = len(rates)
    best, best_rate = 0, committed / (a + b * rows)
    gain = float(committed)
    per_token = np.clip(np.asarray(rates, dtype=np.float64), 0.0, 1.0)  # [n]
    survival = np.ones(n)
    for k in range(1, k_max + 1):
        survival = survival * per_token
        gain += float(survival.sum())
        rate = gain / (a + b * (rows + n * k) + k * a_d + b_d * (n * (k + 1) + catch_up))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def allocate_drafts(confidences: Sequence[Sequence[float]],
                    costs: tuple[float, float] | Callable[[np.ndarray], np.ndarray], rows: int = 0,
                    committed: float | None = None) -> list[int]:
    """How many tokens of each sequence's draft to verify in one shared step, for the step's most
    expected tokens per unit of cost (goodput). Draft i offers tokens with per-token acceptance
    estimates confidences[i]: its token j is accepted with probability prod(confidences[i][:j + 1])
    (its survival). The step commits `committed` tokens whatever the drafts (default: one per
    sequence) plus the survival of each draft token kept.

    costs: (a, b), a forward of R rows taking a + b R seconds, R being one row per sequence, `rows`
    other rows (prompt chunks) and the draft tokens kept (`RowCosts`); or a function from draft
    token counts D (an int array, ascending) to the step's costs with D draft tokens, in any unit
    (`rows` is then not read): vLLM's proposer prices a step by a measured table per batch size
    (`integrations.vllm.StepCosts`, with `committed` every row of its batch).

    Tokens are kept most probable first (a draft's survival never increases along it, so each
    draft keeps a prefix; equal ones in draft order), as many as maximise (committed + the kept
    survivals) / cost(D); ties go to fewer tokens. Under (a, b) that is the greedy rule: a row goes
    in while its survival exceeds the step's tokens per second so far times b (the rate rises
    while the next row's survival beats it, and once it does not, no later row's can). For one
    sequence this is `best_draft_length`. Returns the prefix length per draft."""
    sizes = [len(c) for c in confidences]
    if committed is None:
        committed = len(sizes)
    if callable(costs):
        cost = costs
    else:
        a, b = costs
        base = a + b * (len(sizes) + rows)  # seconds of the step without drafts
        cost = lambda drafted: base + b * drafted  # noqa: E731
    total = sum(sizes)
    if not total:
        return sizes
    path = np.concatenate([np.cumprod(np.clip(np.asarray(c, dtype=np.float64), 0.0, 1.0))
                           for c in confidences if len(c)])  # [M]: each token's survival
    owner = np.repeat(np.arange(len(sizes)), sizes)  # [M]: the draft of each token
    order = np.argsort(-path, kind="stable")  # [M]: most probable first; a draft's tokens keep their order
    gain = committed + np.concatenate(([0.0], np.cumsum(path[order])))  # [M + 1]: expected tokens keeping m
    rate = gain / cost(np.arange(total + 1))  # [M + 1]
    best = int(np.argmax(rate))  # the first maximum: ties go to fewer tokens
    return np.bincount(owner[order[:best]], minlength=len(sizes)).tolist()


class ConstantLength:
    """Always the same draft length; verifies everything proposed."""

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"a constant draft length must be an integer >= 0, got {k!r}")
        self.k = k

    def next_length(self) -> int:
        return self.k

    def keep(self, j: int, confidence: float | None) -> bool:
        return True

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        return proposed

    def observe(self, drafted, accepted, confidence, verify_s, draft_s) -> None:
        pass

    def __repr__(self) -> str:
        return f"constant:{self.k}"


class Heuristic(ConstantLength):
    """transformers' assisted-generation rule: +2 after a fully accepted draft, else -1."""

    def __init__(self, k: int):
        super().__init__(k)
        if k < 1:
            raise ConfigError("the heuristic controller needs a starting length >= 1")

    def observe(self, drafted, accepted, confidence, verify_s, draft_s) -> None:
        if drafted == 0:
            return
        self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)

    def __repr__(self) -> str:
        return f"heuristic:{self.k}"


class ExpectedThroughput(ConstantLength):
    """Drafts up to K and verifies the prefix with the best expected tokens per second."""

    def __init__(self, k: int, memory: ControllerMemory | None = None):
        super().__init__(k)
        if k < 1:
            raise ConfigError(f"the adaptive controller needs K >= 1, got {k!r}")
        self.cost = (memory or ControllerMemory()).cost

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        if not confidence:
            return proposed
        return best_draft_length(confidence[:proposed], self.cost.relative)

    def observe(self, drafted, accepted, confidence, verify_s, draft_s) -> None:
        self.cost.observe(drafted + 1, verify_s, drafted, draft_s)

    def __repr__(self) -> str:
        return f"adaptive:{self.k}"


class Measured(ConstantLength):
    """Up to K, verifying everything proposed, while measuring what each verify width costs (into
    its memory's `CostModel`): for a drafter that chooses its own draft lengths from those costs
    (`drafters.hybrid`). It never cuts a draft, so it biases no drawn draft."""

    def __init__(self, k: int, memory: ControllerMemory | None = None):
        super().__init__(k)
        self.cost = (memory or ControllerMemory()).cost

    def observe(self, drafted, accepted, confidence, verify_s, draft_s) -> None:
        self.cost.observe(drafted + 1, verify_s, drafted, draft_s)

    def __repr__(self) -> str:
        return f"measured:{self.k}"


class BetaThompson(ConstantLength):
    """Thompson sampling over a Beta posterior of the per-token acceptance probability."""

    bins = 0  # confidence bins (0: one overall posterior only)

    def __init__(self, k: int, decay: float = 0.98, seed: int | None = 0, memory: ControllerMemory | None = None,
                 floor: float = 10.0):
        super().__init__(k)
        if k < 1:
            raise ConfigError(f"Thompson-sampling controllers need K >= 1, got {k!r}")
        if not 0 < decay <= 1:
            raise ConfigError(f"decay must be in (0, 1], got {decay}")
        self.decay = decay
        self.floor = floor
        memory = memory or ControllerMemory()
        self.cost = memory.cost
        # posterior[0] is the overall one; posterior[1 + b] that of confidence bin b.
        if memory.posterior is None or len(memory.posterior) != 1 + self.bins:
            memory.posterior = [[1.0, 1.0] for _ in range(1 + self.bins)]
        self.posterior = memory.posterior
        self._random = random.Random(seed)
        self._thresholds = break_even_thresholds(k, self.cost.relative)
        self._log_survival = 0.0

    def _index(self, confidence: float | None) -> int:
        if confidence is None or not self.bins:
            return 0
        return 1 + min(int(confidence * self.bins), self.bins - 1)

    def keep(self, j: int, confidence: float | None) -> bool:
        if j >= self.k:
            return False
        if j == 0:
            self._log_survival = 0.0
            a, b = self.posterior[0]
            return self._random.betavariate(a, b) > self._thresholds[0]
        a, b = self.posterior[self._index(confidence)]
        # The draft so far survives verification with probability prod theta_i (one draw per
        # token, from the posterior of its confidence bin); go on while its geometric mean
        # clears the break-even acceptance for a longer draft. With one posterior this is the
        # plain rule theta > tau_j on a fresh draw per token, up to the running product.
        self._log_survival += math.log(max(self._random.betavariate(a, b), 1e-12))
        return math.exp(self._log_survival / j) > self._thresholds[j]

    def observe(self, drafted, accepted, confidence, verify_s, draft_s) -> None:
        self.cost.observe(drafted + 1, verify_s, drafted, draft_s)
        for posterior in self.posterior:
            # decay, but never below `floor` observations' worth: a posterior left to flatten
            # while nothing is drafted would make the controller draft again after every pause
            factor = max(self.decay, min(1.0, self.floor / (posterior[0] + posterior[1])))
            posterior[0] *= factor
            posterior[1] *= factor
        for j in range(min(drafted, accepted + 1)):  # observed: accepted tokens and the first rejection
            outcome = 0 if j < accepted else 1
            self.posterior[0][outcome] += 1.0
            if self.bins and j < len(confidence):
                self.posterior[self._index(confidence[j])][outcome] += 1.0
        for posterior in self.posterior:  # keep the parameters valid for betavariate
            posterior[0], posterior[1] = max(posterior[0], 1e-3), max(posterior[1], 1e-3)
        self._thresholds = break_even_thresholds(self.k, self.cost.relative)

    def __repr__(self) -> str:
        return f"beta-ts:{self.k}"


class CalibratedThompson(BetaThompson):
    """Thompson sampling with one Beta posterior per bin of the drafter's confidence."""

    bins = 10

    def __repr__(self) -> str:
        return f"calibrated-ts:{self.k}"


LEARNING = {"adaptive", "measured", "beta-ts", "calibrated-ts"}  # controllers that take a ControllerMemory

CONTROLLERS = {
    "constant": ConstantLength,
    "heuristic": Heuristic,
    "adaptive": ExpectedThroughput,
    "measured": Measured,
    "beta-ts": BetaThompson,
    "calibrated-ts": CalibratedThompson,
}


CUTS_AFTER_DRAFTING = frozenset({"adaptive"})  # controllers whose decision is a `cut`


def controller_name(spec: str) -> str:
    """'adaptive:8' -> 'adaptive'."""
    return spec.partition(":")[0].strip().lower()


def parse_controller(spec: str, default_k: int, memory: ControllerMemory | None = None) -> Controller:
    """`name` or `name:K` -> a controller; `default_k` is the method's draft length. Controllers
    that learn (LEARNING: adaptive, beta-ts, calibrated-ts) start from `memory` and update it."""
    name, argument = controller_name(spec), spec.partition(":")[2]
    if name not in CONTROLLERS:
        raise ConfigError(f"unknown controller {spec!r}; known: {', '.join(f'{n}[:K]' for n in CONTROLLERS)}")
    k = default_k
    if argument:
        try:
            k = int(argument)
        except ValueError:
            raise ConfigError(f"draft length in controller {spec!r} must be an integer") from None
    if name in LEARNING:
        return CONTROLLERS[name](k, memory=memory)
    return CONTROLLERS[name](k)
