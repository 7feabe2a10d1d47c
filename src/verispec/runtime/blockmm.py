"""The block-weight matrix multiply: y = x W^T computed on W's int8 block form.

Owns one thing: loading (the build is `build`'s: variants, flags, compiling) and
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

The library is compiled for one instruction-set variant (`build.VARIANTS`), chosen at run time
from the flags the CPU reports (never `-march=native`): AMX (where the kernel also grants the tile
data; else the next), AVX-512 VNNI, AVX-VNNI, AVX2+FMA+F16C, or portable C. `VERISPEC_KERNEL_ISA`
forces one, or a test build (a variant this CPU cannot run is refused with the reason);
`kernel_isa()` says which one runs, `kernel_path()` the same in words for `verispec info`. Without
a C compiler, `kernel()` returns None with the reason and callers keep their float32 path. The
same library holds the C decoder layer (`kernels/decoder_layer.c`, called by `native_layer`) and
the GGUF-block kernels (`kernels/qmatmul.c`, called by `qmatmul`).
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import build
# The build (variants, flags, compiling) is `build`'s; these names stay here for existing callers.
from .build import (  # noqa: F401
    BUILDS as _BUILDS, FLAGS, INCLUDED as HEADERS, SOURCES, TEST_BUILDS, VARIANTS, cpu_flags, supported_variants,
)

_probe_flags = build.probe_flags

NUMERICS = ("int8", "fp32")
ISA_ENV = "VERISPEC_KERNEL_ISA"
_state: dict = {}
_variants: dict = {}  # variant name -> Kernel, or the reason it is unavailable (str)


def _compiler() -> str | None:
    return build.compiler()


def build_variant(variant: str, compiler: str | None = None):
    """`build.compile_library` (kept for existing callers)."""
    return build.compile_library(variant, compiler)


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
        # 0: the AMX tile path is ready (real tiles granted by the kernel, or emulated); -1: not an
        # AMX build (or sources from before the tile path: scripts/kernel_ab.py); -2: the kernel
        # refused the tile data (arch_prctl ARCH_REQ_XCOMP_PERM)
        self.tiles = -1
        if hasattr(library, "qmm_tiles_init"):
            library.qmm_tiles_init.restype = ctypes.c_int
            self.tiles = library.qmm_tiles_init()

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
                    found = Kernel(ctypes.CDLL(str(build.compile_library(variant))), variant)
                    _variants[variant] = found
                    if variant == "amx" and found.tiles != 0:
                        _variants[variant] = ("the kernel did not grant the AMX tile data "
                                              "(arch_prctl ARCH_REQ_XCOMP_PERM refused)")
                except (OSError, RuntimeError) as error:
                    _variants[variant] = f"could not build the block kernel: {error}"
    found = _variants[variant]
    return (None, found) if isinstance(found, str) else (found, None)


def chosen_variant() -> str:
    """The variant `kernel()` loads: `VERISPEC_KERNEL_ISA` if set, else the best this CPU runs (the
    first of `supported_variants()` that loads: "amx" only where the kernel grants the tiles)."""
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        return forced
    found, _ = kernel()
    return found.isa if found is not None else supported_variants()[0]


def kernel() -> tuple[Kernel | None, str | None]:
    """(the kernel, None), or (None, why it is unavailable). Built once per machine and variant
    (the forced one, else the best this CPU runs that loads), then cached."""
    if "kernel" not in _state:
        forced = os.environ.get(ISA_ENV, "").strip().lower()
        if os.environ.get("VERISPEC_NO_BLOCK_KERNEL"):
            _state["kernel"] = (None, "disabled by VERISPEC_NO_BLOCK_KERNEL")
        elif build.compiler() is None:
            _state["kernel"] = (None, "no C compiler (cc) found")
        elif forced:
            found, why = load_variant(forced)
            _state["kernel"] = (found, None if why is None else f"{ISA_ENV}={forced}: {why}")
        else:
            skipped = {}
            for variant in supported_variants():
                found, why = load_variant(variant)
                if found is not None:
                    break
                skipped[variant] = why
            _state["kernel"] = (found, why)
            _state["skipped"] = skipped
    return _state["kernel"]


def kernel_isa() -> str | None:
    """The instruction-set variant the block kernel runs ("amx", "avx512vnni", "avxvnni", "avx2" or
    "portable", or a forced test build), or None where it does not run (see `kernel()` for why)."""
    found, _ = kernel()
    return None if found is None else found.isa


def kernel_path() -> str:
    """Which kernel path runs, in words, e.g. "avx2 (AMX: no; VNNI: no)": the variant, whether wide
    forwards use AMX tiles ("yes, tiles granted", "emulated", "no", or "not used: why" where the CPU
    has them but the kernel did not grant the tile data or the build failed) and whether products
    use VNNI."""
    found, why = kernel()
    if found is None:
        return f"none ({why})"
    isa = found.isa
    if isa == "amx":
        amx = "yes, tiles granted"
    elif isa == "amx-emulated":
        amx = "emulated"
    elif "amx" in _state.get("skipped", {}):
        amx = f"not used: {_state['skipped']['amx']}"
    else:
        amx = "no"
    vnni = "yes" if isa in ("amx", "avx512vnni", "avxvnni") else "emulated" if isa in ("vnni-emulated", "amx-emulated") else "no"
    return f"{isa} (AMX: {amx}; VNNI: {vnni})"
