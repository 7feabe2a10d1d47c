"""The text-level library API: `generate` and `stream` over any method, one request at a time,
and `generate_many` and `stream_many` for many requests decoded together.

Composes `methods` (which recipe), `engine` (the loop of one request), `batch` (the loop of many),
`lifecycle` (a request from its validation to its result: stop strings, text, its end) and `text`
(prompt encoding). The CLI, benchmark and server call these functions. `make_request` validates
and encodes one request for any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from .core.batch import DEFAULT_MAX_ROWS, DEFAULT_MAX_SEQUENCES, BatchEngine
from .errors import ConfigError
from .request.lifecycle import Generation, GenerationResult, Request
from .core.methods import MethodOptions, build, get_method, with_settings
from .target.model import Target
from .core.sampling import SamplingConfig
from .request.grammar import compile_format
from .request.text import encode_prompt


class TextStream:
    """Iterate to receive text as it becomes final; `result` is set once iteration ends."""

    def __init__(self, target: Target, request: Request):
        self.target = target
        self.request = request
        self.result: GenerationResult | None = None
        self._generation = Generation(target, request)
        self.stats = self._generation.stats
        recipe = build(request.method, target, request.options, request.sampling)
        self._steps = self._generation.decode(recipe)

    def __iter__(self) -> Iterator[str]:
        generation = self._generation
        try:
            for committed in self._steps:
                delta = generation.push(committed).text
                if delta:
                    yield delta
                if generation.stopped:
                    break
            tail = generation.finish()
            if tail:
                yield tail
        finally:
            self._steps.close()
            self.result = generation.result()


def sampling_for(method: str, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None) -> SamplingConfig:
    """The sampling configuration of a request: given values, else the method's defaults."""
    defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **(get_method(method).default_sampling or {})}
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    chosen = {key: defaults[key] if value is None else value for key, value in given.items()}
    return SamplingConfig(seed=seed, **chosen)


def make_request(
    target: Target,
    prompt: str | Sequence[int],
    method: str = "anpd",
    *,
    max_new_tokens: int = 128,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    prompt_format: str = "raw",
    options: MethodOptions | None = None,
    response_format: dict | None = None,
) -> Request:
    """Validate the arguments of `generate`/`stream` and encode the prompt.

    method: a name, or a name with settings as in `verispec bench --methods` ('anpd/tree=8',
    'pld/constant:12'), applied to `options` (a setting given both ways with two values is a
    ConfigError: `methods.with_settings`).
    temperature / top_k / top_p left as None take the method's defaults (greedy for every
    method but mtad, which samples at temperature 1 with top-k 10 and top-p 0.9).
    response_format: the output's format, as OpenAI's API writes it (`{"type": "json_object"}`,
    `{"type": "json_schema", "json_schema": {"schema": {...}}}`) or `{"type": "regex", "regex":
    ...}`, `{"type": "grammar", "grammar": <Lark text>}`: every method decodes exactly as `ar`
    on the target's logits masked by the grammar (a bad one is a ConfigError before decoding)."""
    method, options = with_settings(method, options)
    sampling = sampling_for(method, temperature, top_k, top_p, seed)
    if isinstance(prompt, str):
        ids = encode_prompt(target.tokenizer, prompt, prompt_format)
    else:
        ids = [int(i) for i in prompt]
    if isinstance(stop, str):
        stop = (stop,)
    return Request(tuple(ids), method, max_new_tokens, sampling, tuple(stop), options,
                   compile_format(target, response_format))


def stream(target: Target, prompt: str | Sequence[int], method: str = "anpd", **kwargs) -> TextStream:
    """Generate, yielding text as it is committed; see `make_request` for the arguments."""
    return TextStream(target, make_request(target, prompt, method, **kwargs))


def generate(target: Target, prompt: str | Sequence[int], method: str = "anpd", **kwargs) -> GenerationResult:
    """Generate and return the whole result; see `make_request` for the arguments."""
    text_stream = stream(target, prompt, method, **kwargs)
    for _ in text_stream:
        pass
    assert text_stream.result is not None
    return text_stream.result


# -- many requests together ------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDelta:
    """A piece of final text of request `index` (its place in the list given)."""

    index: int
    text: str


@dataclass(frozen=True)
class RequestDone:
    """Request `index` ended: its result, or the error it failed with (`result` None). A
    cancelled request's result holds what it generated until then (stop reason "cancelled")."""

    index: int
    result: GenerationResult | None
    error: BaseException | None = None


class BatchTextStream:
    """Many requests decoded together (`batch.BatchEngine`): iterate to receive each request's
    text as it is committed (`TextDelta`) and each result as soon as its request ends
    (`RequestDone`); `results` holds them in request order (a `GenerationResult`, or the error a
    request failed with). `cancel(index)` ends one request between steps without touching the
    others; leaving the loop early cancels every request still running."""

    def __init__(self, target: Target, requests: Sequence[Request], max_rows: int = DEFAULT_MAX_ROWS,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES):
        requests = list(requests)
        for request in requests:
            if not isinstance(request, Request):
                raise ConfigError(f"generate_many takes requests made by verispec.make_request, not "
                                  f"{type(request).__name__}")
        self.target, self.requests = target, requests
        self.results: list[GenerationResult | BaseException | None] = [None] * len(requests)
        self._engine = BatchEngine(target, max_rows, max_sequences)
        self._running: dict[int, Generation] = {}  # by request index, until it ends
        self._cancelled: set[int] = set()

    def cancel(self, index: int) -> None:
        """End request `index` (if it is still running) before the next step."""
        if not 0 <= index < len(self.requests):
            raise ConfigError(f"no request {index}: there are {len(self.requests)}")
        self._cancelled.add(index)

    def _done(self, index: int) -> Iterator[TextDelta | RequestDone]:
        """The end of request `index`: its held-back text, then its result or error."""
        generation = self._running.pop(index)
        error = generation.job.error
        if error is not None:
            self.results[index] = error
            yield RequestDone(index, None, error)
            return
        tail = generation.finish()
        if tail:
            yield TextDelta(index, tail)
        result = generation.result()
        self.results[index] = result
        yield RequestDone(index, result)

    def __iter__(self) -> Iterator[TextDelta | RequestDone]:
        by_job: dict[int, int] = {}
        try:
            for index, request in enumerate(self.requests):
                try:
                    generation = Generation(self.target, request)
                    by_job[generation.submit(self._engine).id] = index
                    self._running[index] = generation
                except Exception as error:  # noqa: BLE001 - a request that cannot start fails in its place
                    self.results[index] = error
                    yield RequestDone(index, None, error)
            while self._running:
                for index in sorted(self._cancelled & set(self._running)):
                    self._running[index].cancel("cancelled")
                    yield from self._done(index)
                if not self._running:
                    break
                for job, committed in self._engine.step():
                    index = by_job[job.id]
                    delta = self._running[index].push(committed).text  # a stop string ends the job
                    if delta:
                        yield TextDelta(index, delta)
                    if job.done:
                        yield from self._done(index)
        finally:
            for generation in list(self._running.values()):  # the consumer left early
                generation.cancel("cancelled")


def stream_many(target: Target, requests: Sequence[Request], **kwargs) -> BatchTextStream:
    """Decode `requests` (made by `make_request`) together, streaming; see `BatchTextStream`.
    kwargs: `max_rows` (rows of one step's forward), `max_sequences` (requests running at once)."""
    return BatchTextStream(target, requests, **kwargs)


def generate_many(target: Target, requests: Sequence[Request], **kwargs) -> list[GenerationResult | BaseException]:
    """Decode `requests` (made by `make_request`) together and return, in their order, each one's
    `GenerationResult`, or the error it failed with in its place. Each output is the one the
    request gives alone (`generate`): greedy token for token, seeded sampling of `ar`, `pld`,
    `anpd` and `suffix` too. kwargs as `stream_many`."""
    batch = BatchTextStream(target, requests, **kwargs)
    for _ in batch:
        pass
    return list(batch.results)
