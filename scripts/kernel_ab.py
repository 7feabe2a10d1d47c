"""Builds of the C kernels timed side by side in one process, for kernel edits on a noisy machine.

Each directory given holds copies of src/verispec/runtime/kernels/ (the `*.c` and `*.h`), some
edited; each is compiled, into its directory, with the flags of the instruction-set variant this
CPU runs (`build.compile_sources`, as the package compiles it). The builds take turns in a
shuffled order per round, so that the machine's drift (other tenants, clock changes) falls on
every build alike: timings between separate processes on a shared 2-vCPU machine differed by
10-30% run to run, and alternating makes differences of a few percent visible.

    mkdir -p /tmp/a /tmp/b && cp src/verispec/runtime/kernels/*.[ch] /tmp/a && cp /tmp/a/*.[ch] /tmp/b
    (edit /tmp/b/*.c)

`product`: the GGUF-block kernel (`qmatmul.c`) alone. For each shape and row count M, every
build multiplies the same random blocks by the same activations, which each build quantizes
itself, in the form it reads (`qmm_quantize_super` for the K-quants where the build has it), so
builds of different numerics can be timed side by side. The table gives each build's fastest
call (ms and G multiply-adds per second), its ratio to the first build, and whether its output
has the first build's bits (an edit meant to keep the numerics must print "same"). Shapes are
Qwen2.5-1.5B's and two of the embedded Gemma 3 270M's ("gemma-*"); "q4l3" (4096 x 1536 Q4_K,
3.5 MB) stays in the last-level cache, so it times the arithmetic rather than the memory.
`--variant amx-emulated` times the tile path's emulation.

    python scripts/kernel_ab.py product /tmp/a /tmp/b --rows 1,3,8 --shapes q4l3,q6k --threads 1

`forward`: whole forwards of the default model (its transformers form on the int8 block forms,
the fast path), loaded once; before every forward its decoder layers and block linears are
switched to one of the builds. With `--model FILE.gguf`, forwards of that file on its own blocks
(every layer in C, `numerics gguf`): its layers' C function and its head's kernel are switched.
Prints, per verify width, the median forward time of each build, its ratio to the first build's,
and whether every build's logits have the first build's bits ("same"; an edit meant to keep the
numerics must print it).

    python scripts/kernel_ab.py forward /tmp/a /tmp/b --widths 1 8 --seconds 120 [--model M.gguf]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from verispec.runtime import blockmm, qmatmul
from verispec.runtime.build import BUILDS, compile_sources

SHAPES = {  # name: (type, N outputs, K inputs)
    "q4k": ("Q4_K", 8960, 1536), "q4l3": ("Q4_K", 4096, 1536), "q5k": ("Q5_K", 8960, 1536),
    "q6k": ("Q6_K", 1536, 8960), "head": ("Q6_K", 16384, 1536),
    "q8": ("Q8_0", 8960, 1536), "q50": ("Q5_0", 8960, 1536), "q40": ("Q4_0", 8960, 1536),
    "gemma-head": ("Q8_0", 262144, 640), "gemma-up": ("Q5_0", 2048, 640),  # the embedded Gemma 3 270M's
}
P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


# -- product: the GGUF-block kernel alone ----------------------------------------------------------

def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a type: random bits, float16 scales of a sane size where they lie."""
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = [(0, 2), (2, 4)] if type_name in ("Q4_K", "Q5_K") else [(208, 210)] if type_name == "Q6_K" else [(0, 2)]
    for low, high in fields:
        raw[:, :, low:high] = rng.uniform(1e-4, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def product_library(folder: Path, variant: str) -> ctypes.CDLL:
    library = folder / f"qmatmul-ab-{variant}.so"
    compile_sources(folder, variant, library, sources=("qmatmul.c",))
    lib = ctypes.CDLL(str(library))
    lib.qmm_quantize.argtypes = [P, I64, I64, P, P, P, P, INT]
    if hasattr(lib, "qmm_quantize_super"):
        lib.qmm_quantize_super.argtypes = [P, I64, I64, P, P, P, P, INT]
    lib.qmm_matmul.argtypes = [P, P, P, P, P, I64, I64, P, INT, I64, P, I64, INT]
    return lib


def quantized(library: ctypes.CDLL, type_name: str, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """x [m, k] quantized by `library` in the form its kernel reads for `type_name`."""
    m, k = x.shape
    xq, xs = np.zeros((m, k), np.int8), np.zeros((m, k // 32), np.float32)
    xo, xsum = np.zeros_like(xs), np.zeros((m, k // 16), np.int32)
    quantize = library.qmm_quantize
    if type_name.endswith("_K") and hasattr(library, "qmm_quantize_super"):
        quantize = library.qmm_quantize_super
    quantize(x.ctypes.data, m, k, xq.ctypes.data, xs.ctypes.data, xo.ctypes.data, xsum.ctypes.data, 1)
    return xq, xs, xo, xsum


def product(args) -> None:
    variant = args.variant or blockmm.chosen_variant()
    libraries = [product_library(folder, variant) for folder in args.builds]
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        type_name, n, k = SHAPES[shape]
        w = random_blocks(type_name, n, k, rng)
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            forms = [quantized(library, type_name, x) for library in libraries]
            outputs = [np.zeros((m, n), np.float32) for _ in libraries]
            best = [float("inf")] * len(libraries)
            for _ in range(args.rounds):
                order = list(range(len(libraries)))
                random.shuffle(order)
                for i in order:
                    start = time.perf_counter()
                    libraries[i].qmm_matmul(None, *(a.ctypes.data for a in forms[i]), m, k, w.ctypes.data,
                                            qmatmul.TYPES[type_name], n, outputs[i].ctypes.data, n, args.threads)
                    best[i] = min(best[i], time.perf_counter() - start)
            cells = [f"{t * 1e3:8.3f} ms {m * n * k / t / 1e9:6.1f} GMAC/s {t / best[0]:5.3f}x" for t in best]
            same = all(np.array_equal(outputs[0].view(np.int32), y.view(np.int32)) for y in outputs)
            print(f"{shape:5s} M={m:3d}  " + "  |  ".join(cells) + ("  same" if same else "  DIFFERENT"), flush=True)


# -- forward: whole forwards of the default model --------------------------------------------------

def forward_kernel(folder: Path) -> blockmm.Kernel:
    """The kernels of `folder`'s sources, compiled as blockmm builds the variant this CPU runs."""
    variant = blockmm.chosen_variant()
    library = folder / f"kernel-ab-{variant}.so"
    compile_sources(folder, variant, library)
    return blockmm.Kernel(ctypes.CDLL(str(library.resolve())), variant)


def forward(args) -> None:
    from verispec.bench.profile import timing_context
    from verispec.runtime.gguf_decoder import GgufDecoder
    from verispec.runtime.linear import BlockLinear
    from verispec.runtime.native_layer import NativeLayer, bind
    from verispec.target.loading import load

    kernels = {str(folder): forward_kernel(folder) for folder in args.builds}
    functions = {name: bind(kernel.library) for name, kernel in kernels.items()}  # decoder_layers
    if args.model:  # a GGUF file on its own blocks: switch its layers' function and its head's kernel
        target = load(args.model)
        decoder = target.decoder
        assert isinstance(decoder, GgufDecoder), f"{args.model} does not run on its own blocks here"
        layers, linears = decoder.layers, [decoder.head]
        qkernels = {name: qmatmul.wrap(kernel) for name, kernel in kernels.items()}
    else:
        target = load(numerics="fp32")  # the default file's transformers model, on the block forms
        target.numerics = "int8"
        built = list(target.decoder._on_kernel)  # every BlockLinear and NativeLayer of the fast path
        layers = [o for o in built if isinstance(o, NativeLayer)]
        linears = [o for o in built if isinstance(o, BlockLinear)]
        assert layers and linears, "the default model should run on the block kernel"
        qkernels = kernels
    context = timing_context(args.context, target.vocab_size)
    target.reset()
    target.forward(context, last_only=True)
    times: dict[tuple[str, int], list[float]] = {(name, width): [] for name in kernels for width in args.widths}
    logits: dict[tuple[str, int], torch.Tensor] = {}  # each build's first output per width
    order, shuffle = list(kernels), random.Random(0).shuffle
    ends = time.perf_counter() + args.seconds
    while time.perf_counter() < ends:
        shuffle(order)
        for name in order:
            for layer in layers:
                layer.run_many = functions[name]
            for linear in linears:
                linear.kernel = qkernels[name]
            for width in args.widths:
                started = time.perf_counter()
                out = target.forward(context[:width])
                times[(name, width)].append(time.perf_counter() - started)
                logits.setdefault((name, width), out.clone())
                target.crop(len(context))
    baseline = str(args.builds[0])
    for width in args.widths:
        medians = {name: statistics.median(times[(name, width)]) for name in kernels}
        same = all(torch.equal(logits[(name, width)], logits[(baseline, width)]) for name in kernels)
        print(f"width {width}: " + "  ".join(
            f"{name} {seconds * 1e3:.2f} ms ({seconds / medians[baseline]:.3f}x, {len(times[(name, width)])} forwards)"
            for name, seconds in medians.items()) + ("  same" if same else "  DIFFERENT"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("product", help="the GGUF-block kernel alone, on random blocks")
    one.add_argument("builds", nargs="+", type=Path, help="directories of kernel sources (the first is the baseline)")
    one.add_argument("--rows", default="1,3,8")
    one.add_argument("--shapes", default="q4k,q6k,head", help=f"of {', '.join(SHAPES)}")
    one.add_argument("--threads", type=int, default=1)
    one.add_argument("--rounds", type=int, default=15)
    one.add_argument("--variant", choices=list(BUILDS), default=None,
                     help="the build's flags (default: the variant this CPU runs; amx-emulated times the tile path)")
    whole = commands.add_parser("forward", help="whole forwards of the default model")
    whole.add_argument("builds", nargs="+", type=Path, help="directories of kernel sources (the first is the baseline)")
    whole.add_argument("--widths", nargs="+", type=int, default=[1, 8])
    whole.add_argument("--context", type=int, default=256)
    whole.add_argument("--seconds", type=float, default=120.0)
    whole.add_argument("--model", default=None, help="a GGUF file to run on its own blocks (default: the embedded model)")
    args = parser.parse_args()
    (product if args.command == "product" else forward)(args)


if __name__ == "__main__":
    main()
