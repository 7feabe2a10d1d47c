"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Owns the field names, their JSON types (strict: a string is never coerced into a number or a
boolean) and the shape-level checks. Checks that need the model (context length, the served model
id, the method registry) are the app's. Fields OpenAI defines that verispec does not implement are
declared so that a non-default value is refused with a clear message instead of being silently
ignored (see `unsupported`); fields nobody declared are ignored, as OpenAI's own server does with
e.g. `user` or `metadata`.

`response_format` (chat): OpenAI's `{"type": "text"}`, `{"type": "json_object"}` and `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`; the app compiles it into the
request's grammar (a schema that does not compile is a 400 naming `response_format`). `tools`,
`tool_choice` and the messages' `tool_calls` / `tool_call_id`: see `tools.py`.

Extension fields (not in OpenAI's API): `method` (a registered verispec method; default: the
server's `--method`) and `top_k` (0 = off). `n` (1 to MAX_CHOICES) and `logprobs` (completions:
0 to 5 top ones; chat: `logprobs` true and `top_logprobs` 0 to 20) are OpenAI's.

Ranges (docs/server.md lists them): every number must be finite (Python's json reads NaN and
Infinity) and in its field's range, given by the annotations below (OpenAI's ranges where OpenAI
has one); an integer field takes only integers (not 2.0, not true); a text field must be valid
Unicode (JSON can carry lone UTF-16 surrogates such as "\\ud800", which no tokenizer can encode).
A range error names the field and its range.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ..core.sampling import MAX_SEED  # seeds are unsigned 64-bit integers (torch generators)


def _show(value) -> str:
    """A number for an error message; a huge integer by its size, not its thousands of digits."""
    if isinstance(value, int) and abs(value) >= 10**24:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _number(low: float, high: float, low_open: bool = False) -> AfterValidator:
    """A finite float in [low, high] (or (low, high] with low_open)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value: float) -> float:
        above_low = value > low if low_open else value >= low
        if not (math.isfinite(value) and above_low and value <= high):  # NaN fails every comparison
            raise ValueError(f"must be a finite number in {interval}, got {_show(value)}")
        return value

    return AfterValidator(check)


def _integer(low: int, high: int | None = None, note: str = "") -> AfterValidator:
    """An integer in [low, high] (no upper bound when high is None)."""
    interval = f"from {low} to {high}" if high is not None else f">= {low}"

    def check(value: int) -> int:
        if value < low or (high is not None and value > high):
            raise ValueError(f"must be an integer {interval}{note}, got {_show(value)}")
        return value

    return AfterValidator(check)


def _valid_text(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(value[error.start])
        raise ValueError(f"is not valid Unicode text: a lone surrogate \\u{code:04x} at character {error.start}"
                         ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_text)]
MAX_CHOICES = 16  # n: choices of one request
RESPONSE_FORMATS = ("text", "json_object", "json_schema")  # OpenAI's response_format types
TokenBudget = Annotated[int, _integer(1, note=" (and at most the server's limit and the room left in the context)")]
Penalty = Annotated[float, _number(-2, 2)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by both endpoints."""

    model: Text | None = None  # OpenAI requires it; omitted here means the served model
    max_tokens: TokenBudget | None = None
    temperature: Annotated[float, _number(0, 2)] | None = None  # default 1.0 as in OpenAI's API; 0 = greedy
    top_p: Annotated[float, _number(0, 1, low_open=True)] | None = None
    top_k: Annotated[int, _integer(0, note=" (0 = off)")] | None = None  # extension
    seed: Annotated[int, _integer(0, MAX_SEED, " (2**64 - 1)")] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, _integer(1, MAX_CHOICES)] | None = None  # choices: n requests sharing the prompt
    method: Text | None = None  # extension
    presence_penalty: Penalty | None = None  # only 0
    frequency_penalty: Penalty | None = None  # only 0
    logit_bias: dict[str, Annotated[float, _number(-100, 100)]] | None = None  # only empty

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

    prompt: Text | list[Text] | list[int]
    echo: bool = False
    logprobs: Annotated[int, _integer(0, 5)] | None = None  # the chosen token's and this many top ones
    best_of: int | None = None  # only 1
    suffix: Text | None = None  # only empty

    def logprobs_wanted(self) -> int | None:
        """How many top log-probabilities per token (0: the chosen token's only), or None."""
        return self.logprobs

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        if self.echo:
            problems.append(("echo", "echo is not supported"))
        if self.best_of is not None and self.best_of != 1:
            problems.append(("best_of", "best_of must be 1 (one completion per request)"))
        if self.suffix:
            problems.append(("suffix", "suffix (insertion) is not supported"))
        return problems


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class CalledFunction(_Body):
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # None only for an assistant turn of tool calls
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: Text | None = None  # a tool turn: the call it answers

    @model_validator(mode="after")
    def _has_content(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant turn with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Function(_Body):
    name: Text
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class ChosenFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(...)
    max_completion_tokens: TokenBudget | None = None  # OpenAI's newer name for max_tokens; wins if both
    logprobs: bool | None = None
    top_logprobs: Annotated[int, _integer(0, 20)] | None = None  # with logprobs: this many top ones per token
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    response_format: dict | None = None  # text, json_object or json_schema (compiled by the app)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def token_budget_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_wanted(self) -> int | None:
        """How many top log-probabilities per token (0: the chosen token's only), or None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[tuple[str, str]]:
        problems = super().unsupported()
        kind = None if self.response_format is None else self.response_format.get("type")
        if kind not in (None, *RESPONSE_FORMATS):
            problems.append(("response_format", f"response_format type {kind!r} is not supported (one of "
                                                f"{', '.join(RESPONSE_FORMATS)})"))
        return problems
