"""Writes a GGUF file of a llama-family model from its hyper-parameters, its vocabulary and its
tensors, as llama.cpp's converter lays them out (gguf-py's `GGUFWriter` underneath): the one
writer of the synthetic files the tests and scripts/synthetic_gguf.py make. Reading is `reader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np


@dataclass(frozen=True)
class Shape:
    """A model's hyper-parameters, under its GGUF architecture name (`arch`: llama, qwen2, gemma3)."""

    arch: str
    context: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    rope_dims: int | None = None  # `rope.dimension_count`, where the architecture writes it
    name: str | None = None


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as GGUF stores it: `model` "llama" (sentencepiece: pieces with scores) or "gpt2"
    (byte-level BPE: merges); `specials` maps bos, eos, unk, pad, eot to token ids."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    specials: dict[str, int] = field(default_factory=dict)
    add_bos: bool | None = None
    chat_template: str | None = None


# (tensor name, data, GGUF type of raw block bytes or None for a float array as it is)
Tensor = tuple[str, np.ndarray, object]


def sentencepiece_vocabulary(pieces: list[str], scores: list[float] | None = None) -> Vocabulary:
    """<unk>, <s>, </s>, the 256 byte tokens, then `pieces` (ids 0, 1, 2 the specials)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + (scores if scores is not None else [-float(i) for i in range(len(pieces))])
    return Vocabulary("llama", tokens, [2, 3, 3] + [6] * 256 + [1] * len(pieces), scores=scores,
                      specials={"bos": 1, "eos": 2, "unk": 0})


def write_gguf(path: str | Path, shape: Shape, vocabulary: Vocabulary, tensors: Iterable[Tensor], *,
               file_type=None, extra: Callable | None = None) -> Path:
    """Write the file; `extra(writer)` adds keys of its own (an architecture's), `file_type` the
    general.file_type. Returns the path."""
    import gguf

    path = Path(path)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    if shape.name is not None:
        writer.add_name(shape.name)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.rope_dims is not None:
        writer.add_rope_dimension_count(shape.rope_dims)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if file_type is not None:
        writer.add_file_type(file_type)
    if extra is not None:
        extra(writer)
    _add_vocabulary(writer, vocabulary)
    for name, data, raw_type in tensors:
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_vocabulary(writer, vocabulary: Vocabulary) -> None:
    writer.add_tokenizer_model(vocabulary.model)
    if vocabulary.pre is not None:
        writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    if vocabulary.scores is not None:
        writer.add_token_scores(vocabulary.scores)
    if vocabulary.merges is not None:
        writer.add_token_merges(vocabulary.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id,
              "pad": writer.add_pad_token_id, "eot": writer.add_eot_token_id}
    for key, token in vocabulary.specials.items():
        adders[key](token)
    if vocabulary.add_bos is not None:
        writer.add_add_bos_token(vocabulary.add_bos)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)
