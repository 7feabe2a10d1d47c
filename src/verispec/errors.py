"""The exceptions verispec raises for a user's mistake or an unusable input.

Everything a user can get wrong (a bad option, a missing file, a model that cannot be used) raises
a `VerispecError` with a message that names what was wrong; the shells (CLI, server, benchmark)
turn it into a clean message and a non-zero exit or an HTTP error, never a traceback. Bugs in
verispec itself stay ordinary exceptions.
"""

from __future__ import annotations


class VerispecError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model or option."""


class ConfigError(VerispecError, ValueError):
    """An option has a value outside its allowed range."""


class UnknownMethodError(ConfigError):
    """A method name that is not registered (`methods.METHODS`)."""


class ModelLoadError(VerispecError):
    """A model could not be found or used (missing path, not a causal LM, bad dtype...)."""
