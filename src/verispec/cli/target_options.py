"""The options every command shares, declared once: which model to load and how (`TargetOptions`,
added to a command by `@target_options(...)`), and the method settings several commands take.

Also owns the one check the CLI adds to what the methods know: a flag that none of the chosen
methods reads is refused (`refuse_unread_flags`, asking `core.methods` who reads what).
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass, fields
from typing import Optional

import typer

from .shell import fail


@dataclass(frozen=True)
class TargetOptions:
    """Which model a command loads, and the forward it runs on."""

    model: Optional[str] = None
    dtype: str = "auto"
    fast: bool = True
    block_kernel: bool = True
    numerics: str = "int8"
    device: str = "auto"
    compile: bool = False

    def check(self) -> str:
        """Everything that needs no model, before loading one: the numerics' and the device's names
        (a GPU that is not here, --compile on the CPU). Returns the device's resolved name."""
        from ..runtime.blockmm import NUMERICS
        from ..target.device import resolve_device

        if self.numerics not in NUMERICS:
            fail(f"--numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        return resolve_device(self.device, self.compile)

    def load(self, dtype: str | None = None):
        """The target (transformers' progress bars and warnings kept out of the output)."""
        import transformers

        from ..target import loading

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        return loading.load(self.model, dtype or self.dtype, fast=self.fast, block_kernel=self.block_kernel,
                            numerics=self.numerics, device=self.device, compile=self.compile)


# Each field's option, in the order `--help` lists them.
TARGET_OPTIONS = {
    "model": typer.Option(None, help="Model directory, .gguf file or cached hub id (default: embedded Gemma 3 270M)."),
    "dtype": typer.Option("auto", help="auto | float32 | bfloat16 | float16 (auto: float32 for a GGUF model on the block kernel, e.g. the default; otherwise bf16 only on CPUs with native bf16)."),
    "fast": typer.Option(True, "--fast/--no-fast", help="Use the fast forward path where the model supports it (--no-fast: transformers' eager forward)."),
    "block_kernel": typer.Option(
        True, "--block-kernel/--no-block-kernel",
        help="On the fast path in float32, run a GGUF model's linears on their exact int8 blocks (the same weights, a quarter of the bytes; --no-block-kernel: float32 weights)."),
    "numerics": typer.Option(
        "int8", "--numerics",
        help="int8 | fp32: how the block kernel multiplies (int8: activations quantized per block, each position's logits the same whatever the verify width, so wide verifies are cheap and exact against ar, which runs the same numerics; fp32: float32 activations)."),
    "device": typer.Option(
        "auto", "--device",
        help="auto | cpu | cuda | cuda:N | auto-map (auto: the first GPU if CUDA is available, else the CPU; auto-map: spread a model too large for one GPU over every GPU, accelerate's device_map='auto'). The fast path and block kernel run on the CPU only; on a GPU the PyTorch forward runs (dtype auto: bfloat16)."),
    "compile": typer.Option(
        False, "--compile",
        help="CUDA only: run the one-token decode step compiled (torch.compile, CUDA graphs, static KV cache of 4096 positions); falls back with a message where it cannot."),
}
_TYPES = typing.get_type_hints(TargetOptions)


def target_options(*chosen: str):
    """Give a command the `TargetOptions` fields `chosen` (default: all) as options; the command
    receives them as one `target: TargetOptions` argument (fields not chosen keep their default)."""
    chosen = chosen or tuple(field.name for field in fields(TargetOptions))

    def add(command):
        own = inspect.signature(command, eval_str=True)
        kept = [parameter for name, parameter in own.parameters.items() if name != "target"]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=TARGET_OPTIONS[name],
                                   annotation=_TYPES[name]) for name in chosen]

        @functools.wraps(command)
        def run(**given):
            target = TargetOptions(**{name: given.pop(name) for name in chosen})
            return command(target=target, **given)

        run.__signature__ = own.replace(parameters=[*kept, *added])  # what typer reads
        run.__annotations__ = {parameter.name: parameter.annotation for parameter in run.__signature__.parameters.values()}
        return run

    return add


# Method settings several commands take.
EXIT_HEAD_OPTION = typer.Option(None, "--exit-head", help="Exit-head directory for eesd (default: the head trained or shipped for the model).")
DRAFT_LENGTH_OPTION = typer.Option(None, "--draft-length", "-k", help="Most tokens drafted per step (default: the method's).")
CONTROLLER_OPTION = typer.Option(None, help="Draft-length controller: constant[:K], heuristic[:K], adaptive[:K], measured[:K], beta-ts[:K], calibrated-ts[:K].")
NGRAM_MEMORY_OPTION = typer.Option(
    True, "--ngram-memory/--no-ngram-memory",
    help="Memory across requests: anpd also drafts from the n-grams of earlier requests on the same model, suffix from its tree of earlier outputs (outputs never change; in a server one user's text can change another's speed).",
)
FLAGS = {"draft_length": "--draft-length", "controller": "--controller", "exit_head": "--exit-head",
         "draft_model": "--draft-model", "beams": "--beams", "tau": "--tau", "tree": "--tree", "span_min": "--span-min"}


def given_settings(**values) -> dict:
    """The method settings a user gave (a flag left out is None; --no-ngram-memory only when off)."""
    given = {name: value for name, value in values.items() if value is not None and name != "ngram_memory"}
    if values.get("ngram_memory") is False:
        given["ngram_memory"] = False
    return given


def refuse_unread_flags(methods: list[str], given: dict, options=None, also_read_by: dict | None = None) -> None:
    """A ConfigError for a flag that none of `methods` reads, or for the draft length given twice
    (--draft-length and --controller NAME:K)."""
    from ..core.methods import refuse_unread
    from ..errors import ConfigError

    shown = {name: "--no-ngram-memory" if name == "ngram_memory" else FLAGS[name] for name in given}
    refuse_unread(methods, shown, options, also_read_by)
    controller = given.get("controller")
    if "draft_length" in given and controller is not None and ":" in controller:
        raise ConfigError(f"--draft-length {given['draft_length']} and --controller {controller} both set the draft "
                          f"length; give only one")
