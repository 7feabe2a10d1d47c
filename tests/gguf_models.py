"""Tiny random GGUF models written as llama.cpp's converter writes them, for the GGUF runtime's tests.

`write_tiny_gguf(path, arch)` writes a small Llama, Qwen2 or Gemma 3 (text) model: hidden 256
(the K-quants need rows of a multiple of 256), intermediate 512, 4 attention heads of 64 with 2
KV heads, max positions 512, a vocabulary of a few hundred tokens with a working tokenizer of
the architecture's kind (sentencepiece "llama" for Llama and Gemma 3, byte-level BPE for Qwen2).
The weights are those of a seeded transformers float32 model (`source_model`), converted the
way `convert_hf_to_gguf.py` converts them:

- tensor names llama.cpp's (`token_embd`, `blk.N.attn_q`, `ffn_norm`, `post_ffw_norm`...);
- Llama's attn_q / attn_k rows permuted for llama.cpp's adjacent-pair rope (its `permute`);
- Gemma 3's norm weights (every `*norm.weight`) stored as 1 + w; its embedding is not scaled
  (the runtime multiplies by sqrt(hidden), as transformers does);
- matrices in the GGUF types of `types` (per tensor kind), norm weights and biases F32; a tied
  model (`tied=True`) has no output.weight (the head is token_embd).

Gemma 3 has 6 layers: transformers reads no layer-type key from a GGUF file (nor does llama.cpp,
which hard-codes the pattern), so its config takes the default pattern of one full-attention
layer in 6; with 6 layers, layers 0-4 slide (window `GEMMA_WINDOW`) and layer 5 attends to
everything. Its global rope base is `gemma3.rope.freq_base` (1e6), the local one transformers'
default 10000 (written as `rope.freq_base_swa` as well, which transformers does not read), and
query_pre_attn_scalar its config default 256 (llama.cpp has no key for it either).

gguf-py quantizes Q4_0, Q5_0, Q8_0, F16, BF16 and F32 itself; Q4_K, Q5_K and Q6_K are quantized
here (`quantize`: simple per-sub-block min/max scales, valid blocks that gguf-py's dequantizer
reads back within the type's step size).

    from gguf_models import write_tiny_gguf, transformers_model
    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", types={"attn_q": "Q5_K"})
    reference = transformers_model(path)  # what transformers makes of the file, float32
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ARCHITECTURES = ("llama", "qwen2", "gemma3")
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, MAX_POSITIONS = 256, 512, 4, 2, 64, 512
LAYERS = {"llama": 2, "qwen2": 3, "gemma3": 6}
GEMMA_WINDOW = 32
ROPE_BASE = {"llama": 10_000.0, "qwen2": 1_000_000.0, "gemma3": 1_000_000.0}
GEMMA_LOCAL_ROPE_BASE = 10_000.0
RMS_EPS = {"llama": 1e-5, "qwen2": 1e-6, "gemma3": 1e-6}

# the matrices' kinds, as llama.cpp names them
KINDS = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
DEFAULT_TYPES = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_0", "attn_v": "Q8_0",
                 "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
SUPPORTED_TYPES = ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32")

# the source model's random weights: linears ~ N(0, INIT^2), norms around 1 (Gemma: 1 + w, w around 0)
INIT = 0.06
NORM_SPREAD = 0.2
BIAS_SPREAD = 0.2


# -- K-quant quantizers (gguf-py has none) --------------------------------------------------------

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and mins (gguf-py's `Q4_K.get_scale_min`, inverted)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _affine_k(x: np.ndarray, levels: int):
    """Blocks x [n, 256] as 8 sub-blocks of 32, value = d * sc * q - dmin * m (q in 0..levels):
    (d, dmin as float16, sc, m six-bit [n, 8], q [n, 8, 32])."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0.0)
    high = sub.max(axis=2)
    scale = (high - low) / levels  # [n, 8]
    offset = -low
    d = _f16(scale.max(axis=1) / 63.0)
    dmin = _f16(offset.max(axis=1) / 63.0)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(scale / d32[:, None]), 0).clip(0, 63)
        mn = np.where(dmin32[:, None] > 0, np.rint(offset / dmin32[:, None]), 0).clip(0, 63)
        step = (d32[:, None] * sc)[:, :, None]
        shift = (dmin32[:, None] * mn)[:, :, None]
        q = np.where(step > 0, np.rint((sub + shift) / step), 0).clip(0, levels)
    return d, dmin, sc, mn, q.astype(np.uint8)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(x, 15)
    n = x.shape[0]
    q = q.reshape(n, 4, 2, 32)  # chunk j: sub-block 2j in the low nibbles, 2j + 1 in the high ones
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           _pack_scale_min(sc, mn), qs], axis=1)


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _affine_k(x, 31)
    n = x.shape[0]
    low, high = q & 0x0F, q >> 4  # [n, 8, 32]
    low = low.reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):  # bit i of qh[k]: the fifth bit of element k of sub-block i
        qh |= (high[:, i] & 1) << i
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                           _pack_scale_min(sc, mn), qh, qs], axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=2) / 31.0  # [n, 16]
    d = _f16(scale.max(axis=1) / 127.0)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(scale / d32[:, None]), 0).clip(-128, 127)
        step = (d32[:, None] * sc)[:, :, None]
        q = np.where(step != 0, np.rint(sub / step), 0).clip(-32, 31)
    q = (q + 32).astype(np.uint8).reshape(n, 256)
    low, high = q & 0x0F, q >> 4
    low = low.reshape(n, 2, 2, 64)  # half h: elements 0..63 in the low nibbles, 64..127 in the high ones
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)  # half h, shift s: elements h*128 + s*32 + k in bits 2s of qh[h*32 + k]
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for s in range(4):
        qh |= high[:, :, s] << (2 * s)
    return np.concatenate([ql, qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(n, 2)],
                          axis=1)


_K_QUANTIZERS = {"Q4_K": _quantize_q4_k, "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}


def quantize(weight: np.ndarray, type_name: str) -> np.ndarray:
    """A float32 matrix [rows, cols] in the GGUF type `type_name`: the bytes gguf-py's writer takes
    with `raw_dtype` (uint8 [rows, bytes per row]; float16 / float32 arrays for F16 / F32)."""
    from gguf import GGMLQuantizationType, quants

    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported type {type_name!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    if type_name in _K_QUANTIZERS:
        rows, cols = weight.shape
        if cols % QK_K:
            raise ValueError(f"{type_name} needs rows of a multiple of {QK_K} values (got {cols})")
        blocks = _K_QUANTIZERS[type_name](weight.reshape(-1, QK_K))
        return np.ascontiguousarray(blocks.reshape(rows, -1))
    return quants.quantize(weight, GGMLQuantizationType[type_name])


def dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """gguf-py's dequantization of `quantize`'s bytes (what transformers reads from the file)."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[type_name])


# -- vocabularies ---------------------------------------------------------------------------------

PIECES = ["▁", "e", "t", "a", "o", "h", "l", "s", "n", "r", "d", "w", "c", "▁t", "▁a", "▁th", "▁the", "▁c", "at",
          "▁cat", "▁s", "▁sat", "▁o", "▁on", "▁m", "▁mat", "▁h", "ll", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor",
          "▁world", "▁▁", "ld", "in", "▁in", "er", "an", "▁an", "▁and", "it", "▁it", "is", "▁is", "es", "re", "on",
          "ing", "▁do", "▁dog", "og", "▁ran", "ran", "▁b", "▁big", "▁red", "▁fox"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ", "ĠĠ ĠĠ", "e r",
              "Ġ t", "h e", "Ġt he", "a t", "Ġ c", "Ġc at", "Ġ s", "Ġs at", "o n", "Ġ on", "Ġ m", "Ġm at", "i n",
              "Ġ in", "a n", "Ġ an", "Ġan d", "i s", "Ġ is", "i t", "Ġ it"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _unique(items: list[str]) -> list[str]:
    seen, out = set(), []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def vocabulary(arch: str) -> dict:
    """The tokenizer metadata of a tiny model of `arch`: tokens, token types, scores or merges,
    special ids (llama.cpp's token types: 1 normal, 2 unknown, 3 control, 6 byte)."""
    if arch == "qwen2":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        merges = _unique(BPE_MERGES)
        alphabet = list(bytes_to_unicode().values())
        tokens = _unique(alphabet + ["".join(m.split(" ")) for m in merges]) + QWEN_SPECIALS
        n = len(tokens)
        return {"model": "gpt2", "pre": "qwen2", "tokens": tokens, "types": [1] * (n - 3) + [3, 3, 3],
                "merges": merges, "bos": n - 3, "eos": n - 3, "pad": n - 3, "eot": n - 1, "add_bos": False,
                "chat_template": CHAT_TEMPLATE}
    pieces = _unique(PIECES)
    if arch == "llama":
        specials, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
        ids = {"unk": 0, "bos": 1, "eos": 2}
    elif arch == "gemma3":
        specials, types = list(GEMMA_SPECIALS), [3, 3, 3, 2, 3, 3, 3]
        ids = {"pad": 0, "eos": 1, "bos": 2, "unk": 3, "eot": 6}
    else:
        raise ValueError(f"architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = types + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return {"model": "llama", "pre": "default", "tokens": tokens, "types": types, "scores": scores,
            "add_bos": True, **ids}


# -- the source model -----------------------------------------------------------------------------


def source_config(arch: str, vocab_size: int, tied: bool):
    """The transformers config of the tiny model of `arch` (what transformers rebuilds from the file)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS[arch], num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=MAX_POSITIONS, rms_norm_eps=RMS_EPS[arch], tie_word_embeddings=tied,
                  initializer_range=INIT, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        return LlamaConfig(head_dim=HEAD_DIM, rope_theta=ROPE_BASE[arch], **common)
    if arch == "qwen2":
        return Qwen2Config(rope_theta=ROPE_BASE[arch], **common)
    if arch == "gemma3":
        return Gemma3TextConfig(head_dim=HEAD_DIM, rope_theta=ROPE_BASE[arch],
                                rope_local_base_freq=GEMMA_LOCAL_ROPE_BASE, query_pre_attn_scalar=256,
                                sliding_window=GEMMA_WINDOW, hidden_activation="gelu_pytorch_tanh", **common)
    raise ValueError(f"architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")


def source_model(arch: str, seed: int = 0, tied: bool = False):
    """The seeded float32 transformers model whose weights `write_tiny_gguf` writes: linears
    ~ N(0, INIT^2), biases ~ N(0, BIAS_SPREAD^2), norm weights 1 + N(0, NORM_SPREAD^2) in effect
    (Gemma's parameter is the w of its 1 + w)."""
    from transformers import AutoModelForCausalLM

    config = source_config(arch, len(vocabulary(arch)["tokens"]), tied)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                spread = torch.randn(parameter.shape, generator=generator) * NORM_SPREAD
                parameter.copy_(spread if arch == "gemma3" else 1.0 + spread)
            elif name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * BIAS_SPREAD)
            else:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * INIT)
    return model


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (q and k rows for adjacent-pair rope)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, converted as its converter converts them."""
    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                   "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    if arch == "gemma3":
        layer_names.update({"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        layer_names["post_attention_layernorm"] = "ffn_norm"
    out: dict[str, np.ndarray] = {}
    for name, parameter in model.state_dict().items():
        data = parameter.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "lm_head.weight":
            if model.config.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            gguf_name = f"blk.{index}.{layer_names[module]}.{kind}"
        else:
            continue
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = model.config.num_attention_heads
            kv_heads = heads if ".attn_q." in gguf_name else model.config.num_key_value_heads
            data = _permute(data, heads, kv_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            data = data + 1.0
        out[gguf_name] = data
    return out


def _kind(gguf_name: str) -> str | None:
    """The matrix kind of a tensor name ("attn_q" for "blk.0.attn_q.weight"), None for a vector."""
    if not gguf_name.endswith(".weight"):
        return None
    stem = gguf_name[: -len(".weight")].split(".")[-1]
    return stem if stem in KINDS else None


def resolve_types(types: dict | str | None) -> dict[str, str]:
    """`types` (None, one type for every matrix, or {kind: type} over DEFAULT_TYPES) as {kind: type}."""
    if types is None:
        chosen = dict(DEFAULT_TYPES)
    elif isinstance(types, str):
        chosen = {kind: types for kind in KINDS}
    else:
        unknown = set(types) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown tensor kinds {sorted(unknown)} (kinds: {', '.join(KINDS)})")
        chosen = {**DEFAULT_TYPES, **types}
    for kind, name in chosen.items():
        if name not in SUPPORTED_TYPES:
            raise ValueError(f"{kind}: unsupported type {name!r} (supported: {', '.join(SUPPORTED_TYPES)})")
    return chosen


def write_tiny_gguf(path, arch: str, types: dict | str | None = None, seed: int = 0, tied: bool = False) -> Path:
    """Write the tiny model of `arch` ("llama", "qwen2", "gemma3") to `path` as llama.cpp's
    converter would (see the module docstring): matrices in `types` ({kind: GGUF type} over
    DEFAULT_TYPES, or one type name for all; kinds in KINDS), weights of `source_model(arch,
    seed, tied)`; tied: no output.weight. Returns the path."""
    import gguf
    from gguf import GGMLQuantizationType

    from verispec.gguf.writer import Shape, Vocabulary, write_gguf

    chosen = resolve_types(types)
    vocab = vocabulary(arch)
    shape = Shape(arch, context=MAX_POSITIONS, hidden=HIDDEN, layers=LAYERS[arch], ffn=INTERMEDIATE, heads=HEADS,
                  kv_heads=KV_HEADS, rope_base=ROPE_BASE[arch], rms_eps=RMS_EPS[arch],
                  rope_dims=HEAD_DIM if arch == "llama" else None, name=f"tiny {arch}")
    tokenizer = Vocabulary(vocab["model"], vocab["tokens"], vocab["types"], scores=vocab.get("scores"),
                           merges=vocab.get("merges"), pre=vocab["pre"],
                           specials={key: vocab[key] for key in ("bos", "eos", "unk", "pad", "eot") if key in vocab},
                           add_bos=vocab["add_bos"], chat_template=vocab.get("chat_template"))

    def architecture_keys(writer) -> None:
        if arch == "llama":
            writer.add_vocab_size(len(vocab["tokens"]))
        elif arch == "gemma3":
            writer.add_key_length(HEAD_DIM)
            writer.add_value_length(HEAD_DIM)
            writer.add_sliding_window(GEMMA_WINDOW)
            writer.add_rope_freq_base_swa(GEMMA_LOCAL_ROPE_BASE)
            writer.add_add_eos_token(False)
            writer.add_add_space_prefix(False)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    def tensors():
        for name, data in gguf_tensors(source_model(arch, seed, tied), arch).items():
            kind = _kind(name)
            if kind is None:  # norm weights and biases: F32, as llama.cpp keeps 1-D tensors
                yield name, data.astype(np.float32), None
            else:
                yield name, quantize(data, chosen[kind]), GGMLQuantizationType[chosen[kind]]

    return write_gguf(path, shape, tokenizer, tensors(), file_type=gguf.LlamaFileType.MOSTLY_Q4_K_M,
                      extra=architecture_keys)


def transformers_model(path):
    """What transformers makes of the file: `AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=name, dtype=float32)` (its dequantization, un-permuting and norm - 1), eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def transformers_logits(model, ids) -> torch.Tensor:
    """The float32 reference logits [n, vocab] of the ids (one sequence) from `transformers_model`."""
    return model(torch.tensor([list(ids)], dtype=torch.long)).logits[0].float()


def check_file(path, ids=None) -> torch.Tensor:
    """Load `path` with transformers and return its logits for `ids` (default: 40 ids from the
    tokenizer's text), asserting they are finite and not all the same token."""
    from transformers import AutoTokenizer

    path = Path(path)
    model = transformers_model(path)
    if ids is None:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        ids = tokenizer("the cat sat on the mat and the big red fox ran in the world. hello " * 3).input_ids[:40]
    logits = transformers_logits(model, ids)
    assert torch.isfinite(logits).all(), "non-finite logits"
    assert len(set(logits.argmax(-1).tolist())) > 1, "every position predicts the same token"
    return logits


if __name__ == "__main__":  # write one file per architecture and check it loads: python tests/gguf_models.py DIR
    import sys
    import tempfile

    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    directory.mkdir(parents=True, exist_ok=True)
    for arch in ARCHITECTURES:
        file = write_tiny_gguf(directory / f"{arch}.gguf", arch)
        logits = check_file(file)
        top = logits.argmax(-1)
        print(f"{file} ({file.stat().st_size} bytes): logits finite, range {float(logits.min()):.2f}.."
              f"{float(logits.max()):.2f}, std {float(logits.std()):.3f}, {len(set(top.tolist()))} distinct top-1 "
              f"of {len(top)}")
