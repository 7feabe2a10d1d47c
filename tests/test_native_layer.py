"""The C decoder layer (`native_layer`, `kernels/decoder_layer.c`) against the PyTorch layer
(`FastDecoder._layer`) on the same block-form weights: logits and cache contents for one-token
steps, multi-token chunks and trees of drafts, before and past the sliding window, for every
fast architecture; which layers it takes and which it refuses."""

from __future__ import annotations

import pytest
import torch

from helpers import FAST_ARCHITECTURES, SLIDING_WINDOW, make_target_for_path
from verispec.runtime import blockmm, fastpath, native_layer
from verispec.runtime.fastpath import BLOCK_KERNEL_MAX_ROWS, FastDecoder, Linear, Tree
from verispec.runtime.native_layer import NativeLayer, recognise_activation, why_not
from verispec.runtime.rows import Rows

KEY_CHUNK = 64  # keys per attention task in kernels/decoder_layer.c

# No skip without a compiler: the project needs `cc` (README), so a missing kernel fails here.


def _run(target, chunks: list[list[int]], native: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits of each chunk fed in turn, and the keys of every layer afterwards."""
    target.decoder.use_native = native
    target.reset()
    logits = [target.forward(chunk) for chunk in chunks]
    length = target.cache.length
    keys = [k[:, :length].clone() for k in target.cache.keys] + [v[:, :length].clone() for v in target.cache.values]
    return logits, keys


@pytest.mark.parametrize("arch", FAST_ARCHITECTURES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_layer_matches_the_pytorch_layer(arch, seed):
    target = make_target_for_path(f"{arch}-blocks", seed=seed)
    fast = target.decoder
    assert fast.native_layers == len(fast.layers), why_not(fast.layers[0], blockmm.kernel()[0], fast.heads,
                                                           fast.kv_heads, fast.head_dim)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (3 * SLIDING_WINDOW + 7,), generator=generator).tolist()
    # a prompt, one-token steps (past the window), a 5-token chunk, one step more, a wide chunk
    cut = [0, 6, 7, 8, 9, 2 * SLIDING_WINDOW, 2 * SLIDING_WINDOW + 5, 2 * SLIDING_WINDOW + 6, len(tokens)]
    chunks = [tokens[a:b] for a, b in zip(cut, cut[1:])]
    ours, our_cache = _run(target, chunks, native=True)
    theirs, their_cache = _run(target, chunks, native=False)
    for mine, reference in zip(ours + our_cache, theirs + their_cache):
        assert mine.shape == reference.shape
        scale = reference.abs().max().item()
        assert (mine - reference).abs().max().item() <= 1e-5 * max(scale, 1.0)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine.argmax(-1), reference.argmax(-1))


def test_native_layer_leaves_its_input_alone():
    target = make_target_for_path("gemma3-blocks")
    fast = target.decoder
    assert fast.use_native and fast.native_layers == len(fast.layers)  # so run() below goes through C
    cache = fast.new_cache(16)
    x = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    out = fast.run(x, 0, cache)
    assert torch.equal(x, before) and not torch.equal(out, before)


def test_recognise_activation():
    assert recognise_activation(torch.nn.SiLU()) == "silu"
    assert recognise_activation(lambda t: torch.nn.functional.gelu(t, approximate="tanh")) == "gelu_tanh"
    assert recognise_activation(torch.nn.GELU()) is None  # exact (erf) GELU differs by up to ~1e-3
    assert recognise_activation(torch.nn.ReLU()) is None
    assert recognise_activation(lambda t: 1 / 0) is None


def test_layers_without_block_forms_keep_the_pytorch_path():
    target = make_target_for_path("llama")  # float32 fast path, no block forms
    assert target.decoder.native_layers == 0
    blocks = make_target_for_path("llama-blocks").decoder
    layer = blocks.layers[0]
    dense = type(layer)(**{**layer.__dict__, "down": Linear(torch.zeros(64, 128), None), "native": None})
    kernel = blockmm.kernel()[0]
    shape = (blocks.heads, blocks.kv_heads, blocks.head_dim)
    assert why_not(layer, kernel, *shape) is None
    assert NativeLayer.of(dense, blocks.heads, blocks.kv_heads, blocks.head_dim, kernel) is None
    assert "block form" in why_not(dense, kernel, *shape)
    relu = type(layer)(**{**layer.__dict__, "act": torch.nn.ReLU(), "native": None})
    assert NativeLayer.of(relu, blocks.heads, blocks.kv_heads, blocks.head_dim, kernel) is None
    assert "activation" in why_not(relu, kernel, *shape)
    assert "decoder_layers" in why_not(layer, object(), *shape)  # a kernel library without the C layer
    assert "shapes" in why_not(layer, kernel, blocks.heads * 2, blocks.kv_heads, blocks.head_dim)


def test_wide_chunks_use_the_pytorch_layer(monkeypatch):
    target = make_target_for_path("qwen2-blocks")
    calls = []
    original = native_layer.run_layers

    def counted(layers, x, *args, **kwargs):
        calls.append((x.shape[0], len(layers)))
        return original(layers, x, *args, **kwargs)

    monkeypatch.setattr(native_layer, "run_layers", counted)
    target.reset()
    target.forward(list(range(5)) * ((BLOCK_KERNEL_MAX_ROWS + 10) // 5))  # wider than the kernel takes
    assert calls == []
    target.forward([1, 2, 3])
    assert calls == [(3, len(target.decoder.layers))]  # all layers in one C call


def _beam_tree(context: int, beams: int, depth: int) -> Tree:
    """`beams` continuations of `depth` tokens each, side by side in the slots after a context."""
    n = beams * depth
    positions = torch.tensor([context + step for _ in range(beams) for step in range(depth)])
    slots = torch.arange(context, context + n)
    visible = torch.zeros(n, context + n, dtype=torch.bool)
    visible[:, :context] = True
    for beam in range(beams):
        for step in range(depth):
            row = beam * depth + step
            visible[row, context + beam * depth : context + beam * depth + step + 1] = True
    slot_positions = torch.cat([torch.arange(context), positions])
    return Tree(positions, slots, visible, slot_positions)


@pytest.mark.parametrize("arch", FAST_ARCHITECTURES)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_layer_on_a_tree_of_drafts_matches(arch, threads):
    """Beam drafts placed side by side in scratch slots (a tree), past the sliding window."""
    target = make_target_for_path(f"{arch}-blocks", seed=4)
    fast = target.decoder
    assert fast.native_layers == len(fast.layers)  # so the native run below really is C
    context, beams, depth = 2 * SLIDING_WINDOW + 1, 3, 4
    ids = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(4))
    drafts = torch.randint(0, target.vocab_size, (beams * depth,), generator=torch.Generator().manual_seed(5))
    tree = _beam_tree(context, beams, depth)
    window_mask = tree.slot_mask(SLIDING_WINDOW)  # built once per window, shared by the layers
    assert window_mask is tree.slot_mask(SLIDING_WINDOW) and tree.slot_mask(None) is tree.visible
    results = []
    before = torch.get_num_threads()
    for native in (True, False):
        fast.use_native = native
        cache = fast.new_cache(64)
        fast.hidden_states(ids, cache)
        try:
            torch.set_num_threads(threads)
            out = fast.run(fast.embed(drafts), context, cache, tree=tree)
        finally:
            torch.set_num_threads(before)
        results.append([out] + [k[:, : tree.end].clone() for k in cache.keys + cache.values])
    fast.use_native = True
    for mine, reference in zip(*results):
        assert (mine - reference).abs().max().item() <= 1e-5 * max(reference.abs().max().item(), 1.0)
    # Each beam equals its own path run contiguously after the context: the tree's placement and
    # window mask are right, not only the same in C and in PyTorch.
    for beam in range(beams):
        cache = fast.new_cache(64)
        fast.hidden_states(ids, cache)
        alone = fast.run(fast.embed(drafts[beam * depth : (beam + 1) * depth]), context, cache)  # [depth, hidden]
        mine = results[0][0][beam * depth : (beam + 1) * depth]
        assert (mine - alone).abs().max().item() <= 1e-4 * max(alone.abs().max().item(), 1.0), beam


def test_bad_arguments_are_refused_not_computed():
    """Rows the C layer cannot read are refused with nothing written: positions past the pool, a
    tree path that does not end at the row's own slot, a path of the wrong length, a block
    table entry outside the pool."""
    target = make_target_for_path("llama-blocks")
    fast: FastDecoder = target.decoder
    layer = fast.layers[0].native
    cache = fast.new_cache(4)  # one block of 64 positions
    x = torch.zeros(2, target.config.hidden_size)
    cos = sin = torch.zeros(2, fast.head_dim)
    before = cache.keys[0].clone()
    bad = [
        Rows.contiguous(63, 2, cache.block_table, cache.pool_blocks),  # position 64 past the only block
        Rows.placed([5, 6], [70, 6], 5, [[70], [71, 6]], cache.block_table, cache.pool_blocks),  # slot 70
        Rows.placed([5, 6], [8, 9], 5, [[8], [8, 9, 10]], cache.block_table, cache.pool_blocks),  # path too long
        Rows.placed([5, 6], [8, 9], 5, [[8], [9, 8]], cache.block_table, cache.pool_blocks),  # ends elsewhere
        Rows.contiguous(0, 2, [1], cache.pool_blocks),  # a table naming a block the pool lacks
    ]
    for rows in bad:
        with pytest.raises(RuntimeError, match="refused"):
            layer(x, rows, cos, sin, cache.keys[0], cache.values[0])
    assert torch.equal(cache.keys[0], before)


def _assert_native_matches_on(target, chunks: list[list[int]], threads: int) -> None:
    """The C layers on `threads` threads give the PyTorch layers' logits and cache (relative 1e-5)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ours, our_cache = _run(target, chunks, native=True)
    finally:
        torch.set_num_threads(before)
    theirs, their_cache = _run(target, chunks, native=False)
    for mine, reference in zip(ours + our_cache, theirs + their_cache):
        assert (mine - reference).abs().max().item() <= 1e-5 * max(reference.abs().max().item(), 1.0)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_attention_split_over_threads_matches(threads):
    """One-token steps cut each key range into chunks of KEY_CHUNK keys at fixed positions, run
    over the threads as separate tasks, then merged: past two chunk boundaries (and the sliding
    window), at 1, 3 and 5 threads, the C layers must match the PyTorch layers."""
    target = make_target_for_path("gemma3-blocks", seed=3)
    assert target.decoder.native_layers == len(target.decoder.layers)
    count = max(2 * KEY_CHUNK, 2 * SLIDING_WINDOW) + 3  # keys in three chunks at the last steps
    tokens = torch.randint(0, target.vocab_size, (count,), generator=torch.Generator().manual_seed(3))
    chunks = [[t] for t in tokens.tolist()]  # a one-token prompt, then one token at a time
    _assert_native_matches_on(target, chunks, threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_wide_heads_and_large_groups_match(threads):
    """Head dimension 80 (the attention's vector path for the first 64 outputs, the scalar path
    for the other 16) and six query heads per key/value head (the heads' weighted sums taken four
    at a time, then two): shapes the tiny architectures (head dimension 16, groups of 2) never
    reach, against the PyTorch layer, for a prompt, one-token steps and chunks."""
    from helpers import blockify, make_config, make_model
    from verispec.target.model import Target

    config = make_config("llama", num_attention_heads=6, num_key_value_heads=1, head_dim=80)
    model = make_model(config, seed=7)
    target = Target(model, None, fast=True, blocks=blockify(model))
    assert target.decoder.native_layers == len(target.decoder.layers)
    tokens = torch.randint(0, target.vocab_size, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    chunks = [tokens[:19], *[[t] for t in tokens[19:23]], tokens[23:28], tokens[28:29], tokens[29:]]
    _assert_native_matches_on(target, chunks, threads)


def _one_call_per_layer(layers, x, rows, rope, keys, values):
    """What `run_layers_in_calls` replaces: each C layer called from Python in turn."""
    for i, layer in enumerate(layers):
        x = layer(x, rows, *rope[i], keys[i], values[i])
    return x


@pytest.mark.parametrize("arch", FAST_ARCHITECTURES)
@pytest.mark.parametrize("numerics", ["fp32", "int8"])
def test_all_layers_in_one_call_equal_one_call_per_layer(arch, numerics, monkeypatch):
    """`run_layers` (the whole forward in one C call) against the layers called one by one: bit
    for bit, for prompts, one-token steps past the window, chunks and a tree of drafts. In int8
    numerics (batch-invariant) also in calls of 3 rows, as a forward wider than CALL_ROWS runs;
    fp32 numerics sum in an order that depends on the rows of a call."""
    target = make_target_for_path(f"{arch}-blocks", seed=6)
    target.numerics = numerics
    fast = target.decoder
    assert fast.native_layers == len(fast.layers)
    tokens = torch.randint(0, target.vocab_size, (2 * SLIDING_WINDOW + 9,), generator=torch.Generator().manual_seed(6))
    cut = [0, 5, 6, 2 * SLIDING_WINDOW, 2 * SLIDING_WINDOW + 1, len(tokens)]
    chunks = [tokens[a:b].tolist() for a, b in zip(cut, cut[1:])]
    tree = _beam_tree(len(tokens), 2, 3)
    drafts = torch.randint(0, target.vocab_size, (6,), generator=torch.Generator().manual_seed(7))

    def run() -> list[torch.Tensor]:
        target.reset()
        outputs = [target.forward(chunk) for chunk in chunks]
        outputs.append(fast.run(fast.embed(drafts), 0, target.cache, tree=tree))
        return outputs + [k[:, : tree.end].clone() for k in target.cache.keys + target.cache.values]

    runs = {"one call": run()}
    if numerics == "int8":
        with monkeypatch.context() as patch:
            patch.setattr(native_layer, "CALL_ROWS", 3)
            runs["calls of 3 rows"] = run()
    monkeypatch.setattr(fastpath, "run_layers_in_calls", _one_call_per_layer)
    per_layer = run()
    for label, outputs in runs.items():
        assert len(outputs) == len(per_layer)
        for mine, reference in zip(outputs, per_layer):
            assert torch.equal(mine, reference), label


def test_run_layers_refuses_bad_arguments():
    target = make_target_for_path("llama-blocks")
    fast = target.decoder
    cache = fast.new_cache(4)
    layers = [layer.native for layer in fast.layers]
    rope = [(torch.zeros(2, fast.head_dim), torch.zeros(2, fast.head_dim))] * len(layers)
    x = torch.zeros(2, target.config.hidden_size)
    with pytest.raises(RuntimeError, match="refused"):  # positions 63, 64 past a capacity of 64
        native_layer.run_layers(layers, x, Rows.contiguous(63, 2, cache.block_table, cache.pool_blocks), rope,
                                cache.keys, cache.values)
