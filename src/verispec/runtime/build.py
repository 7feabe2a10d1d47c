"""Building the kernel library: which instruction-set variants exist, which this CPU runs, and
compiling one of them with the system C compiler (never `-march=native`).

Owns the build and nothing else (loading and calling the library is `blockmm`'s): the C sources
(`SOURCES`, compiled into one shared library) and the files they include (`INCLUDED`: the headers
and the per-instruction-set files that `qmatmul.c` includes, see kernels/isa.h), the common compiler
flags (`FLAGS`), the variants (`VARIANTS`, best first, each with its compiler flags and the
/proc/cpuinfo flags a CPU needs to run it) and the test-only builds (`TEST_BUILDS`). The public
entry points, used by `blockmm`, `qmatmul`, the C decoder layer's loader and the scripts:

- `compiler()`: the C compiler (`$CC`, else cc or gcc), or None;
- `variant_flags(variant)`: the compiler flags of a variant (FLAGS and its own);
- `compile_library(variant)`: the shared library of a variant, compiled once per variant, compiler
  and source text into the cache, then reused;
- `compile_sources(folder, variant, output)`: a folder's copy of the sources compiled as a variant
  (scripts/kernel_ab.py);
- `cpu_flags()` (`probe_flags()` where /proc/cpuinfo is missing) and `supported_variants()`: what
  this CPU runs.

"amx" needs, besides the CPU flags, the kernel's grant of the tile data state (`arch_prctl
(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which only the loaded library can ask for
(`qmm_tiles_init` in kernels/qmatmul.c): `blockmm` falls back to the next variant where it is refused.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

SOURCES = ("blockmm.c", "blockmm_int8.c", "decoder_layer.c", "qmatmul.c")  # compiled into one library
# Included by the sources (never compiled on their own): part of the build's key and copied beside them.
INCLUDED = ("kernels.h", "numerics.h", "isa.h", "amx.h", "quants.h", "qmatmul_avx2.c", "qmatmul_portable.c",
            "qmatmul_amx.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Wl,-Bsymbolic")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512VNNI = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", *_AVX2)
_AVX512VNNI_CPU = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c")
# Instruction-set variants, best first: the compiler flags of each and the /proc/cpuinfo flags the
# CPU must report to run it ("amx" also needs the kernel's grant of tile data, see the docstring).
VARIANTS = {
    "amx": ((*_AVX512VNNI, "-mamx-tile", "-mamx-int8"), (*_AVX512VNNI_CPU, "amx_tile", "amx_int8")),
    "avx512vnni": (_AVX512VNNI, _AVX512VNNI_CPU),
    "avxvnni": ((*_AVX2, "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (_AVX2, ("avx2", "fma", "f16c")),
    "portable": ((), ()),
}
# Builds never chosen for running, only for tests (`VERISPEC_KERNEL_ISA` can force them): on an AVX2
# CPU, "vnni-emulated" compiles the VNNI code paths with vpdpbusd computed exactly from AVX2
# instructions, "amx-emulated" the AMX tile path of wide forwards with the tile operations computed
# in portable C (kernels/amx.h) over that emulated VNNI (as the real "amx" build has AVX-512 VNNI),
# so that a machine without VNNI or AMX checks their logic bit for bit.
TEST_BUILDS = {
    "vnni-emulated": ((*_AVX2, "-DBLOCKMM_EMULATE_VNNI"), ("avx2", "fma", "f16c")),
    "amx-emulated": ((*_AVX2, "-DBLOCKMM_EMULATE_VNNI", "-DBLOCKMM_EMULATE_AMX"), ("avx2", "fma", "f16c")),
}
BUILDS = {**VARIANTS, **TEST_BUILDS}
_state: dict = {}


def cache_dir() -> Path:
    from ..paths import cache_root

    return cache_root() / "kernels"


def compiler() -> str | None:
    """The C compiler: `$CC`, else cc or gcc on the PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def variant_flags(variant: str) -> tuple[str, ...]:
    """The compiler flags of a variant (a key of VARIANTS or TEST_BUILDS): FLAGS, then its own."""
    return (*FLAGS, *BUILDS[variant][0])


_PROBE = r"""
#include <stdio.h>
int main(void) {
    __builtin_cpu_init();
    const char *flags[] = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                           "amx_tile", "amx_int8"};
    int has[10] = {__builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"), __builtin_cpu_supports("f16c"),
                  __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"),
                  __builtin_cpu_supports("avx512vl"), __builtin_cpu_supports("avx512vnni"),
#if defined(__GNUC__) && __GNUC__ >= 11
                  __builtin_cpu_supports("avxvnni"),
#else
                  0,
#endif
#if defined(__GNUC__) && __GNUC__ >= 12
                  __builtin_cpu_supports("amx-tile"), __builtin_cpu_supports("amx-int8")
#else
                  0, 0
#endif
    };
    for (int i = 0; i < 10; i++) if (has[i]) printf("%s ", flags[i]);
    return 0;
}
"""


def probe_flags() -> frozenset[str]:
    """The flags of VARIANTS that `__builtin_cpu_supports` reports, from a compiled probe (empty
    without a compiler or on a failure)."""
    found = compiler()
    if found is None:
        return frozenset()
    try:
        with tempfile.TemporaryDirectory() as folder:
            source, program = Path(folder) / "probe.c", Path(folder) / "probe"
            source.write_text(_PROBE)
            subprocess.run([found, str(source), "-o", str(program)], check=True, capture_output=True)
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
            flags = probe_flags()
        _state["flags"] = flags
    return _state["flags"]


def supported_variants(flags: frozenset[str] | None = None) -> list[str]:
    """The variants this CPU can run, best first ("portable" always)."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, (_, needed) in VARIANTS.items() if set(needed) <= flags]


def source_texts() -> dict[str, str]:
    """The package's kernel sources and included files, by file name."""
    folder = resources.files("verispec.runtime.kernels")
    return {name: folder.joinpath(name).read_text() for name in (*SOURCES, *INCLUDED)}


def compile_sources(folder: Path, variant: str, output: Path, sources: tuple[str, ...] = SOURCES,
                    found: str | None = None) -> None:
    """Compile `sources` (file names in `folder`, with the files they include beside them) as
    `variant` into the shared library `output`. Raises RuntimeError if the compiler fails."""
    found = found or compiler()
    if found is None:
        raise RuntimeError("no C compiler (cc) found")
    result = subprocess.run([found, *variant_flags(variant), *(str(Path(folder) / name) for name in sources),
                             "-o", str(output), "-lm"], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{found} failed: {result.stderr.strip()[:500]}")


def compile_library(variant: str, found: str | None = None) -> Path:
    """The shared library of `variant` (a key of VARIANTS or TEST_BUILDS), compiled once per variant, compiler and
    source text, then cached. Compiling does not need a CPU that runs the variant (loading and
    calling it does). Raises RuntimeError if the compiler fails."""
    found = found or compiler()
    if found is None:
        raise RuntimeError("no C compiler (cc) found")
    sources = source_texts()
    flags = variant_flags(variant)
    key = hashlib.sha256("|".join([*sources.values(), found, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"blockmm-{variant}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        for name, text in sources.items():
            (Path(staging) / name).write_text(text)
        built = Path(staging) / target.name
        compile_sources(Path(staging), variant, built, found=found)
        os.replace(built, target)  # atomic: a concurrent build either wins or finds it done
    return target
