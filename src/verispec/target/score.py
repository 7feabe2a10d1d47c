"""Scoring generated text under the target model: perplexity of the generated tokens.

Owns `perplexity`, a pure library function: exp of the mean negative log-likelihood of the
generated ids, each given the prompt and the generated ids before it, under the target's raw
distribution (temperature 1, no top-k/top-p), from one forward of `target.model` over
prompt + output with no cache, and a float32 log-softmax; a target with no transformers model
(the GGUF runtime) scores on its own forward path, on a sequence of its own. It does not touch
the target's per-request KV cache, so it can run between generations. Used by the benchmark for every
method, ours and peers alike, so all outputs are scored by the same function.

Also `target_perplexity`: the same quantity computed by the target's own forward path, the way
decoding computes it (the prompt, then the output in verify-sized chunks through the KV cache):
it measures what a change of the target's numerics (int8 activations against float32) does to
the distribution the target samples from.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .model import Target


@torch.inference_mode()
def perplexity(target: Target, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float:
    """exp(-mean log p(output_i | prompt, output_<i)); nan for an empty output."""
    assert len(prompt_ids) > 0, "perplexity needs a non-empty prompt"
    if len(output_ids) == 0:
        return math.nan
    m = len(output_ids)
    if target.model is None:  # no transformers model: the target's own runtime, on a sequence of its own
        sequence = target.new_sequence()
        sequence.reset()
        try:
            logits = _chunked_logits(sequence, prompt_ids, output_ids, chunk=64)  # [m, vocab]
        finally:
            sequence.release()
    else:
        ids = torch.tensor([[*prompt_ids, *output_ids]], dtype=torch.long, device=target.device)  # [1, n + m]
        try:
            # Only the logits that predict output tokens: positions n-1 .. n+m-1 (the last is unused).
            logits = target.model(input_ids=ids, use_cache=False, logits_to_keep=m + 1).logits[0]
        except TypeError:  # a model whose forward has no logits_to_keep
            logits = target.model(input_ids=ids, use_cache=False).logits[0]
        logits = logits[-(m + 1) : -1]  # [m, vocab]: row i predicts output_ids[i]
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [m, vocab] float32
    targets = torch.tensor(list(output_ids), dtype=torch.long, device=log_probs.device).unsqueeze(1)  # [m, 1]
    nll = -log_probs.gather(1, targets).mean()
    return float(torch.exp(nll))


@torch.inference_mode()
def target_logits(target: Target, prompt_ids: Sequence[int], output_ids: Sequence[int], chunk: int = 16) -> torch.Tensor:
    """The target's logits that predict each output token, from `target.forward` (its numerics,
    its runtime): the prompt in one forward, then the output `chunk` tokens at a time, as decoding
    computes them. [m, vocab], row i predicts output_ids[i]. Resets the target's cache."""
    assert len(prompt_ids) > 0 and len(output_ids) > 0 and chunk >= 1, "needs a prompt, an output and chunk >= 1"
    target.reset()
    return _chunked_logits(target, prompt_ids, output_ids, chunk)


def _chunked_logits(sequence, prompt_ids: Sequence[int], output_ids: Sequence[int], chunk: int) -> torch.Tensor:
    """On an empty sequence (a Target or a TargetSequence): the prompt in one forward, then the
    output `chunk` tokens at a time. [m, vocab], row i predicts output_ids[i]."""
    rows = [sequence.forward(list(prompt_ids), last_only=True)]  # [1, vocab]: predicts output_ids[0]
    for start in range(0, len(output_ids) - 1, chunk):
        rows.append(sequence.forward(list(output_ids[start : min(start + chunk, len(output_ids) - 1)])))
    return torch.cat(rows)


@torch.inference_mode()
def target_perplexity(target: Target, prompt_ids: Sequence[int], output_ids: Sequence[int], chunk: int = 16) -> float:
    """Like `perplexity`, from the target's own forward path (`target_logits`)."""
    assert len(prompt_ids) > 0 and chunk >= 1, "needs a prompt and chunk >= 1"
    if len(output_ids) == 0:
        return math.nan
    log_probs = torch.log_softmax(target_logits(target, prompt_ids, output_ids, chunk).float(), dim=-1)
    targets = torch.tensor(list(output_ids), dtype=torch.long, device=log_probs.device).unsqueeze(1)  # [m, 1]
    return float(torch.exp(-log_probs.gather(1, targets).mean()))
