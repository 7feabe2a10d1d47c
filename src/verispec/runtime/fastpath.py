"""The fast forward path: an own layer loop over a static KV cache with prepacked linears.

Owns one thing: computing the decoder's hidden states for a chunk of tokens at given positions,
for the Llama family of architectures (Llama, Qwen2, Gemma 3 text), faster than transformers'
eager forward on CPU, with the same weights and the same per-layer math:

- the KV cache is `static_kv.StaticKV`, preallocated; rollback moves a length (no tensor copies);
- attention is one `scaled_dot_product_attention` per layer over the cached keys of the chunk's
  visible range (sliding-window layers see only their window), with an explicit causal mask only
  when the chunk has more than one token (a one-token step takes three small ops instead,
  `_attend_one`); grouped-query heads are not materialised;
- the q/k/v and gate/up projections are fused into one matrix each, and in float32 every linear
  is prepacked once for oneDNN (`torch.ops.mkldnn._linear_pointwise`): measured here, the
  262,144 x 640 LM head took 47 ms for 1 token and 102 ms for 16, against 94 and 266 ms with
  `F.linear`; 2048 x 640 took 0.25 ms against 0.97 ms;
- linears whose weights have an exact int8 block form (a GGUF model's, `gguf.blocks`) run on the
  block kernel (`BlockLinear`, `blockmm`): the same weights in a quarter of the bytes; a layer
  whose linears all do runs as one C call (`native_layer`) for chunks of up to
  `BLOCK_KERNEL_MAX_ROWS` tokens, the PyTorch layer below being its reference; when every layer
  of a `run` does, they all run in one call (`native_layer.run_layers`);
- activations and rotary embeddings are transformers' own modules and functions, called on our
  tensors, so the math is the model's, not a re-derivation; RMSNorms become one `F.rms_norm`
  call each where that is bit-identical to the module (`FusedNorm.of` checks it at load).

Everything else (sampling, drafting, text) is elsewhere. `FastDecoder.supports(model)` says
whether a model can use it, and why not; `model.Target` falls back to the eager forward with a
message for any other model. Exactness: greedy decoding on this path equals transformers'
`generate()` on the tiny models of every tested architecture (tests/test_equivalence.py).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .static_kv import StaticKV, Tree
from ..gguf.blocks import BlockWeights, quantize_blocks
from .linear import BlockLinear, FusedNorm, Linear, check_numerics, mkldnn_packing_available  # noqa: F401 - re-exported
from .native_layer import NativeLayer, run_layers_in_calls
from .rows import Rows

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "gemma3_text")
# Widest input sent to the block kernel in float32 activations ("fp32" numerics): it beat
# prepacked float32 on whole steps of 1, 2, 4, 8, 16, 24 and 32 tokens here (e.g. 32 tokens: 304
# vs 319 ms); wider chunks (prompts) use float32 there. With int8 activations every width runs on
# the kernel and the C layers (batch-invariant: one numerics for every row, however it is grouped).
BLOCK_KERNEL_MAX_ROWS = 64


@dataclass
class _Layer:
    """One decoder layer: transformers' norm/activation modules and our fused linears."""

    input_norm: "torch.nn.Module | FusedNorm"
    qkv: Linear
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    o: Linear
    post_attention_norm: torch.nn.Module | None  # Gemma: normalises the attention output
    pre_mlp_norm: torch.nn.Module  # Llama's post_attention_layernorm, Gemma's pre_feedforward
    post_mlp_norm: torch.nn.Module | None  # Gemma only
    gate_up: Linear
    down: Linear
    act: torch.nn.Module
    window: int | None
    scaling: float
    rope_layer_type: str | None
    native: "NativeLayer | None" = None  # the whole layer as one C call (native_layer.py)


class FastDecoder:
    """Hidden states of a Llama-family decoder, chunk by chunk, over a `StaticKV` cache."""

    @staticmethod
    def supports(model) -> str | None:
        """None if the fast path can run `model`, else the reason it cannot."""
        config = model.config
        model_type = getattr(config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            return f"architecture {model_type!r} (the fast path supports {', '.join(SUPPORTED_MODEL_TYPES)})"
        if getattr(config, "attn_logit_softcapping", None) is not None:
            return "attention logit soft-capping"
        if getattr(config, "use_bidirectional_attention", False):
            return "bidirectional attention"
        rope = getattr(config, "rope_parameters", None) or {}
        types = {p.get("rope_type", "default") for p in (rope.values() if "rope_type" not in rope else [rope])
                 if isinstance(p, dict)}
        if types - {"default", "linear", "llama3"}:
            return f"rope type {sorted(types)} (position-dependent scaling)"
        layer = model.get_decoder().layers[0]
        mlp = getattr(layer, "mlp", None)
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return "an MLP without gate/up/down projections"
        return None

    def __init__(self, model, blocks: dict | None = None, kernel=None, numerics: str = "fp32"):
        """blocks: {nn.Linear: BlockWeights} exact block forms of some of the model's linears
        (`gguf.blocks`); with a `kernel` (`blockmm.kernel()`), those run on the block kernel, in
        `numerics` ("int8" or "fp32", see `blockmm`; changeable later through `numerics`)."""
        reason = self.supports(model)
        assert reason is None, reason
        check_numerics(numerics)
        self.config = model.config
        self.blocks = blocks if (blocks and kernel is not None) else {}  # the forms actually in use
        self._kernel = kernel
        self._numerics = numerics
        from weakref import WeakSet

        self._on_kernel = WeakSet()  # every BlockLinear and NativeLayer built here (their numerics follow ours)
        body = model.get_decoder()
        self.embed_tokens = body.embed_tokens
        self.norm = FusedNorm.of(body.norm)
        self.rotary = body.rotary_emb
        self._rotary_takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        self.heads = self.config.num_attention_heads
        self.kv_heads = self.config.num_key_value_heads
        self.head_dim = getattr(self.config, "head_dim", None) or self.config.hidden_size // self.heads
        self.dtype = next(model.parameters()).dtype
        self.use_native = True  # layers with a C form run it (set False to compare with the PyTorch path)
        self.layers = [self._wrap(layer) for layer in body.layers]
        first = body.layers[0].self_attn
        self.apply_rotary = sys.modules[type(first).__module__].apply_rotary_pos_emb

    def _wrap(self, layer, blocks: dict | None = None) -> _Layer:
        """`layer` as a fast-path layer; its linears' block forms come from `blocks`
        ({nn.Linear: BlockWeights}), by default the model's own."""
        attn, mlp = layer.self_attn, layer.mlp
        linear = lambda *modules: self.linear(*modules, blocks=blocks)  # noqa: E731
        gemma_style = hasattr(layer, "pre_feedforward_layernorm")
        layer_types = getattr(self.config, "layer_types", None)
        rope_type = layer_types[attn.layer_idx] if (layer_types and self._rotary_takes_type) else None
        norm = FusedNorm.of
        wrapped = _Layer(
            input_norm=norm(layer.input_layernorm),
            qkv=linear(attn.q_proj, attn.k_proj, attn.v_proj),
            q_norm=norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
            k_norm=norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
            o=linear(attn.o_proj),
            post_attention_norm=norm(layer.post_attention_layernorm) if gemma_style else None,
            pre_mlp_norm=norm(layer.pre_feedforward_layernorm if gemma_style else layer.post_attention_layernorm),
            post_mlp_norm=norm(layer.post_feedforward_layernorm) if gemma_style else None,
            gate_up=linear(mlp.gate_proj, mlp.up_proj),
            down=linear(mlp.down_proj),
            act=mlp.act_fn,
            window=getattr(attn, "sliding_window", None),
            scaling=attn.scaling,
            rope_layer_type=rope_type,
        )
        if self.blocks and self.dtype == torch.float32:
            wrapped.native = NativeLayer.of(wrapped, self.heads, self.kv_heads, self.head_dim, self._kernel,
                                            self._numerics)
            if wrapped.native is not None:
                self._on_kernel.add(wrapped.native)
        return wrapped

    @property
    def numerics(self) -> str:
        """How the block kernel multiplies ("int8" or "fp32"): every `BlockLinear` and C layer
        built by this decoder (its layers, the LM head, an exit head's layer and projection)
        follows it; setting it switches them all."""
        return self._numerics

    @numerics.setter
    def numerics(self, value: str) -> None:
        check_numerics(value)
        self._numerics = value
        for part in self._on_kernel:
            part.numerics = value

    def linear(self, *modules: torch.nn.Linear, blocks: dict | None = None, rarely_wide: bool = False
               ) -> "Linear | BlockLinear":
        """The fast form of one nn.Linear, or of several fused (outputs concatenated): on the
        block kernel where every part has a block form in `blocks` (default: the model's exact
        ones), else prepacked float32. `rarely_wide`: the float32 form behind the block kernel is
        packed only if an input wider than the kernel takes is ever given (the LM head's)."""
        forms = self.blocks if blocks is None else blocks
        parts = BlockWeights.concat([forms.get(module) for module in modules])
        lazy = rarely_wide and parts is not None
        dense = Linear.fused(*modules) if len(modules) > 1 else Linear(modules[0].weight, modules[0].bias, lazy)
        return self.on_blocks(dense, parts)

    def on_blocks(self, dense: Linear, blocks: "BlockWeights | None") -> "Linear | BlockLinear":
        """`dense` on the block kernel where `blocks` (its weight's exact block form) is given."""
        if blocks is None:
            return dense
        linear = BlockLinear(blocks, dense, self._kernel, BLOCK_KERNEL_MAX_ROWS, self._numerics)
        self._on_kernel.add(linear)
        return linear

    @property
    def kernel_isa(self) -> str | None:
        """The block kernel's instruction-set build ("avx512vnni", ..., "portable"), or None."""
        return None if self._kernel is None else self._kernel.isa

    @property
    def native_layers(self) -> int:
        """How many layers run as one C call (`native_layer`) for chunks of up to
        `BLOCK_KERNEL_MAX_ROWS` tokens, contiguous or placed as a tree."""
        return sum(layer.native is not None for layer in self.layers)

    @property
    def block_linears(self) -> int:
        """How many of the layers' linears run on the block kernel."""
        return sum(isinstance(linear, BlockLinear) for layer in self.layers
                   for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))

    def new_cache(self, capacity: int = 256, layers: int | None = None) -> StaticKV:
        count = len(self.layers) if layers is None else layers
        return StaticKV(count, self.kv_heads, self.head_dim, self.dtype, capacity)

    def wrap_layer(self, layer, quantize: bool = False) -> "_Layer":
        """A transformers decoder layer of this architecture (e.g. a trained exit head's layer)
        as a fast-path layer; run it with `run_layer`. With `quantize`, and when this decoder runs
        on the block kernel, its linears get Q8_0-style int8 forms (`quantize_blocks`, an
        approximation of their weights) so that it runs on the block kernel and, where the
        layer allows, as one C call; otherwise they stay float32."""
        if not (quantize and self.blocks and self.dtype == torch.float32):
            return self._wrap(layer)
        modules = [module for module in layer.modules() if isinstance(module, torch.nn.Linear)]
        if any(module.in_features % 32 for module in modules):
            return self._wrap(layer)
        return self._wrap(layer, {module: quantize_blocks(module.weight) for module in modules})

    @torch.inference_mode()
    def run_layer(self, layer: "_Layer", x: torch.Tensor, start: int, cache: StaticKV, cache_layer: int = 0,
                  tree: "Tree | None" = None) -> torch.Tensor:
        """One extra layer (not one of the model's) over x [n, hidden] at positions start..
        (or placed by `tree`), with its keys/values in `cache` layer `cache_layer`."""
        placement = tree or Tree.contiguous(start, x.shape[0])
        cache.reserve(placement.end)
        args = (layer.rope_layer_type,) if layer.rope_layer_type is not None else ()
        rope = self.rotary(x, placement.positions.unsqueeze(0), *args)
        return self._layer(layer, cache_layer, x, placement, cache, rope)

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor, cache: StaticKV) -> torch.Tensor:
        """Final-normed states of `ids` [n] at positions cache.length..; appends their keys and
        values to the cache and advances its length. Returns [n, hidden]."""
        start = cache.length
        x = self.run(self.embed(ids), start, cache)
        cache.length = start + ids.shape[0]
        return self.norm(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of ids [n] -> [n, hidden]."""
        return self.embed_tokens(ids.unsqueeze(0))[0]

    @torch.inference_mode()
    def run(self, x: torch.Tensor, start: int, cache: StaticKV, layers: range | None = None,
            tree: "Tree | None" = None, rope: dict | None = None) -> torch.Tensor:
        """The residual stream x [n, hidden] at positions start..start+n-1 (or placed by `tree`)
        through `layers` (default: all), writing their keys/values into `cache` (its length is
        left alone: the caller decides what is committed). Returns the residual stream after the
        last layer. `rope`: a dict shared by calls over the same positions (a forward split in
        two), which fills it with the rotary tables per layer type so they are computed once.
        `cache` is a `StaticKV` or a paged sequence (`kv_pool.PagedKV`, C layers only)."""
        placement = tree or Tree.contiguous(start, x.shape[0])
        layers = layers if layers is not None else range(len(self.layers))
        cache.reserve(placement.end)
        if self.runs_in_c(layers, x.shape[0]):
            return self.run_rows(x, placement.c_rows(cache.block_table, cache.pool_blocks), cache, layers, rope)
        assert isinstance(cache, StaticKV), "a paged cache needs every layer in C"
        rope = self._rope(x, placement.positions.unsqueeze(0), layers, {} if rope is None else rope)
        for index in layers:
            layer = self.layers[index]
            x = self._layer(layer, index, x, placement, cache, rope[layer.rope_layer_type])
        return x

    def runs_in_c(self, layers: range, n: int) -> bool:
        """Whether `layers` run as one C call for n rows: all of them have a C form, and the
        numerics is int8 (every width: batch-invariant) or n is at most BLOCK_KERNEL_MAX_ROWS."""
        return (self.use_native and (n <= BLOCK_KERNEL_MAX_ROWS or self._numerics == "int8")
                and all(self.layers[index].native is not None for index in layers))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, layers: range, rope: dict) -> dict:
        """`rope` filled with the rotary tables (cos, sin) [1, n, head_dim] of `positions` [1, n]
        for every layer type among `layers`."""
        for index in layers:
            kind = self.layers[index].rope_layer_type
            if kind not in rope:
                args = (kind,) if kind is not None else ()
                rope[kind] = self.rotary(x, positions, *args)
        return rope

    @torch.inference_mode()
    def run_rows(self, x: torch.Tensor, rows: Rows, pools, layers: range | None = None,
                 rope: dict | None = None) -> torch.Tensor:
        """x [n, hidden] through `layers` (default: all; every one in C) for the rows `rows`
        describes (one sequence's or several sequences', `rows.Rows`), their keys and values in
        `pools` (`.keys[i]`, `.values[i]`: layer i's [kv, blocks * BLOCK, d]), in calls of at most
        `native_layer.CALL_ROWS` rows. Returns the residual stream after the last layer [n, hidden]."""
        layers = layers if layers is not None else range(len(self.layers))
        chosen = [self.layers[index].native for index in layers]
        assert all(chosen), "run_rows runs C layers only"
        positions = torch.from_numpy(rows.positions).unsqueeze(0)  # [1, n]
        rope = self._rope(x, positions, layers, {} if rope is None else rope)
        kinds = [self.layers[index].rope_layer_type for index in layers]
        keys, values = [pools.keys[i] for i in layers], [pools.values[i] for i in layers]
        return run_layers_in_calls(chosen, x, rows, [rope[kind] for kind in kinds], keys, values)

    def _attend_one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one query token q [1, heads, 1, d] over keys/values [kv, L, d] as three
        small ops: CPU flash attention (SDPA) took about 250 us per layer at L = 256 (profiled);
        with this, a whole 1-token step's attention fell from 3.3 to 1.6 ms (scripts/profile_step.py).
        Query heads are grouped per key/value head as SDPA's enable_gqa does (head h reads kv
        head h // (heads / kv)). Returns [1, heads * d]."""
        kv, length, d = keys.shape
        grouped = q.reshape(kv, self.heads // kv, d)  # [kv, g, d]
        scores = torch.matmul(grouped, keys.transpose(1, 2)).mul_(scale)  # [kv, g, L]
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [kv, g, d]
        return out.reshape(1, self.heads * d)

    def _layer(self, layer: _Layer, index: int, x: torch.Tensor, placement: "Tree", cache: StaticKV, rope) -> torch.Tensor:
        n = x.shape[0]
        if layer.native is not None and self.use_native and (n <= BLOCK_KERNEL_MAX_ROWS or self._numerics == "int8"):
            cos, sin = rope
            rows = placement.c_rows(cache.block_table, cache.pool_blocks)
            return layer.native(x, rows, cos, sin, cache.keys[index], cache.values[index])
        h = layer.input_norm(x)
        q, k, v = layer.qkv(h).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(1, n, self.heads, self.head_dim).transpose(1, 2)  # [1, heads, n, d]
        k = k.view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)  # [1, kv, n, d]
        v = v.view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = rope
        q, k = self.apply_rotary(q, k, cos, sin)
        keys, values, mask = placement.attend(cache, index, k[0], v[0], layer.window)  # [kv, L, d], [n, L]
        if n == 1 and mask is None:
            attended = self._attend_one(q, keys, values, layer.scaling)  # [1, heads * d]
        else:
            attended = F.scaled_dot_product_attention(
                q, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=layer.scaling,
                enable_gqa=self.heads != self.kv_heads,
            ).transpose(1, 2).reshape(n, self.heads * self.head_dim)  # [n, heads * d]
        attended = layer.o(attended)
        if layer.post_attention_norm is not None:
            attended = layer.post_attention_norm(attended)
        x = x + attended
        h = layer.pre_mlp_norm(x)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        mlp = layer.down(layer.act(gate) * up)
        if layer.post_mlp_norm is not None:
            mlp = layer.post_mlp_norm(mlp)
        return x + mlp
