"""`verispec info` (what was loaded and how it runs) and `verispec profile` (what a step, a verify,
a batch and a prefill cost on this machine: can drafting pay here?)."""

from __future__ import annotations

import json
import platform
from typing import Optional

import typer
from rich.table import Table

from ..errors import VerispecError
from .shell import app, err, fail, integers, out
from .target_options import EXIT_HEAD_OPTION, TargetOptions, target_options


@app.command()
@target_options("model", "dtype", "fast", "block_kernel", "numerics", "device")
def info(target: TargetOptions = None) -> None:
    """Print the model, dtype, threads, methods and library versions."""
    try:
        target.check()
        model = target.load()
    except VerispecError as error:
        fail(str(error))
        return
    table = Table(title="verispec info", show_header=False)
    for key, value in _facts(model):
        table.add_row(key, value)
    out.print(table)


def _facts(model) -> list[tuple[str, str]]:
    """(name, value) rows describing the loaded target, this machine and the library."""
    import psutil
    import torch
    import transformers

    from .. import __version__
    from ..core.methods import METHODS
    from ..runtime.blockmm import kernel_path
    from ..paths import cache_root
    from ..target.device import describe, spread_over_devices
    from ..target.loading import cpu_has_native_bf16

    own_blocks = model.model is None
    spread = not own_blocks and spread_over_devices(model.model)
    path = ("GGUF blocks (the file memory-mapped; every layer in C over paged KV)" if own_blocks else
            "fast (static KV cache, prepacked linears)" if model.fast else f"PyTorch (transformers) on {model.device}")
    config = model.config
    return [
        ("model", model.name),
        ("architecture", config.model_type if own_blocks else type(model.model).__name__),
        ("layers / hidden / vocabulary", f"{config.num_hidden_layers} / {config.hidden_size} / {model.vocab_size}"),
        ("dtype", str(model.dtype).replace("torch.", "")),
        ("device", describe(model.device) + (" (spread over several devices)" if spread else "")),
        ("CUDA available", str(torch.cuda.is_available())),
        ("CPU native bf16", str(cpu_has_native_bf16())),
        ("torch threads", str(torch.get_num_threads())),
        ("forward path", path),
        ("weight bytes read a token", f"{model.weight_bytes_per_token / 1e6:.1f} MB"),
        ("resident memory", f"{psutil.Process().memory_info().rss / 1e6:.0f} MB"),
        ("own LM head", str(model.uses_own_head)),
        ("block kernel", model.block_kernel_summary),
        ("numerics", model.numerics),
        ("kernels", kernel_path()),
        ("cache directory", str(cache_root())),
        ("methods", ", ".join(METHODS)),
        ("verispec", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
    ]


@app.command()
@target_options()
def profile(
    context: int = typer.Option(256, help="Tokens in the cache before the timed forwards."),
    widths: str = typer.Option("2,4,8,16,32", help="Comma-separated verify widths to time besides 1."),
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    repeats: int = typer.Option(15, help="Timed calls per width and round (the median is kept)."),
    sequences: str = typer.Option("1,2,4,8,16", help="Comma-separated numbers of sequences for the batched decode curve (empty: none)."),
    prefill: int = typer.Option(1000, help="Tokens of the prompt whose prefill rate is timed (0: none)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    target: TargetOptions = None,
) -> None:
    """Time a 1-token step and verify forwards of several widths on this machine (can drafting pay here?), and
    where the target batches, the aggregate decode rate of many sequences and a prompt's prefill rate."""
    import torch

    from ..bench.profile import (batched_decode, format_batched, format_profile, integer_roof, prefill_rate,
                                 profile_target, roof_fraction)
    from ..bench.report import kernel_info, machine_info

    try:
        target.check()
        chosen = integers(widths, "--widths", 1, 64)
        if not chosen:
            fail(f"--widths must lie in 1..64, got {widths!r}")
        counts = integers(sequences, "--sequences", 1, 64)
        if context < 1 or repeats < 1:
            fail("--context and --repeats must be >= 1")
        if prefill < 0:
            fail(f"--prefill must be >= 0, got {prefill}")
        model = target.load()
        if context + max(chosen) > model.max_length:
            fail(f"--context {context} + width {max(chosen)} exceeds the model's context of {model.max_length}")
        if prefill > model.max_length:
            fail(f"--prefill {prefill} exceeds the model's context of {model.max_length}")
        result = profile_target(model, context, chosen, _draft_head(model, exit_head), repeats)
        if model.pages_kv:
            result["batched"] = batched_decode(model, counts, context) if counts else None
            result["prefill"] = prefill_rate(model, prefill) if prefill else None
            result["roof"] = integer_roof(model)
            if result["roof"] is not None and result["prefill"] is not None:
                result["prefill"]["roof_fraction"] = round(roof_fraction(result["prefill"], result["roof"]), 3)
    except VerispecError as error:
        fail(str(error))
        return
    result.update(model=model.name, dtype=str(model.dtype).replace("torch.", ""), kernel=kernel_info(),
                  threads=torch.get_num_threads(), machine=machine_info())
    if as_json:
        print(json.dumps(result))
        return
    out.print(f"{model.name} on {result['machine']['cpu']} ({result['threads']} threads, kernel: {result['kernel']})",
              highlight=False)
    out.print(format_profile(result), highlight=False)
    if result.get("batched") or result.get("prefill") or result.get("roof"):
        out.print(format_batched(result.get("batched"), result.get("prefill"), result.get("roof")), highlight=False)


def _draft_head(model, exit_head: Optional[str]):
    """The EESD exit head whose draft step is timed beside the target's, or None (said) where the
    model has none and none was named."""
    from ..core.methods import prepared_exit_head
    from ..errors import ConfigError, ModelLoadError

    try:  # on either path: the PyTorch path's draft step runs through the model's own modules
        return prepared_exit_head(model, exit_head)
    except (ModelLoadError, ConfigError) as error:
        if exit_head is not None:
            raise
        err.print(f"no EESD draft step timed: {error}", highlight=False)
        return None
