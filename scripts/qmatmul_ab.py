"""Builds of the GGUF-block kernel (`qmatmul.c`) timed side by side in one process, for kernel edits.

Each directory given holds a `qmatmul.c` (a copy of src/verispec/runtime/kernels/qmatmul.c, some
edited) and the files it includes (`kernels/*.h` and the per-instruction-set `qmatmul_*.c`); each is
compiled alone into that directory with the flags of the instruction-set variant this CPU runs, or
`--variant`'s (`build.compile_sources`, as the package compiles it). For each
shape and row count M, every build multiplies the same random blocks by the same activations,
which each build quantizes itself, in the form it reads (`qmm_quantize_super` for the K-quants
where the build has it), so builds of different numerics can be timed side by side. The builds
take turns in a shuffled order per round so that the machine's drift falls on all of them; the
table gives each build's fastest call (ms and G multiply-adds per second), its ratio to the first
build, and whether its output has the first build's bits (an edit meant to keep the numerics must
print "same"). Shapes are Qwen2.5-1.5B's and two of the embedded Gemma 3 270M's ("gemma-*");
"q4l3" (4096 x 1536 Q4_K, 3.5 MB) stays in the last-level cache, so it times the arithmetic
rather than the memory.

    mkdir -p /tmp/a /tmp/b && cp src/verispec/runtime/kernels/{qmatmul*.c,*.h} /tmp/a && cp /tmp/a/* /tmp/b
    (edit /tmp/b/qmatmul.c)
    python scripts/qmatmul_ab.py /tmp/a /tmp/b --rows 1,3,8 --shapes q4l3,q6k --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time
from pathlib import Path

import numpy as np

from verispec.runtime import blockmm, qmatmul
from verispec.runtime.build import BUILDS, compile_sources

SHAPES = {  # name: (type, N outputs, K inputs)
    "q4k": ("Q4_K", 8960, 1536), "q4l3": ("Q4_K", 4096, 1536), "q5k": ("Q5_K", 8960, 1536),
    "q6k": ("Q6_K", 1536, 8960), "head": ("Q6_K", 16384, 1536),
    "q8": ("Q8_0", 8960, 1536), "q50": ("Q5_0", 8960, 1536), "q40": ("Q4_0", 8960, 1536),
    "gemma-head": ("Q8_0", 262144, 640), "gemma-up": ("Q5_0", 2048, 640),  # the embedded Gemma 3 270M's
}
P, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random valid blocks of a type: random bits, float16 scales of a sane size."""
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = [(0, 2), (2, 4)] if type_name in ("Q4_K", "Q5_K") else [(208, 210)] if type_name == "Q6_K" else [(0, 2)]
    for low, high in fields:
        raw[:, :, low:high] = rng.uniform(1e-4, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def build(folder: Path, variant: str) -> ctypes.CDLL:
    library = folder / f"qmatmul-ab-{variant}.so"
    compile_sources(folder, variant, library, sources=("qmatmul.c",))
    lib = ctypes.CDLL(str(library))
    lib.qmm_quantize.argtypes = [P, I64, I64, P, P, P, P, INT]
    if hasattr(lib, "qmm_quantize_super"):
        lib.qmm_quantize_super.argtypes = [P, I64, I64, P, P, P, P, INT]
    lib.qmm_matmul.argtypes = [P, P, P, P, P, I64, I64, P, INT, I64, P, I64, INT]
    return lib


def weights(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks: random bits, float16 scales of a sane size."""
    if type_name.endswith("_K"):
        return random_blocks(type_name, rows, cols, int(rng.integers(1 << 30)))
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    raw[:, :, 0:2] = rng.uniform(1e-4, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--rows", default="1,3,8")
    parser.add_argument("--shapes", default="q4k,q6k,head", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--variant", choices=list(BUILDS), default=None,
                        help="the build's flags (default: the variant this CPU runs; amx-emulated times the tile path)")
    args = parser.parse_args()
    variant = args.variant or blockmm.chosen_variant()
    libraries = [build(folder, variant) for folder in args.folders]
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        type_name, n, k = SHAPES[shape]
        w = weights(type_name, n, k, rng)
        for m in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            forms = []
            for library in libraries:
                xq, xs = np.zeros((m, k), np.int8), np.zeros((m, k // 32), np.float32)
                xo, xsum = np.zeros_like(xs), np.zeros((m, k // 16), np.int32)
                quantize = library.qmm_quantize
                if type_name.endswith("_K") and hasattr(library, "qmm_quantize_super"):
                    quantize = library.qmm_quantize_super
                quantize(x.ctypes.data, m, k, xq.ctypes.data, xs.ctypes.data, xo.ctypes.data, xsum.ctypes.data, 1)
                forms.append((xq, xs, xo, xsum))
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


if __name__ == "__main__":
    main()
