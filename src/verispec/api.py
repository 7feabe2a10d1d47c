"""The text-level library API: `generate` and `stream` over any method.

Composes `methods` (which recipe), `engine` (the loop) and `text` (prompt encoding, incremental
detokenization, stop strings). The CLI, benchmark and server call these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .engine import DecodeConfig, decode
from .errors import ConfigError
from .methods import MethodOptions, build, check_settings, get_method, with_settings
from .model import Target
from .sampling import SamplingConfig
from .stats import GenerationStats
from .text import TextAssembler, encode_prompt


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

    def __post_init__(self) -> None:
        get_method(self.method)  # raises for an unknown name
        if not self.prompt_ids:
            raise ConfigError("the prompt is empty")
        DecodeConfig(self.max_new_tokens, self.sampling)  # validates the budget
        check_settings(self.method, self.options, self.sampling)


class TextStream:
    """Iterate to receive text as it becomes final; `result` is set once iteration ends."""

    def __init__(self, target: Target, request: Request):
        self.target = target
        self.request = request
        self.stats = GenerationStats(method=request.method)
        self.result: GenerationResult | None = None
        self._assembler = TextAssembler(target.tokenizer, request.stop)
        config = DecodeConfig(request.max_new_tokens, request.sampling, target.eos_token_ids)
        recipe = build(request.method, target, request.options, request.sampling)
        self._steps = decode(target, recipe, list(request.prompt_ids), config, self.stats)

    def __iter__(self) -> Iterator[str]:
        try:
            for committed in self._steps:
                delta = self._assembler.push(committed)
                if delta:
                    yield delta
                if self._assembler.stopped:
                    self.stats.stop_reason = "stop"
                    break
            tail = self._assembler.finish()
            if tail:
                yield tail
        finally:
            self._steps.close()
            self.stats.new_tokens = min(self.stats.new_tokens, len(self._assembler.ids))
            self.result = GenerationResult(
                self._assembler.text, list(self._assembler.ids), list(self.request.prompt_ids), self.stats
            )


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
) -> Request:
    """Validate the arguments of `generate`/`stream` and encode the prompt.

    method: a name, or a name with settings as in `verispec bench --methods` ('anpd/tree=8',
    'pld/constant:12'), applied to `options` (a setting given both ways with two values is a
    ConfigError: `methods.with_settings`).
    temperature / top_k / top_p left as None take the method's defaults (greedy for every
    method but mtad, which samples at temperature 1 with top-k 10 and top-p 0.9)."""
    method, options = with_settings(method, options)
    sampling = sampling_for(method, temperature, top_k, top_p, seed)
    if isinstance(prompt, str):
        ids = encode_prompt(target.tokenizer, prompt, prompt_format)
    else:
        ids = [int(i) for i in prompt]
    if isinstance(stop, str):
        stop = (stop,)
    return Request(tuple(ids), method, max_new_tokens, sampling, tuple(stop), options)


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
