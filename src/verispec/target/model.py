"""The target: a loaded model's identity and the one backend that runs it.

Owns `Target`: the model's facts (config, tokenizer, vocabulary, context length, EOS ids), its
LM head (`head.own_head`), the choice of backend (`backends`: transformers' forward, the compiled
CUDA step, the fast path's decoder over static or paged KV), the KV memory of paged sequences
(`kv_memory`, the block pool) and one sequence of its own for the single-request API (`reset`,
`forward`, `crop`, ... are that sequence's: `sequence.TargetSequence`). Loading lives in
`loading.py`; the engine, the batch and the drafters use a target or one of its sequences.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import lazy_logits
from .backends import CompiledBackend, PagedBackend, StaticBackend, TorchBackend
from .device import STATIC_CACHE_TOKENS, CompiledStep, model_device, spread_over_devices
from ..errors import ConfigError
from .head import VocabularyHead, own_head
from .lazy_logits import LazyRows
from ..notices import notice
from ..runtime import blockmm
from ..runtime.fastpath import BLOCK_KERNEL_MAX_ROWS, FastDecoder
from ..runtime.kv_pool import BlockPool, default_budget_bytes, parse_bytes
from ..runtime.linear import BlockLinear, Linear
from .sequence import TargetSequence


class Target:
    """A loaded causal LM with a per-request KV cache: the engine's view of the target model.

    Call `reset()` before each request, then `forward(tokens)` appends tokens to the cache and
    returns their logits, and `crop(n)` rolls the cache back to its first n positions. Where the
    backend verifies trees (`verifies_trees`), `forward_tree(tokens, parents)` runs a tree of
    drafts in one forward and `keep_path(rows)` keeps one of its paths.

    fast=True runs the fast path (`fastpath.FastDecoder`: static KV cache, prepacked linears)
    when the architecture supports it, and otherwise says why on stderr and uses transformers'
    eager forward with a DynamicCache; fast=False always uses the eager forward. blocks
    ({nn.Linear: gguf.blocks.BlockWeights}, exact block forms) puts those linears, the LM head
    included, on the int8 block kernel on the fast path, multiplying in `numerics` ("int8" or
    "fp32", see `loading.load`; "fp32" here, "int8" by default through `load`). `numerics`
    holds what the target really computes: "fp32" where the block kernel is not used. Where
    every layer runs in C with int8 numerics, sequences page their KV in one block pool and
    many of them share each forward (`PagedBackend`).
    """

    def __init__(self, model, tokenizer, name: str = "", fast: bool = True, blocks: dict | None = None,
                 numerics: str = "fp32", *, decoder=None, config=None, eos_token_ids=None):
        """model: a transformers causal LM; or None with `decoder` (a decoder that needs no
        transformers model: `runtime.gguf_decoder`), its `config` and `eos_token_ids` (see
        `of_decoder`)."""
        if model is None:
            self._identity(config, tokenizer, name, torch.device("cpu"))
            self.model = self.decoder_body = None
            self.decoder, self.head = decoder, decoder.head
            self._eos_ids = frozenset(int(i) for i in eos_token_ids)
            self._sequence = TargetSequence(self)
            return
        if numerics not in blockmm.NUMERICS:
            raise ValueError(f"numerics {numerics!r}: choose one of {', '.join(blockmm.NUMERICS)}")
        self._identity(model.config, tokenizer, name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
                       model_device(model))
        self.model = model.eval()
        self.decoder_body = model.get_decoder()
        self._eos_ids: frozenset[int] | None = None  # read from the model's generation config
        decoder = None
        if fast and self.device.type != "cpu":
            notice(f"fast path not used for {self.name}: it runs on the CPU only, and the model is on "
                   f"{self.device}; using the PyTorch forward")
        elif fast:
            reason = FastDecoder.supports(model)
            if reason is None:
                decoder = FastDecoder(model, blocks, blockmm.kernel()[0] if blocks else None, numerics)
            else:
                notice(f"fast path not available for {self.name}: {reason}; using the eager forward")
        self.head, self.decoder = own_head(model, decoder, self.name, self.device, self.dtype)
        self._sequence = TargetSequence(self)  # the single-request interface's

    @classmethod
    def of_decoder(cls, decoder, config, tokenizer, name: str, eos_token_ids) -> "Target":
        """A target run by a decoder that needs no transformers model (`runtime.gguf_decoder`:
        a GGUF file's own blocks): its LM head is the decoder's, its facts the config's."""
        return cls(None, tokenizer, name, decoder=decoder, config=config, eos_token_ids=eos_token_ids)

    def _identity(self, config, tokenizer, name: str, device: torch.device) -> None:
        self.config, self.tokenizer, self.name, self.device = config, tokenizer, name, device
        self.attachments: dict = {}  # things built once per target (e.g. prepared exit heads)
        self._kv_memory: int | None = None  # bytes of the block pool (None: `kv_pool.default_budget_bytes()`)
        self._prefix_cache = True
        self.recorder = None  # a `recorder.StateRecorder` keeping the batched forwards' states, while attached
        self._compiled: CompiledBackend | None = None  # `compile_decode_step`
        self._backends: dict[type, object] = {}  # each backend made at first use, then kept

    @property
    def backend(self):
        """The backend for the decoder as it is now (see `backends`): the compiled CUDA step where
        one was made; transformers' forward without a decoder; the paged backend where every
        layer runs in C at every width (int8 numerics); else the static one. A sequence keeps the
        backend it was reset on."""
        decoder = self.decoder
        if self._compiled is not None:
            return self._compiled
        if decoder is None:
            kind = TorchBackend
        elif decoder.runs_in_c(range(len(decoder.layers)), BLOCK_KERNEL_MAX_ROWS + 1):
            kind = PagedBackend
        else:
            kind = StaticBackend
        if kind not in self._backends:
            self._backends[kind] = (TorchBackend(self) if kind is TorchBackend else
                                    PagedBackend(self, decoder, self._new_pool) if kind is PagedBackend else
                                    StaticBackend(self, decoder))
        return self._backends[kind]

    def _paged(self) -> PagedBackend | None:
        """The paged backend, if one was made (it holds the pool)."""
        return self._backends.get(PagedBackend)

    def _new_pool(self) -> BlockPool:
        decoder = self.decoder
        return BlockPool.for_budget(len(decoder.layers), decoder.kv_heads, decoder.head_dim,
                                    self._kv_memory or default_budget_bytes(), decoder.dtype,
                                    prefix_cache=self._prefix_cache)

    @property
    def numerics(self) -> str:
        """How the linears multiply: "int8" or "fp32" on the block kernel ("fp32" without it),
        "gguf" on a GGUF file's own blocks (`runtime.gguf_decoder`)."""
        decoder = self.decoder
        if decoder is not None and (decoder.blocks or self.model is None):
            return decoder.numerics
        return "fp32"

    @numerics.setter
    def numerics(self, value: str) -> None:
        """Switch every block-kernel linear of this target (no-op without the kernel); the
        backend of the next sequence reset follows (paged KV in int8 numerics only)."""
        if value not in blockmm.NUMERICS:
            raise ValueError(f"numerics {value!r}: choose one of {', '.join(blockmm.NUMERICS)}")
        if self.model is None:
            raise ConfigError(f"{self.name} runs its GGUF file's own blocks: its numerics are fixed")
        if self.decoder is not None and self.decoder.blocks:
            self.decoder.numerics = value
            paged = self._paged()
            if paged is not None and paged.has_pool:
                paged.pool.clear_cache()  # its blocks hold keys computed in the other numerics

    # -- facts about the model -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.dtype if self.model is None else next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        if self.model is None:
            return int(self.head.out_features)
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        """Longest sequence (prompt + output) the model supports (and the compiled step's cache holds)."""
        longest = 1 << 20
        for attribute in ("max_position_embeddings", "n_positions"):
            value = getattr(self.config, attribute, None)
            if value:
                longest = int(value)
                break
        return longest if self._compiled is None else min(longest, self._compiled.step.capacity)

    def set_eos_token_ids(self, ids) -> None:
        """The ids that end a generation, where the model's files say so elsewhere (a GGUF's metadata)."""
        self._eos_ids = frozenset(int(i) for i in ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        if self._eos_ids is not None:
            return self._eos_ids
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    @property
    def fast(self) -> bool:
        """Whether forwards run on the fast path (a decoder of its own)."""
        return self.decoder is not None

    def compile_decode_step(self, mode: str | None = "reduce-overhead", backend: str = "inductor") -> bool:
        """Run one-token forwards as a `torch.compile`d step over a static KV cache
        (`device.CompiledStep`; `load(compile=True)` calls this on CUDA). Wider forwards run
        uncompiled on the same cache. Returns whether it is in use: not for targets on the fast
        path (the CPU runtime), spread over several devices, or whose model it cannot run (the
        reason on stderr)."""
        if self.decoder is not None:
            reason = "the target runs the CPU fast path"
        elif spread_over_devices(self.model):
            reason = "the model is spread over several devices"
        else:
            reason = CompiledStep.unsupported(self.model)
        if reason is not None:
            notice(f"decode step not compiled for {self.name}: {reason}; running the PyTorch forward")
            return False
        step = CompiledStep(self.model, min(self.max_length, STATIC_CACHE_TOKENS), mode, backend)
        self.head = None  # the step computes logits with the model's own forward
        self._compiled = CompiledBackend(self, step)
        self._sequence = TargetSequence(self)
        return True

    # -- the single-request interface: this target's own sequence (`sequence.TargetSequence`) --
    def reset(self) -> None:
        """Start a new request on this target's own sequence (see `TargetSequence.reset`)."""
        self._sequence.reset()

    def release(self) -> None:
        """End the last request on this target's own sequence: its KV blocks go back to the pool
        (the next `reset` does it too)."""
        self._sequence.release()

    @property
    def cache(self):
        return self._sequence.cache

    @property
    def length(self) -> int:
        return self._sequence.length

    def crop(self, length: int) -> None:
        self._sequence.crop(length)

    def forward(self, tokens: Sequence[int], last_only: bool = False, lazy: bool = False) -> "torch.Tensor | LazyRows":
        return self._sequence.forward(tokens, last_only, lazy)

    def forward_tree(self, tokens: Sequence[int], parents: Sequence[int], lazy: bool = False) -> "torch.Tensor | LazyRows":
        return self._sequence.forward_tree(tokens, parents, lazy)

    def keep_path(self, rows: Sequence[int]) -> None:
        self._sequence.keep_path(rows)

    def hidden_states(self, ids: torch.Tensor) -> torch.Tensor:
        return self._sequence.hidden_states(ids)

    def exit_states(self, low: int, high: int) -> torch.Tensor:
        return self._sequence.exit_states(low, high)

    def capture_exit(self, layer: int) -> None:
        self._sequence.capture_exit(layer)

    def offer_drafted(self, start: int, tokens: Sequence[int], states: torch.Tensor) -> None:
        self._sequence.offer_drafted(start, tokens, states)

    def new_sequence(self) -> "TargetSequence":
        """A sequence of its own on this target (for one of several requests at once)."""
        return TargetSequence(self)

    def forward_parts(self, parts: list) -> list:
        """One forward over several paged sequences' rows (`PagedBackend.forward_parts`)."""
        return self.backend.forward_parts(parts)

    # -- paged KV memory and the prefix cache ------------------------------------------------
    @property
    def pages_kv(self) -> bool:
        """Whether sequences keep their KV in the target's block pool (`kv_pool`): where every
        layer runs in C at every width (the fast path, int8 numerics); elsewhere a sequence has
        a contiguous cache of its own."""
        return self.backend.pages_kv

    @property
    def kv_memory(self) -> int | None:
        """Bytes of KV memory for this target's paged sequences (None: the default,
        `kv_pool.default_budget_bytes()`: a quarter of the memory available, at most 2 GiB)."""
        return self._kv_memory

    @kv_memory.setter
    def kv_memory(self, value: int | str | None) -> None:
        """Set it in bytes or as a size ('512MiB', '2GB'); the pool is made anew at its next use,
        so no request may hold blocks (a ConfigError otherwise)."""
        size = value if value is None or (isinstance(value, int) and not isinstance(value, bool)) else None
        if value is not None and size is None:
            size = parse_bytes(str(value)) if isinstance(value, str) else -1
        if size is not None and size <= 0:
            raise ConfigError(f"kv_memory must be a positive number of bytes or a memory size, got {value!r}")
        paged = self._paged()
        if paged is not None and paged.has_pool:
            if paged.pool.used_blocks:
                raise ConfigError("the KV memory cannot change while requests hold blocks of it")
            paged.drop_pool()
        self._kv_memory = size

    @property
    def pool(self) -> BlockPool:
        """The block pool of this target's paged sequences, made at first use with `kv_memory`
        bytes."""
        return self.backend.pool

    @property
    def prefix_cache(self) -> bool:
        """Whether paged sequences keep their full blocks for later requests that start with the
        same tokens (`kv_pool.PrefixCache`; outputs are identical either way)."""
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, value: bool) -> None:
        self._prefix_cache = bool(value)
        paged = self._paged()
        if paged is not None and paged.has_pool:
            paged.pool.prefix_cache = self._prefix_cache
            if not value:
                paged.pool.clear_cache()

    # -- logits --------------------------------------------------------------------------------
    def batch_invariant(self, rows: int, layers: bool) -> bool:
        """Whether `rows` (at least `lazy_logits.MIN_ROWS`) can be computed in parts with the same
        bits: the LM head on the int8 block kernel and, with `layers`, every decoder layer in C
        (both batch-invariant: a row's result does not depend on the rows sharing its call)."""
        if not (rows >= lazy_logits.MIN_ROWS and getattr(self.head, "batch_invariant", False)):
            return False
        decoder = self.decoder
        return not layers or (decoder.use_native and decoder.native_layers == len(decoder.layers))

    def logits(self, hidden: torch.Tensor, lazy: bool) -> "torch.Tensor | LazyRows":
        """The LM head on final-normed states [n, hidden] -> [n, vocab]; as `LazyRows` (the head
        run on the rows read) if `lazy` and that gives the same bits (`batch_invariant`)."""
        if lazy and self.batch_invariant(hidden.shape[0], layers=False):
            return LazyRows.of_head(hidden, self.head, self.vocab_size)
        return self.head(hidden)

    def ready(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits`, computed: on CUDA this waits for the forward, so that its time counts as the
        forward's (controllers learn from it) and not as the rule's; the rule reads them at once
        anyway, so the wait costs nothing."""
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        return logits

    @property
    def verifies_trees(self) -> bool:
        """Whether `forward_tree` is available: on the fast path, and on the PyTorch path for the
        models `torch_path` can mask (elsewhere the engine verifies a tree's primary branch alone)."""
        return self.backend.verifies_trees

    @property
    def embedding_count(self) -> int:
        """Rows of the input embedding matrix."""
        if self.model is None:
            return self.decoder.embedding.rows
        return int(self.model.get_input_embeddings().weight.shape[0])

    def input_embeddings(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the input embedding matrix as float32 [n, hidden] (as stored: not scaled)."""
        if self.model is None:
            return self.decoder.embedding_rows(ids)
        return self.model.get_input_embeddings().weight.detach()[ids].float()

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the output embedding (the LM head's weight) as [n, hidden], in the
        target's dtype (dequantized from a GGUF file's blocks)."""
        if self.model is None:
            return self.decoder.head_rows(ids)
        return self.model.get_output_embeddings().weight.detach()[ids]

    def layer_state(self, index: int) -> dict:
        """Layer `index`'s weights in float32 under transformers' names (a target without a
        transformers model: dequantized from its GGUF blocks)."""
        return self.decoder.layer_state(index)

    def final_norm_state(self) -> dict:
        """The final norm's weights under transformers' names (as `layer_state`)."""
        return self.decoder.final_norm_state()

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary for final-normed states [n, hidden], as the model's head
        computes them (float32 `hidden @ W^T` where the weight is float, the file's blocks on a
        GGUF runtime); for evaluations (an exit head's acceptance estimates)."""
        if self.model is None:
            return self.head(hidden)
        weight = self.model.get_output_embeddings().weight.detach()
        return hidden.float() @ weight.float().T

    def architecture_parts(self):
        """`torch_path.Parts` of the target's architecture: its own model's, or a weightless
        skeleton's where it runs without one (made once)."""
        from . import torch_path

        if self.model is not None:
            return torch_path.parts(self.model, "an exit head")
        if "skeleton" not in self.attachments:
            self.attachments["skeleton"] = torch_path.skeleton_parts(self.config)
        return self.attachments["skeleton"]

    @property
    def uses_own_head(self) -> bool:
        return self.head is not None

    def restrict_vocabulary(self, ids: torch.Tensor) -> bool:
        """Compute logits only for the tokens `ids` (-inf elsewhere; a draft model's draft
        vocabulary: its head reads a fraction of the weights). False where this target computes
        logits with the model's own forward and cannot."""
        if self.head is None or isinstance(self.head, VocabularyHead):
            return False
        self.head = VocabularyHead(self.output_rows_linear(ids), ids, self.vocab_size)
        return True

    def output_rows_linear(self, rows: torch.Tensor):
        """hidden [n, d] -> hidden @ W[rows]^T [n, len(rows)] for some rows of the output
        embedding (an exit head's draft vocabulary), on the block kernel where the LM head has a
        block form, else prepacked float32."""
        if self.model is None:
            return self.head.rows(rows)
        head = self.model.get_output_embeddings()
        dense = Linear(head.weight.detach()[rows].to(self.dtype).contiguous(), None)
        if self.decoder is None:
            return dense
        form = self.decoder.blocks.get(head)
        return self.decoder.on_blocks(dense, None if form is None else form.rows(rows))

    @property
    def weight_pages(self) -> dict | None:
        """Where a GGUF file's matrices live (`runtime.resident`): {"copied_bytes", "huge_page_bytes"}
        (the latter None where it cannot be read), or None where they stay in the file's map or the
        model is not run from a GGUF file's blocks."""
        placement = getattr(self.decoder, "weight_pages", None) if self.model is None else None
        return placement() if placement else None

    @property
    def weight_bytes_per_token(self) -> int:
        """Bytes of weights a one-token forward reads: a GGUF file's blocks of every layer and the
        head; the int8 block forms where the block kernel runs them (their linears); else every
        parameter but an untied input embedding (looked up, not read whole)."""
        if self.model is None:
            return self.decoder.bytes_per_token
        forms = self.block_forms
        if forms:
            return sum(form.nbytes for form in forms)
        embed = self.model.get_input_embeddings().weight
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        tied = embed is self.model.get_output_embeddings().weight
        return total - (0 if tied else embed.numel() * embed.element_size())

    @property
    def block_forms(self) -> list:
        """The block forms (`gguf.blocks.BlockWeights`, [out, in]) that the block kernel multiplies
        in a forward, one per linear module of the model (a fused linear, e.g. q/k/v, multiplies
        its modules' forms concatenated); empty off the block kernel."""
        return [] if self.decoder is None else list(self.decoder.blocks.values())

    @property
    def block_kernel_summary(self) -> str:
        """Which of the fast path's linears run on the int8 block kernel, for display."""
        decoder = self.decoder
        if self.model is None:
            return (f"the GGUF file's own blocks ({decoder.weight_types}), {decoder.native_layers} layers in C, "
                    f"{decoder.kernel_isa} build")
        if decoder is None or not decoder.blocks:
            return "off"
        head = "the LM head and " if isinstance(self.head, BlockLinear) else ""
        total = 4 * len(decoder.layers)
        native = f"; {decoder.native_layers} of {len(decoder.layers)} layers in C, one call per forward"
        activations = "int8 activations" if self.numerics == "int8" else "float32 activations"
        return (f"{head}{decoder.block_linears} of {total} layer linears (exact int8 blocks, {activations}, "
                f"{decoder.kernel_isa} build){native}")
