"""The `verispec` command line: a thin shell over the library.

Owns argument parsing (typer), turning user errors into one clear line and a non-zero exit code
(never a traceback), and presenting results (rich tables, JSON). All work is done by the library.
One module per group of commands: generation (generate), benchmarks (bench, bench-serve), serving
(serve), inspection (info, profile), training (train-exit); shell (the app and its error rule) and
target_options (the options the commands share) beneath them.
"""

from . import benchmarks, generation, inspection, serving, training  # noqa: F401 - each registers its commands
from .shell import app, main

__all__ = ["app", "main"]
