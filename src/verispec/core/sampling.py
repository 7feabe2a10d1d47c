"""Logits -> probabilities: temperature, top-k, top-p; the sampling configuration.

Pure functions on tensors; no model, no cache, no state. `SamplingConfig` is the one place the
sampling options are validated. Temperature 0 means greedy decoding: the acceptance rules then
compare argmaxes and never call `probabilities`.

The fast `probabilities` and the slow `probabilities_reference` must agree (tested to float32
rounding, with the same support); the fast one works on the k best logits only when top-k is set,
and otherwise avoids sorting the whole vocabulary (262,144 entries for Gemma 3) for top-p when the
nucleus lies inside the top `_TOP_P_CANDIDATES` tokens, which it almost always does.

Every valid configuration gives a distribution: the most likely token is always kept, whatever
top_p (one below float32's smallest number is 0 there, and would keep nothing), and a temperature
so small that logits / temperature would overflow (or round to 0 in float32) scales the logits
less their row's maximum, in float64 (see `_scaled`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

# How many of the most likely tokens are examined first for top-p; if their mass does not reach
# top_p the full sort is used, so this is a speed knob, never a change of the result.
_TOP_P_CANDIDATES = 1024
# Below this temperature logits are scaled less their row's maximum, in float64 (`_scaled`).
_TINY_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the target's distribution.

    temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1.0 = no limit).
    seed: seeds the generator used for sampling (None = nondeterministic).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ConfigError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ConfigError(f"seed must be an integer from 0 to 2**64 - 1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, stream: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for one use of randomness in a request, on `device` (that of the
        probabilities it draws from: the target's): stream 0 draws the committed tokens
        (acceptance), stream 1 the drafts. With a seed, stream s is seeded with seed + s
        (mod 2**64), so a seed reproduces both on a given kind of device (CUDA generators draw
        other numbers than CPU ones for the same seed); without one, every call draws fresh
        entropy, so that drafts are independent across requests (a fixed draft seed would draw
        the same draft for the same context every time, and q would no longer describe how it
        was drawn)."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed((self.seed + stream) % (MAX_SEED + 1))
        return generator


MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds
DRAFT_STREAM = 1  # SamplingConfig.generator(DRAFT_STREAM): the drafters' randomness


def is_number(value) -> bool:
    """An int or a float, not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_logits(logits: torch.Tensor) -> None:
    assert logits.dim() == 2, f"expected logits [n, vocab], got shape {tuple(logits.shape)}"


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Sampling distribution for each row of `logits`.

    logits: [n, vocab] (any float dtype). Returns [n, vocab] float32 probabilities that are zero
    outside the top-k / top-p set. For a greedy config it returns the unwarped softmax (callers
    decide greedily elsewhere; this keeps the function total).
    """
    _check_logits(logits)
    scaled = logits.float()
    if config.greedy:
        return torch.softmax(scaled, dim=-1)
    scaled = _scaled(scaled, config.temperature)
    vocab = scaled.shape[-1]
    if config.top_k and config.top_k < vocab:
        return _top_k_probabilities(scaled, config.top_k, config.top_p)
    if config.top_p < 1.0:
        scaled = _apply_top_p(scaled, config.top_p)
    return torch.softmax(scaled, dim=-1)


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, [..., vocab] float32. Below _TINY_TEMPERATURE (where the quotient
    could overflow to inf, and a temperature under float32's range would be 0) it is computed as
    (logits - row max) / temperature in float64: the same softmax, the row's maximum exactly 0
    and the rest negative or -inf, never NaN."""
    if temperature >= _TINY_TEMPERATURE:
        return logits / temperature
    wide = logits.double()
    return ((wide - wide.amax(dim=-1, keepdim=True)) / temperature).float()


def _top_k_probabilities(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k (then top-p) distribution computed on the k best logits only, scattered into zeros.

    scaled: [n, vocab] temperature-scaled logits. Equal to the softmax of the masked full row (the
    masked entries contribute exp(-inf) = 0), without a softmax or a mask over the whole
    vocabulary. Ties at the k-th value are kept as topk chose them.
    """
    values, indices = torch.topk(scaled, top_k, dim=-1)  # [n, k], sorted descending
    kept = torch.softmax(values, dim=-1)  # [n, k]
    if top_p < 1.0:
        mass_before = torch.cumsum(kept, dim=-1) - kept  # [n, k]
        outside = mass_before >= top_p  # a top_p that is 0 in float32 would leave out the first token too
        outside[..., 0] = False  # the most likely token is always kept
        values = values.masked_fill(outside, float("-inf"))
        kept = torch.softmax(values, dim=-1)
    return torch.zeros_like(scaled).scatter_(-1, indices, kept)  # [n, vocab]


def _apply_top_p(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (-inf) every token outside the nucleus of each row. scaled: [n, vocab]."""
    vocab = scaled.shape[-1]
    probs = torch.softmax(scaled, dim=-1)  # [n, vocab]
    candidates = min(_TOP_P_CANDIDATES, vocab)
    top_probs, top_idx = torch.topk(probs, candidates, dim=-1)  # [n, c], sorted descending
    if candidates < vocab and bool((top_probs.sum(-1) < top_p).any()):
        top_probs, top_idx = torch.sort(probs, dim=-1, descending=True)  # [n, vocab]
    mass_before = torch.cumsum(top_probs, dim=-1) - top_probs  # [n, c]
    keep_sorted = mass_before < top_p  # none where top_p is 0 in float32 (below 1.4e-45)
    keep_sorted[..., 0] = True  # the most likely token is always kept
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top_idx, keep_sorted)
    return scaled.masked_fill(~keep, float("-inf"))


def probabilities_reference(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Slow, obviously-correct version of `probabilities` (full sort, row by row). [n, vocab]."""
    _check_logits(logits)
    rows = []
    for row in logits.float():
        if config.greedy:
            rows.append(torch.softmax(row, -1))
            continue
        row = _scaled(row, config.temperature)
        order = torch.argsort(row, descending=True, stable=True)
        keep = torch.zeros_like(row, dtype=torch.bool)
        if config.top_k:
            keep[order[: config.top_k]] = True
        else:
            keep[:] = True
        row = row.masked_fill(~keep, float("-inf"))
        if config.top_p < 1.0:
            probs = torch.softmax(row, -1)
            sorted_probs = probs[order]
            mass = 0.0
            nucleus = torch.zeros_like(keep)
            for position, token in enumerate(order.tolist()):
                if mass >= config.top_p:
                    break
                nucleus[token] = True
                mass += float(sorted_probs[position])
            row = row.masked_fill(~nucleus, float("-inf"))
        rows.append(torch.softmax(row, -1))
    return torch.stack(rows)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a [vocab] probability vector (need not sum to exactly one).

    Inverse CDF on a float64 cumulative sum: one uniform draw and a binary search. It is an exact
    draw from `probs` like `torch.multinomial`, which on a 262,144-entry vector took 9.4 ms on
    the development CPU (2 threads) against 0.75 ms here. Zero-probability
    entries add nothing to the cumulative sum, so the search never lands on one.
    """
    assert probs.dim() == 1, f"expected probs [vocab], got shape {tuple(probs.shape)}"
    cdf = torch.cumsum(probs.double(), dim=0)  # [vocab]
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index >= probs.shape[0] or probs[index] <= 0:  # u rounded onto the total: vanishingly rare
        index = int(torch.multinomial(probs.double(), 1, generator=generator))
    return index
