"""Counts of one generation and the metrics derived from them.

`GenerationStats` stores only counts and times; every rate is a property computed from them, so
stats from several generations can be added (`merge`) without averaging averages.

Definitions (used everywhere, README included):
- target_forwards: forward passes of the target, the prefill included (it yields the first token).
- mean accepted tokens = new_tokens / target_forwards (1.0 for autoregressive decoding).
- acceptance rate = accepted / drafted (None when nothing was drafted).
- accepted-length histogram: histogram[a] = number of verification steps that accepted a drafts.
- tokens_per_s = new_tokens / (prefill_s + decode_s): end to end, as Spec-Bench times it.
- decode_tokens_per_s = (new_tokens - 1) / decode_s: the tokens after the prefill's.
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

    def record_step(self, drafted: int, accepted: int) -> None:
        """Count one verification step (a target forward after the prefill)."""
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accepted_histogram) <= accepted:
            self.accepted_histogram.extend([0] * (accepted + 1 - len(self.accepted_histogram)))
        self.accepted_histogram[accepted] += 1

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

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
        hist = [0] * max(len(self.accepted_histogram), len(other.accepted_histogram))
        for source in (self.accepted_histogram, other.accepted_histogram):
            for i, count in enumerate(source):
                hist[i] += count
        return GenerationStats(
            method=self.method or other.method,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            new_tokens=self.new_tokens + other.new_tokens,
            target_forwards=self.target_forwards + other.target_forwards,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            accepted_histogram=hist,
            prefill_s=self.prefill_s + other.prefill_s,
            decode_s=self.decode_s + other.decode_s,
        )

    def to_dict(self) -> dict:
        """Counts and derived metrics, JSON-ready."""
        data = asdict(self)
        data.update(
            mean_accepted_tokens=round(self.mean_accepted_tokens, 4),
            acceptance_rate=None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
            decode_tokens_per_s=round(self.decode_tokens_per_s, 3),
            prefill_s=round(self.prefill_s, 4),
            decode_s=round(self.decode_s, 4),
        )
        return data
