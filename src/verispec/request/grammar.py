"""A request's output format, compiled into a grammar with llguidance.

Owns what `response_format` may say (OpenAI's `{"type": "json_object"}` and `{"type":
"json_schema", "json_schema": {"schema": ...}}`, and `{"type": "regex", "regex": ...}`,
`{"type": "grammar", "grammar": <Lark text>}`), its compilation against a target's tokenizer
(`compile_format`: a bad schema, regex or grammar is a `ConfigError` naming the reason, raised
before any decoding; `checked_grammar` checks one without a model), and `LLGuidanceMatcher`, the `core.constraint.Matcher` one request decodes
under. The tokenizer's llguidance form is built once per target (`Target.attachments`).

llguidance (the constrained-decoding library llama.cpp offers) compiles JSON schemas, regular
expressions and Lark grammars to one Earley parser over the tokenizer, computes a token mask in
tens of microseconds, forced continuations (`compute_ff_tokens`) and rolls back consumed tokens,
which the speculative loop needs: drafts are walked through the grammar, then undone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..target.model import Target

TOKENIZER_KEY = "llguidance-tokenizer"  # Target.attachments key
KINDS = ("text", "json_object", "json_schema", "regex", "grammar")


def grammar_text(response_format: dict) -> str | None:
    """llguidance's grammar for a `response_format` (None for plain text). Raises ConfigError
    for a shape it does not know."""
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ConfigError('response_format must be an object with a "type"')
    kind = response_format["type"]
    import llguidance

    if kind == "text":
        return None
    if kind == "json_object":
        return _from_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ConfigError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        return _from_schema(schema)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_text(response_format, "regex"))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(_text(response_format, "grammar"))
    raise ConfigError(f"response_format type {kind!r} is not one of {', '.join(KINDS)}")


def _text(response_format: dict, key: str) -> str:
    value = response_format.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f'response_format of type "{key}" needs a non-empty string "{key}"')
    return value


def _from_schema(schema) -> str:
    """A JSON schema's grammar: JSON on one line with no free whitespace, so the text between
    values is forced, and with a space after each comma and colon (as `json.dumps` writes it):
    models tokenize `", "` and `": "` as they learned them. Without the spaces (measured on
    Qwen2.5-Coder-1.5B) the model, denied its usual `", "`, wrote stray commas inside the next
    string (`["Open a project",",File > Export"]`), and fewer tokens came a forward."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    except (ValueError, TypeError) as error:
        raise ConfigError(f"invalid JSON schema: {error}") from None


@dataclass(frozen=True)
class Constraint:
    """A compiled output format: its llguidance grammar and the tokenizer it runs on. `matcher()`
    gives each request its own state."""

    grammar: str
    tokenizer: Any = field(repr=False, compare=False)
    kind: str = ""

    def matcher(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self)


def checked_grammar(response_format: dict | None, tokenizer=None) -> str | None:
    """`response_format`'s llguidance grammar, validated (against `tokenizer`, an `LLTokenizer`,
    where given; without one nothing needs a model), None for none or plain text. Raises
    ConfigError with llguidance's reason on one line."""
    if response_format is None:
        return None
    grammar = grammar_text(response_format)
    if grammar is None:
        return None
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ConfigError(f"invalid {response_format['type']}: {' '.join(messages[0].split())}")
    return grammar


def compile_format(target: "Target", response_format: dict | None) -> Constraint | None:
    """`response_format` compiled for `target`'s tokenizer, None for none or plain text. Raises
    ConfigError (the reason in its message) for a format llguidance cannot compile."""
    if checked_grammar(response_format) is None:
        return None
    tokenizer = llguidance_tokenizer(target)
    return Constraint(checked_grammar(response_format, tokenizer), tokenizer, response_format["type"])


def llguidance_tokenizer(target: "Target"):
    """The target's tokenizer as llguidance's `LLTokenizer`, with the target's EOS ids as its
    end of sequence (built once per target)."""
    cached = target.attachments.get(TOKENIZER_KEY)
    if cached is not None:
        return cached
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise ConfigError("a response_format needs the model's tokenizer; this model has none")
    eos = sorted(target.eos_token_ids)
    if not eos:
        raise ConfigError("a response_format needs a model with an end-of-sequence token")
    import llguidance
    import llguidance.hf

    try:
        built = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
    except ValueError:  # a decoder llguidance does not read: each token's own text
        built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, eos[0])))
    target.attachments[TOKENIZER_KEY] = built
    return built


class _TokenBytes:
    """A tokenizer as llguidance's `TokenizerWrapper` reads one: each token's bytes by decoding it
    alone (for tokenizers whose decoder llguidance does not know, e.g. a character vocabulary)."""

    def __init__(self, tokenizer, eos: int):
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = eos, getattr(tokenizer, "bos_token_id", None)
        self.tokens = [tokenizer.decode([i]).encode("utf-8") for i in range(len(tokenizer))]
        self.special_token_ids = list(getattr(tokenizer, "all_special_ids", []))

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(text, add_special_tokens=False)


class LLGuidanceMatcher:
    """One request's grammar state (`core.constraint.Matcher`) on an `llguidance.LLMatcher`."""

    def __init__(self, constraint: Constraint):
        import llguidance

        self._matcher = llguidance.LLMatcher(constraint.tokenizer, constraint.grammar, log_level=0)
        self._tokenizer, self._vocab = constraint.tokenizer, constraint.tokenizer.vocab_size
        if self._matcher.is_error():
            raise ConfigError(f"invalid {constraint.kind}: {self._matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """bool [vocab] on the host: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab].view(np.bool_))

    def consume(self, tokens) -> int:
        return self._matcher.try_consume_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n and not self._matcher.rollback(n):
            raise RuntimeError(f"the grammar could not roll back {n} tokens: {self._matcher.get_error()}")

    def forced(self) -> list[int]:
        """The forced text's tokens: llguidance's forced tokens (`compute_ff_tokens`, which holds
        back a last token that could merge with what follows), or, where longer, the whole forced
        text tokenized (that last token included: the target usually takes it; it is verified as
        any draft), each prefix valid in the grammar."""
        tokens = list(self._matcher.compute_ff_tokens())
        text = self._matcher.compute_ff_bytes()
        if text:
            whole = self._tokenizer.tokenize_bytes(text)
            n = self.consume(whole)
            self.rollback(n)
            if n > len(tokens):
                tokens = whole[:n]
        return tokens

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()
