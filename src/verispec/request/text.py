"""Text in and out: prompt encoding, incremental detokenization, stop strings.

The engine works on token ids only; this module turns a prompt into ids and committed ids back
into text, emitting only text that can no longer change: an incomplete UTF-8 sequence, a run of
byte-fallback tokens not yet ended (`byte_token_ids`), or a tail that could still become a stop
string, is held back until the next tokens decide it. So the text handed out adds up to the
decode of every id, however many ids each step commits. When a stop
string appears, the text ends just before it, and the ids are cut after the token that completed
it (anything accepted after it in the same step is dropped).

Text must be valid Unicode: a lone surrogate (which no tokenizer can encode) is refused with a
ConfigError by `checked_text`. Python turns bytes that are not UTF-8 into lone surrogates when it
decodes command-line arguments or a stream with `surrogateescape`; for those the error names the
byte and its offset in the UTF-8 input (`decode_utf8` decodes raw bytes the same way).

Prompt formats: `raw` encodes the prompt as given (with the tokenizer's special tokens such as
BOS); `chat` applies the tokenizer's chat template when it has one, and otherwise the plain
template `PLAIN_TEMPLATE` (documented in README), which suits base models.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError

PLAIN_TEMPLATE = "Question: {prompt}\n\nAnswer:"
PROMPT_FORMATS = ("raw", "chat")


def checked_text(text: str, what: str) -> str:
    """`text` itself if UTF-8 can encode it; else a ConfigError naming `what` and the first lone
    surrogate: as the byte that is not UTF-8 and its byte offset when the surrogate stands for one
    (U+DC80..U+DCFF, Python's surrogateescape), else as the code point and its character index."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        if 0xDC80 <= code <= 0xDCFF:
            offset = len(text[: error.start].encode("utf-8"))
            raise ConfigError(f"{what} is not valid UTF-8: byte 0x{code - 0xDC00:02x} at byte offset {offset}"
                              ) from None
        raise ConfigError(f"{what} is not valid Unicode text: a lone surrogate \\u{code:04x} at character "
                          f"{error.start}") from None
    return text


def decode_utf8(data: bytes, what: str) -> str:
    """UTF-8 bytes -> text; a ConfigError naming `what`, the first invalid byte and its offset."""
    return checked_text(data.decode("utf-8", "surrogateescape"), what)


def encode_prompt(tokenizer, prompt: str, prompt_format: str = "raw") -> list[int]:
    """Prompt text -> token ids; raises ConfigError for an empty or invalid prompt or unknown format."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError("the prompt is empty")
    checked_text(prompt, "the prompt")
    if prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"unknown prompt format {prompt_format!r}; choose one of {', '.join(PROMPT_FORMATS)}")
    if prompt_format == "chat":
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        prompt = PLAIN_TEMPLATE.format(prompt=prompt)
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def encode_messages(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Chat messages -> ids, with the chat template (given `tools`, OpenAI's function
    definitions, where the request has some) or a plain "Role: content" fallback."""
    if not messages:
        raise ConfigError("messages must not be empty")
    for message in messages:
        if isinstance(message.get("content"), str):
            checked_text(message["content"], "a message")
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": list(tools)} if tools else {}
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return [int(i) for i in tokenizer("\n\n".join(lines) + "\n\nAssistant:")["input_ids"]]


def byte_token_ids(tokenizer) -> frozenset[int]:
    """The ids of the byte tokens <0x00>..<0xFF> of a SentencePiece-style vocabulary with byte
    fallback (Gemma, Llama 2, Mistral); none for others. transformers decodes a run of them to its
    UTF-8 characters only if the whole run is valid UTF-8, else to one U+FFFD per byte: a run's
    text can change as long as it grows (E0 A5 B4 is one character, E0 A5 B4 E0 four U+FFFD)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return frozenset()
    unknown = getattr(tokenizer, "unk_token_id", None)
    return frozenset(i for i in convert([f"<0x{b:02X}>" for b in range(256)]) if i is not None and i != unknown)


CONTEXT = 8  # ids decoded before the anchor with the new ones (`TextAssembler._decoded`)
HOLD = 4  # ids after the anchor: their text may still change as more ids come


class TextAssembler:
    """Accumulates committed ids and emits the text that is final so far."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise ConfigError("stop strings must be non-empty strings")
        for stop in stop_strings:
            checked_text(stop, "a stop string")
        self.tokenizer = tokenizer
        self._bytes = byte_token_ids(tokenizer)
        self._run = 0  # how many of the last ids are byte tokens (a run the next id may extend)
        self.stop_strings = tuple(stop_strings)
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (may extend past a stop string)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self._anchor = 0  # ids[:_anchor] decode to text[:_anchor_chars], for good
        self._anchor_chars = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _decoded(self) -> str:
        """The text of all ids, decoding only those after the anchor (and CONTEXT ids before it,
        so that a tokenizer that treats a leading piece specially sees it in context): a step
        costs the same at the thousandth token as at the first, instead of a decode of every id.
        Where the context does not decode to the anchored text's end (a split inside a
        character, say), every id is decoded. The anchor then moves to all but the last HOLD ids,
        unless their text ends in an incomplete character or the anchor would split a run of byte
        tokens."""
        start = max(0, self._anchor - CONTEXT)
        head = self._decode(self.ids[start : self._anchor])
        window = self._decode(self.ids[start:])
        if not (window.startswith(head) and self.text[: self._anchor_chars].endswith(head)):
            text = self._decode(self.ids)
            self._anchor, self._anchor_chars = 0, 0
            return text
        text = self.text[: self._anchor_chars] + window[len(head):]
        anchor = len(self.ids) - HOLD
        if anchor > self._anchor and not (self.ids[anchor - 1] in self._bytes and self.ids[anchor] in self._bytes):
            fixed = self._decode(self.ids[start:anchor])
            if fixed.startswith(head) and not fixed.endswith("\ufffd") and window.startswith(fixed):
                self._anchor, self._anchor_chars = anchor, self._anchor_chars + len(fixed) - len(head)
        return text

    def push(self, ids: Sequence[int]) -> str:
        """Add a step's ids; return newly final text ('' if none). Sets `stopped` on a stop string."""
        if self.stopped:
            return ""
        start = len(self.ids)
        self.ids.extend(int(i) for i in ids)
        self.text = self._decoded()
        stop = self._find_stop(max(0, self.emitted - self._hold))
        if stop is not None:
            cut, length = stop
            self.stopped = True
            self._cut_ids_at(cut + length, start)
            self.text = self.text[:cut]
            return self._emit(cut)
        final = len(self.text) - self._hold
        if self.text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            final = min(final, len(self.text.rstrip("\ufffd")))
        for i in self.ids[start:]:
            self._run = self._run + 1 if i in self._bytes else 0
        if self._run:  # the last ids are a run of byte tokens: its text may still change
            final = min(final, len(self.text) - len(self._decode(self.ids[-self._run :])))
        return self._emit(final)

    def finish(self) -> str:
        """Flush the held-back tail at the end of generation."""
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, int] | None:
        """(index, length) of the earliest stop string in the text, or None."""
        hits = [(i, len(s)) for s in self.stop_strings if (i := self.text.find(s, search_from)) >= 0]
        return min(hits) if hits else None

    def _cut_ids_at(self, stop_end: int, step_start: int) -> None:
        """Keep ids up to the token that completed the stop string (text ending at `stop_end`)."""
        for end in range(step_start + 1, len(self.ids) + 1):
            if len(self._decode(self.ids[:end])) >= stop_end:
                del self.ids[end:]
                return
