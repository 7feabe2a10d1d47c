"""Where the time of one target step goes: a decode step (1 token) and verify steps (8, 16).

Runs the default model after a 256-token context on the chosen forward path(s) under the PyTorch
profiler and groups the operators into parts: LM head, attention projections, attention itself,
MLP, norms, rotary embedding, cache writes/reads, masks, and the rest; "Python and framework
overhead" is the step's wall time minus the time inside operators. On the `blocks` path each
forward's decoder layers run in C (`native_layer`), shown as one part; `blocks-torch` runs the same
layers as PyTorch operators. Also measures the memory
read bandwidth (2 threads, summing a 1 GiB tensor) and prints the bandwidth floor of one step:
the bytes of the weights divided by that bandwidth; and the block kernel's multiply-adds per second
at 1 thread and at all threads (`bench.profile.arithmetic_rate`: the LM head's codes, 16 rows),
with the arithmetic each verify row past the first adds at that rate.

    python scripts/profile_step.py [--dtype float32] [--paths fast eager] [--widths 1 8 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import verispec
from verispec.bench.profile import arithmetic_rate, describe_arithmetic
from verispec.target.model import Target


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    data = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    data.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / min(times)


def classify(name: str, shapes, vocab: int, hidden: int) -> str:
    if name == NATIVE_LABEL:
        return "decoder layers in C"
    if name == "block kernel: LM head":
        return "LM head"
    if name == "block kernel: linear":
        return "linear layers (q/k/v/o, MLP)"
    if "linear" in name or name in ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm"):
        flat = str(shapes)
        if str(vocab) in flat:
            return "LM head"
        return "linear layers (q/k/v/o, MLP)"
    if "scaled_dot_product" in name or "softmax" in name:
        return "attention (SDPA)"
    if name in ("aten::gelu", "aten::silu", "aten::gelu_"):
        return "MLP activation"
    if name in ("aten::pow", "aten::mean", "aten::rsqrt", "aten::add_", "aten::norm"):
        return "norms"
    if name in ("aten::cos", "aten::sin", "aten::cat", "aten::neg", "aten::slice"):
        return "rotary / reshaping"
    if name in ("aten::index_copy_", "aten::copy_", "aten::index_select"):
        return "cache writes / copies"
    if name in ("aten::le", "aten::gt", "aten::__and__", "aten::bitwise_and", "aten::arange", "aten::masked_fill"):
        return "masks / positions"
    if name.startswith("aten::embedding"):
        return "embedding"
    return "other elementwise"


@contextmanager
def native_layers(target: Target, on: bool):
    """Run `target`'s block-kernel layers in C (on) or as PyTorch operators (off)."""
    fast = target.decoder
    if fast is None:  # the eager path has no layers of its own
        yield
        return
    before, fast.use_native = fast.use_native, on
    try:
        yield
    finally:
        fast.use_native = before


def weight_bytes(target: Target) -> int:
    """Bytes of weights one step of `target` reads: every parameter once (the tied embedding as
    the LM head), with the block forms' bytes in place of the float32 weights they replace."""
    total = sum(p.numel() * p.element_size() for p in target.model.parameters())
    if target.block_kernel_summary != "off":
        total += sum(form.nbytes - module.weight.numel() * module.weight.element_size()
                     for module, form in target.decoder.blocks.items())
    return total


NATIVE_LABEL = "native decoder layer"


def label_block_kernel(vocab: int) -> None:
    """Make the block kernel's calls and the C decoder layer's (ctypes, invisible to the
    profiler) show up as events."""
    from verispec.runtime import fastpath
    from verispec.runtime.fastpath import BlockLinear
    from verispec.runtime.native_layer import NativeLayer

    unlabelled_layer = NativeLayer.__call__

    def labelled_layer(self, *args):
        with record_function(NATIVE_LABEL):
            return unlabelled_layer(self, *args)

    NativeLayer.__call__ = labelled_layer
    unlabelled_layers = fastpath.run_layers_in_calls  # a whole forward's layers in one call

    def labelled_layers(*args, **kwargs):
        with record_function(NATIVE_LABEL):
            return unlabelled_layers(*args, **kwargs)

    fastpath.run_layers_in_calls = labelled_layers

    unlabelled = BlockLinear.__call__

    def labelled(self, x):
        part = "LM head" if self.blocks.codes.shape[0] == vocab else "linear"
        with record_function(f"block kernel: {part}"):
            return unlabelled(self, x)

    BlockLinear.__call__ = labelled


def profile_path(target: Target, context: list[int], width: int, repeats: int) -> tuple[float, dict]:
    vocab, hidden = target.vocab_size, target.config.hidden_size
    target.reset()
    target.forward(context, last_only=True)
    tokens = context[:width]
    for _ in range(2):
        target.forward(tokens)
        target.crop(len(context))
    walls = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(repeats):
            started = time.perf_counter()
            target.forward(tokens)
            walls.append(time.perf_counter() - started)
            target.crop(len(context))
    parts: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        parts[classify(event.key, event.input_shapes, vocab, hidden)] += event.self_cpu_time_total / 1e6 / repeats
    wall = statistics.median(walls)
    inside = sum(parts.values())
    parts["Python and framework overhead"] = max(0.0, sum(walls) / repeats - inside)
    return wall, dict(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--paths", nargs="+", default=["blocks", "blocks-torch", "fast", "eager"],
                        help="blocks: fast path on the int8 block kernel, the layers in C (one call per forward); blocks-torch: the "
                             "same with the layers as PyTorch operators; fast: fast path on float32 weights")
    parser.add_argument("--widths", nargs="+", type=int, default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    # the transformers model of the default GGUF file (numerics "fp32" loads it) on the int8 block kernel
    blocks = verispec.load(None, args.dtype, numerics="fp32")
    blocks.numerics = "int8"
    fast = Target(blocks.model, blocks.tokenizer, "fast", fast=True)
    targets = {"fast": fast, "blocks": blocks, "blocks-torch": blocks,
               "eager": Target(fast.model, fast.tokenizer, "eager", fast=False)}
    label_block_kernel(fast.vocab_size)
    context = torch.randint(1000, 20000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    bandwidth = read_bandwidth()
    print(f"threads {torch.get_num_threads()}, dtype {fast.dtype}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name in args.paths:
        size = weight_bytes(targets[name])
        print(f"{name} path: weights read per step {size / 1e9:.3f} GB, bandwidth floor {size / bandwidth * 1e3:.1f} ms/step")
    arithmetic = arithmetic_rate(blocks)
    if arithmetic:
        print(describe_arithmetic(arithmetic, blocks.numerics) + f" (the largest block form, {arithmetic['rows']} rows)")
    for width in args.widths:
        for name in args.paths:
            with native_layers(targets[name], name != "blocks-torch"):
                wall, parts = profile_path(targets[name], context, width, args.repeats)
            print(f"\n{name} path, width {width}: {wall * 1e3:.1f} ms per step (median of {args.repeats}; "
                  f"profiled, so a little slower than unprofiled)")
            print(f"  {'part':34} {'ms':>8} {'share':>6}")
            total = sum(parts.values())
            for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
                print(f"  {part:34} {seconds * 1e3:8.1f} {seconds / total:6.1%}")


if __name__ == "__main__":
    main()
