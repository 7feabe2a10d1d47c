"""verispec profile's core: forward costs by width, as milliseconds and ratios."""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.bench.profile import arithmetic_rate, format_profile, profile_target, timing_context
from verispec.core.drafters.early_exit import ExitHead, PreparedHead


@pytest.mark.parametrize("path", ["llama", "llama-blocks", "llama-eager", "gemma3-eager"])
def test_profile_reports_every_width_its_ratio_and_the_draft_step(path):
    target = helpers.make_target_for_path(path, seed=0)
    head = PreparedHead(target, ExitHead(target.model, 1, list(range(64))), quantize=False)
    profile = profile_target(target, context_length=24, widths=(4, 2), prepared_head=head, repeats=2, rounds=1)
    assert list(profile["widths"]) == ["1", "2", "4"] and list(profile["ratios"]) == ["2", "4"]
    for width in ("2", "4"):
        assert profile["ratios"][width] == pytest.approx(profile["widths"][width] / profile["widths"]["1"], rel=1e-2)
    assert profile["context"] == 24 and profile["draft_ms"] > 0
    assert profile["numerics"] == target.numerics
    assert list(profile["rejected"]) == ["2", "4"] and list(profile["rejected_ratios"]) == ["2", "4"]
    assert all(ms > 0 for ms in profile["rejected"].values())
    text = format_profile(profile)
    on_blocks = path == "llama-blocks"
    assert "EESD draft token" in text and len(text.splitlines()) == 7 + on_blocks  # the weights-read line too
    assert "rejected ms" in text and f"{profile['rejected']['4']:12.2f}" in text.splitlines()[-2 - on_blocks]
    if target.fast:
        assert target.cache.length == 24  # the context stays; the timed forwards were cropped
    else:  # the PyTorch path: every layer holds the context, none a timed draft's rows
        assert [int(layer.get_seq_length()) for layer in target.cache.layers] == [24] * len(target.cache.layers)
    assert bool(target.block_forms) == on_blocks and (profile["arithmetic"] is not None) == on_blocks
    if on_blocks:
        arithmetic = profile["arithmetic"]
        rates = arithmetic["multiply_adds_per_s"]
        assert arithmetic["rows"] == 16 and set(rates) == {"1", str(torch.get_num_threads())}
        assert all(rate > 0 for rate in rates.values())
        linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]  # all on the block kernel
        assert arithmetic["row_multiply_adds"] == sum(m.weight.numel() for m in linears)
        assert arithmetic["row_ms"] == pytest.approx(arithmetic["row_multiply_adds"] / max(rates.values()) * 1e3,
                                                     abs=1e-3)  # rounded to microseconds
        assert text.splitlines()[-1].startswith(f"{target.numerics} products, multiply-adds/s: ")


@pytest.mark.parametrize("path", ["llama", "llama-eager", "gemma3-eager"])
def test_a_beam_step_is_timed_and_leaves_the_context_in_every_layer(path):
    from verispec.bench.profile import draft_step_seconds

    target = helpers.make_target_for_path(path, seed=0)
    head = PreparedHead(target, ExitHead(target.model, 1, list(range(64))), quantize=False)
    context = timing_context(24, target.vocab_size)
    one, beams = (draft_step_seconds(target, head, context, repeats=2, width=w) for w in (1, 4))
    assert one > 0 and beams > 0
    if target.fast:
        assert target.cache.length == 24
    else:
        assert [int(layer.get_seq_length()) for layer in target.cache.layers] == [24] * len(target.cache.layers)
    # the target still continues the context as a fresh forward of it does
    after = target.forward(context[:1], last_only=True)
    target.reset()
    expected = target.forward(context + context[:1], last_only=True)
    assert torch.allclose(after, expected, atol=1e-4)


def test_arithmetic_rate_restores_the_thread_count_when_a_product_fails(monkeypatch):
    """It times at 1 thread, then at the process's count: a failure at 1 thread must not leave
    the process on 1 thread."""
    from verispec.runtime import blockmm

    target = helpers.make_target_for_path("llama-blocks", seed=0)

    def failing(self, x, form, numerics="fp32"):
        raise RuntimeError("refused")

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(blockmm.Kernel, "matmul", failing)
        with pytest.raises(RuntimeError, match="refused"):
            arithmetic_rate(target, rows=4, repeats=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_timing_context_is_fixed_and_inside_the_vocabulary():
    assert timing_context(16, 100) == timing_context(16, 100)
    assert all(0 <= t < 100 for t in timing_context(64, 100)) and len(timing_context(64, 100)) == 64


def test_the_batched_curve_and_the_prefill_rate_on_a_target_that_batches():
    from verispec.bench.profile import batched_decode, format_batched, prefill_rate
    from verispec.target.model import Target

    model = helpers.make_model(helpers.make_config("gemma3"), 0)
    target = Target(model, None, fast=True, blocks=helpers.blockify(model), numerics="int8")
    curve = batched_decode(target, (4, 2), context_length=70, repeats=2)
    assert list(curve["ms"]) == ["1", "2", "4"] and curve["ratios"]["1"] == 1.0
    for n in ("2", "4"):
        assert curve["tokens_per_s"][n] == pytest.approx(int(n) / (curve["ms"][n] / 1e3), rel=1e-2)
    config = model.config
    assert curve["kv_bytes_per_token"] == 2 * config.num_hidden_layers * config.num_key_value_heads * \
        config.head_dim * 4
    assert target.pool.used_blocks == 0  # the timed sequences were released
    prefill = prefill_rate(target, 100, repeats=1)
    assert prefill["tokens"] == 100 and prefill["tokens_per_s"] == pytest.approx(100 / (prefill["ms"] / 1e3), rel=1e-2)
    assert target.prefix_cache and len(target.pool.prefix) == 0  # nothing cached by the timing
    lines = format_batched(curve, prefill).splitlines()
    assert len(lines) == 2 + 3 + 1 and lines[-1].startswith("prefill of 100 tokens")


def test_the_integer_roof_and_the_share_of_it_a_prefill_reaches(tmp_path):
    """On a GGUF file's own blocks: the wide product's multiply-adds per second on the largest
    quantized layer matrix, a token's multiply-adds through every layer matrix, and the prefill's
    share of the roof; None on a target without GGUF matrices."""
    pytest.importorskip("gguf")
    from gguf_models import write_tiny_gguf
    from verispec.bench.profile import format_batched, integer_roof, prefill_rate, roof_fraction
    from verispec.gguf.metadata import read_gguf_model
    from verispec.runtime import blockmm, qmatmul
    from verispec.runtime.gguf_decoder import GgufDecoder
    from verispec.target.model import Target

    gguf = read_gguf_model(write_tiny_gguf(tmp_path / "m.gguf", "qwen2"), cache_dir=tmp_path / "cache")
    target = Target.of_decoder(GgufDecoder(gguf, blockmm.kernel()[0]), gguf.config, gguf.tokenizer, gguf.name,
                               gguf.eos_token_ids)
    roof = integer_roof(target, rows=32, repeats=1)
    matrices = [m for layer in target.decoder.layers for m in layer.keep if isinstance(m, qmatmul.QMatrix)]
    quantized = [m for m in matrices if m.type not in qmatmul.FLOAT_TYPES]
    largest = max(quantized, key=lambda m: m.rows * m.cols)
    assert roof["rows"] == 32 and roof["type"] == largest.type_name and roof["shape"] == [largest.rows, largest.cols]
    assert roof["multiply_adds_per_s"] > 0
    assert roof["token_multiply_adds"] == sum(m.rows * m.cols for m in matrices)
    prefill = prefill_rate(target, 40, repeats=1)
    fraction = roof_fraction(prefill, roof)
    assert fraction == pytest.approx(prefill["tokens_per_s"] * roof["token_multiply_adds"] / roof["multiply_adds_per_s"])
    line = format_batched(None, prefill, roof).splitlines()[-1]
    assert line.startswith("integer roof: ") and f"{100 * fraction:.0f}% of it" in line

    assert integer_roof(helpers.make_target("llama")) is None
