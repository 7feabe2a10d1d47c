"""The exact block form of a GGUF model's quantized weights.

Owns: reading the per-block scales (and offsets) of a GGUF file's Q8_0, Q5_0, Q4_K and Q6_K
tensors, turning a float32 weight that was dequantized from such a tensor back into int8 codes
(`BlockWeights`), and proving the result exact: a block form is kept only if
`fl(scale * code) - offset` rebuilds the model's float32 weight bit for bit, which is also how the
kernel (`blockmm`, fp32 numerics) rebuilds it for several rows of input (for one row it applies the
scale once per block: the same weights, float32 rounding in another order); in int8 numerics the
kernel multiplies these codes with int8 activations and applies scale and offset per block. So the block form is not an
approximation of the model: it is the model's own weights, stored in 1 byte plus a shared scale
per block instead of 4 bytes each.

A weight whose check fails (a different dtype, a transformed tensor, an unknown type) simply keeps
its float32 form; `read_gguf_blocks` reports how many matrices it covered.

One function here is not exact, and says so: `quantize_blocks` gives a float32 weight that has no
GGUF form (a trained exit head's layer) a Q8_0-style int8 form that approximates it (per block of
32 inputs, scale = max |w| / 127, codes = round(w / scale)), so that a drafter's extra layer can run
on the block kernel too. It is only used where the weights do not define the output (drafts, which
verification checks), never for the target's own weights.

GGUF layouts (ggml's, as in gguf-py's dequantizers), per block of the tensor's rows:
  Q8_0 (34 bytes / 32 weights): d fp16, 32 int8              w = d * q
  Q5_0 (22 bytes / 32):         d fp16, 4 + 16 bytes of bits w = d * (q - 16)
  Q4_K (144 bytes / 256):       d, dmin fp16, 12 bytes of 6-bit (sc, m) x 8, 128 bytes of bits
                                w = (d * sc_j) * q - dmin * m_j  over 8 sub-blocks of 32
  Q6_K (210 bytes / 256):       128 + 64 bytes of bits, 16 int8 sc, d fp16
                                w = (d * sc_j) * (q - 32)        over 16 sub-blocks of 16
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

SUPPORTED_TYPES = ("Q8_0", "Q5_0", "Q4_K", "Q6_K")


@dataclass(frozen=True)
class BlockWeights:
    """W [out, in] = scales (x) codes - offsets, per block of `block` consecutive inputs."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in // block] float32
    offsets: torch.Tensor | None  # [out, in // block] float32, or None (symmetric formats)
    block: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in], rebuilt as the kernel rebuilds it: fl(s * q) - o."""
        out, inputs = self.codes.shape
        weight = self.codes.view(out, -1, self.block).float().mul_(self.scales.unsqueeze(-1))  # [out, nb, block]
        if self.offsets is not None:
            weight.sub_(self.offsets.unsqueeze(-1))
        return weight.view(out, inputs)

    def rows(self, index: torch.Tensor) -> "BlockWeights":
        """The block form of W[index] (some output rows, e.g. an exit head's draft vocabulary)."""
        pick = lambda t: None if t is None else t[index].contiguous()  # noqa: E731
        return BlockWeights(pick(self.codes), pick(self.scales), pick(self.offsets), self.block)

    @cached_property
    def packed(self) -> "PackedBlocks":
        """This matrix in the int8 kernel's layout (`PackedBlocks`), built on first use and kept."""
        return PackedBlocks.of(self)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offsets is None else self.offsets.numel() * 4
        return self.codes.numel() + self.scales.numel() * 4 + extra

    @staticmethod
    def concat(parts: list["BlockWeights | None"]) -> "BlockWeights | None":
        """Several matrices stacked along the outputs (a fused q/k/v), or None if any is missing.
        Mixed block sizes are brought to the smallest; offsets become zeros where absent."""
        if not parts or any(part is None for part in parts):
            return None
        block = min(part.block for part in parts)
        if any(part.block % block for part in parts):
            return None
        with_offsets = any(part.offsets is not None for part in parts)
        codes, scales, offsets = [], [], []
        for part in parts:
            repeat = part.block // block
            codes.append(part.codes)
            scales.append(part.scales.repeat_interleave(repeat, dim=1))
            if with_offsets:
                own = part.offsets if part.offsets is not None else torch.zeros_like(part.scales)
                offsets.append(own.repeat_interleave(repeat, dim=1))
        return BlockWeights(
            torch.cat(codes).contiguous(), torch.cat(scales).contiguous(),
            torch.cat(offsets).contiguous() if with_offsets else None, block,
        )


@dataclass(frozen=True)
class PackedBlocks:
    """A `BlockWeights` laid out for the int8 kernel (`kernels/blockmm_int8.c`): outputs in groups
    of 8 (the last padded), and per group, for each 4 consecutive inputs, the 4 codes of each of
    the 8 outputs, so that one 32-byte load feeds 8 output lanes. The codes are stored in one of
    two forms, chosen per matrix from lo = min(its smallest code, 0) and hi = its largest code:
      unsigned (hi - lo <= 128: Q4_K's 0..15, Q5_0's -16..15, Q6_K's -32..31): u = code - lo as
        uint8 in 0..code_span (= hi - lo), code_bias = -lo; the kernel sums u * x exactly and
        subtracts code_bias * sum(x) per block;
      signed (a wider range, Q8_0): the int8 codes, code_bias None.
    The padding's bytes are 0 (code lo in the unsigned form); padded outputs are never stored.
    Scales are stored as float16 where every one of them is a float16 value (Q8_0's and Q5_0's
    own fp16 scales: 14.5 MB less for a one-token step of the default model to read), else as
    float32; the kernel converts them exactly, so the result is the same either way."""

    codes: torch.Tensor  # [groups, in // 4, 8, 4] int8 (signed) or uint8 (unsigned)
    scales: torch.Tensor  # [groups, in // block, 8] float16 where every scale is one exactly, else float32
    offsets: torch.Tensor | None  # [groups, in // block, 8] float32, or None
    block: int
    outputs: int  # the real number of outputs (the padding is not part of the matrix)
    code_bias: int | None  # u = code + code_bias (unsigned form), or None (signed form)
    code_span: int  # the largest u (unsigned form; hi - lo in the signed form, where it is unused)

    MAX_SPAN = 128  # widest unsigned range: a vpmaddubsw pair of 2 * 128 * 127 fits in int16

    @property
    def kernel_form(self) -> tuple[int, int, int]:
        """blockmm_int8's (code_bias, code_span, half_scales) arguments: code_bias -1 for signed
        codes, half_scales 1 where the scales are stored as float16."""
        return (-1 if self.code_bias is None else self.code_bias, self.code_span, int(self.scales.dtype == torch.float16))

    @staticmethod
    def of(blocks: BlockWeights) -> "PackedBlocks":
        out, inputs = blocks.codes.shape
        groups = (out + 7) // 8
        pad = groups * 8 - out

        def per_group(t: torch.Tensor) -> torch.Tensor:  # [out, nb] -> [groups, nb, 8]
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
            return t.view(groups, 8, -1).transpose(1, 2).contiguous()

        lo, hi = min(int(blocks.codes.min()), 0), int(blocks.codes.max())  # the real rows' codes
        codes, bias = blocks.codes, None
        if hi - lo <= PackedBlocks.MAX_SPAN:
            codes, bias = (codes.to(torch.int16) - lo).to(torch.uint8), -lo
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))  # [groups * 8, in]
        codes = codes.view(groups, 8, inputs // 4, 4).transpose(1, 2).contiguous()  # [groups, in // 4, 8, 4]
        offsets = None if blocks.offsets is None else per_group(blocks.offsets)
        scales = per_group(blocks.scales)
        half = scales.half()
        if torch.equal(half.float(), scales):  # each scale exactly a float16 (the kernel converts any float16)
            scales = half
        return PackedBlocks(codes, scales, offsets, blocks.block, out, bias, hi - lo)


def block_scales(raw: np.ndarray, type_name: str, columns: int) -> tuple[int, np.ndarray, np.ndarray | None]:
    """(block, scales [rows, columns // block], offsets or None) of a GGUF tensor's raw bytes
    [rows, bytes per row] of type `type_name`, as float32 exactly as ggml computes them."""
    rows = raw.shape[0]
    if type_name in ("Q8_0", "Q5_0"):
        size = 34 if type_name == "Q8_0" else 22
        blocks = raw.reshape(rows, columns // 32, size)
        d = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0].astype(np.float32)
        return 32, d, None
    if type_name == "Q4_K":
        blocks = raw.reshape(rows, columns // 256, 144)
        d = np.ascontiguousarray(blocks[:, :, 0:2]).view(np.float16).astype(np.float32)  # [rows, nb, 1]
        dmin = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16).astype(np.float32)
        packed = blocks[:, :, 4:16].reshape(rows, -1, 3, 4)
        low, high, mixed = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)  # [rows, nb, 8]
        m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
        scales = (d * sc.astype(np.float32)).reshape(rows, -1)
        offsets = (dmin * m.astype(np.float32)).reshape(rows, -1)
        return 32, scales, offsets
    if type_name == "Q6_K":
        blocks = raw.reshape(rows, columns // 256, 210)
        sc = np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).astype(np.float32)  # [rows, nb, 16]
        d = np.ascontiguousarray(blocks[:, :, 208:210]).view(np.float16).astype(np.float32)  # [rows, nb, 1]
        return 16, (d * sc).reshape(rows, -1), None
    raise ValueError(f"unsupported GGUF type {type_name}")


def exact_blocks(weight: torch.Tensor, block: int, scales: torch.Tensor, offsets: torch.Tensor | None) -> BlockWeights | None:
    """The block form of a float32 `weight` [out, in] with the given per-block scales/offsets,
    or None unless it rebuilds `weight` bit for bit with int8 codes."""
    if weight.dtype != torch.float32 or weight.shape[1] % block or scales.shape != (weight.shape[0], weight.shape[1] // block):
        return None
    out = weight.shape[0]
    shifted = weight.reshape(out, -1, block)  # [out, nb, block]
    if offsets is not None:
        shifted = shifted + offsets.unsqueeze(-1)
    codes = (shifted / torch.where(scales != 0, scales, 1.0).unsqueeze(-1)).round_()
    codes.masked_fill_((scales == 0).unsqueeze(-1), 0.0)
    if not bool(((codes >= -128) & (codes <= 127)).all()):
        return None
    codes = codes.view(out, -1)
    candidate = BlockWeights(codes.to(torch.int8).contiguous(), scales.contiguous(),
                             None if offsets is None else offsets.contiguous(), block)
    return candidate if torch.equal(candidate.dequantize(), weight) else None


def quantize_blocks(weight: torch.Tensor, block: int = 32) -> BlockWeights:
    """A Q8_0-style int8 form of a float32 `weight` [out, in] (in a multiple of `block`): per block
    of `block` inputs, scale = max |w| / 127 and codes = round(w / scale). An approximation (the
    relative error of each weight is at most 1/254 of its block's largest), unlike `exact_blocks`."""
    out, inputs = weight.shape
    if inputs % block:
        raise ValueError(f"{inputs} inputs are not a multiple of the block size {block}")
    grouped = weight.detach().float().reshape(out, -1, block)  # [out, nb, block]
    scales = grouped.abs().amax(dim=-1) / 127.0  # [out, nb]
    codes = (grouped / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)).round_().clamp_(-127, 127)
    return BlockWeights(codes.to(torch.int8).reshape(out, inputs).contiguous(), scales.contiguous(), None, block)


_LAYER_NAMES = {  # GGUF tensor name in block i -> attribute path in decoder layer i
    "attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}


def _module_for(model, tensor_name: str):
    """The nn.Linear of `model` that a GGUF tensor name holds the weight of, or None."""
    if not tensor_name.endswith(".weight"):
        return None
    stem = tensor_name[: -len(".weight")]
    if stem == "output" or (stem == "token_embd" and getattr(model.config, "tie_word_embeddings", False)):
        return model.get_output_embeddings()
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        layers = model.get_decoder().layers
        index = int(parts[1])
        if index < len(layers):
            owner, name = _LAYER_NAMES[parts[2]]
            return getattr(getattr(layers[index], owner, None), name, None)
    return None


def read_gguf_blocks(path: str | Path, model) -> tuple[dict, int, int]:
    """Block forms of the linear weights of `model` (loaded from the GGUF file `path`).

    Returns ({nn.Linear: BlockWeights}, matrices covered, matrices tried); a matrix is covered
    only if its block form rebuilds the model's float32 weight exactly."""
    from .reader import read_gguf

    found: dict = {}
    tried = 0
    with read_gguf(path) as file:
        for info in file.tensors.values():
            module = _module_for(model, info.name)
            if not isinstance(module, torch.nn.Linear) or info.type_name not in SUPPORTED_TYPES:
                continue
            tried += 1
            weight = module.weight.detach()
            raw = np.asarray(file.tensor_bytes(info.name)).reshape(weight.shape[0], -1)
            block, scales, offsets = block_scales(raw, info.type_name, weight.shape[1])
            blocks = exact_blocks(
                weight, block, torch.from_numpy(np.ascontiguousarray(scales)),
                None if offsets is None else torch.from_numpy(np.ascontiguousarray(offsets)),
            )
            if blocks is not None:
                found[module] = blocks
    return found, len(found), tried
