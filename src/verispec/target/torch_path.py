"""The PyTorch path's machinery: what verispec runs through a transformers model's own modules.

Owns, for targets that run transformers' forward (`backends.TorchBackend`: any device, with a
DynamicCache or the compiled CUDA step's StaticCache):
- which decoder-only models can be taken apart (`parts`, `unsupported`): the decoder's layer
  list, final norm and rotary module, found by structure, and each layer's attention kind and
  window as transformers builds its cache; `FAMILIES` are the tested ones, any other model is
  refused with the reason (the plain forward, `ar`, `pld`, `anpd`'s single paths, `suffix`,
  still runs it);
- forwards through the model's own modules where the fast path has its own layer loop: a
  forward that also keeps the residual stream after layer N (a forward hook on that layer), a
  forward through layers 0..N-1 alone (the model's forward, stopped after layer N by a hook:
  the model's embedding, masks and rotary tables, not a re-implementation), and one decoder
  layer with a cache of its own (an exit head's, `run_layer`);
- placed forwards: rows after the cache that are not one contiguous continuation (a tree of
  drafts, MTAD's beams), each at its logical position and seeing the context, its ancestors and
  itself through a custom 4D attention mask (`attention_mask`: one tensor, or one per layer
  kind where the model mixes them, as Gemma 3 and Qwen2 take them); rows are appended to the
  cache in row order, so the placement is `Tree` with slots = the next positions;
- the rollback of what those leave: some layers cropped back (a draft's rows in layers
  0..N-1, `crop_layers`) and a tree's accepted path gathered to the next positions of every
  layer (`keep_rows`), for DynamicCache and StaticCache layers alike (`hf_cache.py` builds them
  so that every layer can be rolled back).
`backends.TorchBackend` calls it for a sequence's forwards, the drafters for their drafts.

Numerics: the model's own modules compute every row, so a position's logits are those of a
plain forward up to floating-point rounding, which differs with the shape of the call (PyTorch's
matrix products are not batch-invariant): a tree or a beam row gets a linear verification's
token wherever the top-2 logit gap exceeds that rounding (tests use float32, as the equivalence
suite does; `verispec bench` reports how often outputs match `ar`).

Speed on the CPU in float32 (`packed_linears`): PyTorch's float32 product (MKL) repacks a
weight at every call of more than one row, so a decoder layer's linears cost 1.8-3.1x for two
rows what they cost for one, and the 262,144-row LM head 2.6x (1 thread, AVX-512 EPYC), which
would make every verification of a draft cost nearly two one-token steps. During this module's
forwards the nn.Linear modules of the decoder layers therefore multiply inputs of more than one
row with weights packed once for oneDNN (`runtime.linear.Linear`: 1.06x for two rows, 1.15x for
four), and one-row inputs with PyTorch's own product, so a one-token step (`ar`) computes what
it computed before. The packed copies are made at first use and again when a weight changes.
"""

from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .hf_cache import set_static_length
from ..runtime.static_kv import Tree
from ..errors import ConfigError
from ..runtime.linear import Linear, mkldnn_packing_available


# model_type -> the family's name, as tested on tiny random models through this path
# (tests/test_torch_path.py): greedy eesd, sps and trees equal ar, sampled methods pass the
# chi-square tests.
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3",
            "gpt2": "GPT-2"}
KINDS = ("full_attention", "sliding_attention")  # the attention kinds a layer may have here
MASKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask
_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


@dataclass(frozen=True)
class Parts:
    """A decoder-only model taken apart: its decoder, layer list, final norm, rotary module
    (None: positions enter at the embedding, GPT-2) and each layer's attention kind and window."""

    body: torch.nn.Module
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    rotary: torch.nn.Module | None
    rotary_takes_kind: bool  # the rotary module is called per layer kind (Gemma 3)
    kinds: tuple[str, ...]  # per layer: "full_attention" or "sliding_attention"
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    float_masks: bool  # eager attention adds its mask (0 / -inf); sdpa takes booleans

    @property
    def mixed(self) -> bool:
        """Whether layers of several kinds need masks of their own (passed as a dict)."""
        return len(set(self.kinds)) > 1


_PARTS: "weakref.WeakKeyDictionary[torch.nn.Module, Parts | str]" = weakref.WeakKeyDictionary()


def _take_apart(model) -> "Parts | str":
    """`Parts` of `model`, or why it cannot be taken apart."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = model.config
    family = getattr(config, "model_type", "")
    name = FAMILIES.get(family)
    if name is None:
        return (f"its architecture {family!r} is not one of the families the PyTorch path supports "
                f"({', '.join(FAMILIES.values())})")
    text = config.get_text_config(decoder=True)
    if getattr(text, "is_encoder_decoder", False) or not getattr(text, "is_causal", True) \
            or getattr(text, "use_bidirectional_attention", False):
        return "it is not a causal decoder-only model"
    implementation = getattr(config, "_attn_implementation", None) or "eager"
    if implementation not in MASKED_ATTENTION:
        return (f"its attention implementation {implementation!r} takes no custom attention mask "
                f"(load it with attn_implementation='sdpa' or 'eager')")
    body = model.get_decoder()
    count = int(text.num_hidden_layers)
    lists = [module for module in body.children() if isinstance(module, torch.nn.ModuleList) and len(module) == count]
    norms = [getattr(body, attribute) for attribute in _NORMS if isinstance(getattr(body, attribute, None), torch.nn.Module)]
    if len(lists) != 1 or not norms:
        return f"its decoder's layers or final norm could not be found ({type(body).__name__})"
    layers = lists[0]
    signature = inspect.signature(layers[0].forward).parameters
    if not {"attention_mask", "cache"} <= set(signature):
        return f"its decoder layers ({type(layers[0]).__name__}) take no attention_mask and cache keywords"
    kinds, layer_kwargs = get_layer_types_and_kwargs(text)
    other = sorted(set(kinds) - set(KINDS))
    if other:
        return f"its {', '.join(other)} layers (the PyTorch path masks full and sliding-window attention only)"
    windows = tuple(kwargs.get("sliding_window") if kind == "sliding_attention" else None
                    for kind, kwargs in zip(kinds, layer_kwargs))
    rotary = getattr(body, "rotary_emb", None)
    takes_kind = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    return Parts(body, layers, norms[0], rotary, takes_kind, tuple(kinds), windows, implementation == "eager")


def skeleton_parts(config) -> Parts:
    """`Parts` of the architecture `config` describes, for a target that runs without a
    transformers model (a GGUF file's own blocks): the model built on the meta device (its
    structure, no weights: layers to copy and fill, e.g. an exit head's), with a real rotary
    module (it holds no weights, only its frequencies)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    found = _take_apart(skeleton)
    if isinstance(found, str):
        raise ConfigError(f"this architecture cannot be taken apart: {found}")
    rotary = type(found.rotary)(config) if found.rotary is not None else None
    return Parts(found.body, found.layers, found.norm, rotary, found.rotary_takes_kind, found.kinds, found.windows,
                 found.float_masks)


def unsupported(model) -> str | None:
    """None if the PyTorch path can take `model` apart (exit heads, trees, beams), else why not."""
    found = _PARTS.get(model)
    if found is None:
        found = _PARTS[model] = _take_apart(model)
    return found if isinstance(found, str) else None


def parts(model, what: str = "this") -> Parts:
    """`Parts` of `model`; a ConfigError saying why not, for `what` (e.g. "eesd")."""
    reason = unsupported(model)
    if reason is not None:
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise ConfigError(f"{what} cannot run on {name} through the PyTorch path: {reason}")
    return _PARTS[model]


# -- masks -----------------------------------------------------------------------------------------

def contiguous(start: int, n: int, device) -> Tree:
    """Rows at positions start..start+n-1 appended to the cache, attending causally."""
    return Tree.contiguous(start, n, device)


def append_tree(length: int, parents: Sequence[int], device) -> Tree:
    """A tree of rows after the first `length` positions, appended in row order: row i sits at
    slot length + i and position length + its depth, and sees the context, its ancestors and
    itself. parents[i] < i, -1 for a row following the context."""
    m = len(parents)
    depth: list[int] = []
    for i, parent in enumerate(parents):
        assert -1 <= parent < i, f"row {i}: parent {parent} is not an earlier row"
        depth.append(0 if parent < 0 else depth[parent] + 1)
    sees: list[list[bool]] = []  # sees[i][j]: row j is row i or one of its ancestors
    for i, parent in enumerate(parents):
        row = list(sees[parent]) if parent >= 0 else [False] * m
        row[i] = True
        sees.append(row)
    positions = torch.tensor(depth, dtype=torch.long, device=device) + length  # [m]
    slots = torch.arange(length, length + m, device=device)  # [m]
    visible = torch.zeros(m, length + m, dtype=torch.bool, device=device)  # [m, S]
    visible[:, :length] = True
    visible[:, length:] = torch.tensor(sees, dtype=torch.bool, device=device)
    slot_positions = torch.arange(length + m, device=device)  # [S]
    slot_positions[length:] = positions
    return Tree(positions, slots, visible, slot_positions)


def _layer_mask(tree: Tree, kv_length: int, kv_offset: int, window: int | None, as_float: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """The mask of `tree`'s rows over the keys a cache layer returns: slots kv_offset ..
    kv_offset + kv_length - 1. [1, 1, n, kv_length], bool (True: attend) or additive float."""
    device = tree.positions.device
    keys = torch.arange(kv_offset, kv_offset + kv_length, device=device)  # [K] slots
    query = tree.positions.unsqueeze(1)  # [n, 1]
    if tree.slots is None:  # contiguous: slots are positions
        seen = keys.unsqueeze(0) <= query  # [n, K]
        key_positions = keys.unsqueeze(0)
    else:
        width = tree.visible.shape[1]
        inside = keys < width
        seen = torch.zeros(len(tree.positions), kv_length, dtype=torch.bool, device=device)  # [n, K]
        seen[:, inside] = tree.visible[:, keys[inside]]
        key_positions = torch.where(inside, tree.slot_positions[keys.clamp(max=width - 1)], keys).unsqueeze(0)
    if window is not None:
        seen &= key_positions > query - window
    seen = seen[None, None]  # [1, 1, n, K]
    if not as_float:
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)


def attention_mask(model, cache, tree: Tree, layers: range | None = None, dtype: torch.dtype = torch.float32):
    """The custom mask of `tree`'s rows for the model's forward over `cache` (before the rows
    are appended): one [1, 1, n, K] tensor, or {kind: tensor} where the model mixes layer kinds.
    Sized for the first layer of each kind among `layers` (default: all), which must all hold
    the same positions (a draft through layers 0..N-1 leaves the others behind)."""
    found = parts(model)
    layers = layers if layers is not None else range(len(found.kinds))
    n = len(tree.positions)
    masks = {}
    for kind in dict.fromkeys(found.kinds):
        index = next((i for i in layers if found.kinds[i] == kind), found.kinds.index(kind))
        kv_length, kv_offset = cache.get_mask_sizes(n, index)
        masks[kind] = _layer_mask(tree, int(kv_length), int(kv_offset), found.windows[index], found.float_masks, dtype)
    return masks if found.mixed else next(iter(masks.values()))


# -- multi-row products on the CPU in float32 ----------------------------------------------------------

_PACKED: "weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple, Linear]]" = weakref.WeakKeyDictionary()


def _packed(linear: torch.nn.Linear) -> Linear:
    """`linear`'s weight packed for oneDNN, made again when the weight changed (another tensor,
    or an in-place update)."""
    weight = linear.weight
    key = (weight.data_ptr(), weight._version)
    found = _PACKED.get(linear)
    if found is None or found[0] != key:
        found = _PACKED[linear] = (key, Linear(weight, linear.bias))
    return found[1]


def _multi_row_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward: x [..., in] -> [..., out]; more than one row through packed weights."""
    rows = x.numel() // x.shape[-1]
    if rows == 1 or x.requires_grad:
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    return _packed(linear)(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], linear.out_features)


_LINEARS: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Linear]]" = weakref.WeakKeyDictionary()


def _linears(root: torch.nn.Module) -> list[torch.nn.Linear]:
    """The float32 CPU nn.Linear modules inside `root` that `packed_linears` swaps."""
    linears = _LINEARS.get(root)
    if linears is None:
        linears = _LINEARS[root] = [
            module for module in root.modules()
            if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
            and mkldnn_packing_available(module.weight.dtype)]
    return linears


def pack(root: torch.nn.Module) -> None:
    """Pack `root`'s float32 CPU linears now (`packed_linears` would at their first multi-row
    product): an exit head's layer is packed when it is prepared, so that no draft's time
    includes it."""
    for linear in _linears(root):
        _packed(linear)


@contextmanager
def packed_linears(root: torch.nn.Module, rows: int) -> Iterator[None]:
    """Within the block (a forward of `rows` rows), the float32 CPU nn.Linear modules inside
    `root` (a decoder, a layer) multiply inputs of more than one row with weights packed for
    oneDNN (see the module docstring); a no-op where packing is not available (other dtypes,
    other devices) or for one row."""
    if rows == 1:  # one-row products are PyTorch's own: nothing to swap
        yield
        return
    linears = [linear for linear in _linears(root) if "forward" not in linear.__dict__]  # not already in a block
    for linear in linears:
        linear.forward = _multi_row_forward.__get__(linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


# -- forwards through the model's own modules --------------------------------------------------------

class _Stop(Exception):
    """Raised by a forward hook to end a forward after a layer, carrying its output."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.output = output


def _output(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def through(model, body, head, cache, ids: torch.Tensor, tree: Tree, *, stop_after: int | None = None,
            capture: int = 0, logits: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `ids` [n] placed by `tree` (contiguous or appended rows) through `model` (its decoder
    `body`) over `cache`, appending the rows' keys and values to it.

    Returns (out, captured): with `stop_after` = N, out is the residual stream after layers
    0..N-1 [n, d] (the other layers neither run nor grow); else with `logits` (0: every row,
    1: the last) out is logits [n or 1, vocab], from `head` where one is given (the target's own
    LM head, `Target.head`), else from the model's forward; else the final-normed states [n, d].
    captured: the residual stream after `capture` layers [n, d] (0: None)."""
    found = parts(model) if (stop_after or capture or tree.slots is not None) else None
    hooks, kept = [], []
    if capture:
        hooks.append(found.layers[capture - 1].register_forward_hook(
            lambda module, args, output: kept.append(_output(output)[0])))
    if stop_after:
        def stop(module, args, output):
            raise _Stop(_output(output)[0])

        hooks.append(found.layers[stop_after - 1].register_forward_hook(stop))
    mask = None
    if tree.slots is not None:
        mask = attention_mask(model, cache, tree, range(stop_after) if stop_after else None,
                              next(model.parameters()).dtype)
    inputs = dict(input_ids=ids.unsqueeze(0), position_ids=tree.positions.unsqueeze(0), attention_mask=mask,
                  cache=cache, use_cache=True)
    try:
        with packed_linears(body, ids.shape[0]):
            if logits is not None and head is None and not stop_after:
                out = model(**inputs, logits_to_keep=logits).logits[0]  # [n or 1, vocab]
            else:
                out = body(**inputs).last_hidden_state[0]  # [n, d]
                if logits is not None and not stop_after:
                    out = head(out[-1:] if logits == 1 else out)
    except _Stop as stopped:
        out = stopped.output  # [n, d]
    finally:
        for hook in hooks:
            hook.remove()
    return out, (kept[0] if kept else None)


def run_layer(layer: torch.nn.Module, model, hidden: torch.Tensor, tree: Tree, cache, index: int,
              rotary_kind: tuple = ()) -> torch.Tensor:
    """One decoder layer of `model`'s architecture (an exit head's copy of layer `index`) over
    hidden [n, d] placed by `tree`, appending to its own `cache` (at layer `index`) -> [n, d]."""
    found = parts(model)
    x = hidden.unsqueeze(0)  # [1, n, d]
    positions = tree.positions.unsqueeze(0)  # [1, n]
    n = hidden.shape[0]
    kv_length, kv_offset = cache.get_mask_sizes(n, index)
    mask = _layer_mask(tree, int(kv_length), int(kv_offset), found.windows[index], found.float_masks, hidden.dtype)
    extra = {}
    if found.rotary is not None:
        extra["position_embeddings"] = found.rotary(x, positions, *rotary_kind)
    with packed_linears(layer, hidden.shape[0]):
        return _output(layer(x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, **extra))[0]


def call_layer(layer: torch.nn.Module, found: Parts, hidden: torch.Tensor, mask: torch.Tensor,
               rotary_kind: tuple = ()) -> torch.Tensor:
    """One decoder layer over whole sequences without a cache (training): hidden [B, T, d] at
    positions 0..T-1, `mask` [B, 1, T, T] -> [B, T, d]; rotary tables from `found.rotary`."""
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0).expand(hidden.shape[0], -1)  # [B, T]
    extra = {}
    if found.rotary is not None:
        extra["position_embeddings"] = found.rotary(hidden, positions, *rotary_kind)
    return _output(layer(hidden, attention_mask=mask, position_ids=positions, **extra))


# -- rollback -------------------------------------------------------------------------------------------

def _length(layer) -> int:
    return int(layer.get_seq_length())


def crop_layers(cache, layers: Sequence[int] | range, length: int) -> None:
    """Cut the layers `layers` of `cache` back to their first `length` positions (those that
    hold more: a draft's rows appended to some layers only). A sliding-window layer drops the
    rows and keeps what it held before them (no trim to its window): the model sizes one mask
    for all its layers of a kind, so they must hold the same entries."""
    for i in layers:
        layer = cache.layers[i]
        extra = _length(layer) - length
        if extra <= 0:
            continue
        if hasattr(layer, "max_cache_len") or not hasattr(layer, "cumulative_length"):
            layer.crop(-extra)  # a static layer moves its length; a full dynamic one drops the rows
        else:
            layer.keys, layer.values = layer.keys[:, :, :-extra], layer.values[:, :, :-extra]
            layer.cumulative_length -= extra


def keep_rows(cache, start: int, m: int, rows: Sequence[int]) -> None:
    """After `m` rows were appended to every layer of `cache` at positions start..: keep `rows`
    (in order) as positions start.. and drop the others. DynamicCache layers hold their last
    entries in row order; StaticCache layers hold row i at slot start + i."""
    rows = list(rows)
    if rows == list(range(len(rows))) and len(rows) == m:
        return  # every row kept where it is
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        keys, values = layer.keys, layer.values  # [b, heads, P, head_dim]
        if hasattr(layer, "max_cache_len"):  # a static layer: rows at slots start..start+m-1
            index = torch.tensor([start + r for r in rows], dtype=torch.long, device=keys.device)
            keys[:, :, start : start + len(rows)] = keys[:, :, index]
            values[:, :, start : start + len(rows)] = values[:, :, index]
            continue
        physical = keys.shape[-2]
        index = torch.tensor([physical - m + r for r in rows], dtype=torch.long, device=keys.device)
        layer.keys = torch.cat([keys[:, :, : physical - m], keys[:, :, index]], dim=-2)
        layer.values = torch.cat([values[:, :, : physical - m], values[:, :, index]], dim=-2)
        if hasattr(layer, "cumulative_length"):  # a sliding layer counts positions apart
            layer.cumulative_length -= m - len(rows)
            layer.crop(0)  # back to its window
    if any(hasattr(layer, "max_cache_len") for layer in cache.layers):
        set_static_length(cache, start + len(rows))  # a static cache's length tensors, in place


def verifies_trees(model) -> bool:
    """Whether `model` (on the PyTorch path) can verify a tree in one forward."""
    return unsupported(model) is None
