"""Builds of the C kernels timed side by side in one process, for kernel edits on a noisy machine.

Each directory given holds the kernel sources (`blockmm.c`, `blockmm_int8.c`, `decoder_layer.c`,
`qmatmul.c` and the files they include: the `*.h` and qmatmul's per-instruction-set `qmatmul_*.c`;
copies of src/verispec/runtime/kernels/, some edited); each is compiled, into its directory, with
the flags of the instruction-set variant this CPU runs (`build.compile_sources`). The default model is loaded once (its transformers form on the int8 block forms, the fast
path; `qmatmul_ab.py` times the GGUF-block kernel), and before every forward its decoder layers
and block linears are switched to one of the builds, in a shuffled order per
round, so that the machine's drift (other tenants, clock changes) falls on every build alike.
Timings between separate processes on a shared 2-vCPU machine differed by 10-30% run to run;
alternating per forward makes differences of a few percent visible. Prints, per verify width,
the median forward time of each build and its ratio to the first build's.

    mkdir -p /tmp/a /tmp/b && cp src/verispec/runtime/kernels/*.[ch] /tmp/a && cp /tmp/a/*.[ch] /tmp/b
    (edit /tmp/b/*.c)
    python scripts/kernel_ab.py /tmp/a /tmp/b --widths 1 8 --seconds 120
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time
from pathlib import Path

from verispec.bench.profile import timing_context
from verispec.target.loading import load
from verispec.runtime import blockmm
from verispec.runtime import build as build_module
from verispec.runtime.linear import BlockLinear
from verispec.runtime.native_layer import NativeLayer, bind


def build(folder: Path) -> blockmm.Kernel:
    """The kernels of `folder`'s sources, compiled as blockmm builds the variant this CPU runs."""
    variant = blockmm.chosen_variant()
    library = folder / f"kernel-ab-{variant}.so"
    build_module.compile_sources(folder, variant, library)
    return blockmm.Kernel(ctypes.CDLL(str(library.resolve())), variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", type=Path, help="directories of kernel sources (the first is the baseline)")
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    kernels = {str(folder): build(folder) for folder in args.builds}
    target = load(numerics="fp32")  # the default file's transformers model, on the block forms
    target.numerics = "int8"
    built = list(target.decoder._on_kernel)  # every BlockLinear and NativeLayer of the fast path
    layers = [o for o in built if isinstance(o, NativeLayer)]
    linears = [o for o in built if isinstance(o, BlockLinear)]
    assert layers and linears, "the default model should run on the block kernel"
    functions = {name: bind(kernel.library) for name, kernel in kernels.items()}  # decoder_layers
    context = timing_context(args.context, target.vocab_size)
    target.reset()
    target.forward(context, last_only=True)
    times: dict[tuple[str, int], list[float]] = {(name, width): [] for name in kernels for width in args.widths}
    order, shuffle = list(kernels), random.Random(0).shuffle
    ends = time.perf_counter() + args.seconds
    while time.perf_counter() < ends:
        shuffle(order)
        for name in order:
            for layer in layers:
                layer.run_many = functions[name]
            for linear in linears:
                linear.kernel = kernels[name]
            for width in args.widths:
                started = time.perf_counter()
                target.forward(context[:width])
                times[(name, width)].append(time.perf_counter() - started)
                target.crop(len(context))
    baseline = str(args.builds[0])
    for width in args.widths:
        medians = {name: statistics.median(times[(name, width)]) for name in kernels}
        print(f"width {width}: " + "  ".join(
            f"{name} {seconds * 1e3:.2f} ms ({seconds / medians[baseline]:.3f}x, {len(times[(name, width)])} forwards)"
            for name, seconds in medians.items()))


if __name__ == "__main__":
    main()
