"""A Llama-shaped GGUF file with random quantized blocks, to run model sizes no package here ships.

    .venv/bin/python scripts/synthetic_gguf.py OUT.gguf [--shape 7b|1b] [--seed 0]

Writes a Llama-2-7B-shaped model (hidden 4096, 32 layers, 32 heads, FFN 11008, 32,000 tokens) in
Q4_K_M's mix as llama.cpp's quantizer lays it out: Q4_K for most matrices, Q6_K for the output
matrix and for attn_v / ffn_down in every other layer, F32 norms; with a sentencepiece-style
vocabulary (specials, byte tokens, pieces) that llama.cpp and verispec both load. The blocks are
random (random codes, small positive scales), so the text is noise, but the bytes read per token,
the memory and the kernels' work are a real 7B Q4_K_M model's (a 3.9 GB file; nothing of that size
can be downloaded here). `--shape 1b`: a small one (hidden 2048, 8 layers) for a quick check.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from verispec.gguf.writer import Shape, sentencepiece_vocabulary, write_gguf

SHAPES = {"7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=32000),
          "1b": dict(hidden=2048, layers=8, heads=16, kv_heads=8, ffn=5632, vocab=32000)}
Q = gguf.GGMLQuantizationType


def random_blocks(rng: np.random.Generator, kind: Q, rows: int, columns: int) -> np.ndarray:
    """[rows, bytes per row] of `kind` blocks with random codes and scales of a sane size."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    scales = lambda n: (rng.uniform(0.5, 2.0, (rows, columns // block, n)) * 1e-3).astype(np.float16).view(np.uint8)  # noqa: E731
    if kind == Q.Q4_K:  # d, dmin fp16 first
        data[:, :, 0:4] = scales(2).reshape(rows, columns // block, 4)
    elif kind == Q.Q6_K:  # d fp16 last; the 16 int8 sub-scales small
        data[:, :, 192:208] = rng.integers(-32, 32, (rows, columns // block, 16), dtype=np.int8).view(np.uint8)
        data[:, :, 208:210] = scales(1).reshape(rows, columns // block, 2)
    return data.reshape(rows, -1)


def write(path: Path, shape: str, seed: int) -> None:
    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    hidden, head_dim = s["hidden"], s["hidden"] // s["heads"]
    vocabulary = sentencepiece_vocabulary([f"▁t{i}" for i in range(s["vocab"] - 259)])
    model = Shape("llama", context=4096, hidden=hidden, layers=s["layers"], ffn=s["ffn"], heads=s["heads"],
                  kv_heads=s["kv_heads"], rope_dims=head_dim, name=f"synthetic llama {shape} Q4_K_M")
    ones = np.ones(hidden, dtype=np.float32)

    def blocks(name: str, kind: Q, rows: int, columns: int):
        return name, random_blocks(rng, kind, rows, columns), kind

    def tensors():
        yield blocks("token_embd.weight", Q.Q4_K, s["vocab"], hidden)
        yield "output_norm.weight", ones, None
        yield blocks("output.weight", Q.Q6_K, s["vocab"], hidden)
        kv = s["kv_heads"] * head_dim
        for i in range(s["layers"]):
            wide = Q.Q6_K if i % 2 == 0 else Q.Q4_K  # Q4_K_M: every other layer's attn_v and ffn_down in Q6_K
            yield f"blk.{i}.attn_norm.weight", ones, None
            yield blocks(f"blk.{i}.attn_q.weight", Q.Q4_K, hidden, hidden)
            yield blocks(f"blk.{i}.attn_k.weight", Q.Q4_K, kv, hidden)
            yield blocks(f"blk.{i}.attn_v.weight", wide, kv, hidden)
            yield blocks(f"blk.{i}.attn_output.weight", Q.Q4_K, hidden, hidden)
            yield f"blk.{i}.ffn_norm.weight", ones, None
            yield blocks(f"blk.{i}.ffn_gate.weight", Q.Q4_K, s["ffn"], hidden)
            yield blocks(f"blk.{i}.ffn_up.weight", Q.Q4_K, s["ffn"], hidden)
            yield blocks(f"blk.{i}.ffn_down.weight", wide, hidden, s["ffn"])

    write_gguf(path, model, vocabulary, tensors(), file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write(args.out, args.shape, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
