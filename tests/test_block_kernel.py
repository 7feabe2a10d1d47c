"""The int8 block form of GGUF weights (`gguf.blocks`) and its kernel (`blockmm`).

The block form must rebuild the float32 weights bit for bit (checked against gguf-py's own
dequantizers on random blocks of every supported type), the kernel must equal a float64
reference up to float32 rounding for every shape the engine sends it, and the fast path on the
kernel must stay greedy-exact (the equivalence suite runs the "-blocks" paths of every fast
architecture; here we check that those paths really use the kernel).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import helpers
from verispec.runtime import blockmm
from verispec.gguf.blocks import BlockWeights, _module_for, block_scales, exact_blocks, quantize_blocks
from verispec.core.methods import build
from verispec.target.model import Target

BYTES_PER_BLOCK = {"Q8_0": (34, 32), "Q5_0": (22, 32), "Q4_K": (144, 256), "Q6_K": (210, 256)}
FP16_FIELDS = {"Q8_0": [(0, 2)], "Q5_0": [(0, 2)], "Q4_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)]}


def random_gguf_rows(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random raw bytes [rows, bytes per row] of a GGUF tensor, with finite fp16 scales."""
    size, per_block = BYTES_PER_BLOCK[type_name]
    generator = np.random.default_rng(seed)
    raw = generator.integers(0, 256, (rows, columns // per_block, size), dtype=np.uint8)
    for low, high in FP16_FIELDS[type_name]:
        scales = generator.uniform(1e-4, 0.05, (rows, columns // per_block)).astype(np.float16)
        raw[:, :, low:high] = scales.view(np.uint8).reshape(rows, columns // per_block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_form_rebuilds_gguf_dequantization_exactly(type_name, seed):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, columns = 12, 512
    raw = random_gguf_rows(type_name, rows, columns, seed)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32)).reshape(rows, columns)
    block, scales, offsets = block_scales(raw, type_name, columns)
    form = exact_blocks(weight, block, torch.from_numpy(scales),
                        None if offsets is None else torch.from_numpy(offsets))
    assert form is not None
    assert form.block == (16 if type_name == "Q6_K" else 32)
    assert (form.offsets is not None) == (type_name == "Q4_K")
    assert torch.equal(form.dequantize(), weight)


def test_weights_without_an_exact_block_form_are_refused():
    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    form = helpers.block_quantize(weight, 32, affine=False)
    assert exact_blocks(weight, 32, form.scales, None) is None  # random floats are not on the grid
    exact = form.dequantize()
    assert exact_blocks(exact, 32, form.scales, None) is not None
    assert exact_blocks(exact.double(), 32, form.scales, None) is None  # not float32
    assert exact_blocks(exact, 32, form.scales / 4, None) is None  # codes would leave int8
    assert exact_blocks(exact, 16, form.scales, None) is None  # wrong block shape
    nudged = exact.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))
    assert exact_blocks(nudged, 32, form.scales, None) is None  # one ulp off is refused


def test_concat_mixes_block_sizes_and_offsets():
    torch.manual_seed(1)
    parts = [
        helpers.block_quantize(torch.randn(6, 64), 32, affine=False),
        helpers.block_quantize(torch.randn(4, 64), 16, affine=False),
        helpers.block_quantize(torch.randn(5, 64), 32, affine=True),
    ]
    fused = BlockWeights.concat(parts)
    assert fused.block == 16 and fused.offsets is not None
    assert torch.equal(fused.dequantize(), torch.cat([part.dequantize() for part in parts]))
    assert BlockWeights.concat([parts[0], None]) is None
    picked = torch.tensor([4, 0, 9, 9])
    assert torch.equal(fused.rows(picked).dequantize(), fused.dequantize()[picked])


@pytest.fixture(scope="module")
def kernel():
    found, why = blockmm.kernel()
    assert found is not None, why  # this machine and CI have a C compiler: the kernel must build
    return found


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11, 17])
@pytest.mark.parametrize("block,affine,inputs", [
    (32, False, 192), (16, False, 192), (16, False, 208), (32, True, 192), (16, True, 208),  # 208: 13 blocks of 16
    (64, True, 256), (48, False, 144),  # other multiples of 16
    (16, True, 304),  # 19 blocks: offsets summed 8 at a time and 3 more
])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_float64_reference(kernel, rows, block, affine, inputs, threads):
    torch.manual_seed(rows * 10 + block)
    form = helpers.block_quantize(torch.randn(67, inputs), block, affine)  # 67 outputs: uneven split
    x = torch.randn(rows, inputs)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernel.matmul(x, form)
    finally:
        torch.set_num_threads(previous)
    reference = x.double() @ form.dequantize().double().T
    assert y.shape == (rows, 67) and y.dtype == torch.float32
    assert float((y.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


@pytest.mark.parametrize("block,affine,inputs", [(32, False, 192), (16, True, 208), (48, False, 144), (32, True, 640)])
def test_portable_build_equals_float64_reference(block, affine, inputs):
    """The portable build's float32-activation loop (CPUs without AVX2/FMA, or forced with
    VERISPEC_KERNEL_ISA=portable): the same product, up to float32 rounding."""
    portable, why = blockmm.load_variant("portable")
    assert portable is not None and portable.compiled_isa == "portable", why
    torch.manual_seed(inputs + block)
    form = helpers.block_quantize(torch.randn(67, inputs), block, affine)
    x = torch.randn(5, inputs)
    y = portable.matmul(x, form)
    reference = x.double() @ form.dequantize().double().T
    assert float((y.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


@pytest.mark.parametrize("rows", [2, 3, 9, 10, 11])
@pytest.mark.parametrize("block,affine", [(32, False), (32, True), (16, True)])
def test_up_to_three_rows_equal_one_row_calls_bit_for_bit(kernel, rows, block, affine):
    """Groups of up to 3 rows (a short verify, or the rows left after groups of 8) are computed
    exactly as one-row calls (a decoding step) compute them: same bits, not just close."""
    torch.manual_seed(rows + block)
    form = helpers.block_quantize(torch.randn(67, 320), block, affine)
    x = torch.randn(rows, 320)
    together = kernel.matmul(x, form)
    alone = torch.cat([kernel.matmul(x[i : i + 1], form)
                       for i in range(rows)])
    tail = range(rows - rows % 8, rows)  # the rows outside groups of 8
    assert torch.equal(together[tail], alone[tail])


def test_kernel_accepts_non_contiguous_input(kernel):
    form = helpers.block_quantize(torch.randn(9, 64), 32, affine=False)
    x = torch.randn(64, 3).T  # [3, 64], not contiguous
    expected = x.contiguous() @ form.dequantize().T
    torch.testing.assert_close(kernel.matmul(x, form), expected, rtol=1e-5, atol=1e-5)


def test_kernel_refuses_unsupported_blocks(kernel):
    form = helpers.block_quantize(torch.randn(4, 64), 8, affine=False)  # blocks of 8: fp32 takes multiples of 16
    with pytest.raises(RuntimeError, match="refused"):
        kernel.matmul(torch.randn(1, 64), form)


@pytest.mark.parametrize("arch", helpers.FAST_ARCHITECTURES)
def test_blocks_paths_run_every_linear_on_the_kernel(tiny_targets, arch):
    target = tiny_targets[f"{arch}-blocks"]
    layers = target.config.num_hidden_layers
    assert target.block_kernel_summary == (
        f"the LM head and {4 * layers} of {4 * layers} layer linears (exact int8 blocks, float32 activations, "
        f"{blockmm.kernel_isa()} build); {layers} of {layers} layers in C, one call per forward")
    assert tiny_targets[arch].block_kernel_summary == "off"


def test_lm_head_float32_form_is_packed_only_for_wide_inputs():
    """Behind the block kernel the LM head's float32 form is packed on first use (logits of more
    than BLOCK_KERNEL_MAX_ROWS rows), and gives what an eagerly packed one gives."""
    from verispec.runtime.fastpath import BLOCK_KERNEL_MAX_ROWS, Linear

    model = helpers.make_model(helpers.make_config("llama"), seed=5)
    target = Target(model, None, fast=True, blocks=helpers.blockify(model))
    head = target.head
    target.reset()
    target.forward(list(range(3, 3 + BLOCK_KERNEL_MAX_ROWS)))  # at most the kernel's width: the kernel
    assert head.dense._packed is None
    hidden = torch.randn(BLOCK_KERNEL_MAX_ROWS + 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    wide = head(hidden)  # [65, vocab] on the float32 form
    assert head.dense._packed is not None
    assert torch.equal(wide, Linear(model.get_output_embeddings().weight, None)(hidden))
    layer = target.decoder.layers[0].qkv  # layer linears keep packing at load (every long prompt uses them)
    assert layer.dense._packed is not None


def test_without_the_kernel_the_blocks_are_ignored_and_output_is_unchanged(monkeypatch, tiny_targets):
    monkeypatch.setitem(blockmm._state, "kernel", (None, "disabled for this test"))
    model = helpers.make_model(helpers.make_config("llama"), seed=4)
    blocks = helpers.blockify(model)
    target = Target(model, None, fast=True, blocks=blocks)
    assert target.fast and target.block_kernel_summary == "off"
    prompt = [5, 9, 2, 7]
    ids = helpers.run(target, build("ar", target), prompt, 12)[0]
    assert ids == helpers.hf_greedy(model, prompt, 12)


def test_gguf_tensor_names_map_to_the_model_linears():
    model = helpers.make_model(helpers.make_config("gemma3", tie_word_embeddings=True))
    layers = model.get_decoder().layers
    assert _module_for(model, "blk.1.attn_q.weight") is layers[1].self_attn.q_proj
    assert _module_for(model, "blk.0.attn_output.weight") is layers[0].self_attn.o_proj
    assert _module_for(model, "blk.2.ffn_down.weight") is layers[2].mlp.down_proj
    assert _module_for(model, "token_embd.weight") is model.get_output_embeddings()
    assert _module_for(model, "blk.9.attn_q.weight") is None  # no such layer
    assert _module_for(model, "blk.0.attn_norm.weight") is None  # not a linear
    untied = helpers.make_model(helpers.make_config("gemma3"))
    assert _module_for(untied, "token_embd.weight") is None
    assert _module_for(untied, "output.weight") is untied.get_output_embeddings()


def test_quantize_blocks_approximates_within_half_a_step():
    """Q8_0-style forms of a weight without a GGUF form: each weight within half a quantization
    step (scale / 2) of its original, codes in -127..127 with each block's largest at +-127, an
    all-zero block exact, and inputs not a multiple of the block refused."""
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    weight[2, 32:64] = 0.0
    form = quantize_blocks(weight)
    assert form.block == 32 and form.offsets is None and form.codes.dtype == torch.int8
    assert form.scales.shape == (6, 3)
    step = form.scales.repeat_interleave(32, dim=1)  # [6, 96]
    assert bool(((form.dequantize() - weight).abs() <= step / 2 + 1e-7).all())
    assert int(form.codes.abs().max()) == 127 and int(form.codes.min()) >= -127
    assert bool((form.codes.view(6, 3, 32).abs().amax(-1)[form.scales > 0] == 127).all())
    assert torch.equal(form.dequantize()[2, 32:64], torch.zeros(32))
    assert not torch.equal(form.dequantize(), weight)  # an approximation, not exact
    with pytest.raises(ValueError, match="multiple"):
        quantize_blocks(torch.randn(4, 40))


def test_auto_dtype_prefers_float32_for_a_block_kernel_model(monkeypatch, tmp_path):
    """'auto' is float32 for a model the block kernel runs, whatever the CPU; for any other model
    it is bfloat16 only where the CPU has native bf16 units."""
    from verispec.target import loading as model_module
    from verispec.errors import ModelLoadError

    for native in (True, False):
        monkeypatch.setattr(model_module, "cpu_has_native_bf16", lambda: native)
        assert model_module.resolve_dtype("auto", block_kernel_model=True) == torch.float32
        assert model_module.resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
        assert model_module.resolve_dtype("bfloat16", block_kernel_model=True) == torch.bfloat16
    with pytest.raises(ModelLoadError):
        model_module.resolve_dtype("int8", block_kernel_model=True)

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_module.runs_on_block_kernel(None)  # the embedded default (a C compiler is required here)
    assert model_module.runs_on_block_kernel(str(gguf))
    assert not model_module.runs_on_block_kernel(str(tmp_path / "missing.gguf"))
    assert not model_module.runs_on_block_kernel(str(tmp_path))  # a transformers directory
    assert not model_module.runs_on_block_kernel(None, fast=False)
    assert not model_module.runs_on_block_kernel(None, block_kernel=False)
    monkeypatch.setitem(blockmm._state, "kernel", (None, "no C compiler (cc) found"))
    assert not model_module.runs_on_block_kernel(None)


def test_the_kernel_sources_and_headers_are_built_and_shipped_together():
    """Every file a kernel source includes (headers, and qmatmul.c's per-instruction-set files, at
    any depth) is one the build copies beside the sources and hashes into its key
    (`build.INCLUDED`, also `blockmm.HEADERS`), none is compiled on its own, and the package ships
    both kinds of file."""
    import re
    from importlib import resources
    from pathlib import Path

    from verispec.runtime import build

    folder = resources.files("verispec.runtime.kernels")
    included, pending = set(), list(build.SOURCES)
    while pending:
        for name in re.findall(r'^\s*#include "([^"]+)"', folder.joinpath(pending.pop()).read_text(), re.M):
            if name not in included:
                included.add(name)
                pending.append(name)
    assert {"isa.h", "amx.h", "quants.h", "qmatmul_avx2.c", "qmatmul_portable.c", "qmatmul_amx.c"} <= included
    assert included == set(build.INCLUDED) == set(blockmm.HEADERS)
    assert not included & set(build.SOURCES)
    assert all(folder.joinpath(name).is_file() for name in build.INCLUDED)
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert '"runtime/kernels/*.c"' in pyproject and '"runtime/kernels/*.h"' in pyproject
