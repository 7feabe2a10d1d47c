"""What a GGUF file says about its model, read without transformers loading any weight: the
transformers config, the tokenizer (with the chat template) and the EOS ids.

Owns: turning a parsed GGUF file (`gguf.reader.GgufFile`) into a transformers `PretrainedConfig`
with transformers' own GGUF key mapping (the same dict `AutoConfig.from_pretrained(dir,
gguf_file=...)` builds, fed our metadata instead of `gguf.GGUFReader`'s), building the tokenizer
exactly as transformers builds it from GGUF (`convert_gguf_tokenizer`, then the class
`AutoTokenizer` would pick for the config), and caching that tokenizer on disk. Does not own the
weights (the runtime reads `GgufModel.file.tensor_bytes`) or the loader (`target/loading.py`).

Why: transformers reads the metadata through `GGUFReader` (15-22 s on the embedded Gemma 3 270M,
whose vocabulary has 262,144 tokens; `AutoConfig` then `AutoTokenizer` read it twice: 20 s + 23 s
here) and converts the tokenizer every time. Here the metadata takes ~0.15 s, the config a few
milliseconds, and the tokenizer is converted once (4.4 s for Gemma, 1.2 s for Qwen2.5-Coder) and
saved as tokenizer.json + tokenizer_config.json (+ chat_template.jinja) under
`cache_root()/gguf/<key>`; later starts load that. Measured on the shared 2-core machine, in a
fresh process, `read_gguf_model` (including the first import of torch and transformers' config
classes, ~1.6 s): Gemma 8.3 s the first time, 4.0 s cached; Qwen2.5-Coder-1.5B 3.6 s, then
2.5 s. Most of a cached start is `TokenizersBackend.from_pretrained` (2.2 s for Gemma's 33 MB
tokenizer.json: 1.0 s in tokenizers' parser, 0.9 s in transformers' own reads of the JSON).

The cache key is a sha256 of the architecture, the tokenizer class, the raw bytes of every
`tokenizer.*` key/value in the file, the transformers version and this module's cache format:
moving or touching the file keeps it, a file with another vocabulary or template gets its own.
Writes go to a staging directory that is renamed into place (atomic: a concurrent start either
wins or finds it done). The cached tokenizer is loaded as the generic `TokenizersBackend` (as
`target/loading.py` loads the embedded model's), with the padding side of the class transformers picks
(left for Gemma, right for Qwen2); its ids, texts, special tokens and chat template equal that
class's (tests/test_gguf_file.py).

    from verispec.gguf.metadata import read_gguf_model
    model = read_gguf_model("model.gguf")  # .file .config .tokenizer .name .eos_token_ids ...
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelLoadError
from .reader import GgufFile, read_gguf
from ..paths import cache_root

CACHE_FORMAT = 1  # bump when what is cached, or how it is built, changes
_TOKENIZER_STAMP = "verispec-gguf.json"  # written last into a cache entry: the entry is complete


@dataclass(frozen=True)
class GgufModel:
    """A GGUF model's description: the parsed file (tensors as zero-copy views), its transformers
    config and tokenizer, and its display name."""

    file: GgufFile
    config: Any  # transformers.PretrainedConfig
    tokenizer: Any  # transformers.TokenizersBackend (a PreTrainedTokenizerFast)
    name: str  # general.name, else the file's stem
    architecture: str  # general.architecture as the file spells it ("gemma3", "qwen2", "llama")
    eos_token_ids: frozenset[int]  # the config's eos_token_id(s) and the tokenizer's eos token
    stop_token_ids: frozenset[int]  # eos_token_ids plus the file's end-of-turn/message ids (llama.cpp's EOG set)
    tokenizer_dir: Path  # the cache entry the tokenizer was loaded from

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def path(self) -> Path:
        return self.file.path


def read_gguf_model(path: str | os.PathLike, *, cache_dir: Path | None = None) -> GgufModel:
    """Parse `path` and build its config and tokenizer (the tokenizer from the cache under
    `cache_dir or cache_root()`, converted and cached on first use). ModelLoadError for a file
    that cannot be read or an architecture / tokenizer transformers cannot build from GGUF."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    gguf = read_gguf(path)
    config = gguf_config(gguf)
    tokenizer, tokenizer_dir = gguf_tokenizer(gguf, config, cache_dir=cache_dir)
    eos = set(_ids(getattr(config, "eos_token_id", None)))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    stop = set(eos)
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if isinstance(gguf.get(key), int) and not isinstance(gguf.get(key), bool):
            stop.add(int(gguf.get(key)))
    name = gguf.get("general.name")
    return GgufModel(
        file=gguf, config=config, tokenizer=tokenizer,
        name=name if isinstance(name, str) and name else path.stem,
        architecture=gguf.architecture, eos_token_ids=frozenset(eos), stop_token_ids=frozenset(stop),
        tokenizer_dir=tokenizer_dir,
    )


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (int, np.integer)):
        return [int(value)]
    return [int(v) for v in value]


# -- the config -----------------------------------------------------------------------------------


def _plain(value):
    """A metadata value as transformers' GGUF readers give it: numpy arrays as lists of Python
    numbers, nested arrays as nested lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _transformers_metadata(gguf: GgufFile) -> dict:
    """The metadata as `transformers.integrations.gguf.read_gguf_metadata` returns it (arrays of
    numbers as lists; string arrays as their lengths, except the tokens and merges)."""
    out = {}
    for key, value in gguf.metadata.items():
        if isinstance(value, list) and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") and (
                gguf.value_types[key][:2] == (9, 8)):
            out[key] = len(value)
        else:
            out[key] = _plain(value)
    return out


def gguf_config_dict(gguf: GgufFile) -> dict:
    """The config dict transformers builds from this file's metadata (`AutoConfig.from_pretrained
    (dir, gguf_file=...)`): its fast per-architecture builders where it has one, else the generic
    key mapping of `modeling_gguf_pytorch_utils.load_gguf_checkpoint`, mirrored here step by step."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, GGUF_TO_TRANSFORMERS_MAPPING

    architecture = gguf.architecture
    if not isinstance(architecture, str):
        raise ModelLoadError(f"{gguf.path} has no general.architecture in its metadata")
    if architecture in GGUF_CONFIG_ARCHS:
        return get_gguf_config(_transformers_metadata(gguf), tuple(gguf.tensors))

    model_name = gguf.get("general.name")
    updated = architecture
    # as load_gguf_checkpoint: its `"mistral" in model_name` tests a one-element list, i.e. equality
    if "llama" in architecture and model_name == "mistral":
        updated = "mistral"
    elif "t5" in architecture:
        raise ModelLoadError(f"{gguf.path} is a {architecture} model (encoder-decoder), not a decoder-only causal LM")
    if "qwen2moe" in architecture:
        updated = "qwen2_moe"
    elif "gpt_oss" in architecture or "gpt-oss" in architecture:
        updated = "gpt_oss"
    elif "qwen3moe" in architecture:
        updated = "qwen3_moe"
    elif "minimax-m2" in architecture:
        updated = "minimax_m2"
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES and updated not in GGUF_SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {architecture!r} ({gguf.path.name}) is not supported by transformers "
                             f"{_transformers_version()}")

    config: dict[str, Any] = {}
    names = tuple(gguf.tensors)
    if "stablelm" in architecture:
        config["use_qkv_bias"] = any(b in n for n in names for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"))
        config["use_parallel_residual"] = not any("ffn_norm" in n for n in names)
    config["tie_word_embeddings"] = "output.weight" not in names or architecture in ("falcon", "bloom")
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
                                                       ).items():
        config.setdefault(key, value)

    mapping = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for gguf_key, value in gguf.metadata.items():
        gguf_key = gguf_key.replace(architecture, updated)
        prefix, _, config_key = gguf_key.partition(".")
        renamed = mapping.get(prefix, {}).get(config_key, -1)
        if renamed == -1 or renamed is None:
            continue
        value = _plain(value)
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[renamed] = value

    model_type = config.get("model_type")
    if model_type == "gemma3":  # the GGUF holds the text backbone only
        config["model_type"] = "gemma3_text"
    elif model_type == "gemma4":
        config["model_type"] = "gemma4_text"
        config["eos_token_id"] = [1, 106, 50]
    elif model_type == "minimax_m2" and isinstance(config.get("scoring_func"), int):
        config["scoring_func"] = {0: "none", 1: "softmax", 2: "sigmoid"}.get(config["scoring_func"], "softmax")
    if updated == "gpt_oss" and isinstance(gguf.get("gpt-oss.rope.scaling.type"), str):
        rope = {"rope_type": gguf.get("gpt-oss.rope.scaling.type")}
        for key, value in gguf.metadata.items():
            if not key.startswith("gpt-oss.rope.scaling.") or key.endswith(".type"):
                continue
            suffix = key[len("gpt-oss.rope.scaling."):]
            if suffix in ("factor", "attention_factor", "beta_fast", "beta_slow"):
                value = float(value)
            elif suffix in ("original_context_length", "original_max_position_embeddings"):
                suffix, value = "original_max_position_embeddings", int(value)
            rope[suffix] = value
        config["rope_scaling"] = rope
    if "vocab_size" not in config and isinstance(gguf.get("tokenizer.ggml.tokens"), list):
        config["vocab_size"] = len(gguf.get("tokenizer.ggml.tokens"))
    return config


def gguf_config(gguf: GgufFile):
    """The transformers config of this file's model (a `PretrainedConfig` of the model type)."""
    from transformers import CONFIG_MAPPING

    config_dict = gguf_config_dict(gguf)
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"{gguf.path.name}: model type {model_type!r} is unknown to transformers "
                             f"{_transformers_version()}")
    try:
        return CONFIG_MAPPING[model_type].from_dict(config_dict)
    except (TypeError, ValueError, KeyError) as error:
        raise ModelLoadError(f"{gguf.path.name}: cannot build a {model_type} config from its metadata: {error}"
                             ) from error


# -- the tokenizer --------------------------------------------------------------------------------


def gguf_tokenizer_inputs(gguf: GgufFile) -> tuple[dict, dict]:
    """(tokenizer_dict, tokenizer_config) as `transformers.integrations.gguf.get_gguf_tokenizer`
    builds them from the file, from our metadata."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    metadata = gguf.metadata
    grouped = {
        group: {name: _plain(metadata[f"tokenizer.{key}"]) for key, name in renames.items()
                if f"tokenizer.{key}" in metadata}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer or not isinstance(tokenizer["tokens"], list):
        raise ModelLoadError(f"{gguf.path.name} has no tokenizer.ggml.tokens: no vocabulary to build a tokenizer from")
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        tokenizer_config["add_bos_token"] = False
    tokens = tokenizer["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelLoadError(f"{gguf.path.name}: tokenizer.ggml.{key} is {token_id}, outside the vocabulary "
                                 f"of {len(tokens)} tokens")
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    return tokenizer, tokenizer_config


def tokenizer_class_for(config):
    """The class `AutoTokenizer.from_pretrained(dir, gguf_file=...)` instantiates for this config
    (a GGUF directory has no tokenizer_config.json, so it is the model type's registered class)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    if cls is None or getattr(cls, "__name__", "") in ("MistralCommonBackend", "PythonBackend"):
        cls = TokenizersBackend
    return cls


def tokenizer_cache_key(gguf: GgufFile, tokenizer_class_name: str) -> str:
    """sha256 of what the tokenizer is built from: the architecture, the tokenizer class, the raw
    bytes of every `tokenizer.*` key/value record, and the versions that build it."""
    digest = hashlib.sha256()
    for part in (f"verispec-gguf-tokenizer/{CACHE_FORMAT}", f"transformers/{_transformers_version()}",
                 f"architecture/{gguf.architecture}", f"class/{tokenizer_class_name}"):
        digest.update(part.encode() + b"\0")
    for key in sorted(k for k in gguf.metadata if k.startswith("tokenizer.")):
        record = gguf.raw_record(key)
        digest.update(len(record).to_bytes(8, "little"))
        digest.update(record)
    return digest.hexdigest()


def gguf_tokenizer(gguf: GgufFile, config=None, *, cache_dir: Path | None = None):
    """(tokenizer, its cache directory): loaded from the cache, or converted from the file's
    metadata the way transformers does it and cached first."""
    from transformers import TokenizersBackend

    config = gguf_config(gguf) if config is None else config
    cls = tokenizer_class_for(config)
    key = tokenizer_cache_key(gguf, cls.__name__)
    target = (cache_dir or cache_root()) / "gguf" / key
    stamp = target / _TOKENIZER_STAMP
    if not stamp.is_file():
        _build_tokenizer_cache(gguf, cls, target)
    try:
        padding_side = json.loads(stamp.read_text())["padding_side"]
        tokenizer = TokenizersBackend.from_pretrained(str(target), padding_side=padding_side)
    except Exception as error:  # a damaged cache entry: rebuild it once
        shutil.rmtree(target, ignore_errors=True)
        _build_tokenizer_cache(gguf, cls, target)
        try:
            padding_side = json.loads(stamp.read_text())["padding_side"]
            tokenizer = TokenizersBackend.from_pretrained(str(target), padding_side=padding_side)
        except Exception as again:
            raise ModelLoadError(f"cannot load the cached tokenizer of {gguf.path.name} at {target}: {again}"
                                 ) from error
    return tokenizer, target


def convert_tokenizer(gguf: GgufFile, cls=None, config=None):
    """The tokenizer transformers builds from this file (`AutoTokenizer.from_pretrained(dir,
    gguf_file=...)`), as an instance of `cls` (by default the class AutoTokenizer picks)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    if cls is None:
        cls = tokenizer_class_for(gguf_config(gguf) if config is None else config)
    tokenizer_dict, tokenizer_config = gguf_tokenizer_inputs(gguf)
    try:
        backend, extra = convert_gguf_tokenizer(gguf.architecture, tokenizer_dict)
        return cls(tokenizer_object=backend, **{**tokenizer_config, **extra})
    except ModelLoadError:
        raise
    except Exception as error:  # transformers raises ValueError, KeyError... for what it cannot build
        raise ModelLoadError(f"cannot build the tokenizer of {gguf.path.name}: {error}") from error


def _build_tokenizer_cache(gguf: GgufFile, cls, target: Path) -> None:
    import sys
    import time

    started = time.perf_counter()
    print(f"[verispec] first use of the tokenizer of {gguf.path.name}: converting it (once)", file=sys.stderr,
          flush=True)
    tokenizer = convert_tokenizer(gguf, cls)
    if target.exists() and not (target / _TOKENIZER_STAMP).is_file():
        shutil.rmtree(target, ignore_errors=True)  # an entry left incomplete by hand: it cannot be used
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer.save_pretrained(str(staging))
        (staging / _TOKENIZER_STAMP).write_text(json.dumps({
            "source": gguf.path.name, "architecture": gguf.architecture, "tokenizer_class": cls.__name__,
            "padding_side": tokenizer.padding_side, "transformers": _transformers_version(),
            "format": CACHE_FORMAT,
        }, indent=1))
        try:
            staging.rename(target)  # atomic: a concurrent conversion either wins or finds it done
        except OSError:
            if not (target / _TOKENIZER_STAMP).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"[verispec] tokenizer converted and cached in {time.perf_counter() - started:.1f} s at {target}",
          file=sys.stderr, flush=True)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
