"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Owns the field names, their JSON types (strict: a string is never coerced into a number or a
boolean) and the shape-level checks. Checks that need the model (context length, the served model
id, the method registry) are the app's. Fields OpenAI defines that verispec does not implement are
declared so that a non-default value is refused with a clear message instead of being silently
ignored (see `unsupported`); fields nobody declared are ignored, as OpenAI's own server does with
e.g. `user` or `metadata`.

Extension fields (not in OpenAI's API): `method` (a registered verispec method; default: the
server's `--method`) and `top_k` (0 = off).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: str | None = None  # OpenAI requires it; omitted here means the served model
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0 as in OpenAI's API; 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    method: str | None = None  # extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, message) for each field set to a value verispec does not implement."""
        problems = []
        if self.presence_penalty:
            problems.append(("presence_penalty", "presence_penalty is not supported (use 0 or omit it)"))
        if self.frequency_penalty:
            problems.append(("frequency_penalty", "frequency_penalty is not supported (use 0 or omit it)"))
        if self.logit_bias:
            problems.append(("logit_bias", "logit_bias is not supported"))
        return problems


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list holding one string, or a list of token ids."""

    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.echo:
            problems.append(("echo", "echo is not supported"))
        if self.logprobs is not None:
            problems.append(("logprobs", "logprobs are not supported"))
        if self.best_of is not None and self.best_of != 1:
            problems.append(("best_of", "best_of must be 1 (one completion per request)"))
        if self.suffix:
            problems.append(("suffix", "suffix (insertion) is not supported"))
        return problems


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(...)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins if both
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.logprobs:
            problems.append(("logprobs", "logprobs are not supported"))
        if self.top_logprobs:
            problems.append(("top_logprobs", "top_logprobs are not supported"))
        if self.tools:
            problems.append(("tools", "tools (function calling) are not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            problems.append(("response_format", "only response_format {\"type\": \"text\"} is supported"))
        return problems
