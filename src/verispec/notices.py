"""What verispec tells the user on stderr while it works (a model converted, a path not taken and
why): one line each, prefixed `[verispec]`, flushed at once."""

from __future__ import annotations

import sys


def notice(message: str) -> None:
    print(f"[verispec] {message}", file=sys.stderr, flush=True)
