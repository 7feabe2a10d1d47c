"""A whole decoder layer in one C call (`kernels/decoder_layer.c`) for layers on the block kernel.

Owns one thing: deciding whether a fast-path layer (`fastpath._Layer`) can run in C
(`decoder_layers`), describing it to C once (a ctypes struct of pointers to its block-form
weights and norm weights), and calling it for the rows of a forward: one sequence's or several
sequences' (`rows.Rows`: positions, KV slots, block tables of paged memory). A one-token step otherwise
runs about 35 small PyTorch operators per layer, which cost about a third of the step
(scripts/profile_step.py); the C layer computes the same math as `FastDecoder._layer`, with the model's
own rotary tables, its norm weights as `FusedNorm` verified them, and its activation recognised
by value (gelu-tanh or SiLU, checked on a probe against PyTorch's). Contiguous chunks and trees
of drafts both run in C, a tree row with the bits the same position gets in a contiguous chunk,
and a row of one sequence with the bits it gets beside other sequences' rows. Anything else -- a
linear without an exact block form, a norm that is not a plain RMSNorm, another activation --
keeps the PyTorch path (`of` returns None; `why_not` says why).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from .rows import BLOCK, Rows

ACTIVATIONS = {"gelu_tanh": 0, "silu": 1}  # the C enum
NUMERICS = {"int8": 0, "fp32": 1}  # the C enum: blockmm_int8.c or blockmm.c for the layer's linears
NUMERICS_GGUF = 2  # the C enum's third value: qmatmul.c on a GGUF file's own blocks (`gguf_decoder`)


class _CLinear(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("out", ctypes.c_int64), ("inputs", ctypes.c_int64), ("block", ctypes.c_int64),
                ("code_bias", ctypes.c_int), ("code_span", ctypes.c_int), ("half_scales", ctypes.c_int)]


class CNorm(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("eps", ctypes.c_float)]


class CGgufPart(ctypes.Structure):
    """One matrix as a GGUF file stores it (decoder_layer.c's GgufPart; data NULL: absent)."""

    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int), ("out", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class CGgufLinear(ctypes.Structure):
    _fields_ = [("part", CGgufPart * 3)]


class CLayer(ctypes.Structure):
    """decoder_layer.c's Layer: what one decoder layer computes with, by pointers."""

    _fields_ = [("linear", _CLinear * 4), ("input", CNorm), ("q", CNorm), ("k", CNorm),
                ("post_attention", CNorm), ("pre_mlp", CNorm), ("post_mlp", CNorm),
                ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("window", ctypes.c_int64),
                ("scaling", ctypes.c_float), ("act", ctypes.c_int), ("numerics", ctypes.c_int),
                ("gguf", CGgufLinear * 4), ("rope_interleaved", ctypes.c_int)]


@torch.inference_mode()
def recognise_activation(act) -> str | None:
    """'gelu_tanh' or 'silu' if the module computes that function (to float32 rounding, on a probe
    spanning [-8, 8]), else None."""
    probe = torch.linspace(-8, 8, 4001)
    try:
        got = act(probe)
    except Exception:  # noqa: BLE001 - an activation we cannot call on a plain tensor is not ours
        return None
    candidates = {"gelu_tanh": F.gelu(probe, approximate="tanh"), "silu": F.silu(probe)}
    for name, expected in candidates.items():
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
            return name
    return None


def _linears(layer) -> list:
    """The layer's four linears in the C struct's order (QKV, O, GATE_UP, DOWN)."""
    return [layer.qkv, layer.o, layer.gate_up, layer.down]


def _norms(layer) -> list:
    """The layer's norms in the C struct's order (None where the architecture has none)."""
    return [layer.input_norm, layer.q_norm, layer.k_norm, layer.post_attention_norm, layer.pre_mlp_norm,
            layer.post_mlp_norm]


_NORM_FIELDS = ("input", "q", "k", "post_attention", "pre_mlp", "post_mlp")


def bind(library):
    """The C function `decoder_layers` with its argument types."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    many = library.decoder_layers
    many.restype = ctypes.c_int
    # layers**, count, x, n, rows*, sequence count, cos**, sin**, keys**, values**, threads
    many.argtypes = [pointer, size, pointer, size, pointer, size, pointer, pointer, pointer, pointer, ctypes.c_int]
    return many


def why_not(layer, kernel, heads: int, kv_heads: int, head_dim: int) -> str | None:
    """None if fast-path `layer` (`fastpath._Layer`) can run as the C layer, else the reason."""
    from .linear import BlockLinear, FusedNorm

    if getattr(getattr(kernel, "library", None), "decoder_layers", None) is None:
        return "the kernel library has no decoder_layers"
    linears = _linears(layer)
    if not all(isinstance(linear, BlockLinear) for linear in linears):
        return "a linear without an exact block form"
    if any(linear.blocks.codes.dtype != torch.int8 or linear.blocks.scales.dtype != torch.float32 for linear in linears):
        return "block forms of an unexpected dtype"
    hidden, intermediate = layer.qkv.blocks.codes.shape[1], layer.gate_up.blocks.codes.shape[0] // 2
    expected = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden),
                (hidden, intermediate)]
    if [tuple(linear.blocks.codes.shape) for linear in linears] != expected:
        return "linear shapes that do not match the attention/MLP layout"
    if layer.input_norm is None or layer.pre_mlp_norm is None:
        return "a layer without input or pre-MLP norm"
    if not all(norm is None or isinstance(norm, FusedNorm) for norm in _norms(layer)):
        return "a norm that is not a plain RMSNorm"
    if recognise_activation(layer.act) is None:
        return f"activation {type(layer.act).__name__} (supported: gelu-tanh, SiLU)"
    return None


def pointer(tensor: torch.Tensor | None, keep: list) -> int | None:
    """The address of `tensor` (contiguous; kept alive in `keep`), or None."""
    if tensor is None:
        return None
    tensor = tensor.detach().contiguous()
    keep.append(tensor)
    return tensor.data_ptr()


class NativeLayer:
    """One fast-path layer as a C call. Build with `of`; call with the residual stream."""

    def __init__(self, struct: CLayer, keep: list, function, linears: list):
        self.struct, self.keep = struct, keep
        self.run_many = function  # decoder_layers
        self._linears = linears
        self._described: dict = {}  # numerics -> the 4 _CLinear structs of that weight layout

    def _describe(self, numerics: str) -> list:
        """The layer's linears as C structs, pointing at the weights in the layout `numerics`
        multiplies (int8: `BlockWeights.packed`), built once per numerics."""
        if numerics not in self._described:
            structs = []
            for linear in self._linears:
                b = linear.blocks
                weights = b.packed if numerics == "int8" else b
                form_arguments = weights.kernel_form if numerics == "int8" else (-1, 0, 0)
                bias = linear.dense.bias
                structs.append(_CLinear(pointer(weights.codes, self.keep), pointer(weights.scales, self.keep),
                                        pointer(weights.offsets, self.keep),
                                        pointer(None if bias is None else bias.float(), self.keep),
                                        b.codes.shape[0], b.codes.shape[1], b.block, *form_arguments))
            self._described[numerics] = structs
        return self._described[numerics]

    @staticmethod
    def of(layer, heads: int, kv_heads: int, head_dim: int, kernel, numerics: str = "fp32") -> "NativeLayer | None":
        """The C form of fast-path `layer` (`fastpath._Layer`), or None (`why_not` says why);
        its linears multiply in `numerics` ("int8" or "fp32", see `blockmm`)."""
        if why_not(layer, kernel, heads, kv_heads, head_dim) is not None:
            return None
        keep: list = []
        hidden, intermediate = layer.qkv.blocks.codes.shape[1], layer.gate_up.blocks.codes.shape[0] // 2
        struct = CLayer()
        for field, norm in zip(_NORM_FIELDS, _norms(layer)):
            if norm is not None:
                setattr(struct, field, CNorm(pointer(norm.weight.float(), keep), norm.eps))
        struct.hidden, struct.heads, struct.kv_heads, struct.head_dim = hidden, heads, kv_heads, head_dim
        struct.intermediate, struct.window = intermediate, layer.window or 0
        struct.scaling, struct.act = layer.scaling, ACTIVATIONS[recognise_activation(layer.act)]
        native = NativeLayer(struct, keep, bind(kernel.library), _linears(layer))
        native.numerics = numerics
        return native

    @property
    def numerics(self) -> str:
        """"int8" or "fp32": how the layer's linears multiply (settable)."""
        return next(name for name, value in NUMERICS.items() if value == self.struct.numerics)

    @numerics.setter
    def numerics(self, value: str) -> None:
        for i, linear in enumerate(self._describe(value)):
            self.struct.linear[i] = linear
        self.struct.numerics = NUMERICS[value]

    def __call__(self, x: torch.Tensor, rows: Rows, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor) -> torch.Tensor:
        """The layer's output for x [n, hidden] float32 at the rows `rows` describes (positions,
        KV slots, block tables: `rows.Rows`); cos/sin [.., n, head_dim]; writes the rows' keys
        and values into the pools keys/values [kv, blocks * BLOCK, d] (one layer of a
        `StaticKV` or a `kv_pool.BlockPool`). x itself is left unchanged."""
        return run_layers([self], x, rows, [(cos, sin)], [keys], [values])


# Most rows in one call of the C layers: wider inputs (a long prompt, a large batch) run as
# consecutive calls of this many rows, each after the previous one wrote its keys (the same bits:
# the C layers are batch-invariant); bounds the call's scratch memory.
CALL_ROWS = 256


def run_layers_in_calls(layers: list[NativeLayer], x: torch.Tensor, rows: Rows, rope: list, keys: list,
                        values: list) -> torch.Tensor:
    """`run_layers` over x [n, hidden] in consecutive calls of at most CALL_ROWS rows, in order
    (a row's ancestors and earlier positions come before it); rope[i] is layer i's (cos, sin)
    [1, n, head_dim] for all n rows. Returns the residual stream after the last layer [n, hidden]."""
    n = x.shape[0]
    if n <= CALL_ROWS:
        return run_layers(layers, x, rows, rope, keys, values)
    parts = []
    for begin in range(0, n, CALL_ROWS):
        end = min(n, begin + CALL_ROWS)
        part_rope = [(cos[:, begin:end], sin[:, begin:end]) for cos, sin in rope]
        parts.append(run_layers(layers, x[begin:end], rows.select(begin, end), part_rope, keys, values))
    return torch.cat(parts)


def _pointers(tensors: list) -> ctypes.Array:
    """A C array of the tensors' data pointers (NULL for None)."""
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


def run_layers(layers: list[NativeLayer], x: torch.Tensor, rows: Rows, rope: list, keys: list,
               values: list) -> torch.Tensor:
    """Several C layers in turn over x [n, hidden] float32 in one call (`decoder_layers`),
    without a trip through Python per layer (about 40 us each, a few percent of a one-token
    step). Per layer i: rope[i] its (cos, sin) [.., n, head_dim] tables, keys[i]/values[i] its
    [kv, blocks * BLOCK, d] pool; `rows` says where each row sits and where its keys are (one
    sequence or several). x itself is left unchanged. A RuntimeError if C refuses the rows (a
    slot outside its sequence's blocks, a path of the wrong length)."""
    if not layers:
        return x
    n = x.shape[0]
    assert len(rows) == n, f"{len(rows)} row descriptions for {n} rows"
    out = x.to(torch.float32, copy=True).contiguous()  # [n, hidden], updated in place by C
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layers of one kind share their tables
    for cos, sin in rope:
        if id(cos) not in tables:
            tables[id(cos)] = (cos.reshape(n, -1).to(torch.float32).contiguous(),  # [n, head_dim]
                               sin.reshape(n, -1).to(torch.float32).contiguous())
    cos_sin = [tables[id(cos)] for cos, _ in rope]
    assert all(k.is_contiguous() and k.dtype == torch.float32 for k in keys + values)
    assert all(k.shape[1] == rows.pool_blocks * BLOCK for k in keys + values), "pools of the rows' size"
    described, sequences = rows.c_struct()
    structs = (ctypes.c_void_p * len(layers))(*[ctypes.addressof(layer.struct) for layer in layers])
    status = layers[0].run_many(structs, len(layers), out.data_ptr(), n, ctypes.addressof(described), sequences,
                                 _pointers([c for c, _ in cos_sin]), _pointers([s for _, s in cos_sin]),
                                 _pointers(keys), _pointers(values), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"decoder_layers refused its arguments (n={n}, positions {rows.positions.min()}.."
                           f"{rows.positions.max()}, {rows.pool_blocks} blocks)")
    return out
