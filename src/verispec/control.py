"""Draft-length controllers: how many tokens to draft, and how many of a draft to verify.

A controller is a small stateful policy with three calls per step:
- `next_length()` before drafting: the most tokens the drafter may propose;
- `cut(confidence, proposed)` after drafting: how many of the proposed tokens to verify, given
  the drafter's per-token confidence (an estimate of P(token accepted | the ones before it were));
- `observe(drafted, accepted, confidence, seconds)` after verification, with the time the
  target's forward of drafted + 1 tokens took.

Controllers know nothing of models; they are tested on synthetic acceptance streams.
`parse_controller` maps the CLI's `--controller` spec to one:

- `constant[:K]`: always K tokens (everything the drafter proposes, up to K).
- `adaptive[:K]`: verifies the draft prefix that maximises the expected tokens per second,
  (1 + sum_{j<=L} prod_{i<=j} c_i) / cost(L + 1), where c_i are the drafter's calibrated
  confidences and cost(w) is the measured time of a target forward of width w (learned online by
  `ForwardCostModel`). On a CPU where verifying 8 tokens costs twice one token, it drafts only
  when the draft is likely to pay for itself; where wide forwards are nearly free it drafts long.
  Drafts without confidence are verified whole.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .errors import ConfigError


class Controller(Protocol):
    def next_length(self) -> int:
        """Most tokens to draft in the next step (0 = decode one token autoregressively)."""

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        """How many of `proposed` draft tokens to verify (0..proposed)."""

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float], seconds: float) -> None:
        """Learn from a step: `drafted` tokens verified, `accepted` kept, forward took `seconds`."""


class ConstantLength:
    """Always the same draft length; verifies everything proposed."""

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"a constant draft length must be an integer >= 0, got {k!r}")
        self.k = k

    def next_length(self) -> int:
        return self.k

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        return proposed

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float], seconds: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"constant:{self.k}"


class ForwardCostModel:
    """Relative cost of a target forward by width (tokens), learned from measured times.

    Each width keeps an exponential moving average of its seconds. `relative(w)` is that over
    width 1's; widths not yet measured are interpolated linearly between measured neighbours, and
    before any measurement the prior 1 + prior_slope * (w - 1) is used. The prior is deliberately
    optimistic (cheap wide forwards) so that wide forwards get tried and measured.
    """

    def __init__(self, prior_slope: float = 0.05, smoothing: float = 0.2):
        self.prior_slope = prior_slope
        self.smoothing = smoothing
        self.seconds: dict[int, float] = {}

    def observe(self, width: int, seconds: float) -> None:
        if seconds <= 0:
            return
        old = self.seconds.get(width)
        self.seconds[width] = seconds if old is None else old + self.smoothing * (seconds - old)

    def relative(self, width: int) -> float:
        if 1 not in self.seconds or width == 1:
            return 1.0 + self.prior_slope * (width - 1)
        base = self.seconds[1]
        if width in self.seconds:
            return self.seconds[width] / base
        below = max(w for w in self.seconds if w < width)
        above = [w for w in self.seconds if w > width]
        if not above:  # extrapolate with the prior's slope from the widest measured width
            return self.seconds[below] / base + self.prior_slope * (width - below)
        upper = min(above)
        t = (width - below) / (upper - below)
        return ((1 - t) * self.seconds[below] + t * self.seconds[upper]) / base


def best_draft_length(confidence: Sequence[float], relative_cost) -> int:
    """L in 0..len(confidence) maximising expected tokens per unit of time:
    (1 + sum_{j<=L} prod_{i<=j} c_i) / relative_cost(L + 1)."""
    best_length, best_rate = 0, 1.0 / relative_cost(1)
    expected, survive = 1.0, 1.0
    for length, c in enumerate(confidence, start=1):
        survive *= min(max(c, 0.0), 1.0)
        expected += survive
        rate = expected / relative_cost(length + 1)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length


class ExpectedThroughput:
    """Drafts up to K and verifies the prefix with the best expected tokens per second."""

    def __init__(self, k: int, cost: ForwardCostModel | None = None):
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"the adaptive controller needs K >= 1, got {k!r}")
        self.k = k
        self.cost = cost or ForwardCostModel()

    def next_length(self) -> int:
        return self.k

    def cut(self, confidence: Sequence[float], proposed: int) -> int:
        if not confidence:
            return proposed
        return best_draft_length(confidence[:proposed], self.cost.relative)

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float], seconds: float) -> None:
        self.cost.observe(drafted + 1, seconds)

    def __repr__(self) -> str:
        return f"adaptive:{self.k}"


CONTROLLERS = {"constant": ConstantLength, "adaptive": ExpectedThroughput}


def parse_controller(spec: str, default_k: int) -> Controller:
    """`name` or `name:K` -> a controller; `default_k` is the method's draft length."""
    name, _, argument = spec.partition(":")
    name = name.strip().lower()
    if name not in CONTROLLERS:
        raise ConfigError(f"unknown controller {spec!r}; known: {', '.join(f'{n}[:K]' for n in CONTROLLERS)}")
    k = default_k
    if argument:
        try:
            k = int(argument)
        except ValueError:
            raise ConfigError(f"draft length in controller {spec!r} must be an integer") from None
    return CONTROLLERS[name](k)
