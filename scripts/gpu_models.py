"""Random-weight models for the GPU check, built from configs where they run (no network, nothing
to carry): a target of a chosen size, a small draft model with the same vocabulary, a tokenizer
for both, and an untrained exit head for the target.

Random weights are valid for what the GPU check measures -- step costs (a forward of k tokens
against one, a draft step against a target step) and exactness (outputs against `ar`) -- and not
for acceptance rates: a random draft model, or an untrained head, agrees with a random target
by chance. Every figure made with them says so.

    python scripts/gpu_models.py OUT_DIR [--size 7b|1b|tiny] [--device cuda]

writes OUT_DIR/target, OUT_DIR/draft (transformers model directories, bfloat16 on a GPU) and
OUT_DIR/exit-head (a head after layer 4 over the 8,192 lowest ids, initialised from layer 4),
and prints their paths.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# Llama shapes: a 7B target (Llama 2 7B), a 1B one (TinyLlama 1.1B), a tiny one (CPU trials), and
# a 68M draft model (the shape of JackFram/llama-68m), all with a 32,000-token vocabulary.
SHAPES = {
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2),
    "draft": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                  num_key_value_heads=12),
}
VOCAB = 32000
EXIT_LAYER = 4


def tokenizer():
    """A byte-level tokenizer of VOCAB ids: the 256 bytes, then filler tokens (never produced from
    text, decoded as themselves), so that any prompt tokenizes and any id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(["<unk>", "</s>", *sorted(alphabet)])}
    for i in range(len(vocab), VOCAB):
        vocab[f"<t{i}>"] = i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def build(shape: dict, seed: int, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=None, eos_token_id=1,
                         pad_token_id=None, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("7b", "1b", "tiny"), default="7b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from verispec.core.drafters.early_exit import ExitHead, save_head

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    words = tokenizer()
    for name, shape, seed in (("target", SHAPES[args.size], 0), ("draft", SHAPES["draft"], 1)):
        model = build(shape, seed, args.device, dtype)
        model.save_pretrained(args.out / name)
        words.save_pretrained(args.out / name)
        print(f"{name}: {args.out / name} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, {dtype})")
        if name == "target":
            head = ExitHead(model, EXIT_LAYER, list(range(8192)))
            save_head(head, head.spec(model, "random target"), args.out / "exit-head", dtype=dtype)
            print(f"exit-head: {args.out / 'exit-head'} (untrained, after layer {EXIT_LAYER})")
        del model


if __name__ == "__main__":
    main()
