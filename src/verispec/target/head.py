"""The target's LM head: logits from the decoder's last hidden state, computed by verispec itself
where that is exactly the model's own map.

Owns `own_head` (which head a loaded transformers model gets) and `ChunkedHead`. On the fast path
the head is one of the decoder's linears (prepacked float32, or the int8 block kernel on a GGUF
model's exact blocks); on the PyTorch path on the CPU it is packed once for oneDNN
(`runtime.linear.Linear`: on the 262,144-token vocabulary, 1 thread of an AVX-512 EPYC, 46-51 ms
for 1 and 2 positions and 68-75 ms for 16, against 60 / 134-152 / 157-215 ms for `nn.Linear`,
whose float32 product repacks the weight at every call), else multiplied by the output
embedding in vocabulary chunks (`ChunkedHead`: one batched matmul). It is used only for models
whose logits are exactly `hidden @ W^T` (checked numerically at load against the model's own
forward), on the CPU; any other model (soft-capped or scaled logits, a head bias), and any
model on a GPU, computes logits with its own forward (`logits_to_keep`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..notices import notice
from ..runtime.linear import Linear

HEAD_CHUNK = 1024  # vocabulary rows per block of the chunked LM head


@dataclass(frozen=True)
class ChunkedHead:
    """logits = hidden @ W^T, computed over vocabulary blocks in one batched matmul."""

    blocks: torch.Tensor  # [n_blocks, HEAD_CHUNK, hidden] view of W
    rest: torch.Tensor  # [vocab % HEAD_CHUNK, hidden]

    @staticmethod
    def of(weight: torch.Tensor) -> "ChunkedHead":
        vocab, hidden = weight.shape
        whole = vocab // HEAD_CHUNK * HEAD_CHUNK
        return ChunkedHead(weight[:whole].view(-1, HEAD_CHUNK, hidden), weight[whole:])

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]  # hidden: [n, hidden]
        blocks = torch.matmul(hidden.unsqueeze(0), self.blocks.transpose(1, 2))  # [n_blocks, n, chunk]
        logits = blocks.transpose(0, 1).reshape(n, -1)  # [n, whole]
        if self.rest.shape[0]:
            logits = torch.cat([logits, torch.nn.functional.linear(hidden, self.rest)], dim=-1)
        return logits  # [n, vocab]


@torch.inference_mode()
def own_head(model, decoder, name: str, device: torch.device, dtype: torch.dtype):
    """(head, decoder): a faster LM head than the model's forward where its logits are exactly
    hidden @ W^T (prepacked or on the block kernel on the fast path, `decoder`; packed or
    chunked on the PyTorch path), else None: use the model's own forward. The decoder comes back
    None where the fast path cannot compute this model's logits (a head that is not a plain
    linear map, logits that differ from the model's own)."""
    if device.type != "cpu":  # a CPU speed-up: elsewhere the model's own forward (logits_to_keep)
        return None, decoder
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        if decoder is not None:  # the fast path computes hidden states only
            notice(f"fast path not available for {name}: its LM head is not a plain linear map")
        return None, None
    if decoder is not None:
        ours = decoder.linear(head, rarely_wide=True)
    else:  # the PyTorch path: packed for oneDNN in float32 (see the module docstring)
        packable = head.weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        ours = Linear(head.weight.detach(), None) if packable else ChunkedHead.of(head.weight)
    probe = torch.arange(3, 3 + min(4, head.weight.shape[0] - 3), dtype=torch.long, device=device).unsqueeze(0)
    numerics = decoder.numerics if decoder is not None else None
    if numerics is not None:
        decoder.numerics = "fp32"  # the check is of the map (hidden @ W^T), at float32 tolerance
    try:
        reference = model(input_ids=probe, use_cache=False).logits[0].float()  # [4, vocab]
        if decoder is not None:
            hidden = decoder.hidden_states(probe[0], decoder.new_cache(8))
        else:
            hidden = model.get_decoder()(input_ids=probe, use_cache=False).last_hidden_state[0]
        logits = ours(hidden).float()
    except Exception as error:  # a decoder that cannot be called alone: use the model's own forward
        notice(f"own LM head disabled for {name}: {error}")
        return None, None
    finally:
        if numerics is not None:
            decoder.numerics = numerics
    scale = reference.abs().max().clamp_min(1.0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    if bool(((logits - reference).abs().max() / scale) < tolerance):
        return ours, decoder
    if decoder is not None:
        notice(f"fast path disabled for {name}: its logits differ from the model's own forward")
    return None, None


class VocabularyHead:
    """An LM head over some of its rows (a draft model's draft vocabulary): hidden [n, d] ->
    logits [n, vocab] whose rows outside `ids` are -inf, reading only those rows' weights. A
    drafter on it proposes only tokens of `ids` (q is zero elsewhere); the target's verify keeps
    every method exact."""

    def __init__(self, part, ids: torch.Tensor, vocab_size: int):
        self.part, self.ids, self.vocab_size = part, ids.to(torch.int64), vocab_size

    @property
    def out_features(self) -> int:
        return self.vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        some = self.part(hidden)  # [n, len(ids)]
        full = some.new_full((hidden.shape[0], self.vocab_size), float("-inf"))  # [n, vocab]
        full[:, self.ids] = some
        return full
