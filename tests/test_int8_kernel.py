"""The int8-activation block kernel (`kernels/blockmm_int8.c`, numerics "int8") and the choice of
the kernel's instruction-set build (`blockmm` variants).

The int8 product must equal, bit for bit, a numpy emulation of its definition (activations
quantized per row and block, exact integer sums, then the documented fixed sequence of float32
operations), on every build this CPU runs (the portable C and the SIMD ones), for weights packed
as signed codes and as unsigned ones (`PackedBlocks`: small code ranges, the GGUF formats of the
default model's layers); a row's result must not depend on the other rows of the call nor on the
thread count; a build forced through `VERISPEC_KERNEL_ISA` that the CPU cannot run, or no working
compiler, must be refused with a message, not crash.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import helpers
from verispec.runtime import blockmm
from verispec.gguf.blocks import BlockWeights, PackedBlocks

F32 = np.float32


def quantize_rows(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (codes [M, K] int32 in -127..127, scales [M, K / block] float32):
    scale = max |x| / 127 per row and block, code = round-half-even(x / scale)."""
    m, k = x.shape
    grouped = x.reshape(m, k // block, block)
    scales = (np.abs(grouped).max(-1) / F32(127)).astype(F32)  # [M, nb]
    safe = np.where(scales > 0, scales, F32(1))[..., None]
    codes = np.clip(np.rint(grouped / safe), -127, 127)
    codes = np.where(scales[..., None] > 0, codes, 0).astype(np.int32)
    return codes.reshape(m, k), scales


def block_terms(x: torch.Tensor, form: BlockWeights) -> tuple[np.ndarray, np.ndarray | None]:
    """The kernel's per-block terms in float32: (float)(integer sum) * (xs * scale) [M, N, nb],
    and offset * xo [M, N, nb] (None without offsets)."""
    x = x.numpy().astype(F32)
    codes, scales = form.codes.numpy().astype(np.int32), form.scales.numpy()
    block, (m, k), n = form.block, x.shape, codes.shape[0]
    nb = k // block
    q, xs = quantize_rows(x, block)
    sums = (q[:, None, :] * codes[None, :, :]).reshape(m, n, nb, block).sum(-1)  # exact [M, N, nb]
    scale = (xs[:, None, :] * scales[None, :, :]).astype(F32)
    terms = (sums.astype(F32) * scale).astype(F32)
    if form.offsets is None:
        return terms, None
    xo = (xs * q.reshape(m, nb, block).sum(-1).astype(F32)).astype(F32)  # [M, nb]
    return terms, (form.offsets.numpy()[None, :, :] * xo[:, None, :]).astype(F32)


def reference_int8(x: torch.Tensor, form: BlockWeights) -> torch.Tensor:
    """The kernel's definition (blockmm_int8.c's header) emulated in numpy: [M, N] float32,
    the block terms summed one by one in block order (and the offsets' products likewise)."""
    terms, products = block_terms(x, form)
    acc = np.zeros(terms.shape[:2], dtype=F32)
    for b in range(terms.shape[2]):
        acc = acc + terms[..., b]
    if products is not None:
        shift = np.zeros_like(acc)
        for b in range(products.shape[2]):
            shift = shift + products[..., b]
        acc = acc - shift
    return torch.from_numpy(np.ascontiguousarray(acc.astype(F32)))


def variants_here() -> list[str]:
    return blockmm.supported_variants()


def builds_here() -> list[str]:
    """The variants this CPU runs and the test builds it runs (the VNNI paths emulated on AVX2)."""
    return variants_here() + [name for name in blockmm.TEST_BUILDS if blockmm.load_variant(name)[0] is not None]


def kernel_of(variant: str) -> blockmm.Kernel:
    found, why = blockmm.load_variant(variant)
    assert found is not None, why  # every variant this CPU reports must build and load
    assert found.compiled_isa == variant  # the build really is that variant
    return found


def wide_form(outputs: int, inputs: int, block: int, affine: bool, seed: int) -> BlockWeights:
    """A block form with the extremes a GGUF file may hold: codes over all of -128..127 (not only
    the +-127 a quantizer makes), negative scales (Q6_K's int8 sub-scales), all-zero blocks."""
    generator = torch.Generator().manual_seed(seed)
    form = helpers.block_quantize(torch.randn(outputs, inputs, generator=generator), block, affine)
    codes = form.codes.clone() if affine else torch.randint(-128, 128, (outputs, inputs), generator=generator,
                                                            dtype=torch.int8)
    scales = form.scales.clone()
    if not affine:
        scales[::3] = -scales[::3]
        codes[0, :block] = -128  # the largest products: |-128| * 127, twice per int16 pair
    scales[1, 0] = 0.0
    return BlockWeights(codes.contiguous(), scales.contiguous(), form.offsets, block)


def run(kernel, x, form, threads: int = 1) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel.matmul(x, form, "int8")
    finally:
        torch.set_num_threads(previous)


def activations(rows: int, inputs: int, seed: int) -> torch.Tensor:
    """Random rows with the cases quantization must get right: an all-zero block, a block with
    one value (scale from it alone), exact ties x / scale = k + 1/2, huge and tiny magnitudes."""
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed))
    x[0, :16] = 0.0
    if rows > 1:
        x[1, 16:32] = 0.0
        x[1, 20] = -3.0
    if rows > 2:
        x[2, :16] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 63.5] * 2)  # scale 1: ties to even
    if rows > 3:
        x[3] *= 1e4
        x[4 % rows] *= 1e-4
    return x


@pytest.mark.parametrize("variant", ["portable", "avx2", "vnni-emulated"])
@pytest.mark.parametrize("block,affine,inputs", [
    (32, False, 640), (16, False, 208), (32, True, 192), (16, True, 304), (64, True, 256), (48, False, 144),
])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_int8_product_equals_its_numpy_definition(variant, block, affine, inputs, rows):
    if variant not in builds_here():  # the portable build runs everywhere; AVX2 is required on x86 CI
        pytest.fail(f"this CPU does not run the {variant} build: {blockmm.load_variant(variant)[1]}")
    form = wide_form(37, inputs, block, affine, seed=inputs + block + rows)
    x = activations(rows, inputs, seed=rows)
    got = run(kernel_of(variant), x, form)
    expected = reference_int8(x, form)
    assert got.shape == (rows, 37)
    assert torch.equal(got, expected), float((got - expected).abs().max())
    # and it is a good approximation of x @ W^T: activations lose about 1/254 of a block's largest
    exact = x.double() @ form.dequantize().double().T
    error = (got.double() - exact).abs().max().item()
    assert error <= 0.03 * exact.abs().max().item(), error


def test_reference_emulation_would_see_a_different_order():
    """The emulation is strict: summing the same block terms in another order (pairwise, as a
    vectorised reduction would) changes some bits, so the equality above really checks the
    kernel's fixed order (not a tolerance in disguise)."""
    form = wide_form(64, 640, 32, False, seed=3)
    x = activations(8, 640, seed=3)
    in_order = reference_int8(x, form)
    terms, _ = block_terms(x, form)
    pairwise = terms[..., 0::2] + terms[..., 1::2]  # [M, N, 10]
    other = np.zeros(terms.shape[:2], dtype=F32)
    for b in range(pairwise.shape[2]):
        other = other + pairwise[..., b]
    assert not torch.equal(torch.from_numpy(other), in_order)
    assert torch.allclose(torch.from_numpy(other), in_order, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["portable", "avx2", "vnni-emulated"])
@pytest.mark.parametrize("block,affine", [(32, False), (32, True), (16, False)])
def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads(variant, block, affine):
    """Row r of a call with M rows (any M from 1 to 64, the other rows random) equals row r of
    a one-row call, bit for bit, at 1 and 2 threads."""
    kernel = kernel_of(variant)
    form = wide_form(133, 320, block, affine, seed=block)  # 133 outputs: tasks of uneven size
    row = activations(1, 320, seed=99)
    alone = run(kernel, row, form, threads=1)
    generator = torch.Generator().manual_seed(7)
    for m in range(1, 65):
        x = torch.randn(m, 320, generator=generator) * float(torch.rand(1, generator=generator)) * 10
        at = int(torch.randint(0, m, (1,), generator=generator))
        x[at] = row[0]
        for threads in (1, 2):
            assert torch.equal(run(kernel, x, form, threads)[at], alone[0]), (m, at, threads)


def test_fp32_numerics_are_not_batch_invariant_but_int8_are():
    """What the int8 path is for: the float32-activation kernel groups 4 to 8 rows differently
    from a one-row call (other roundings), the int8 one does not."""
    kernel = kernel_of(variants_here()[0])
    form = wide_form(256, 640, 32, False, seed=11)
    x = torch.randn(8, 640, generator=torch.Generator().manual_seed(11))
    one = lambda numerics: torch.cat([kernel.matmul(x[i : i + 1], form, numerics) for i in range(8)])  # noqa: E731
    together = lambda numerics: kernel.matmul(x, form, numerics)  # noqa: E731
    if kernel.isa != "portable":
        assert not torch.equal(together("fp32"), one("fp32"))
    assert torch.equal(together("int8"), one("int8"))


@pytest.mark.parametrize("variant", [*blockmm.VARIANTS, *blockmm.TEST_BUILDS])
def test_every_variant_builds_and_those_this_cpu_runs_equal_the_portable_build(variant):
    """Every variant compiles here (the VNNI ones need only the compiler, not the CPU); the ones
    this CPU can run give the portable build's bits; the others are refused with the flags the
    CPU lacks."""
    assert blockmm.build_variant(variant).is_file()
    if variant in builds_here():
        form = wide_form(97, 656, 16, False, seed=5)  # 41 blocks of 16: the 16-input tail too
        x = activations(11, 656, seed=5)
        portable = run(kernel_of("portable"), x, form)
        for threads in (1, 2):
            assert torch.equal(run(kernel_of(variant), x, form, threads), portable), threads
        affine = wide_form(97, 640, 32, True, seed=6)
        x = activations(5, 640, seed=6)
        assert torch.equal(run(kernel_of(variant), x, affine), run(kernel_of("portable"), x, affine))
    else:
        found, why = blockmm.load_variant(variant)
        assert found is None and "cannot run" in why and "lacks" in why


# Code ranges (lo, hi, block, offsets) of the GGUF formats: the default model's layers are Q4_K,
# Q5_0 and Q6_K (unsigned codes in the packed form), its LM head Q8_0 (signed codes).
CODE_RANGES = {
    "q4_k": (0, 15, 32, True),
    "q5_0": (-16, 15, 32, False),
    "span_32": (-16, 16, 32, False),  # the widest range of 4-step int16 chunks
    "q6_k": (-32, 31, 16, False),
    "span_64": (-32, 32, 16, False),  # the widest range of 2-step chunks
    "span_128": (-64, 64, 16, False),  # the widest unsigned range (1-step chunks)
    "q8_0": (-128, 127, 32, False),
}


def steps16(span: int) -> int:
    """blockmm_int8.c's int16 chunk length (steps of 4 inputs) for unsigned codes of this span."""
    return 4 if span <= 32 else 2 if span <= 64 else 1


def ranged_form(outputs: int, inputs: int, lo: int, hi: int, block: int, affine: bool, seed: int) -> BlockWeights:
    """Random codes over all of lo..hi (both ends present), fp16-rounded scales of both signs
    (one zero), random offsets where `affine`."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi + 1, (outputs, inputs), generator=generator, dtype=torch.int16)
    codes[0, 0], codes[0, 1] = lo, hi
    scales = (torch.randn(outputs, inputs // block, generator=generator) * 0.01).half().float()
    scales[1, 0] = 0.0
    offsets = (torch.rand(outputs, inputs // block, generator=generator) * 0.1).half().float() if affine else None
    return BlockWeights(codes.to(torch.int8), scales, offsets, block)


def assert_every_build_gives(x: torch.Tensor, form: BlockWeights, expected: torch.Tensor, widths) -> None:
    """Rows 0..m-1 of x, for each width m, give expected[:m] on every build here at 1 and 2 threads."""
    for variant in builds_here():
        kernel = kernel_of(variant)
        for m in widths:
            for threads in (1, 2):
                got = run(kernel, x[:m], form, threads)
                assert torch.equal(got, expected[:m]), (variant, m, threads, float((got - expected[:m]).abs().max()))


@pytest.mark.parametrize("kind", list(CODE_RANGES))
def test_signed_and_unsigned_codes_equal_the_numpy_definition_on_every_build(kind):
    lo, hi, block, affine = CODE_RANGES[kind]
    form = ranged_form(45, 256, lo, hi, block, affine, seed=block + hi)  # 45 outputs: a short last group
    assert (form.packed.code_bias is None) == (kind == "q8_0")
    x = activations(12, 256, seed=hi)
    expected = reference_int8(x, form)
    assert torch.equal(run(kernel_of("portable"), x, form), expected)
    assert_every_build_gives(x, form, expected, range(1, 13))


@pytest.mark.parametrize("kind", ["q4_k", "q5_0", "span_32", "q6_k", "span_64", "span_128"])
def test_unsigned_codes_at_the_int16_limit(kind):
    """Every code at the top of its range (u = code_span) and every activation at +-127 of one
    sign per row: the AVX2 path's int16 sums reach steps16 * 2 * code_span * 127 <= 32767, and
    except for q4_k's span 15 one step more per chunk would wrap (the blocks are long enough for
    that step: this test catches it)."""
    lo, hi, block, affine = CODE_RANGES[kind]
    form = ranged_form(24, 256, lo, hi, block, affine, seed=1)
    codes = torch.full_like(form.codes, hi)
    codes[0, 0] = lo  # the range's other end, outside the outputs that matter
    form = BlockWeights(codes, form.scales.abs() + 0.01, form.offsets, block)
    span = form.packed.code_span
    assert form.packed.code_bias is not None and span == hi - lo
    steps = steps16(span)
    assert steps * 2 * 127 * span <= 32767
    if kind != "q4_k":
        assert (steps + 1) * 2 * 127 * span > 32767 and block // 4 > steps
    x = torch.ones(3, 256)
    x[1] = -2.0
    x[2] = torch.arange(256).div(block, rounding_mode="floor").remainder(2).mul(2).sub(1).float() * 3.0  # +-3 by block
    expected = reference_int8(x, form)
    assert torch.equal(run(kernel_of("portable"), x, form), expected)
    assert_every_build_gives(x, form, expected, (1, 2, 3))


@pytest.mark.parametrize("lo,hi,bias,span", [
    (0, 15, 0, 15), (3, 15, 0, 15), (-16, 15, 16, 31), (-32, 31, 32, 63), (-20, -5, 20, 15), (-64, 64, 64, 128),
    (-64, 65, None, 129), (-127, 127, None, 254), (-128, 127, None, 255),
])
def test_packing_stores_a_range_of_at_most_129_codes_unsigned(lo, hi, bias, span):
    """`PackedBlocks.of`: u = code + code_bias as uint8 for a small range (lo taken at most 0),
    the int8 codes for a wider one; either way the packed bytes give the codes back, and the
    padding of the last group is zero bytes."""
    form = ranged_form(13, 64, lo, hi, 32, False, seed=0)
    packed = PackedBlocks.of(form)
    assert (packed.code_bias, packed.code_span) == (bias, span)
    assert packed.kernel_form == (-1 if bias is None else bias, span, 1)  # ranged_form: float16 scales
    assert packed.codes.dtype == (torch.int8 if bias is None else torch.uint8)
    rows = packed.codes.transpose(1, 2).reshape(16, 64)  # [groups * 8, in]
    assert torch.equal(rows[:13].to(torch.int16) - (bias or 0), form.codes.to(torch.int16))
    assert not rows[13:].any()


def _gguf_like(weight: torch.Tensor, lo: int, hi: int, block: int) -> BlockWeights:
    """A symmetric block form of `weight` with codes in lo..hi (Q5_0: -16..15, Q6_K: -32..31)."""
    out = weight.shape[0]
    grouped = weight.detach().view(out, -1, block)
    scales = (grouped.abs().amax(-1) / -lo).half().float()
    codes = (grouped / scales.unsqueeze(-1)).round().clamp(lo, hi)
    return BlockWeights(codes.to(torch.int8).view(out, -1).contiguous(), scales, None, block)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_c_layers_multiply_unsigned_codes_as_the_kernel_does(arch):
    """The C decoder layer on the default model's mix of formats (Q5_0 q/k/v and gate/up, Q4_K o,
    Q6_K down, Q8_0 head: unsigned codes with code_bias 16, 0 and 32) gives the logits of the
    PyTorch layer, whose linears call the kernel from Python, in int8 numerics: to float32
    rounding in most rows; a rounding difference before a quantization may move an activation
    code by one step, so a few rows differ by up to about 1% (a code_bias lost or off by one on
    the way to the kernel moves every row by about the logits' size)."""
    from verispec.target.model import Target

    model = helpers.make_model(helpers.make_config(arch), seed=4)
    formats = {"down_proj": (-32, 31, 16), "lm_head": (-127, 127, 32)}  # others Q5_0-like, o_proj Q4_K-like
    blocks = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(module, torch.nn.Linear):
                continue
            if leaf == "o_proj":
                form = helpers.block_quantize(module.weight, 32, True)  # codes 0..15 with offsets
            else:
                form = _gguf_like(module.weight, *formats.get(leaf, (-16, 15, 32)))
            module.weight.copy_(form.dequantize())
            blocks[module] = form
    target = Target(model, None, fast=True, blocks=blocks, numerics="int8")
    fast = target.decoder
    assert fast.native_layers == len(fast.layers)
    first = fast.layers[0]
    assert [linear.blocks.packed.code_bias for linear in (first.qkv, first.o, first.gate_up, first.down)] == [16, 0, 16, 32]
    tokens = torch.randint(0, target.vocab_size, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = []
    for native in (True, False):
        fast.use_native = native
        target.reset()
        logits.append([target.forward(tokens[:20]), target.forward(tokens[20:21]), target.forward(tokens[21:])])
    mine, reference = torch.cat(logits[0]), torch.cat(logits[1])
    rows = (mine - reference).abs().amax(-1) / max(reference.abs().max().item(), 1.0)  # [23]
    assert rows.max().item() <= 0.02 and rows.median().item() <= 1e-5, rows.tolist()


def test_variant_choice_follows_the_cpu_flags():
    assert blockmm.supported_variants(frozenset()) == ["portable"]
    avx2 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    assert blockmm.supported_variants(avx2) == ["avx2", "portable"]
    assert blockmm.supported_variants(avx2 - {"fma"}) == ["portable"]  # AVX2 without FMA: portable
    assert blockmm.supported_variants(avx2 | {"avx_vnni"}) == ["avxvnni", "avx2", "portable"]
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert blockmm.supported_variants(zen4)[0] == "avx512vnni"
    assert not set(blockmm.TEST_BUILDS) & set(blockmm.supported_variants(zen4 | {"avx_vnni"}))  # never chosen


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """blockmm's caches emptied for the test (and restored after it)."""
    monkeypatch.setattr(blockmm, "_state", dict(blockmm._state))
    blockmm._state.pop("kernel", None)
    monkeypatch.setattr(blockmm, "_variants", {})
    return monkeypatch


def test_forced_variant_is_used(fresh_kernel_state):
    fresh_kernel_state.setenv(blockmm.ISA_ENV, "portable")
    found, why = blockmm.kernel()
    assert why is None and found.isa == "portable" == found.compiled_isa
    assert blockmm.kernel_isa() == "portable"


@pytest.mark.parametrize("forced", ["sse9", "unavailable"])
def test_forced_variant_the_cpu_cannot_run_is_refused_with_a_message(fresh_kernel_state, forced):
    if forced == "unavailable":
        missing = [name for name in blockmm.VARIANTS if name not in variants_here()]
        forced = missing[0] if missing else "not-a-variant"  # a CPU with every variant: an unknown name
    fresh_kernel_state.setenv(blockmm.ISA_ENV, forced)
    found, why = blockmm.kernel()
    assert found is None and blockmm.kernel_isa() is None
    assert why.startswith(f"{blockmm.ISA_ENV}={forced}: ")
    assert ("unknown kernel variant" in why) or ("cannot run" in why)


def test_a_broken_compiler_gives_a_reason_and_the_fast_path_keeps_float32(fresh_kernel_state, capsys, tmp_path):
    from verispec.target import loading as model_module

    fresh_kernel_state.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_kernel_state.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached: it must compile
    found, why = blockmm.kernel()
    assert found is None and "could not build the block kernel" in why
    model = helpers.make_model(helpers.make_config("llama"), seed=2)
    assert model_module._gguf_blocks(tmp_path / "m.gguf", model) is None
    assert "block kernel not used: could not build" in capsys.readouterr().err


def test_fp32_numerics_on_a_portable_build_keep_pytorch_linears(fresh_kernel_state, capsys, tmp_path):
    """Float32 activations on the portable scalar loop would be slower than PyTorch's float32
    linears: the blocks are not used, with a message."""
    from verispec.target import loading as model_module

    fresh_kernel_state.setenv(blockmm.ISA_ENV, "portable")
    model = helpers.make_model(helpers.make_config("llama"), seed=2)
    assert model_module._gguf_blocks(tmp_path / "m.gguf", model, "fp32") is None
    assert "portable build" in capsys.readouterr().err


def test_the_compiled_probe_agrees_with_proc_cpuinfo():
    """Where /proc/cpuinfo is missing the flags come from a compiled `__builtin_cpu_supports`
    probe; here both exist, and they must agree on every flag the variants need."""
    probed = blockmm._probe_flags()
    needed = {flag for _, flags in blockmm.VARIANTS.values() for flag in flags}
    compared = needed - {"avx_vnni"}  # the probe knows AVX-VNNI only when built by GCC 11 or later
    assert probed & compared == blockmm.cpu_flags() & compared
    assert "avx2" in probed  # x86 CI and this machine have AVX2: the probe really ran


def test_scales_that_are_float16_are_packed_as_float16_and_give_the_same_bits():
    """GGUF Q8_0/Q5_0 scales are float16 values: packed as float16 (half the bytes a one-token
    step reads for them), converted exactly (F16C or the portable conversion, subnormals too),
    so the product equals the float32-scales product bit for bit on every build. Scales that are
    not all float16 values (such as Q4_K's d * sc products) stay float32."""
    form = ranged_form(45, 256, -128, 127, 32, False, seed=9)
    scales = form.scales.clone()
    scales[2, 1], scales[3, 2] = 2.0 ** -20, -(2.0 ** -24)  # float16 subnormals
    form = BlockWeights(form.codes, scales, None, 32)
    assert form.packed.scales.dtype == torch.float16 and form.packed.kernel_form[2] == 1
    as_float32 = BlockWeights(form.codes, scales, None, 32)
    as_float32.__dict__["packed"] = dataclasses.replace(form.packed, scales=form.packed.scales.float())
    assert as_float32.packed.kernel_form[2] == 0
    x = activations(7, 256, seed=9)
    expected = reference_int8(x, form)
    for variant in builds_here():
        for threads in (1, 2):
            assert torch.equal(run(kernel_of(variant), x, form, threads), expected), variant
            assert torch.equal(run(kernel_of(variant), x, as_float32, threads), expected), variant
    products = BlockWeights(form.codes, scales * 1.0001, None, 32)  # float32 values off the float16 grid
    assert products.packed.scales.dtype == torch.float32 and products.packed.kernel_form[2] == 0
