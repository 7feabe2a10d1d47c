"""The linear layers of the fast path: y = x W^T (+ b) for a chunk of rows.

Owns three small things the fast path and the C layers share: `Linear` (a float32 weight
prepacked once for oneDNN), `FusedNorm` (an RMSNorm module as one `F.rms_norm` call where that
is bit-identical to it) and `BlockLinear` (a weight with an exact int8 block form, multiplied by
the block kernel in the target's numerics for up to `max_rows` rows, by its `Linear` above).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACK_HINT = 16  # oneDNN packs for this batch size; measured fastest across widths 1..16


def mkldnn_packing_available(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


class Linear:
    """y = x W^T (+ b) for x [n, in]; prepacked for oneDNN in float32 where available, at
    construction or, with `lazy`, at the first call (for a weight that may never be multiplied
    here: the LM head's float32 form behind the block kernel, 0.67 GB and about a second to pack
    for the default model, is needed only for logits of more than 64 rows)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lazy: bool = False):
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        self._packable = weight.device.type == "cpu" and mkldnn_packing_available(weight.dtype)  # oneDNN: CPU only
        self._packed = None
        if not lazy:
            self._pack()

    def _pack(self) -> torch.Tensor | None:
        """The oneDNN-packed weight (packed once, here), or None where packing is unavailable."""
        if self._packable and self._packed is None:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_HINT)
        return self._packed

    @staticmethod
    def fused(*linears: torch.nn.Linear) -> "Linear":
        """One Linear computing several nn.Linear layers on the same input (outputs concatenated)."""
        weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
        biases = [lin.bias for lin in linears]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(lin.out_features, dtype=weight.dtype)
             for b, lin in zip(biases, linears)]
        )
        return Linear(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed if self._packed is not None else self._pack()  # a call only until packed
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class FusedNorm:
    """An RMSNorm module of transformers as one `F.rms_norm` call (half the time of the module's
    six elementwise ops, measured on [1, 640]). `of` returns the module itself unless the fused call
    is bit-identical to it on random inputs, so the math stays the model's."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps, self.shape = weight, eps, (weight.shape[0],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)

    @staticmethod
    @torch.inference_mode()
    def of(module):
        weight = getattr(module, "weight", None)
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
            return module
        probe = torch.randn(3, 5, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        expected = module(probe)
        for candidate in (weight.detach(), 1.0 + weight.detach()):  # Llama/Qwen2 scale by w, Gemma by 1 + w
            fused = FusedNorm(candidate.contiguous(), eps)
            got = fused(probe)
            if got.dtype == expected.dtype and torch.equal(got, expected):
                return fused
        return module


def check_numerics(value: str) -> None:
    """Refuse numerics other than `blockmm.NUMERICS`."""
    from .blockmm import NUMERICS  # blockmm builds C at first use: imported when needed

    if value not in NUMERICS:
        raise ValueError(f"numerics {value!r}: choose one of {', '.join(NUMERICS)}")


class BlockLinear:
    """A `Linear` whose weight also has an exact int8 block form (`gguf.blocks.BlockWeights`),
    multiplied by the block kernel (`blockmm`), which reads a quarter of the bytes, in `numerics`:
    "int8" (activations quantized per block, batch-invariant) at every width, so that a row's
    result never depends on how many rows share the call; "fp32" (float32 activations) for inputs
    of at most `max_rows` rows, wider ones (prompt processing), where both are compute-bound, by
    the float32 `Linear` and its tuned oneDNN matmul."""

    def __init__(self, blocks, dense: Linear, kernel, max_rows: int, numerics: str = "fp32"):
        self.blocks, self.dense, self.kernel, self.max_rows = blocks, dense, kernel, max_rows
        self.numerics = numerics
        if numerics == "int8":
            blocks.packed  # noqa: B018 - laid out for the int8 kernel now, at load, not in the first request

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's result does not depend on the other rows of the call (int8 numerics)."""
        return self.numerics == "int8"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows and self.numerics != "int8":
            return self.dense(x)
        b = self.blocks
        y = self.kernel.matmul(x, b, self.numerics)  # [n, out], ours
        return y if self.dense.bias is None else y.add_(self.dense.bias)  # in place: same bits, no new tensor
