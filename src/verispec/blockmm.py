"""The block-weight matrix multiply: y = x W^T computed on W's int8 block form.

Owns one thing: building (once per machine, with the system C compiler) and calling the C kernel
`kernels/blockmm.c`, which multiplies float32 activations by a weight matrix stored as int8 codes
with a float32 scale (and offset) per block of inputs. The weights are rebuilt in float32 inside
the kernel exactly as `gguf_blocks.BlockWeights.dequantize` rebuilds them, so the result equals
`x @ W^T` up to the order of float32 sums; it reads 1 byte per weight instead of 4, which is what
a memory-bound one-token step pays for (measured in docs/profile.md).

No library was found that does this exactly: ggml's CPU dot products convert the activations to
8-bit blocks too (its `vec_dot_type`; a different function), and PyTorch's int8 weight kernels
take one scale per output row, not per block. Without a C compiler, `kernel()` returns None
with the reason and callers keep their float32 path. The same library holds the C decoder
layer (`kernels/decoder_layer.c`, called by `native_layer`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

SOURCES = ("blockmm.c", "decoder_layer.c")  # compiled into one library
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_state: dict = {}


def _cache_dir() -> Path:
    from .model import cache_root  # model imports this module

    return cache_root() / "kernels"


def _build(sources: dict[str, str], compiler: str) -> Path:
    """The shared library compiled from `sources` {file name: C text}, cached per machine."""
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    flags_line = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu[:200])
    key = hashlib.sha256("|".join([*sources.values(), compiler, *FLAGS, flags_line]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"blockmm-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        paths = []
        for name, text in sources.items():
            paths.append(Path(staging) / name)
            paths[-1].write_text(text)
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *FLAGS, *map(str, paths), "-o", str(built), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: a concurrent build either wins or finds it done
    return target


class Kernel:
    """The loaded C kernel; `matmul` is the only entry point."""

    def __init__(self, library: ctypes.CDLL):
        self.library = library  # also holds `decoder_layer` (native_layer.py)
        self._fn = library.blockmm
        self._fn.restype = ctypes.c_int
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [pointer, size, size, pointer, pointer, pointer, size, size, pointer, ctypes.c_int]

    def matmul(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               block: int) -> torch.Tensor:
        """x [m, in] float32 times the block-form weights codes [out, in] int8, scales/offsets
        [out, in // block] float32 -> [m, out] float32."""
        assert x.dtype == torch.float32 and codes.dtype == torch.int8 and scales.dtype == torch.float32
        x = x.contiguous()
        m, inputs = x.shape
        outputs = codes.shape[0]
        assert codes.shape[1] == inputs and codes.is_contiguous() and scales.is_contiguous()
        y = torch.empty(m, outputs, dtype=torch.float32)
        status = self._fn(
            x.data_ptr(), m, inputs, codes.data_ptr(), scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(), outputs, block, y.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"blockmm kernel refused its arguments (status {status}): m={m}, in={inputs}, block={block}")
        return y


def kernel() -> tuple[Kernel | None, str | None]:
    """(the kernel, None), or (None, why it is unavailable). Built once per machine, then cached."""
    if "kernel" not in _state:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if os.environ.get("VERISPEC_NO_BLOCK_KERNEL"):
            _state["kernel"] = (None, "disabled by VERISPEC_NO_BLOCK_KERNEL")
        elif compiler is None:
            _state["kernel"] = (None, "no C compiler (cc) found")
        else:
            folder = resources.files("verispec.kernels")
            sources = {name: folder.joinpath(name).read_text() for name in SOURCES}
            try:
                _state["kernel"] = (Kernel(ctypes.CDLL(str(_build(sources, compiler)))), None)
            except (OSError, RuntimeError) as error:
                _state["kernel"] = (None, f"could not build the block kernel: {error}")
    return _state["kernel"]
