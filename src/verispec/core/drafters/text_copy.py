"""Drafting by copying the prompt's text where the output writes it in other tokens.

An n-gram table matches tokens, but the same text is often tokenized otherwise in the output than
in the prompt: a value that begins after a quote loses the space it had in the prompt (the prompt's
` Sofia`, ` Marin`; a JSON answer's `S`, `of`, `ia`, ` Marin`), so no n-gram of the output occurs in
the prompt until the copy has passed that word. `TextCopy` matches text instead: the text of the
output's last few tokens, found in the prompt's text, is re-tokenized together with the text that
followed it there, and where that tokenization begins with those same last tokens, the tokens
after them are the draft. Measured on the project's extraction set (`scripts/structured_output.py`,
Qwen2.5-Coder-1.5B, constrained `ar`'s answers): of 690 answer tokens, 57 that no bigram of the
context predicts are predicted this way (an offline count).

Pure: the tokenizer enters as `encode` / `decode` callables; no model, no torch. Cost per draft: a
decode of at most `max_tail` tokens and an encode of about `span_chars` characters per tail length
tried, and a search of the prompt's text (`str.rfind`, at most MAX_LOOKS occurrences): about
0.1 ms a draft on the 1.5B's tokenizer.
"""

from __future__ import annotations

from typing import Callable, Sequence

MAX_TAIL = 3  # output tokens whose text is looked up, longest first
SPAN_CHARS = 48  # characters of the prompt after a match that are re-tokenized
MAX_LOOKS = 32  # occurrences of a text looked at for one that fits


class TextCopy:
    """Draft tokens from the prompt's text after the text of the output's last tokens."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str],
                 max_tail: int = MAX_TAIL, span_chars: int = SPAN_CHARS):
        self.encode, self.decode = encode, decode
        self.max_tail, self.span_chars = max_tail, span_chars
        self.text = ""

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "TextCopy | None":
        """A copier over a transformers tokenizer (None without one)."""
        if tokenizer is None:
            return None
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False),
                   lambda ids: tokenizer.decode(list(ids)))

    def begin(self, prompt: Sequence[int]) -> None:
        self.text = self.decode(prompt)

    def draft(self, tail: Sequence[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens, the characters matched) after `tail`, the output's last tokens; ([], 0)
        where no text of them occurs in the prompt followed by a tokenization that starts with
        them. The match at a word start, where the output's text starts a word there."""
        tail = [int(token) for token in tail]
        if k <= 0:
            return [], 0
        for m in range(min(self.max_tail, len(tail)), 0, -1):
            piece = self.decode(tail[-m:])
            if not piece.strip() or "\ufffd" in piece:
                continue
            before = self.decode(tail[-m - 1:-m]) if len(tail) > m else ""
            at = self._find(piece, word_start=piece[0].isalnum() and not (before[-1:].isalnum()))
            if at < 0:
                continue
            follow = self.text[at + len(piece): at + len(piece) + self.span_chars]
            ids = self.encode(piece + follow)
            if ids[:m] != tail[-m:]:
                continue
            # the last token may be a word cut by the span's end: dropped unless the prompt ends there
            end = len(ids) if at + len(piece) + self.span_chars >= len(self.text) else len(ids) - 1
            return ids[m:end][:k], len(piece)
        return [], 0

    def _find(self, piece: str, word_start: bool) -> int:
        """The last occurrence of `piece` in the prompt's text with text after it (at a word start
        if asked), or -1; at most MAX_LOOKS occurrences are looked at (a letter occurs thousands
        of times in a long prompt)."""
        end = len(self.text) - 1
        for _ in range(MAX_LOOKS):
            at = self.text.rfind(piece, 0, end + 1)
            if at < 0:
                return -1
            followed = at + len(piece) < len(self.text)
            if followed and (not word_start or at == 0 or not self.text[at - 1].isalnum()):
                return at
            end = at + len(piece) - 2  # the next search ends before this occurrence does
        return -1
