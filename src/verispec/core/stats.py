"""Counts of one generation and the metrics derived from them.

`GenerationStats` stores only counts and times; every rate is a property computed from them, so
stats from several generations can be added (`merge`) without averaging averages.

Definitions (used everywhere, README included):
- target_forwards: forward passes of the target, the prefill included (it yields the first token).
- mean accepted tokens = new_tokens / target_forwards (1.0 for autoregressive decoding).
- acceptance rate = accepted / drafted (None when nothing was drafted).
- accepted-length histogram: histogram[a] = number of verification steps that accepted a drafts.
- drafts: verification steps that verified at least one drafted token (vLLM's num_drafts).
- accepted per position: accepted_per_position[i] = drafts whose token at 0-based position i was
  accepted (vLLM's num_accepted_tokens_per_pos; acceptance is a prefix, so it never increases
  with i and sums to `accepted`).
- mean acceptance length = 1 + accepted / drafts: tokens a draft step commits, the target's own
  token included (vLLM's definition; None when nothing was drafted). Unlike mean accepted
  tokens it leaves out the prefill and the steps that drafted nothing.
- tokens_per_s = new_tokens / (prefill_s + decode_s): end to end, as Spec-Bench times it.
- decode_tokens_per_s = (new_tokens - 1) / decode_s: the tokens after the prefill's.
- forced: accepted draft tokens of the text a grammar forced (its only continuation;
  `core/constraint.py`), counted in drafted and accepted as well.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    method: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_histogram: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    forced: int = 0  # accepted draft tokens of a grammar's forced text (counted in drafted and accepted too)

    def record_step(self, drafted: int, accepted: int) -> None:
        """Count one verification step (a target forward after the prefill) that verified
        `drafted` draft tokens and accepted the first `accepted` of them."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"a step accepts 0..{drafted} of its {drafted} drafts, got {accepted}")
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        _grow(self.accepted_histogram, accepted + 1)
        self.accepted_histogram[accepted] += 1
        if drafted:
            self.drafts += 1
            _grow(self.accepted_per_position, drafted)  # every drafted position has a count, 0 included
            for position in range(accepted):
                self.accepted_per_position[position] += 1

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    def merge(self, other: "GenerationStats") -> "GenerationStats":
        """Sum of the counts of two generations (for totals over prompts)."""
        return GenerationStats(
            method=self.method or other.method,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            new_tokens=self.new_tokens + other.new_tokens,
            target_forwards=self.target_forwards + other.target_forwards,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            accepted_histogram=_sum_lists(self.accepted_histogram, other.accepted_histogram),
            prefill_s=self.prefill_s + other.prefill_s,
            decode_s=self.decode_s + other.decode_s,
            drafts=self.drafts + other.drafts,
            accepted_per_position=_sum_lists(self.accepted_per_position, other.accepted_per_position),
            forced=self.forced + other.forced,
        )

    def to_dict(self) -> dict:
        """Counts and derived metrics, JSON-ready."""
        data = asdict(self)
        data.update(
            mean_accepted_tokens=round(self.mean_accepted_tokens, 4),
            acceptance_rate=None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            mean_acceptance_length=(None if self.mean_acceptance_length is None
                                    else round(self.mean_acceptance_length, 4)),
            tokens_per_s=round(self.tokens_per_s, 3),
            decode_tokens_per_s=round(self.decode_tokens_per_s, 3),
            prefill_s=round(self.prefill_s, 4),
            decode_s=round(self.decode_s, 4),
        )
        return data


def _grow(counts: list[int], length: int) -> None:
    """Pad `counts` with zeros to at least `length` entries."""
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))


def _sum_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of any lengths."""
    total = [0] * max(len(a), len(b))
    for source in (a, b):
        for i, count in enumerate(source):
            total[i] += count
    return total
