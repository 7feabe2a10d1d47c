"""Named recipes: method name -> (drafter, draft-length controller, acceptance rule).

The registry `METHODS` is the single list every shell (CLI, benchmark, server) offers; adding a
method here makes it available everywhere. `MethodOptions` carries every per-method knob, with
`None` meaning "the method's default".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .acceptance import verify_lossless
from .control import parse_controller
from .drafters.base import Drafter, NullDrafter
from .drafters.ngram import AnpdDrafter, NgramConfig, PromptLookupDrafter
from .engine import Recipe, Rule
from .errors import ConfigError
from .model import Target


@dataclass(frozen=True)
class MethodOptions:
    """Knobs shared by the shells. None = the method's own default."""

    draft_length: int | None = None  # K: tokens drafted per step by a constant controller
    controller: str | None = None  # e.g. "constant:8"
    ngram_max_n: int = 5  # ANPD: largest n-gram order
    pld_max_ngram: int = 3  # prompt lookup: longest n-gram matched

    def __post_init__(self) -> None:
        if self.draft_length is not None and (not isinstance(self.draft_length, int) or self.draft_length < 1):
            raise ConfigError(f"draft length must be an integer >= 1, got {self.draft_length!r}")
        if self.controller is not None:
            parse_controller(self.controller, self.draft_length or 1)  # validates the spec


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    lossless: bool
    default_length: int
    make_drafter: Callable[[Target, MethodOptions], Drafter]
    default_controller: str = "constant"
    rule: Rule = verify_lossless


# Draft lengths chosen by measurement on the default model; see README "Choosing K".
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "autoregressive decoding: one target forward per token (the baseline)", True, 0,
               lambda target, options: NullDrafter()),
        Method("pld", "prompt lookup: copy what followed the last n-gram match in the context", True, 10,
               lambda target, options: PromptLookupDrafter(options.pld_max_ngram)),
        Method("anpd", "ANPD: adaptive multi-level n-gram tables from the prompt and the output", True, 16,
               lambda target, options: AnpdDrafter(NgramConfig(max_n=options.ngram_max_n)), "adaptive"),
    )
}


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ConfigError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


def build(name: str, target: Target, options: MethodOptions = MethodOptions()) -> Recipe:
    """A fresh recipe (drafter with its own state, controller, rule) for one request."""
    method = get_method(name)
    length = options.draft_length if options.draft_length is not None else method.default_length
    if method.name == "ar":  # nothing to draft, whatever the options say
        controller = parse_controller("constant", 0)
    else:
        controller = parse_controller(options.controller or method.default_controller, length)
    return Recipe(method.make_drafter(target, options), controller, method.rule)
