"""The command line's shell: the typer app, its consoles, and how a mistake reaches the user.

Owns the one rule every command follows: a user's mistake is one `error:` line on stderr and exit
status 2, never a traceback (usage mistakes the parser finds included).
"""

from __future__ import annotations

import sys

import typer
import typer.core
from rich.console import Console

try:  # typer 0.29 (pinned) carries its own copy of click: its usage errors are these classes
    from typer._click import exceptions as usage
except ImportError:  # typer releases that use click itself
    from click import exceptions as usage


class _OneLineErrors(typer.core.TyperGroup):
    """The command group, with a usage mistake (a missing argument, an unknown option, a value of
    the wrong type) reported as every other mistake is: one `error:` line on stderr naming where
    help is, and exit status 2 (typer's own report is a framed box after the usage line)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except usage.NoArgsIsHelpError as error:  # `verispec` alone: the help
            typer.echo(error.ctx.get_help())
            sys.exit(2)
        except usage.UsageError as error:
            where = error.ctx.command_path if error.ctx is not None else "verispec"
            error_line(f"{error.format_message().rstrip('.')}; see '{where} --help'")
            sys.exit(error.exit_code)
        except usage.ClickException as error:
            error_line(error.format_message())
            sys.exit(error.exit_code)
        except typer.Abort:  # end of input where an answer was expected
            error_line("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="verispec: faster LLM generation by drafting cheaply and verifying in one target forward.",
)
out = Console()
err = Console(stderr=True)


def error_line(message: str) -> None:
    """One `error:` line on stderr (never wrapped; the message is not read as markup)."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """One `error:` line on stderr, then exit."""
    error_line(message)
    raise typer.Exit(code)


def log(message: str) -> None:
    """A progress line on stderr, printed as given."""
    err.print(message, highlight=False, markup=False, soft_wrap=True)


def names(value: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [part.strip() for part in value.split(",") if part.strip()]


def integers(value: str, option: str, low: int, high: int) -> list[int]:
    """'4,2,2' -> [2, 4]: the distinct integers of a comma-separated option, each in low..high."""
    try:
        chosen = sorted({int(part) for part in names(value)})
    except ValueError:
        fail(f"{option} must be comma-separated integers, got {value!r}")
    if chosen and not low <= chosen[0] <= chosen[-1] <= high:
        fail(f"{option} must lie in {low}..{high}, got {value!r}")
    return chosen


def read_stdin() -> str:
    """Standard input as UTF-8 text, whatever the locale; a ConfigError at the first byte that is
    not UTF-8."""
    from ..request.text import checked_text, decode_utf8

    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream
        return checked_text(sys.stdin.read(), "standard input")
    return decode_utf8(raw.read(), "standard input")


def main() -> None:
    """Console-script entry point."""
    app()
