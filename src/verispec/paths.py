"""Where verispec keeps what it builds once per machine: converted models, block forms, kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/verispec`, else `~/.cache/verispec`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verispec"
