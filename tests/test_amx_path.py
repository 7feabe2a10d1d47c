"""The AMX tile path of wide forwards (`kernels/qmatmul_amx.c`, tile operations in `kernels/amx.h`)
and the build's variants for it (`runtime/build.py`, `blockmm.kernel_path`).

This CPU may have no AMX, so the path runs here as the test build "amx-emulated": the same kernel
code over tile operations computed in portable C. A quantized product of M >= `tile_rows` rows
(32) takes the tile path there; it must give, bit for bit, what the default build (the row-wise,
fused and buffered AVX2 / VNNI paths) gives, for every weight type the path supports, any M on
either side of the threshold and any thread count, through `qmm_matmul` and through
`qmm_matmul_parts` (several matrices fed by one input, as the decoder layers call it). On a CPU
with AMX the real tiles are held to the same bits, against that CPU's AVX-512 VNNI build. The real
AMX variant must compile everywhere (not run), and be refused with a reason where the CPU or the kernel
does not grant the tiles, the next variant taking over.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from verispec.runtime import blockmm, build, qmatmul

pytest.importorskip("gguf")
from test_qmatmul import activations, random_raw  # noqa: E402

TILE_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
ROWS = (1, 16, 31, 32, 33, 64)


def kernel_of(variant: str) -> qmatmul.QKernel:
    found, why = qmatmul.load_variant(variant)
    assert found is not None, why
    assert found.compiled_isa == variant
    return found


@pytest.fixture(scope="module")
def emulated() -> qmatmul.QKernel:
    return kernel_of("amx-emulated")


@pytest.fixture(scope="module")
def tile_kernels(emulated) -> list[qmatmul.QKernel]:
    """The builds with the tile path: the emulated one, and on an AMX CPU the real one too."""
    found, _ = qmatmul.kernel()
    return [emulated] + ([found] if found is not None and found.isa == "amx" else [])


@pytest.fixture(scope="module")
def default() -> qmatmul.QKernel:
    """The build this CPU runs, or on an AMX CPU its AVX-512 VNNI build: the paths without tiles."""
    found, why = qmatmul.kernel()
    assert found is not None, why
    return kernel_of("avx512vnni") if found.isa == "amx" else found


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def test_the_emulated_build_has_the_tile_path_and_the_others_do_not(emulated, default):
    # the row counts of these tests straddle the threshold: the tile path and the others both run
    assert min(ROWS) < emulated.tile_rows <= max(ROWS) and emulated.tile_rows - 1 in ROWS and emulated.tile_rows in ROWS
    assert default.tile_rows == 0
    assert kernel_of("portable").tile_rows == 0 and kernel_of("vnni-emulated").tile_rows == 0


@pytest.mark.parametrize("type_name", TILE_TYPES)
def test_the_tile_path_gives_the_default_builds_bits(tile_kernels, default, type_name):
    """37 outputs (two tiles of 16 and a short one), K = 1024 (4 super-blocks, 32 blocks of 32)."""
    rng = np.random.default_rng(TILE_TYPES.index(type_name))
    w = qmatmul.QMatrix(random_raw(type_name, 37, 1024, rng).reshape(-1), type_name, 37, 1024)
    x = activations(max(ROWS), 1024, seed=21)
    x[5:9] = torch.randn(4, 1024, generator=torch.Generator().manual_seed(2))  # ordinary rows among the extremes
    expected = default.matmul(x, w, threads=1)
    for m in ROWS:
        for threads in (1, 2):
            for tiles in tile_kernels:
                assert same_bits(tiles.matmul(x[:m], w, threads=threads), expected[:m]), (tiles.isa, type_name, m, threads)
            assert same_bits(default.matmul(x[:m], w, threads=threads), expected[:m]), (type_name, m, threads)


def test_extreme_codes_and_activations_are_exact_on_the_tile_path(tile_kernels, default):
    """Every code at its largest or smallest value, activations at +-127 (40 rows: the tile path):
    the signed codes times the signed activations, Q4_K's codes times the digits of its largest
    scales, exact int32 sums."""
    for type_name in TILE_TYPES:
        block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
        raw = np.full((17, 512 // block, size), 0xFF, dtype=np.uint8)
        raw[1::3] = 0x00
        raw[2::3] = 0x80 if type_name == "Q8_0" else 0x77
        fields = [(0, 2), (2, 4)] if type_name in ("Q4_K", "Q5_K") else [(208, 210)] if type_name == "Q6_K" else [(0, 2)]
        for low, high in fields:
            raw[:, :, low:high] = np.array([0.01], dtype=np.float16).view(np.uint8)
        w = qmatmul.QMatrix(raw.reshape(-1), type_name, 17, 512)
        x = torch.full((40, 512), 3.0)
        x[1::2] = -3.0
        x[3, ::2] = 1.0
        for tiles in tile_kernels:
            assert same_bits(tiles.matmul(x, w, threads=2), default.matmul(x, w, threads=2)), (tiles.isa, type_name)


class QmmPart(ctypes.Structure):
    _fields_ = [("weights", ctypes.c_void_p), ("type", ctypes.c_int), ("n", ctypes.c_int64)]


def parts_product(kernel: qmatmul.QKernel, x: torch.Tensor, weights: list[qmatmul.QMatrix], threads: int) -> torch.Tensor:
    """qmm_matmul_parts over `weights` (one quantization form), outputs side by side in one buffer."""
    library = kernel.kernel.library
    function = library.qmm_matmul_parts
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    function.restype = ctypes.c_int
    function.argtypes = [pointer, pointer, pointer, pointer, size, size, pointer, ctypes.c_int, pointer, size, ctypes.c_int]
    activations_ = kernel.quantize(x)
    parts = (QmmPart * len(weights))(*[QmmPart(w.address, w.type, w.rows) for w in weights])
    width = sum(w.rows for w in weights)
    y = torch.full((x.shape[0], width + 3), -1.0)
    status = function(*activations_.pointers(weights[0].type)[1:], x.shape[0], x.shape[1], ctypes.addressof(parts),
                      len(weights), y.data_ptr(), y.stride(0), threads)
    assert status == 0
    assert bool((y[:, width:] == -1.0).all())
    return y[:, :width]


@pytest.mark.parametrize("form", [("Q4_K", "Q6_K", "Q5_K"), ("Q8_0", "Q4_0", "Q5_0")])
def test_parts_on_the_tile_path_give_the_default_builds_bits(tile_kernels, default, form):
    """A layer's q, k, v (or gate, up) in one call: parts of different types and sub-block sizes
    (Q6_K's 16, the others' 32) in one parallel region, each part's columns qmm_matmul's."""
    rng = np.random.default_rng(3)
    weights = [qmatmul.QMatrix(random_raw(name, rows, 512, rng).reshape(-1), name, rows, 512)
               for name, rows in zip(form, (40, 8, 23))]
    x = activations(33, 512, seed=4)
    for m in (16, 32, 33):
        for threads in (1, 2):
            expected = parts_product(default, x[:m], weights, threads)
            for tiles in tile_kernels:
                assert same_bits(parts_product(tiles, x[:m], weights, threads), expected), (tiles.isa, form, m, threads)
                alone = torch.cat([tiles.matmul(x[:m], w, threads=threads) for w in weights], dim=1)
                assert same_bits(alone, expected), (tiles.isa, form, m, threads)


def test_the_real_amx_variant_compiles_with_tile_instructions():
    """Compiled, not run (this CPU may lack AMX): gcc's -mamx-tile -mamx-int8 and the intrinsics
    of amx.h's real definitions, so that the variant cannot rot unseen."""
    library = build.compile_library("amx")
    assert library.is_file()
    objdump = shutil.which("objdump")
    if objdump:
        text = subprocess.run([objdump, "-d", str(library)], capture_output=True, text=True).stdout
        for instruction in ("ldtilecfg", "tileloadd", "tdpbssd", "tilestored", "tilerelease"):
            assert instruction in text, instruction


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """blockmm's and build's caches emptied for the test (and restored after it)."""
    monkeypatch.setattr(blockmm, "_state", {})
    monkeypatch.setattr(blockmm, "_variants", {})
    monkeypatch.setattr(build, "_state", dict(build._state))
    monkeypatch.delenv(blockmm.ISA_ENV, raising=False)
    return monkeypatch


def test_the_emulated_tile_build_can_be_forced_and_says_so(fresh_kernel_state):
    fresh_kernel_state.setenv(blockmm.ISA_ENV, "amx-emulated")
    found, why = blockmm.kernel()
    assert why is None and found.isa == "amx-emulated" == found.compiled_isa and found.tiles == 0
    assert blockmm.kernel_path() == "amx-emulated (AMX: emulated; VNNI: emulated)"
    assert qmatmul.kernel()[0].tile_rows > 0


def test_the_kernel_path_names_the_variant_and_its_amx_and_vnni():
    found, why = blockmm.kernel()
    assert found is not None, why
    path = blockmm.kernel_path()
    assert path.startswith(f"{found.isa} (AMX: ")
    if found.isa == "avx2":
        assert path == "avx2 (AMX: no; VNNI: no)"
    elif found.isa in ("avx512vnni", "avxvnni"):
        assert path.endswith("VNNI: yes)")


@pytest.mark.skipif("amx_int8" in build.cpu_flags(), reason="this CPU has AMX: the tiles may well be granted")
def test_amx_refused_by_the_cpu_or_kernel_falls_back_to_the_next_variant(fresh_kernel_state):
    """A CPU that reports AMX (here pretended) whose kernel does not grant the tile data: "amx" is
    refused with the reason, the next variant runs, and kernel_path says so. The amx library is
    loaded and asks arch_prctl (which refuses here), never runs a tile instruction."""
    pretended = build.cpu_flags() | set(build.VARIANTS["amx"][1])
    fresh_kernel_state.setitem(build._state, "flags", frozenset(pretended))
    assert build.supported_variants()[:2] == ["amx", "avx512vnni"]
    amx, why = blockmm.load_variant("amx")
    assert amx is None and "did not grant the AMX tile data" in why
    found, _ = blockmm.kernel()
    assert found.isa == "avx512vnni"
    path = blockmm.kernel_path()
    assert path.startswith("avx512vnni (AMX: not used: the kernel did not grant") and path.endswith("VNNI: yes)")
    assert blockmm.chosen_variant() == "avx512vnni"


def test_a_forced_amx_variant_the_cpu_lacks_is_refused(fresh_kernel_state):
    if "amx_int8" in build.cpu_flags():
        pytest.skip("this CPU has AMX")
    fresh_kernel_state.setenv(blockmm.ISA_ENV, "amx")
    found, why = blockmm.kernel()
    assert found is None and why.startswith(f"{blockmm.ISA_ENV}=amx: this CPU cannot run the amx kernel variant")
