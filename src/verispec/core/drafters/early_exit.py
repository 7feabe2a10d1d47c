"""EESD drafting: the target's own first N layers plus a small trained exit head.

Owns the exit head (`ExitHead`, an nn.Module: one decoder layer of the target's architecture, a
final norm, and a projection onto a reduced draft vocabulary), its file format (safetensors +
JSON, `save_head` / `load_head`, refusing a head made for another model or layer), and the
drafter (`EarlyExitDrafter`). Training lives in `verispec.train`.

The head's layer is initialised from target layer N, the first layer the draft skips: its
input is exactly the residual stream at depth N that the head reads, so it starts as a sensible
next step of the computation. Measured on the default model (N = 4, V_d = 32768, 400 training
steps), it reached a held-out greedy acceptance of 37.7% (sampled 31.8%) against 36.2% (30.3%)
for a head initialised from the last layer, whose output lives in the LM head's space but whose
input statistics are wrong at depth 4 (initial KL 27.6). Its output projection is the rows of the target's own output embedding for the V_d most
frequent tokens of the training corpus; it is tied, not trained or stored, so a head file holds
one layer and a norm (about 11 MB in bfloat16 for Gemma 3 270M). q is zero outside the draft
vocabulary, which keeps speculative sampling lossless (the rejection step covers those tokens).

Shared cache: to draft, the drafter runs the target's layers 0..N-1 for its tokens in the
target's own KV cache, past the committed length; context tokens are never recomputed. On the
fast path they write a static cache's positions that the verification forward then overwrites;
on the PyTorch path (any transformers model `torch_path` can take apart, on any device) they run
through the model's own forward, stopped after layer N, and are appended to layers 0..N-1 of its
DynamicCache (or the compiled step's StaticCache), which the drafter crops back when its draft
is done (`end_draft`), before the verification forward. The head keeps a cache of its own (a
one-layer static cache on the fast path, a DynamicCache on the PyTorch path), rolled back to the
committed positions. After verification, the accepted tokens' head entries are already there
(drafting computed them) except for the last draft token when everything was accepted; its
layer-N state is taken from the verification forward itself (`Target.exit_states`: the fast
path keeps it, the PyTorch path reads it with a forward hook on layer N), so committed target
cache entries are never rewritten. When the controller decides not to draft, nothing is
computed: the next draft catches up on the skipped positions from the states the target's
forwards captured meanwhile.
The verify reuses the draft's rows where that gives the same bits: drafting ran layers 0..N-1
for the last committed token and every fed draft token at their own positions in the target's
cache, so at `end_draft` the drafter offers their residual streams (`TargetSequence.offer_drafted`),
and a verify whose layers are batch-invariant at every width (C layers in int8 or a GGUF file's
numerics: `backends.DecoderBackend.reuses_drafted`) takes the rows whose tokens match and runs
layers 0..N-1 only for the rest (the last draft token, and anything after a differing token),
then layers N..L-1 for all. A row's result does not depend on the rows sharing its call there, so
the logits, the keys and the captured exit states are those of a verify that recomputes
(tests/test_draft_reuse.py). What it saves is arithmetic, not weight reads: the first layers
still run once per verify (for the row the draft did not feed), so it pays where extra rows cost
(a wide verify on few cores), by about k rows x N/L of a row's cost. Elsewhere (the fp32 block
path, the PyTorch path, the batch's shared forwards) the verify recomputes every row.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from ...target import torch_path
from ...target.hf_cache import new_cache
from ...runtime.static_kv import StaticKV, Tree
from ...errors import ConfigError, ModelLoadError
from ...runtime.linear import Linear
from ..sampling import SamplingConfig
from .draft_model import SampledDrafter

HEAD_WEIGHTS = "exit_head.safetensors"
HEAD_CONFIG = "exit_head.json"


class ModelView:
    """What an exit head reads of its target, for a bare transformers model (a `Target`, or one
    of its sequences, offers the same: `config`, `device`, `dtype`, `architecture_parts`,
    `input_embeddings`, `output_rows`)."""

    def __init__(self, model):
        self.model, self.config = model, model.config
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    def architecture_parts(self):
        return torch_path.parts(self.model, "an exit head")

    @property
    def embedding_count(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    def input_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.get_input_embeddings().weight.detach()
        return weight[ids.to(weight.device)].float()

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.get_output_embeddings().weight.detach()
        return weight[ids.to(weight.device)]


def _view(owner):
    """`owner` as what an exit head reads: a Target or sequence as it is, a model through `ModelView`."""
    return ModelView(owner) if isinstance(owner, torch.nn.Module) else owner


def target_fingerprint(target) -> str:
    """Identifies a target model independently of the dtype it was loaded in (or whether it runs
    a GGUF file's own blocks or their dequantized copy): architecture, sizes, and a checksum of
    a fixed sample of its input embeddings (rounded to bfloat16)."""
    target = _view(target)
    config = target.config
    vocab = target.embedding_count
    rows = target.input_embeddings(torch.arange(0, vocab, max(1, vocab // 512)))[:, :64]
    sample = rows.to(torch.bfloat16).float().cpu().numpy().tobytes()
    digest = hashlib.sha256(sample).hexdigest()[:16]
    return (f"{config.model_type}-layers{config.num_hidden_layers}-hidden{config.hidden_size}"
            f"-vocab{vocab}-{digest}")


@dataclass(frozen=True)
class ExitHeadSpec:
    """What a head file says about itself (the JSON next to its weights)."""

    target: str  # target_fingerprint of the model it was trained for
    target_name: str
    exit_layer: int  # N: the head reads the residual stream after the target's first N layers
    init_layer: int  # the target layer the head's layer was initialised from
    draft_vocab: tuple[int, ...]  # V_d token ids, most frequent first
    training: dict = field(default_factory=dict)  # data, steps, loss, held-out metrics
    # Prefixes of the head's parameters that are the target's own (layer init_layer's, not
    # trained, not in the file): e.g. ("layer.mlp.",) for a head that trained its attention only
    shared: tuple[str, ...] = ()


class ExitHead(torch.nn.Module):
    """One decoder layer + final norm; logits over the draft vocabulary through the target's
    own (tied, frozen) output-embedding rows."""

    def __init__(self, target, exit_layer: int, draft_vocab: Sequence[int], init_layer: int | None = None,
                 shared: Sequence[str] = ()):
        """target: the `Target` (or a sequence of it) the head drafts for. On a target without
        a transformers model (a GGUF file's own blocks) the layer and norm come from a weightless
        skeleton of the architecture and must be filled (`load_head`, or training's init).
        shared: prefixes of parameters kept as the target's layer init_layer has them (frozen,
        and left out of the head's file), e.g. ("layer.mlp.",): a head a fraction of a layer's size."""
        super().__init__()
        target = _view(target)
        parts = target.architecture_parts()  # the decoder's layers, final norm, rotary module
        layers = len(parts.layers)
        if not 1 <= exit_layer <= layers:
            raise ConfigError(f"exit layer must be in 1..{layers} for this model, got {exit_layer}")
        self.exit_layer = exit_layer
        self.init_layer = min(exit_layer, layers - 1) if init_layer is None else init_layer
        self.layer = copy.deepcopy(parts.layers[self.init_layer])
        self.norm = copy.deepcopy(parts.norm)
        if any(p.is_meta for p in [*self.layer.parameters(), *self.norm.parameters()]):
            # a skeleton's layer (a target without a transformers model): the target's own weights
            self.layer.to_empty(device="cpu").load_state_dict(target.layer_state(self.init_layer))
            self.norm.to_empty(device="cpu").load_state_dict(target.final_norm_state())
        self.register_buffer("vocab", torch.tensor(list(draft_vocab), dtype=torch.long, device=target.device),
                             persistent=False)
        # The target (its output embedding, rotary module, layer kinds) is used, not owned: kept
        # out of this module's parameters, state dict and dtype casts.
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_parts", parts)
        self.rotary_args = (parts.kinds[self.init_layer],) if parts.rotary_takes_kind else ()
        self._window = parts.windows[self.init_layer]
        self.shared = tuple(shared)
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(not self.is_shared(name))

    def is_shared(self, name: str) -> bool:
        """Whether parameter `name` is the target's own (frozen, not saved)."""
        return any(name.startswith(prefix) for prefix in self.shared)

    def output_rows(self) -> torch.Tensor:
        """The draft vocabulary's rows of the target's output embedding: [V_d, hidden]."""
        return self._target.output_rows(self.vocab)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Training/reference forward over whole sequences. hidden: [B, T, d] (the residual
        stream after N target layers, positions 0..T-1) -> draft logits [B, T, V_d]."""
        batch, length, _ = hidden.shape
        steps = torch.arange(length, device=hidden.device)
        query, key = steps.unsqueeze(1), steps.unsqueeze(0)
        visible = key <= query
        if self._window is not None:
            visible &= key > query - self._window
        mask = torch.zeros(length, length, dtype=hidden.dtype, device=hidden.device).masked_fill(~visible, float("-inf"))
        out = torch_path.call_layer(self.layer, self._parts, hidden, mask[None, None].expand(batch, 1, -1, -1),
                                    self.rotary_args)  # [B, T, d]
        return self.norm(out) @ self.output_rows().to(hidden.dtype).T  # [B, T, V_d]

    def spec(self, target, name: str, training: dict | None = None) -> ExitHeadSpec:
        return ExitHeadSpec(target_fingerprint(target), name, self.exit_layer, self.init_layer,
                            tuple(int(t) for t in self.vocab.tolist()), training or {}, self.shared)


def save_head(head: ExitHead, spec: ExitHeadSpec, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write HEAD_WEIGHTS (the layer and norm, in `dtype`, less the parameters shared with the
    target) and HEAD_CONFIG into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).cpu().contiguous() for k, v in head.state_dict().items() if not head.is_shared(k)}
    save_file(state, str(directory / HEAD_WEIGHTS))
    (directory / HEAD_CONFIG).write_text(json.dumps(asdict(spec), indent=1) + "\n")


def read_spec(directory: Path) -> ExitHeadSpec:
    path = directory / HEAD_CONFIG
    if not path.is_file():
        raise ModelLoadError(f"no exit head at {directory} ({HEAD_CONFIG} missing)")
    try:
        data = json.loads(path.read_text())
        data["draft_vocab"] = tuple(data["draft_vocab"])
        data["shared"] = tuple(data.get("shared", ()))
        return ExitHeadSpec(**data)
    except (ValueError, TypeError, KeyError) as error:
        raise ModelLoadError(f"{path} is not an exit-head config: {error}") from error


def load_head(directory: Path, target, name: str = "", exit_layer: int | None = None) -> tuple[ExitHead, ExitHeadSpec]:
    """Load a head for `target`; refuse one trained for another model or exit layer."""
    spec = read_spec(directory)
    target = _view(target)
    fingerprint = target_fingerprint(target)
    if spec.target != fingerprint:
        raise ModelLoadError(
            f"the exit head at {directory} was trained for {spec.target_name or spec.target}, not for "
            f"{name or 'this model'} (fingerprint {spec.target} != {fingerprint}); train one with "
            f"`verispec train-exit`"
        )
    if exit_layer is not None and exit_layer != spec.exit_layer:
        raise ModelLoadError(
            f"the exit head at {directory} reads layer {spec.exit_layer}, but layer {exit_layer} was asked for"
        )
    head = ExitHead(target, spec.exit_layer, spec.draft_vocab, spec.init_layer, spec.shared)
    state = {k: v.to(target.dtype) for k, v in load_file(str(directory / HEAD_WEIGHTS)).items()}
    head.to(target.dtype)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [name for name in missing if not head.is_shared(name)]  # those are the target's, as it has them
    if missing or unexpected:
        raise ModelLoadError(f"exit head at {directory} does not fit this model (missing {missing}, unexpected {unexpected})")
    return head.eval(), spec


class PreparedHead:
    """An exit head made ready for drafting on one target; built once per target and head,
    shared by that target's requests.

    On the fast path: a packed projection and a wrapped layer. With `quantize` (the default) and
    a target on the block kernel, the head's layer runs on int8 Q8_0-style forms of its weights
    (`gguf.blocks.quantize_blocks`), as one C call like the target's layers, instead of as
    float32 PyTorch operators; the drafts are then those of the quantized head (verification
    keeps the output exact either way, and sps/mtad's q is the distribution the drafts were
    actually sampled from). On the PyTorch path: the head's own layer module and the draft
    vocabulary's output rows in the target's dtype (`quantize` has no effect there)."""

    def __init__(self, target, head: ExitHead, spec: ExitHeadSpec | None = None, quantize: bool = True):
        self.head, self.spec = head, spec
        self.exit_layer = head.exit_layer
        self.norm = head.norm
        self.vocab = head.vocab  # [V_d]
        if target.fast:
            self.layer = target.decoder.wrap_layer(head.layer, quantize=quantize)
            self.project = target.output_rows_linear(head.vocab)  # hidden [n, d] -> [n, V_d]
        else:
            torch_path.parts(target.model, "eesd")  # a model it cannot take apart is refused here
            self.layer = head.layer
            torch_path.pack(head.layer)  # its multi-row products' packed weights (CPU, float32), made now
            # hidden [n, d] -> [n, V_d]; packed for oneDNN in float32 on the CPU, as the target's head
            self.project = Linear(head.output_rows().to(target.dtype).contiguous(), None)


class ExitHeadLM:
    """The target's first N layers plus an exit head, as a `DraftLM` (see `drafters.draft_model`), on
    the fast path or the PyTorch path (see the module docstring)."""

    def __init__(self, target, head: "PreparedHead | ExitHead"):
        prepared = head if isinstance(head, PreparedHead) else PreparedHead(target, head)
        self.target = target
        self.exit_layer = prepared.exit_layer
        self.vocab = prepared.vocab  # [V_d]
        self.vocab_size = target.vocab_size
        self.device = target.device
        self.decoder = target.decoder
        self._layer, self._project, self._norm = prepared.layer, prepared.project, prepared.norm
        self._cache = None  # the head's own: a one-layer StaticKV (fast path), a DynamicCache (PyTorch path)
        self._head_length = 0  # positions 0.. with valid head keys/values
        # PyTorch path: the head's layer is a copy of target layer `_index` (its cache slot and kind)
        self._index = prepared.head.init_layer
        self._rotary_kind = prepared.head.rotary_args
        self._scratch: int | None = None  # draft rows in the target's layers 0..N-1 from this position on
        # This draft's rows of the target's layers 0..N-1 at consecutive positions (fast path):
        # (first position, tokens, residual streams [1, d] each), offered to the verify at `end_draft`
        self._drafted: tuple[int, list[int], list[torch.Tensor]] | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        self.target.capture_exit(self.exit_layer)
        if self.decoder is None:
            self._cache = new_cache(self.target.model)
            self._scratch = None
        elif self._cache is None:
            self._cache = self.decoder.new_cache(layers=1)
        else:
            self._cache.crop(0)
        self._head_length = 0

    def assume_head_cache(self, length: int, room: int) -> None:
        """Treat the head's cache as holding positions 0..length-1, with room for `room` more
        (a timing of draft steps past a context, `bench.profile`; fast path only)."""
        self._head_length = length
        self._cache.reserve(length + room)
        self._cache.length = length

    def _head(self, residual: torch.Tensor, start: int, tree: Tree | None = None,
              last_only: bool = False) -> torch.Tensor:
        """Head layer over residual [m, d] (filling the head cache for all m) -> draft logits
        [m, V_d], or [1, V_d] for the last row only."""
        if self.decoder is None:
            placed = tree if tree is not None else torch_path.contiguous(start, residual.shape[0], self.device)
            out = torch_path.run_layer(self._layer, self.target.model, residual, placed, self._cache, self._index,
                                       self._rotary_kind)  # [m, d]
        else:
            out = self.decoder.run_layer(self._layer, residual, start, self._cache, tree=tree)  # [m, d]
        return self._project(self._norm(out[-1:] if last_only else out))

    def _first_layers(self, tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
        """Layers 0..N-1 of the target for draft tokens [m] placed by `tree`, in the target's
        cache (scratch rows past the committed positions) -> the residual stream [m, d]."""
        if self.decoder is None:
            if self._scratch is None:
                self._scratch = int(tree.positions.min())
            residual, _ = torch_path.through(self.target.model, self.target.decoder_body, self.target.head,
                                             self.target.cache, tokens, tree, stop_after=self.exit_layer)
            return residual
        return self.decoder.run(self.decoder.embed(tokens), int(tree.positions[0]), self.target.cache, range(self.exit_layer),
                              tree=tree if tree.slots is not None else None)

    @torch.inference_mode()
    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Fill the head cache for every committed position; logits [V_d] after the last token."""
        last = len(context) - 1
        rows = []
        if self._head_length < last:  # committed tokens the head has not seen: captured by the target
            rows.append(self.target.exit_states(self._head_length, last))
        token = torch.tensor([context[-1]], dtype=torch.long, device=self.device)
        # The last token is not in the target's cache yet: run layers 0..N-1 for it, writing
        # scratch entries that the next verification overwrites (fast path) or that `end_draft`
        # crops (PyTorch path).
        residual = self._first_layers(token, Tree.contiguous(last, 1, self.device))  # [1, d]
        rows.append(residual)
        self._drafted = (last, [int(context[-1])], [residual]) if self.decoder is not None else None
        # Only the last row's logits are used: projecting the catch-up rows too cost a
        # 32k-row projection per committed token (a whole prompt's on the first draft).
        logits = self._head(torch.cat(rows), self._head_length, last_only=True)  # [1, V_d]
        self._head_length = len(context)
        return logits[0]

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
        """Draft tokens through layers 0..N-1 (scratch entries in the target's cache) and the head."""
        residual = self._first_layers(tokens, tree)  # [m, d]
        self._note_drafted(tokens, tree, residual)
        return self._head(residual, int(tree.positions[0]), tree if tree.slots is not None else None)

    def _note_drafted(self, tokens: torch.Tensor, tree: Tree, residual: torch.Tensor) -> None:
        """Keep a draft's rows for the verify while they continue the chain from `sync` at
        consecutive positions (a linear draft); a branching one (beams in scratch slots) ends it."""
        drafted = self._drafted
        if drafted is None:
            return
        first, ids, states = drafted
        if tree.slots is not None or int(tree.positions[0]) != first + len(ids):
            self._drafted = None
            return
        ids += tokens.tolist()
        states.append(residual)

    def keep(self, m: int) -> None:
        self._head_length += m
        if self.decoder is None:
            torch_path.crop_layers(self._cache, [self._index], self._head_length)
        else:
            self._cache.length = self._head_length

    def end_draft(self) -> None:
        """The draft is done: on the fast path its rows of layers 0..N-1 are offered to the
        verification forward, which takes those whose tokens it verifies where the layers are
        batch-invariant and overwrites the others; on the PyTorch path they leave the target's
        layers 0..N-1 before the verification forward appends to every layer."""
        if self._drafted is not None:
            first, ids, states = self._drafted
            self.target.offer_drafted(first, ids, torch.cat(states))
            self._drafted = None
        if self._scratch is not None:
            torch_path.crop_layers(self.target.cache, range(self.exit_layer), self._scratch)
            self._scratch = None


class EarlyExitDrafter(SampledDrafter):
    """EESD's drafter: `SampledDrafter` over the target's first N layers and an exit head."""

    def __init__(self, target, head: "PreparedHead | ExitHead", sampling: SamplingConfig = SamplingConfig()):
        super().__init__(ExitHeadLM(target, head), sampling)
