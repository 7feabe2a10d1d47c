"""A decoder that runs a GGUF file's own quantized blocks: no float32 copy of any weight.

Owns `GgufDecoder` and `GgufHead`. The weights are the file's tensors as stored (the matrices
a step reads in full copied once into huge pages, `resident`; the rest memory-mapped,
`gguf.reader`): every layer's q, k, v, o, gate, up and down matrices stay in their GGUF types
(Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32) and are multiplied by `kernels/qmatmul.c`
straight from those bytes, inside the C decoder layer (`kernels/decoder_layer.c`, numerics
"gguf"): one call runs every layer for the rows of one sequence or of many (`rows.Rows`, paged
KV in a `kv_pool.BlockPool`). Norm weights and biases (a few KB a layer) are copied to float32;
the token embedding is dequantized row by row on lookup (`qmatmul.get_rows`); the LM head is the
output matrix (or the tied embedding) multiplied the same way. So a model costs about its
file's size in memory, and a decode step reads the file's 4.5-6.6 bits a weight.

Numerics (qmatmul.c's): each row of activations is quantized from that row alone (per block of
32 for the 32-block types, per super-block of 256 for the K-quants), the integer sums are exact
and one fixed float32 sequence turns them into the result, and the rest of the layer is the C
layer's row-wise or fixed-chunk math: a row's logits do not depend on how many rows or which
sequences share its call, on the thread count or on the instruction set. Lossless methods are therefore exact against `ar` (which runs
the same numerics), batched or alone, from the prefix cache or not.

The math is transformers' for the architecture (Llama, Qwen2, Gemma 3 text), fed from the GGUF
metadata's config (`gguf.metadata`): rotary tables from the architecture's own rotary module, the
sliding windows, query scaling and activation of its config. Two conventions of llama.cpp's
converter are undone in place instead of copying weights: Gemma's norm weights are stored as
1 + w (the C layer multiplies by them directly, as Gemma's norm does by 1 + w), and a Llama's q
and k rows are permuted for adjacent-pair rotary (the C layer rotates adjacent pairs for it,
`rope_interleaved`: attention scores are invariant to the same permutation of q and k).
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import torch
import torch.nn.functional as F

from .static_kv import StaticKV, Tree
from ..errors import ModelLoadError
from . import qmatmul
from .linear import FusedNorm
from .native_layer import (ACTIVATIONS, NUMERICS_GGUF, CGgufPart, CLayer, CNorm, bind, pointer, recognise_activation,
                           run_layers, run_layers_in_calls)
from .qmatmul import QMatrix
from .resident import huge_page_bytes, resident_copy
from .rows import Rows

# model_type -> (transformers package, rotary class, llama.cpp's q/k rows permuted for adjacent-pair rope)
ARCHITECTURES = {"llama": ("llama", "LlamaRotaryEmbedding", True), "qwen2": ("qwen2", "Qwen2RotaryEmbedding", False),
                 "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding", False)}
_ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _matrix(file, name: str, resident: dict | None = None) -> QMatrix | None:
    """The tensor `name` of a parsed GGUF file as a weight (its resident copy where `resident`
    has one, else its mapped bytes), or None."""
    info = file.tensors.get(name)
    if info is None:
        return None
    data = resident[name] if resident and name in resident else file.tensor_bytes(name).reshape(-1)
    return QMatrix(data, info.ggml_type, info.rows, int(info.shape[0]))


def _vector(file, name: str) -> torch.Tensor | None:
    """A small float tensor (a norm weight, a bias) as float32 (copied), or None."""
    info = file.tensors.get(name)
    if info is None:
        return None
    raw = file.tensor_bytes(name).reshape(-1)
    kinds = {"F32": np.float32, "F16": np.float16}
    if info.type_name not in kinds:
        if info.type_name == "BF16":
            return torch.from_numpy(raw.view(np.uint16).astype(np.int32) << 16).view(torch.float32).clone()
        raise ModelLoadError(f"{name} is {info.type_name}; a norm weight or bias must be F32, F16 or BF16")
    return torch.from_numpy(raw.view(kinds[info.type_name]).astype(np.float32))


class GgufHead:
    """The LM head on the file's output matrix: hidden [n, d] -> logits [n, vocab], batch-invariant."""

    batch_invariant = True  # a row's logits do not depend on the other rows of the call

    def __init__(self, matrix: QMatrix, kernel: qmatmul.QKernel):
        self.matrix, self.kernel = matrix, kernel

    @property
    def out_features(self) -> int:
        return self.matrix.rows

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernel.matmul(hidden.to(torch.float32).contiguous(), self.matrix)

    def rows(self, index: torch.Tensor) -> "GgufHead":
        """The head over some of its rows (an exit head's draft vocabulary): their bytes copied."""
        data = np.asarray(self.matrix.data).reshape(self.matrix.rows, -1)[index.numpy()]
        picked = QMatrix(np.ascontiguousarray(data).reshape(-1), self.matrix.type, len(index), self.matrix.cols)
        return GgufHead(picked, self.kernel)


class _Layer:
    """One decoder layer as the C struct describes it (kept with what its pointers point at)."""

    def __init__(self, struct: CLayer, keep: list, run_many, rope_layer_type: str | None):
        self.struct, self.keep, self.run_many = struct, keep, run_many
        self.rope_layer_type = rope_layer_type


class GgufDecoder:
    """Hidden states of a GGUF model (see the module docstring), with `FastDecoder`'s interface
    for the paged backend: `embed`, `run`, `run_rows`, `norm`."""

    numerics = "gguf"
    use_native = True
    blocks: dict = {}  # no int8 block forms: the file's blocks are multiplied as they are

    def __init__(self, gguf, kernel):
        """gguf: a `gguf.metadata.GgufModel`; kernel: the loaded `blockmm.Kernel` (qmatmul.c with it)."""
        config = gguf.config
        if config.model_type not in ARCHITECTURES:
            raise ModelLoadError(f"{gguf.name}: architecture {config.model_type!r} is not one the GGUF runtime runs "
                                 f"({', '.join(ARCHITECTURES)})")
        package, rotary_class, interleaved = ARCHITECTURES[config.model_type]
        file = gguf.file
        self.file, self.config = file, config
        self.qkernel = qmatmul.wrap(kernel)
        self.kernel_isa = kernel.isa
        self.dtype = torch.float32
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        gemma = config.model_type == "gemma3_text"
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32) if gemma else None
        # the matrices every step reads in full, in huge pages (`resident`): the layers' and the head's
        head_name = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
        self._resident = resident_copy(file, [info.name for info in file.tensors.values()
                                              if (info.name.startswith("blk.") and len(info.shape) >= 2)
                                              or info.name == head_name])
        self.embedding = _matrix(file, "token_embd.weight", self._resident)
        output = _matrix(file, "output.weight", self._resident) or self.embedding
        self.head = GgufHead(output, self.qkernel)
        self.vocab_size = output.rows
        self._final_norm = _vector(file, "output_norm.weight")
        self.eps = float(config.rms_norm_eps)
        module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
        self.rotary = getattr(module, rotary_class)(config)
        self._rotary_takes_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        activation = _ACTIVATION_NAMES.get(getattr(config, "hidden_activation", None) or config.hidden_act)
        if activation is None:
            raise ModelLoadError(f"{gguf.name}: activation {config.hidden_act!r} (supported: gelu-tanh, SiLU)")
        scaling = config.query_pre_attn_scalar ** -0.5 if gemma else self.head_dim ** -0.5
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        run_many = bind(kernel.library)
        self.layers = []
        for i in range(config.num_hidden_layers):
            window = config.sliding_window if layer_types[i] == "sliding_attention" else 0
            rope_type = layer_types[i] if self._rotary_takes_type else None
            self.layers.append(self._layer(i, activation, scaling, window or 0, interleaved, gemma, run_many,
                                           rope_type))

    def _layer(self, i: int, activation: str, scaling: float, window: int, interleaved: bool, gemma: bool,
               run_many, rope_type) -> _Layer:
        file, keep = self.file, []
        name = lambda part: f"blk.{i}.{part}.weight"  # noqa: E731
        struct = CLayer()
        norms = {"input": "attn_norm", "q": "attn_q_norm", "k": "attn_k_norm",
                 "post_attention": "post_attention_norm", "pre_mlp": "ffn_norm", "post_mlp": "post_ffw_norm"}
        for field, part in norms.items():
            weight = _vector(file, name(part))
            if weight is not None:
                setattr(struct, field, CNorm(pointer(weight, keep), self.eps))
        if not struct.input.weight or not struct.pre_mlp.weight:
            raise ModelLoadError(f"layer {i} of the GGUF file lacks its attention or MLP norm")
        linears = [("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)]
        for slot, parts in enumerate(linears):
            for p, part in enumerate(parts):
                matrix = _matrix(file, name(part), self._resident)
                if matrix is None:
                    raise ModelLoadError(f"the GGUF file has no tensor {name(part)}")
                keep.append(matrix)
                bias = _vector(file, f"blk.{i}.{part}.bias")
                struct.gguf[slot].part[p] = CGgufPart(matrix.address, matrix.type, matrix.rows, pointer(bias, keep))
        struct.hidden, struct.heads, struct.kv_heads, struct.head_dim = self.hidden, self.heads, self.kv_heads, self.head_dim
        struct.intermediate = file.tensors[name("ffn_gate")].rows
        struct.window, struct.scaling, struct.act = window, scaling, ACTIVATIONS[activation]
        struct.numerics, struct.rope_interleaved = NUMERICS_GGUF, int(interleaved)
        return _Layer(struct, keep, run_many, rope_type)

    # -- the weights as transformers names them (an exit head's initialisation) ---------------
    _HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm"}

    def layer_state(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index`'s weights dequantized to float32 under transformers' names (as its GGUF
        reader gives them: a Llama's q/k rows un-permuted, Gemma's norms minus 1), to initialise
        a module of the architecture (an exit head's layer, for training)."""
        gemma = self.config.model_type == "gemma3_text"
        names = dict(self._HF_NAMES)
        if gemma:
            names.update(post_attention_norm="post_attention_layernorm", ffn_norm="pre_feedforward_layernorm",
                         post_ffw_norm="post_feedforward_layernorm")
        else:
            names["ffn_norm"] = "post_attention_layernorm"
        state = {}
        for part, name in names.items():
            for suffix in ("weight", "bias"):
                tensor = f"blk.{index}.{part}.{suffix}"
                info = self.file.tensors.get(tensor)
                if info is None:
                    continue
                if len(info.shape) == 1:
                    value = _vector(self.file, tensor)
                    value = value - 1 if gemma and part.endswith("norm") else value
                else:
                    matrix = _matrix(self.file, tensor, self._resident)
                    value = self.qkernel.get_rows(matrix, torch.arange(matrix.rows))  # [out, in]
                    if ARCHITECTURES[self.config.model_type][2] and part in ("attn_q", "attn_k"):
                        heads = self.heads if part == "attn_q" else self.kv_heads
                        value = value.reshape(heads, value.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(value.shape)
                state[f"{name}.{suffix}"] = value
        return state

    def final_norm_state(self) -> dict[str, torch.Tensor]:
        """The final norm's weight under transformers' name (Gemma's minus 1)."""
        gemma = self.config.model_type == "gemma3_text"
        return {"weight": self._final_norm - 1 if gemma else self._final_norm.clone()}

    # -- an extra layer (an exit head's) ------------------------------------------------------
    def new_cache(self, capacity: int = 256, layers: int | None = None) -> StaticKV:
        """A contiguous KV cache of its own (an exit head's layer), float32."""
        count = len(self.layers) if layers is None else layers
        return StaticKV(count, self.kv_heads, self.head_dim, self.dtype, capacity)

    def wrap_layer(self, layer, quantize: bool = True) -> _Layer:
        """A transformers decoder layer of this architecture (a trained exit head's) as a C
        layer: its matrices as Q8_0 blocks (`quantize`: an approximation of its weights, which
        only drafts use) or float32, its norms as its modules compute them (`FusedNorm`), rotary
        as its own weights expect (halves, not the file's permuted pairs). Run it with
        `run_layer`."""
        from gguf import GGMLQuantizationType, quants

        attn, mlp = layer.self_attn, layer.mlp
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        keep: list = []
        struct = CLayer()
        norms = {"input": layer.input_layernorm, "q": getattr(attn, "q_norm", None), "k": getattr(attn, "k_norm", None),
                 "post_attention": layer.post_attention_layernorm if gemma else None,
                 "pre_mlp": layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                 "post_mlp": layer.post_feedforward_layernorm if gemma else None}
        for field, module in norms.items():
            if module is None:
                continue
            fused = FusedNorm.of(module)
            if not isinstance(fused, FusedNorm):
                raise ModelLoadError(f"the exit head's {field} norm is not a plain RMSNorm")
            setattr(struct, field, CNorm(pointer(fused.weight.float(), keep), fused.eps))
        groups = [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)]
        for slot, modules in enumerate(groups):
            for p, module in enumerate(modules):
                weight = module.weight.detach().float().contiguous().numpy()  # [out, in]
                if quantize and weight.shape[1] % 32 == 0:
                    data, kind = quants.quantize(weight, GGMLQuantizationType.Q8_0), qmatmul.TYPES["Q8_0"]
                else:
                    data, kind = weight.view(np.uint8), qmatmul.TYPES["F32"]
                matrix = QMatrix(np.ascontiguousarray(data).reshape(-1), kind, weight.shape[0], weight.shape[1])
                keep.append(matrix)
                bias = None if module.bias is None else module.bias.detach().float()
                struct.gguf[slot].part[p] = CGgufPart(matrix.address, matrix.type, matrix.rows, pointer(bias, keep))
        struct.hidden, struct.heads, struct.kv_heads, struct.head_dim = self.hidden, self.heads, self.kv_heads, self.head_dim
        struct.intermediate = mlp.gate_proj.out_features
        struct.window, struct.scaling = getattr(attn, "sliding_window", None) or 0, attn.scaling
        activation = recognise_activation(mlp.act_fn)
        if activation is None:
            raise ModelLoadError(f"the exit head's activation {type(mlp.act_fn).__name__} is not gelu-tanh or SiLU")
        struct.act, struct.numerics, struct.rope_interleaved = ACTIVATIONS[activation], NUMERICS_GGUF, 0
        layer_types = getattr(self.config, "layer_types", None)
        kind = layer_types[attn.layer_idx] if (layer_types and self._rotary_takes_type) else None
        return _Layer(struct, keep, self.layers[0].run_many, kind)

    @torch.inference_mode()
    def run_layer(self, layer: _Layer, x: torch.Tensor, start: int, cache: StaticKV, cache_layer: int = 0,
                  tree: Tree | None = None) -> torch.Tensor:
        """An extra layer (`wrap_layer`) over x [n, hidden] at positions start.. (or placed by
        `tree`), with its keys and values in `cache` layer `cache_layer`."""
        placement = tree or Tree.contiguous(start, x.shape[0])
        cache.reserve(placement.end)
        positions = placement.positions.unsqueeze(0)  # [1, n]
        kind = layer.rope_layer_type
        rope = self.rotary(x, positions, *((kind,) if kind is not None else ()))
        rows = placement.c_rows(cache.block_table, cache.pool_blocks)
        return run_layers([layer], x, rows, [rope], [cache.keys[cache_layer]], [cache.values[cache_layer]])

    # -- what the paged backend calls ------------------------------------------------------------
    @property
    def native_layers(self) -> int:
        return len(self.layers)

    def runs_in_c(self, layers: range, n: int) -> bool:
        return True

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the token embedding as stored (not scaled): [n, hidden] float32."""
        return self.qkernel.get_rows(self.embedding, ids.to(torch.int64))

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the LM head's matrix: [n, hidden] float32."""
        return self.qkernel.get_rows(self.head.matrix, ids.to(torch.int64))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of ids [n] -> [n, hidden] (Gemma's scaled by sqrt(hidden))."""
        x = self.qkernel.get_rows(self.embedding, ids.to(torch.int64))
        return x * self.embed_scale if self.embed_scale is not None else x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm, row by row."""
        return F.rms_norm(x, (self.hidden,), self._final_norm, self.eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, layers: range, rope: dict) -> dict:
        for index in layers:
            kind = self.layers[index].rope_layer_type
            if kind not in rope:
                rope[kind] = self.rotary(x, positions, *((kind,) if kind is not None else ()))
        return rope

    @torch.inference_mode()
    def hidden_states(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Final-normed states of `ids` [n] at positions cache.length.. of a cache of its own (a
        draft model's): appended, the length advanced. Returns [n, hidden]."""
        start = cache.length
        x = self.run(self.embed(ids), start, cache)
        cache.length = start + ids.shape[0]
        return self.norm(x)

    @torch.inference_mode()
    def run(self, x: torch.Tensor, start: int, cache, layers: range | None = None, tree: Tree | None = None,
            rope: dict | None = None) -> torch.Tensor:
        """x [n, hidden] at positions start.. (or placed by `tree`) through `layers` (default:
        all), writing keys and values into the paged `cache` (its length is left alone)."""
        placement = tree or Tree.contiguous(start, x.shape[0])
        cache.reserve(placement.end)
        return self.run_rows(x, placement.c_rows(cache.block_table, cache.pool_blocks), cache, layers, rope)

    @torch.inference_mode()
    def run_rows(self, x: torch.Tensor, rows: Rows, pools, layers: range | None = None,
                 rope: dict | None = None) -> torch.Tensor:
        """x [n, hidden] through `layers` for the rows `rows` describes, keys and values in
        `pools` (`.keys[i]`, `.values[i]`); in calls of at most `native_layer.CALL_ROWS` rows."""
        layers = layers if layers is not None else range(len(self.layers))
        chosen = [self.layers[index] for index in layers]
        positions = torch.from_numpy(rows.positions).unsqueeze(0)  # [1, n]
        rope = self._rope(x, positions, layers, {} if rope is None else rope)
        kinds = [self.layers[index].rope_layer_type for index in layers]
        keys, values = [pools.keys[i] for i in layers], [pools.values[i] for i in layers]
        return run_layers_in_calls(chosen, x, rows, [rope[kind] for kind in kinds], keys, values)

    @property
    def weight_types(self) -> str:
        """The GGUF types of the layers' matrices and the head, with their counts ("Q4_K x169, ...")."""
        counts: dict[str, int] = {}
        for matrix in [m for layer in self.layers for m in layer.keep if isinstance(m, QMatrix)] + [self.head.matrix]:
            counts[matrix.type_name] = counts.get(matrix.type_name, 0) + 1
        return ", ".join(f"{name} x{count}" for name, count in sorted(counts.items(), key=lambda kv: -kv[1]))

    def weight_pages(self) -> dict | None:
        """{"copied_bytes": the matrices copied into huge pages, "huge_page_bytes": how much of that the
        kernel granted as 2 MiB pages (None: unknown)}, or None where the matrices stay mapped."""
        if not self._resident:
            return None
        views = list(self._resident.values())
        return {"copied_bytes": sum(view.nbytes for view in views), "huge_page_bytes": huge_page_bytes(views[0])}

    @property
    def bytes_per_token(self) -> int:
        """Weight bytes a one-token step reads: every layer's matrices and the LM head."""
        return self.head.matrix.nbytes + sum(m.nbytes for layer in self.layers for m in layer.keep
                                             if isinstance(m, QMatrix))
