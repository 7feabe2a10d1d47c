"""The block-weight matrix multiply: y = x W^T computed on W's int8 block form.

Owns one thing: building (once per machine and instruction set, with the system C compiler) and
calling the C kernels, which multiply activations by a weight matrix stored as int8 codes with a
float32 scale (and offset) per block of inputs, in two numerics:

- "fp32" (`kernels/blockmm.c`): float32 activations times the weights rebuilt in float32 inside
  the kernel exactly as `gguf.blocks.BlockWeights.dequantize` rebuilds them, so the result equals
  `x @ W^T` up to the order of float32 sums; it reads 1 byte per weight instead of 4, which is
  what a memory-bound one-token step pays for (scripts/profile_step.py measures it).
- "int8" (`kernels/blockmm_int8.c`): each row of activations quantized per block (symmetric int8,
  a float32 scale per row and block from that row alone), exact integer products with the weight
  codes (in `gguf.blocks.PackedBlocks`' layout: 8 outputs per vector lane group, no horizontal
  sums; codes of a range of at most 129 values stored unsigned, u = code + code_bias, and summed
  as sum(u * x) - code_bias * sum(x), wider ones as signed int8), then one float32 multiply-add per
  block in block order: batch-invariant (a row's result does not depend on the other rows, the
  thread count or the instruction set), bit for bit.

The library is compiled for one instruction-set variant (`VARIANTS`), chosen at run time from
the flags the CPU reports (never `-march=native`): AVX-512 VNNI, AVX-VNNI, AVX2+FMA+F16C, or
portable C. `VERISPEC_KERNEL_ISA` forces one (a variant this CPU cannot run is refused with the
reason); `kernel_isa()` says which one runs. Without a C compiler, `kernel()` returns None with
the reason and callers keep their float32 path. The same library holds the C decoder layer
(`kernels/decoder_layer.c`, called by `native_layer`).
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

SOURCES = ("blockmm.c", "blockmm_int8.c", "decoder_layer.c", "qmatmul.c")  # compiled into one library
HEADERS = ("kernels.h", "numerics.h")  # included by the sources: part of the build's key and copied beside them
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Wl,-Bsymbolic")
# Instruction-set variants, best first: the compiler flags of each and the /proc/cpuinfo flags
# the CPU must report to run it.
VARIANTS = {
    "avx512vnni": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
                   ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")),
    "avxvnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "portable": ((), ()),
}
# Builds never chosen for running, only for tests: "vnni-emulated" compiles the VNNI code paths
# for an AVX2 CPU, with vpdpbusd computed exactly from AVX2 instructions (slower than "avx2"), so
# that a machine without VNNI checks their logic bit for bit; `VERISPEC_KERNEL_ISA` can force it.
TEST_BUILDS = {
    "vnni-emulated": (("-mavx2", "-mfma", "-mf16c", "-DBLOCKMM_EMULATE_VNNI"), ("avx2", "fma", "f16c")),
}
_BUILDS = {**VARIANTS, **TEST_BUILDS}
NUMERICS = ("int8", "fp32")
ISA_ENV = "VERISPEC_KERNEL_ISA"
_state: dict = {}
_variants: dict = {}  # variant name -> Kernel, or the reason it is unavailable (str)


def _cache_dir() -> Path:
    from ..paths import cache_root

    return cache_root() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


_PROBE = r"""
#include <stdio.h>
int main(void) {
    __builtin_cpu_init();
    const char *flags[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni"};
    int has[8] = {__builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"), __builtin_cpu_supports("f16c"),
                  __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"),
                  __builtin_cpu_supports("avx512vl"), __builtin_cpu_supports("avx512vnni"),
#if defined(__GNUC__) && __GNUC__ >= 11
                  __builtin_cpu_supports("avxvnni")
#else
                  0
#endif
    };
    for (int i = 0; i < 8; i++) if (has[i]) printf("%s ", flags[i]);
    return 0;
}
"""


def _probe_flags() -> frozenset[str]:
    """The flags of VARIANTS that `__builtin_cpu_supports` reports, from a compiled probe (empty
    without a compiler or on a failure)."""
    compiler = _compiler()
    if compiler is None:
        return frozenset()
    try:
        with tempfile.TemporaryDirectory() as folder:
            source, program = Path(folder) / "probe.c", Path(folder) / "probe"
            source.write_text(_PROBE)
            subprocess.run([compiler, str(source), "-o", str(program)], check=True, capture_output=True)
            return frozenset(subprocess.run([str(program)], capture_output=True, text=True).stdout.split())
    except (OSError, subprocess.CalledProcessError):
        return frozenset()


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags the CPU reports (/proc/cpuinfo, else a compiled probe using
    `__builtin_cpu_supports` on x86; empty if neither is available: only the portable variant runs)."""
    if "flags" not in _state:
        flags: frozenset[str] = frozenset()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
            flags = frozenset(line.partition(":")[2].split())
        elif platform.machine().lower() in ("x86_64", "amd64"):
            flags = _probe_flags()
        _state["flags"] = flags
    return _state["flags"]


def supported_variants(flags: frozenset[str] | None = None) -> list[str]:
    """The variants this CPU can run, best first ("portable" always)."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, (_, needed) in VARIANTS.items() if set(needed) <= flags]


def build_variant(variant: str, compiler: str | None = None) -> Path:
    """The shared library of `variant` (a key of VARIANTS or TEST_BUILDS), compiled once per variant, compiler and
    source text, then cached. Compiling does not need a CPU that runs the variant (loading and
    calling it does). Raises RuntimeError if the compiler fails."""
    compiler = compiler or _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc) found")
    folder = resources.files("verispec.runtime.kernels")
    sources = {name: folder.joinpath(name).read_text() for name in (*SOURCES, *HEADERS)}
    flags = (*FLAGS, *_BUILDS[variant][0])
    key = hashlib.sha256("|".join([*sources.values(), compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"blockmm-{variant}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        for name, text in sources.items():
            (Path(staging) / name).write_text(text)
        paths = [Path(staging) / name for name in SOURCES]
        built = Path(staging) / target.name
        result = subprocess.run([compiler, *flags, *map(str, paths), "-o", str(built), "-lm"], capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: a concurrent build either wins or finds it done
    return target


class Kernel:
    """The loaded C kernels of one instruction-set variant (`isa`); `matmul` is the entry point."""

    def __init__(self, library: ctypes.CDLL, isa: str = "unknown"):
        self.library = library  # also holds `decoder_layer` (native_layer.py)
        self.isa = isa
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._fns = {"fp32": library.blockmm, "int8": library.blockmm_int8}
        for fn in self._fns.values():
            fn.restype = ctypes.c_int
        # x, M, K, codes, scales, offsets, N, B, (int8: code_bias, code_span, half_scales,) y, threads
        library.blockmm.argtypes = [pointer, size, size, pointer, pointer, pointer, size, size, pointer, ctypes.c_int]
        library.blockmm_int8.argtypes = [pointer, size, size, pointer, pointer, pointer, size, size, ctypes.c_int,
                                         ctypes.c_int, ctypes.c_int, pointer, ctypes.c_int]
        compiled = library.blockmm_isa
        compiled.restype = ctypes.c_char_p
        self.compiled_isa = compiled().decode()  # what the C preprocessor saw: "avx512vnni", ..., "portable"

    def matmul(self, x: torch.Tensor, form, numerics: str = "fp32") -> torch.Tensor:
        """x [m, in] float32 times the block-form weights `form` (`gguf.blocks.BlockWeights`,
        [out, in]) -> [m, out] float32, in `numerics` "fp32" or "int8" (see the module docstring;
        int8 reads the form's packed layout, `form.packed`)."""
        assert x.dtype == torch.float32 and form.codes.dtype == torch.int8 and form.scales.dtype == torch.float32
        x = x.contiguous()
        m, inputs = x.shape
        outputs = form.codes.shape[0]
        assert form.codes.shape[1] == inputs and inputs % form.block == 0
        assert form.scales.shape == (outputs, inputs // form.block), "scales must be [out, in // block]"
        weights = form.packed if numerics == "int8" else form
        codes, scales, offsets = weights.codes, weights.scales, weights.offsets
        assert codes.is_contiguous() and scales.is_contiguous() and (offsets is None or offsets.is_contiguous())
        y = torch.empty(m, outputs, dtype=torch.float32)
        form_arguments = () if numerics == "fp32" else weights.kernel_form
        status = self._fns[numerics](
            x.data_ptr(), m, inputs, codes.data_ptr(), scales.data_ptr(),
            None if offsets is None else offsets.data_ptr(), outputs, form.block, *form_arguments, y.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"blockmm kernel refused its arguments (status {status}): m={m}, in={inputs}, block={form.block}")
        return y


def load_variant(variant: str) -> tuple[Kernel | None, str | None]:
    """(the kernel of `variant`, None), or (None, why it cannot run here): an unknown name, a
    CPU without the variant's instructions, no compiler, a failed build. Cached per variant."""
    if variant not in _variants:
        if variant not in _BUILDS:
            _variants[variant] = f"unknown kernel variant {variant!r} (choose one of {', '.join(VARIANTS)})"
        else:
            missing = sorted(set(_BUILDS[variant][1]) - cpu_flags())
            if missing:
                _variants[variant] = (f"this CPU cannot run the {variant} kernel variant (it lacks "
                                      f"{', '.join(missing)}; it runs {', '.join(supported_variants())})")
            else:
                try:
                    _variants[variant] = Kernel(ctypes.CDLL(str(build_variant(variant))), variant)
                except (OSError, RuntimeError) as error:
                    _variants[variant] = f"could not build the block kernel: {error}"
    found = _variants[variant]
    return (None, found) if isinstance(found, str) else (found, None)


def chosen_variant() -> str:
    """The variant `kernel()` loads: `VERISPEC_KERNEL_ISA` if set, else the best this CPU runs."""
    return os.environ.get(ISA_ENV, "").strip().lower() or supported_variants()[0]


def kernel() -> tuple[Kernel | None, str | None]:
    """(the kernel, None), or (None, why it is unavailable). Built once per machine and variant
    (`chosen_variant`), then cached."""
    if "kernel" not in _state:
        if os.environ.get("VERISPEC_NO_BLOCK_KERNEL"):
            _state["kernel"] = (None, "disabled by VERISPEC_NO_BLOCK_KERNEL")
        elif _compiler() is None:
            _state["kernel"] = (None, "no C compiler (cc) found")
        else:
            variant = chosen_variant()
            found, why = load_variant(variant)
            if why is not None and os.environ.get(ISA_ENV):
                why = f"{ISA_ENV}={variant}: {why}"
            _state["kernel"] = (found, why)
    return _state["kernel"]


def kernel_isa() -> str | None:
    """The instruction-set variant the block kernel runs ("avx512vnni", "avxvnni", "avx2" or
    "portable"), or None where it does not run (see `kernel()` for why)."""
    found, _ = kernel()
    return None if found is None else found.isa
