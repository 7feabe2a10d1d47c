"""Draft-length controllers: how many tokens to draft in the next step.

A controller is a small stateful policy with two calls: `next_length()` before a step and
`observe(drafted, accepted)` after its verification. Controllers know nothing of models; they are
tested on synthetic acceptance streams. `parse_controller` maps the CLI's `--controller` spec
(e.g. `constant:8`) to one.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from .errors import ConfigError


class Controller(Protocol):
    def next_length(self) -> int:
        """Draft length for the next step (0 = decode one token autoregressively)."""

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float] = ()) -> None:
        """Learn from a step in which `drafted` tokens were proposed and `accepted` kept."""


class ConstantLength:
    """Always the same draft length."""

    def __init__(self, k: int):
        if not isinstance(k, int) or k < 0:
            raise ConfigError(f"a constant draft length must be an integer >= 0, got {k!r}")
        self.k = k

    def next_length(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float] = ()) -> None:
        pass

    def __repr__(self) -> str:
        return f"constant:{self.k}"


def parse_controller(spec: str, default_k: int) -> Controller:
    """`constant` / `constant:K` -> a controller. `default_k` is the method's draft length."""
    name, _, argument = spec.partition(":")
    name = name.strip().lower()
    if name == "constant":
        if not argument:
            return ConstantLength(default_k)
        try:
            return ConstantLength(int(argument))
        except ValueError:
            raise ConfigError(f"constant draft length must be an integer, got {argument!r}") from None
    raise ConfigError(f"unknown controller {spec!r}; known: constant[:K]")
