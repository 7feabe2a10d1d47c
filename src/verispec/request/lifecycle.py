"""One request's life in the text layer, from a validated `Request` to its `GenerationResult`.

Owns `Request` (one generation request, validated on construction), `GenerationResult`, and
`Generation`: a request in progress, what `api.TextStream` (one request, `engine.decode`),
`api.BatchTextStream` (many, in a `batch.BatchEngine`) and the server's worker share. On the way
in, its decode config, its stats and its recipe (built on a sequence of its own in a batch); on
the way out, how each step's committed tokens become final text (`text.TextAssembler`:
incremental detokenization and stop strings) with the ids and log-probabilities that text keeps
(`Piece`), the end on a stop string (stop reason "stop", its job out of the batch), and its
result. How the text reaches anyone (an iterator, events), when to cancel and what to report
stay with each caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple, Sequence

from ..core.constraint import constrain
from ..core.engine import DecodeConfig, Logprobs, Recipe, decode
from ..errors import ConfigError
from ..core.methods import MethodOptions, build, check_settings, get_method
from ..core.sampling import SamplingConfig
from ..core.stats import GenerationStats
from .grammar import Constraint
from .text import TextAssembler

if TYPE_CHECKING:
    from ..core.batch import BatchEngine, Job
    from ..target.model import Target


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


@dataclass(frozen=True)
class Request:
    """One generation request, validated on construction."""

    prompt_ids: tuple[int, ...]
    method: str = "anpd"
    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()
    options: MethodOptions = field(default_factory=MethodOptions)
    constraint: Constraint | None = None  # the output's grammar (`grammar.compile_format`), if any

    def __post_init__(self) -> None:
        get_method(self.method)  # raises for an unknown name
        if not self.prompt_ids:
            raise ConfigError("the prompt is empty")
        DecodeConfig(self.max_new_tokens, self.sampling)  # validates the budget
        check_settings(self.method, self.options, self.sampling)


class Piece(NamedTuple):
    """What one step's committed tokens add: the text that became final ('' if none yet), the
    ids the text keeps (a stop string drops those after the token that completed it) and, when
    log-probabilities were asked for, theirs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple


class Generation:
    """A request in progress (see the module docstring). `logprobs`: None, or how many top
    log-probabilities to record per token (0: the chosen token's only)."""

    def __init__(self, target: "Target", request: Request, logprobs: int | None = None):
        self.target, self.request = target, request
        self.stats = GenerationStats(method=request.method)
        self.config = DecodeConfig(request.max_new_tokens, request.sampling, target.eos_token_ids)
        self.assembler = TextAssembler(target.tokenizer, request.stop)
        self.logprobs = None if logprobs is None else Logprobs(logprobs)
        self.job: "Job | None" = None  # its job in a batch engine, once submitted
        self._engine: "BatchEngine | None" = None
        self._logprobs_read = 0  # entries of `logprobs` that `push` has gone past

    # -- running it ---------------------------------------------------------------------------
    def decode(self, recipe: Recipe) -> Iterator[list[int]]:
        """Its decode loop alone on the target (`engine.decode`; `recipe` built on the target)."""
        return decode(self.target, self.constrained(recipe), list(self.request.prompt_ids), self.config, self.stats,
                      self.logprobs)

    def constrained(self, recipe: Recipe) -> Recipe:
        """`recipe` under the request's grammar (a matcher of its own), or itself without one.
        `ar` drafts nothing, forced tokens included: constrained `ar` is the reference."""
        constraint = self.request.constraint
        if constraint is None:
            return recipe
        return constrain(recipe, constraint.matcher(), self.stats, force=self.request.method != "ar")

    def submit(self, engine: "BatchEngine") -> "Job":
        """Queue it in `engine`: its recipe built on a new sequence of the target (a drafter that
        runs the target's layers drafts in it, beside the batch). Raises what the engine refuses
        (a prompt too long, a request that could never fit the KV memory)."""
        request = self.request
        sequence = self.target.new_sequence()
        recipe = self.constrained(build(request.method, sequence, request.options, request.sampling))
        self.job = engine.submit(list(request.prompt_ids), recipe, self.config, self.stats, sequence=sequence,
                                 logprobs=self.logprobs)
        self._engine = engine
        return self.job

    def cancel(self, reason: str = "cancelled") -> None:
        """End its job in the batch now (between steps; nothing happens to a job that has ended)."""
        self._engine.cancel(self.job, reason)

    # -- its text ------------------------------------------------------------------------------
    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.assembler.stopped

    def push(self, committed: Sequence[int]) -> Piece:
        """A step's committed tokens -> the `Piece` they add. On a stop string the request ends:
        its stop reason becomes "stop" and its job leaves the batch (unless the job had already
        ended in that step: EOS or its budget)."""
        before = len(self.assembler.ids)
        text = self.assembler.push(committed)
        ids = tuple(self.assembler.ids[before:])
        logprobs = ()
        if self.logprobs is not None:  # the entries of this step's tokens that a stop string left
            logprobs = tuple(self.logprobs.entries[self._logprobs_read : self._logprobs_read + len(ids)])
            self._logprobs_read += len(committed)
        if self.assembler.stopped and not (self.job is not None and self.job.done):
            self.stats.stop_reason = "stop"
            if self.job is not None:
                self._engine.cancel(self.job, "stop")
        return Piece(text, ids, logprobs)

    def finish(self) -> str:
        """The text held back until the end ('' after a stop string)."""
        return self.assembler.finish()

    def result(self, text: str | None = None) -> GenerationResult:
        """Its result: the text decoded so far (or `text`, e.g. only what was handed out of a
        request cut short), the ids the text keeps, and its stats (new_tokens counting those ids)."""
        self.stats.new_tokens = min(self.stats.new_tokens, len(self.assembler.ids))
        return GenerationResult(self.assembler.text if text is None else text, list(self.assembler.ids),
                                list(self.request.prompt_ids), self.stats)

    @property
    def kept_logprobs(self) -> tuple:
        """The log-probabilities of the ids its text keeps (() when none were asked for)."""
        return () if self.logprobs is None else tuple(self.logprobs.entries[: len(self.assembler.ids)])
