"""Matrix products on a GGUF file's own blocks (`runtime/qmatmul.py`, `kernels/qmatmul.c`).

Small GGUF files are written with gguf-py's writer (its quantizers where it has one, else random
valid blocks) and read back memory-mapped; the kernels read those bytes as they lie. Every product
must equal, bit for bit, a numpy emulation of the numerics in qmatmul.c's header (activations
quantized per row and block of 32, or super-block of 256 for the K-quants, exact integer sums, then
one fixed sequence of float32 operations), for every row count, on every build this CPU runs (AVX2,
the portable C, the VNNI paths emulated on AVX2); for Q8_0 and Q5_0 it must give the bits of the
existing int8 block kernel on the matrix's exact block form. A row's result must not depend on the
other rows of the call, the thread count or where the output is written; `get_rows` must equal
gguf-py's dequantization; bad arguments must raise, not crash.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from verispec.runtime import blockmm, qmatmul
from verispec.gguf.blocks import block_scales, exact_blocks

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402
from gguf.quants import Q4_K, dequantize, quantize  # noqa: E402

F32 = np.float32
QUANTIZED_BY_GGUF = ("Q4_0", "Q5_0", "Q8_0")  # gguf-py quantizes these; the K-quants get random valid blocks
FLOATS = ("F32", "F16", "BF16")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = FLOATS + QUANTIZED_BY_GGUF + K_QUANTS
# (outputs N, inputs K) per type: N not a multiple of 8 or 16, K = 256 and 512 (and 32, 64, 288 for
# the 32-blocks: one block, two, and a chunk of 256 plus one block)
SHAPES = {name: [(13, 256), (21, 512)] for name in K_QUANTS}
SHAPES.update({name: [(3, 32), (13, 64), (21, 288), (10, 512)] for name in QUANTIZED_BY_GGUF})
SHAPES.update({name: [(5, 40), (19, 256)] for name in FLOATS})  # K a multiple of 8
ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 16, 33)
FP16_FIELDS = {"Q4_K": [(0, 2), (2, 4)], "Q5_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)]}


def random_raw(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes [rows, bytes per row] of a `type_name` weight: gguf-py's quantization of random floats,
    or for the K-quants random bits with finite float16 scales of a sane size."""
    if type_name in FLOATS + QUANTIZED_BY_GGUF:
        values = (rng.standard_normal((rows, cols)) * 0.1).astype(F32)
        raw = quantize(values, GT[type_name])
        return np.ascontiguousarray(raw).view(np.uint8).reshape(rows, -1)
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for low, high in FP16_FIELDS[type_name]:
        scales = rng.uniform(1e-4, 0.05, (rows, cols // block)).astype(np.float16)
        raw[:, :, low:high] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray, int]]):
    """A GGUF file holding raw tensors {name: (type, bytes [rows, bytes per row], cols)}, read back."""
    writer = gguf.GGUFWriter(str(path), "test")
    for name, (type_name, raw, cols) in tensors.items():
        if type_name == "F32":
            writer.add_tensor(name, raw.view(F32).reshape(raw.shape[0], cols))
        elif type_name == "F16":
            writer.add_tensor(name, raw.view(np.float16).reshape(raw.shape[0], cols))
        else:
            writer.add_tensor(name, raw, raw_dtype=GT[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> dict[tuple[str, int, int], qmatmul.QMatrix]:
    """One memory-mapped QMatrix per (type, N, K) of SHAPES, from a GGUF file."""
    rng = np.random.default_rng(0)
    tensors = {}
    for type_name in ALL_TYPES:
        for rows, cols in SHAPES[type_name]:
            tensors[f"{type_name}.{rows}.{cols}"] = (type_name, random_raw(type_name, rows, cols, rng), cols)
    reader = write_gguf(tmp_path_factory.mktemp("gguf") / "weights.gguf", tensors)
    found = {}
    for tensor in reader.tensors:
        type_name, rows, cols = tensor.name.split(".")
        matrix = qmatmul.QMatrix.from_gguf(tensor)
        assert np.shares_memory(matrix.data, reader.data)  # the memory-mapped file's bytes, not a copy
        assert (matrix.type_name, matrix.rows, matrix.cols) == (type_name, int(rows), int(cols))
        assert np.array_equal(matrix.data.reshape(int(rows), -1), tensors[tensor.name][1])
        found[(type_name, int(rows), int(cols))] = matrix
    return found


def builds_here() -> list[str]:
    """The variants this CPU runs and the test builds it runs (the VNNI paths emulated on AVX2)."""
    names = blockmm.supported_variants() + [name for name in blockmm.TEST_BUILDS if blockmm.load_variant(name)[0]]
    assert "portable" in names
    return names


def kernel_of(variant: str) -> qmatmul.QKernel:
    found, why = qmatmul.load_variant(variant)
    assert found is not None, why
    assert found.compiled_isa == variant
    return found


# ---------------------------------------------------------------------------------------------
# The numpy reference: codes and scales straight from the layouts, then the header's numerics.


def f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(F32)


def reference_form(w: qmatmul.QMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """(codes [N, K] int64, ws [N, K / S] float32, wo or None, S) of a quantized weight, as in qmatmul.c's header."""
    name, rows, cols = w.type_name, w.rows, w.cols
    block, size = qmatmul.BLOCKS[w.type]
    blocks = np.asarray(w.data).reshape(rows, cols // block, size)
    wo = None
    if name in QUANTIZED_BY_GGUF:
        d = f16(blocks[..., 0:2])  # [N, nb]
        if name == "Q8_0":
            codes = blocks[..., 2:34].view(np.int8).astype(np.int64)
        else:
            qs = blocks[..., -16:].astype(np.int64)
            q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [N, nb, 32]
            if name == "Q5_0":
                qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32).astype(np.int64)  # [N, nb, 1]
                q = q | (((qh >> np.arange(32)) & 1) << 4)
            codes = q - (16 if name == "Q5_0" else 8)
        return codes.reshape(rows, cols), d, None, 32
    if name in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[..., 0:2])[..., None], f16(blocks[..., 2:4])[..., None]
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        ws = (d * sc.reshape(rows, -1, 8).astype(F32)).reshape(rows, -1)
        wo = (dmin * m.reshape(rows, -1, 8).astype(F32)).reshape(rows, -1)
        qs = blocks[..., -128:].reshape(rows, -1, 4, 1, 32).astype(np.int64)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # sub-block 2c: low, 2c+1: high
        if name == "Q5_K":
            qh = blocks[..., 16:48].astype(np.int64)[:, :, None, :]  # [N, nb, 1, 32]
            q = q | (((qh >> np.arange(8)[:, None]) & 1) << 4)
        return q.reshape(rows, cols), ws, wo, 32
    # Q6_K: input 128h + 32s + l
    ql, qh = blocks[..., :128].astype(np.int64), blocks[..., 128:192].astype(np.int64)
    d = f16(blocks[..., 208:210])[..., None]
    ws = (d * blocks[..., 192:208].view(np.int8).astype(F32)).reshape(rows, -1)
    q = np.empty((rows, cols // 256, 2, 4, 32), dtype=np.int64)
    for h in range(2):
        for s in range(4):
            byte = ql[..., 64 * h + 32 * (s & 1): 64 * h + 32 * (s & 1) + 32]
            low = byte & 15 if s < 2 else byte >> 4
            q[:, :, h, s] = low | (((qh[..., 32 * h: 32 * h + 32] >> (2 * s)) & 3) << 4)
    return (q - 32).reshape(rows, cols), ws, None, 16


def quantize_rows(x: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (xq [M, K] int64, xs, xo [M, K / 32] float32) with one scale per `group`
    inputs (32: blockmm_int8.c's quantize_row; 256: the K-quants' super-block form, xs repeating each
    super-block's scale for its 8 blocks of 32)."""
    m, k = x.shape
    grouped = x.reshape(m, k // group, group)
    scale = (np.abs(grouped).max(-1) / F32(127)).astype(F32)
    safe = np.where(scale > 0, scale, F32(1))[..., None]
    q = np.clip(np.rint(grouped / safe), -127, 127)
    q = np.where(scale[..., None] > 0, q, 0).astype(np.int64).reshape(m, k // 32, 32)
    xs = np.repeat(scale, group // 32, axis=1)
    xo = (xs * q.sum(-1).astype(F32)).astype(F32)
    return q.reshape(m, k), xs, xo


def k_header(w: qmatmul.QMatrix) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """A K-quant's (sc [N, K / S] int64, m or None, d [N, K / 256] float32, dmin or None) as the file stores them."""
    blocks = np.asarray(w.data).reshape(w.rows, w.cols // 256, -1)
    if w.type_name == "Q6_K":
        return blocks[..., 192:208].view(np.int8).astype(np.int64).reshape(w.rows, -1), None, f16(blocks[..., 208:210]), None
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    return (sc.astype(np.int64).reshape(w.rows, -1), m.astype(np.int64).reshape(w.rows, -1), f16(blocks[..., 0:2]),
            f16(blocks[..., 2:4]))


def reference_quantized(x: np.ndarray, w: qmatmul.QMatrix, reverse: bool = False) -> np.ndarray:
    """y [M, N] by the header's definition, float32 operations one at a time (`reverse`: the float
    steps in the opposite order, to show that the comparison sees the order).
    32-blocks: per block j in order, acc = acc + (float)isum_j * (xs * ws_j).
    K-quants: per super-block B in order, isum_B = sum_j sc_j * isum_j (exact), acc = acc + (float)isum_B
    * (D_B * d_B); Q4_K / Q5_K also shift = shift + (float)msum_B * (D_B * dmin_B), msum_B = sum_j m_j *
    (sum of xq over sub-block j), y = acc - shift."""
    codes, ws, _, sub = reference_form(w)
    kquant = w.type_name in K_QUANTS
    xq, xs, _ = quantize_rows(x, 256 if kquant else 32)
    m, n, k = x.shape[0], codes.shape[0], x.shape[1]
    subs = k // sub
    isum = np.einsum("mjs,njs->mnj", xq.reshape(m, subs, sub), codes.reshape(n, subs, sub))  # exact (int64)
    shift = None
    if kquant:
        sc, mins, d, dmin = k_header(w)
        per = 256 // sub  # sub-blocks per super-block
        total = (isum * sc[None]).reshape(m, n, -1, per).sum(-1)  # [M, N, K / 256], exact
        assert np.abs(total).max() < 2**31
        D = xs[:, ::8]  # [M, K / 256]
        terms = (total.astype(F32) * (D[:, None, :] * d[None]).astype(F32)).astype(F32)
        if mins is not None:
            block_sums = xq.reshape(m, subs, sub).sum(-1)  # [M, subs]
            msum = (mins[None] * block_sums[:, None, :]).reshape(m, n, -1, per).sum(-1)
            shift = (msum.astype(F32) * (D[:, None, :] * dmin[None]).astype(F32)).astype(F32)
    else:
        terms = (isum.astype(F32) * (xs[:, None, :] * ws[None, :, :]).astype(F32)).astype(F32)
    order = range(terms.shape[2] - 1, -1, -1) if reverse else range(terms.shape[2])
    acc = np.zeros((m, n), dtype=F32)
    for j in order:
        acc = (acc + terms[..., j]).astype(F32)
    if shift is not None:
        total_shift = np.zeros_like(acc)
        for j in range(shift.shape[2]):
            total_shift = (total_shift + shift[..., j]).astype(F32)
        acc = (acc - total_shift).astype(F32)
    return acc


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c) = round(a * b + c), one rounding: a * b is exact in float64, the sum's
    rounding error is recovered exactly (TwoSum), and a float64 sum that lies exactly halfway
    between two float32 values is resolved by the sign of that error."""
    product = a.astype(np.float64) * b.astype(np.float64)
    addend = np.broadcast_to(c, product.shape).astype(np.float64)
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    rounded = total.astype(F32)
    toward = np.nextafter(rounded, np.where(rounded.astype(np.float64) < total, F32(np.inf), F32(-np.inf)).astype(F32))
    halfway = (rounded.astype(np.float64) != total) & ((rounded.astype(np.float64) + toward.astype(np.float64)) / 2 == total)
    up = np.nextafter(rounded, F32(np.inf)).astype(F32)
    down = np.nextafter(rounded, F32(-np.inf)).astype(F32)
    # at a tie, the exact value lies above `total` when error > 0: the candidate above it, else below
    above = np.where(rounded.astype(np.float64) > total, rounded, up)
    below = np.where(rounded.astype(np.float64) < total, rounded, down)
    fixed = np.where(error > 0, above, np.where(error < 0, below, rounded))
    return np.where(halfway, fixed, rounded).astype(F32)


def reference_float(x: np.ndarray, w: qmatmul.QMatrix) -> np.ndarray:
    """Lanes l = 0..7 of partial sums p_l = fma(w, x, p_l) over k = l, l + 8, ... in order, then
    ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))."""
    weight = dequantize(np.asarray(w.data).reshape(w.rows, -1), GT[w.type_name]).astype(F32).reshape(w.rows, w.cols)
    m, n = x.shape[0], w.rows
    p = np.zeros((m, n, 8), dtype=F32)
    for k in range(0, w.cols, 8):
        p = fma32(weight[None, :, k:k + 8], x[:, None, k:k + 8], p)
    q = [(p[..., i] + p[..., i + 4]).astype(F32) for i in range(4)]
    return ((q[0] + q[2]).astype(F32) + (q[1] + q[3]).astype(F32)).astype(F32)


def reference(x: np.ndarray, w: qmatmul.QMatrix) -> np.ndarray:
    return reference_float(x, w) if w.type in qmatmul.FLOAT_TYPES else reference_quantized(x, w)


def activations(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random rows with the cases quantization must get right: an all-zero block (and super-block), a
    block of one repeated value (a code of exactly 127), huge and tiny magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator)
    x[0, :32] = 0.0
    if rows > 1:
        x[1, -32:] = -0.75
    if rows > 2:
        x[2] *= 1e4
    if rows > 3:
        x[3] *= 1e-4
    if rows > 4 and cols >= 512:
        x[4, 256:512] = 0.0  # a whole super-block of zeros (its scale 0)
    return x


def cases():
    return [(name, n, k) for name in ALL_TYPES for n, k in SHAPES[name]]


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", QUANTIZED_BY_GGUF + K_QUANTS)
def test_reference_layouts_rebuild_gguf_dequantization_exactly(weights, type_name):
    """The reference's codes and scales are the file's: fl(ws * code) - wo is gguf-py's dequantization."""
    for (name, n, k), w in weights.items():
        if name != type_name:
            continue
        codes, ws, wo, sub = reference_form(w)
        rebuilt = (np.repeat(ws, sub, axis=1) * codes.astype(F32)).astype(F32)
        if wo is not None:
            rebuilt = (rebuilt - np.repeat(wo, sub, axis=1)).astype(F32)
        expected = dequantize(np.asarray(w.data).reshape(n, -1), GT[name]).reshape(n, k)
        assert np.array_equal(rebuilt.view(np.uint32), expected.astype(F32).view(np.uint32))


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_product_equals_its_numpy_definition_bit_for_bit_on_every_build(weights, case):
    w = weights[case]
    x = activations(max(ROW_COUNTS), w.cols, seed=case[1] * 1000 + case[2])
    expected = reference(x.numpy(), w)
    for variant in builds_here():
        kernel = kernel_of(variant)
        for m in ROW_COUNTS:
            got = kernel.matmul(x[:m], w, threads=2)
            assert got.shape == (m, w.rows)
            assert np.array_equal(got.numpy().view(np.uint32), expected[:m].view(np.uint32)), (variant, m)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0"])
def test_reference_sees_a_different_float_order(type_name):
    """The bit-exact comparison can fail: summing the same terms in another order changes bits."""
    rng = np.random.default_rng(5)
    w = qmatmul.QMatrix(random_raw(type_name, 16, 1024, rng).reshape(-1), type_name, 16, 1024)
    x = activations(8, 1024, seed=5).numpy()
    x[2:4] = rng.standard_normal((2, 1024)).astype(F32)  # rows of ordinary size
    assert not np.array_equal(reference_quantized(x, w, reverse=True), reference_quantized(x, w))
    assert np.array_equal(qmatmul.matmul(torch.from_numpy(x), w).numpy(), reference_quantized(x, w))


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_product_is_close_to_the_float_product(weights, case):
    """|y - x W^T| within what int8 activations allow: sum_k |w_k| xs_k / 2, plus float32 rounding."""
    w = weights[case]
    x = activations(9, w.cols, seed=7)
    weight = torch.from_numpy(dequantize(np.asarray(w.data).reshape(w.rows, -1), GT[w.type_name]).astype(F32))
    weight = weight.reshape(w.rows, w.cols).double()
    exact = x.double() @ weight.T
    got = qmatmul.matmul(x, w).double()
    magnitude = x.double().abs() @ weight.abs().T
    if w.type in qmatmul.FLOAT_TYPES:
        bound = magnitude * 1e-6
    else:
        _, xs, _ = quantize_rows(x.numpy(), 256 if w.type_name in K_QUANTS else 32)
        step = torch.from_numpy(np.repeat(xs, 32, axis=1)).double()  # xs per input
        bound = (step / 2) @ weight.abs().T * 1.001 + magnitude * 1e-5
    assert bool(((got - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_same_bits_as_the_int8_block_kernel(weights, type_name, rows):
    """For Q8_0 and Q5_0 the sequence is blockmm_int8's on the exact block form."""
    old, why = blockmm.kernel()
    assert old is not None, why
    for (name, n, k), w in weights.items():
        if name != type_name:
            continue
        raw = np.asarray(w.data).reshape(n, -1)
        weight = torch.from_numpy(dequantize(raw, GT[name]).astype(F32).reshape(n, k))
        block, scales, offsets = block_scales(raw, name, k)
        form = exact_blocks(weight, block, torch.from_numpy(np.ascontiguousarray(scales)),
                            None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets)))
        assert form is not None
        x = activations(rows, k, seed=n + k)
        assert torch.equal(qmatmul.matmul(x, w).view(torch.int32), old.matmul(x, form, "int8").view(torch.int32))


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_rows_do_not_depend_on_the_batch_the_threads_or_the_output_buffer(weights, type_name):
    key = next(key for key in weights if key[0] == type_name and key[2] >= 256)
    w = weights[key]
    x = activations(33, w.cols, seed=3)
    together = qmatmul.matmul(x, w, threads=2)
    assert torch.equal(together, qmatmul.matmul(x, w, threads=1))
    for i in (0, 4, 17, 32):
        alone = qmatmul.matmul(x[i:i + 1], w, threads=1)
        assert torch.equal(alone.view(torch.int32), together[i:i + 1].view(torch.int32))
    # written into a column range of a wider buffer (row stride 2N + 3), from activations quantized once
    shared = qmatmul.quantize(x)
    buffer = torch.full((33, 2 * w.rows + 3), -1.0)
    qmatmul.matmul(shared, w, out=buffer[:, 3:3 + w.rows])
    qmatmul.matmul(shared, w, out=buffer[:, 3 + w.rows:])
    assert torch.equal(buffer[:, 3:3 + w.rows], together) and torch.equal(buffer[:, 3 + w.rows:], together)
    assert bool((buffer[:, :3] == -1.0).all())


def test_every_build_gives_the_same_bits_on_many_rows():
    """Larger matrices than the reference tests: every build this CPU runs, 33 rows, K = 1024."""
    rng = np.random.default_rng(11)
    x = activations(33, 1024, seed=11)
    for type_name in ("Q4_0", "Q5_0", "Q8_0") + K_QUANTS + FLOATS:
        w = qmatmul.QMatrix(random_raw(type_name, 37, 1024, rng).reshape(-1), type_name, 37, 1024)
        results = {variant: kernel_of(variant).matmul(x, w, threads=2) for variant in builds_here()}
        first = results["portable"]
        for variant, got in results.items():
            assert torch.equal(got.view(torch.int32), first.view(torch.int32)), (type_name, variant)


@pytest.mark.parametrize("super_blocks", [128, 129])
def test_q6_k_rows_at_the_row_wise_paths_length_limit_give_every_builds_bits(super_blocks):
    """Q6_K's 16-lane row-wise path holds up to 128 super-blocks a row (K = 32,768) and hands longer
    rows to rows_group: both sides of that limit, 1-3 rows (the row-wise path), a short last group."""
    rng = np.random.default_rng(super_blocks)
    cols = 256 * super_blocks
    w = qmatmul.QMatrix(random_raw("Q6_K", 11, cols, rng).reshape(-1), "Q6_K", 11, cols)
    x = activations(3, cols, seed=super_blocks)
    first = kernel_of("portable").matmul(x, w, threads=2)
    for variant in builds_here():
        for m in (1, 2, 3):
            got = kernel_of(variant).matmul(x[:m], w, threads=2)
            assert torch.equal(got.view(torch.int32), first[:m].view(torch.int32)), (variant, m)


@pytest.mark.parametrize("type_name", QUANTIZED_BY_GGUF + K_QUANTS)
def test_extreme_codes_and_activations_do_not_overflow(type_name):
    """Every code at its largest (or smallest) value and activations at +-127: the int16 sums of
    the AVX2 path at their limit, exact on every build."""
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    cols = 512
    raw = np.full((4, cols // block, size), 0xFF, dtype=np.uint8)
    raw[1] = 0x00
    raw[2] = 0x80 if type_name == "Q8_0" else 0xFF  # Q8_0: codes -128 (|code| 128)
    raw[3] = 0x77
    for low, high in FP16_FIELDS.get(type_name, [(0, 2)]):
        raw[:, :, low:high] = np.array([0.01], dtype=np.float16).view(np.uint8)
    if type_name == "Q6_K":
        raw[:, :, 192:208] = np.array([127, -128] * 8, dtype=np.int8).view(np.uint8)
    w = qmatmul.QMatrix(raw.reshape(-1), type_name, 4, cols)
    x = torch.ones(3, cols)
    x[1] = -1.0
    x[2, ::2] = -1.0
    expected = reference_quantized(x.numpy(), w)
    for variant in builds_here():
        for m in (1, 2, 3):  # 1 and 2 rows: the row-wise path of the AVX2 build
            got = kernel_of(variant).matmul(x[:m], w)
            assert np.array_equal(got.numpy().view(np.uint32), expected[:m].view(np.uint32)), (variant, m)


@pytest.mark.parametrize("case", cases(), ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}")
def test_get_rows_equals_gguf_dequantization(weights, case):
    w = weights[case]
    expected = dequantize(np.asarray(w.data).reshape(w.rows, -1), GT[w.type_name]).astype(F32).reshape(w.rows, w.cols)
    ids = [w.rows - 1, 0, w.rows // 2, 0]
    for variant in ("portable", builds_here()[0]):
        got = qmatmul.get_rows(w, ids, kernel=kernel_of(variant)).numpy()
        assert np.array_equal(got.view(np.uint32), expected[ids].view(np.uint32))
    assert torch.equal(w.dequantize(), torch.from_numpy(expected))
    assert qmatmul.get_rows(w, []).shape == (0, w.cols)
    with pytest.raises(IndexError):
        qmatmul.get_rows(w, [w.rows])


def test_bad_arguments_raise_clear_errors():
    raw = np.zeros(144 * 2, dtype=np.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        qmatmul.QMatrix(raw, "Q4_K", 1, 288)  # K not a multiple of the block
    with pytest.raises(ValueError, match="unsupported GGUF weight type"):
        qmatmul.QMatrix(raw, "Q2_K", 1, 512)
    with pytest.raises(ValueError, match="unsupported GGUF weight type"):
        qmatmul.QMatrix(raw, 3, 1, 512)
    with pytest.raises(ValueError, match="takes 144 bytes"):
        qmatmul.QMatrix(raw, "Q4_K", 1, 256)  # wrong byte count
    w = qmatmul.QMatrix(raw, "Q4_K", 2, 256)
    with pytest.raises(ValueError, match="inputs per row"):
        qmatmul.matmul(torch.zeros(1, 512), w)
    with pytest.raises(ValueError, match="float32"):
        qmatmul.matmul(torch.zeros(1, 256, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="out must be"):
        qmatmul.matmul(torch.zeros(1, 256), w, out=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="multiple of 32"):
        qmatmul.quantize(torch.zeros(1, 48))
    # the C entry points refuse bad arguments themselves (no crash)
    functions = qmatmul.kernel()[0].functions
    y = torch.zeros(1, 2)
    x = torch.zeros(1, 256)
    assert functions["qmm_row_bytes"](12, 288) == -1 and functions["qmm_row_bytes"](3, 256) == -1
    assert functions["qmm_row_bytes"](12, 512) == 288 and functions["qmm_row_bytes"](14, 256) == 210
    assert functions["qmm_matmul_f32"](x.data_ptr(), 1, 250, raw.ctypes.data, 12, 2, y.data_ptr(), 2, 1) == -1
    assert functions["qmm_matmul_f32"](x.data_ptr(), 1, 256, raw.ctypes.data, 99, 2, y.data_ptr(), 2, 1) == -1
    assert functions["qmm_matmul_f32"](x.data_ptr(), 1, 256, raw.ctypes.data, 12, 2, y.data_ptr(), 1, 1) == -1  # ldy < N
    assert functions["qmm_matmul"](None, None, None, None, None, 1, 256, raw.ctypes.data, 12, 2, y.data_ptr(), 2, 1) == -1
    ids = (ctypes.c_int64 * 1)(2)
    assert functions["qmm_get_rows"](raw.ctypes.data, 12, 2, 256, ids, 1, y.data_ptr()) == -1  # id out of range
    assert functions["qmm_matmul_f32"](x.data_ptr(), 1, 256, raw.ctypes.data, 12, 2, y.data_ptr(), 2, 1) == 0


def test_the_kernel_is_the_blockmm_library():
    """Same library, ISA selection and override as blockmm: the wrapper loads no other build."""
    found, why = qmatmul.kernel()
    assert found is not None, why
    assert found.kernel is blockmm.kernel()[0]
    assert found.compiled_isa == blockmm.kernel_isa()
