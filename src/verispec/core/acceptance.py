"""Pure acceptance rules: how many draft tokens the target accepts, and which token follows.

Each rule sees one verification step: the draft tokens d_1..d_k, the target's logits or
probabilities p_1..p_{k+1} at the k+1 verified positions (p_i is the target's distribution for
the token that d_i proposes; p_{k+1} follows the whole draft) and, for model drafters, the draft
distributions q_1..q_k the tokens were drawn from. It returns a `Verdict`: n accepted drafts and
the next token, taken from the target at position n+1. Rules never touch models or caches.

- `greedy_match`: temperature 0; accept while d_i == argmax p_i. Lossless (exact ids).
- `sampled_match`: deterministic drafts (q = None) under sampling; at each position draw x ~ p_i
  and accept while x == d_i. This is speculative sampling with a one-hot q, and it draws exactly
  one sample per committed token, in order, as autoregressive sampling does. Lossless.
- `tree_match`: a tree of deterministic drafts (several continuations verified in one forward);
  from the root, take the target's token at each node (argmax, or one draw x ~ p) and move to
  the child carrying it while there is one. The same one pick per committed token. Lossless.
- `speculative_sample`: model drafts with q (Leviathan et al. 2023; Chen et al. 2023): accept d_i
  with probability min(1, p_i(d_i) / q_i(d_i)); on rejection sample from norm(max(p_i - q_i, 0)).
  Lossless in distribution.
- `joint_likelihood`: MTAD's rule (Qin et al., ICLR 2025); accept the longest prefix L whose
  sum_{j<=L} log p_j(d_j) - log q_j(d_j) exceeds log tau, then sample from p_{L+1}. Not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .drafters.base import Draft
from ..target.lazy_logits import LazyRows, materialize
from .sampling import SamplingConfig, probabilities, sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verification: `n_accepted` drafts kept, then `next_token` from the target.
    `path`: for a tree of drafts, the accepted tokens' indices in the draft, root side first (None
    for a linear draft, whose first `n_accepted` tokens are kept)."""

    n_accepted: int
    next_token: int
    path: tuple[int, ...] | None = None


def _check_step(draft: torch.Tensor, target: torch.Tensor) -> int:
    assert draft.dim() == 1, f"draft must be [k], got {tuple(draft.shape)}"
    assert target.dim() == 2, f"target must be [k+1, vocab], got {tuple(target.shape)}"
    k = draft.shape[0]
    assert target.shape[0] == k + 1, f"target has {target.shape[0]} rows for a draft of {k}"
    return k


def argmax(row: torch.Tensor) -> int:
    """The index of the largest entry of a 1-D tensor, the first one on ties (NaN counts as the
    largest, as in torch.argmax). numpy's argmax where it takes the dtype: 23 us against 283 us
    for torch's on a 262,144-entry float32 row here (2 cores)."""
    if row.dtype in (torch.float32, torch.float64) and row.device.type == "cpu":
        return int(row.contiguous().numpy().argmax())
    return int(row.argmax())


def greedy_match(draft: torch.Tensor, logits: torch.Tensor) -> Verdict:
    """draft: [k] ids; logits: [k+1, vocab]. Accept while the draft equals the target's argmax;
    rows after the first mismatch are not looked at."""
    k = _check_step(draft, logits)
    drafted = draft.tolist()
    on_device = logits.argmax(-1).tolist() if logits.device.type != "cpu" else None  # a GPU's: one transfer
    for i in range(k + 1):
        choice = argmax(logits[i]) if on_device is None else on_device[i]
        if i == k or choice != drafted[i]:
            return Verdict(i, choice)
    raise AssertionError("unreachable")


def sampled_match(draft: torch.Tensor, probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """draft: [k] ids; probs: [k+1, vocab] target probabilities. One draw per committed token."""
    k = _check_step(draft, probs)
    draft_ids = draft.tolist()
    for i in range(k + 1):
        token = sample(probs[i], generator)
        if i == k or token != draft_ids[i]:
            return Verdict(i, token)
    raise AssertionError("unreachable")


def tree_match(draft: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, pick) -> Verdict:
    """A tree of deterministic drafts. draft: [k] ids; parents: [k] (-1: a child of the root,
    the last committed token); target: [k+1, vocab] logits (what `pick` reads), row 0 after the
    committed tokens, row 1 + i after draft token i's path. From the root, `pick(row)` takes the
    target's token at the current node (the argmax when greedy, one draw from p when sampling);
    if a child of the node carries it, the walk moves there, else it stops: the path walked is
    accepted and the picked token follows it. One pick per committed token, in order, as
    autoregressive decoding makes them, so the committed tokens follow the target's distribution
    exactly (with a seed: `ar`'s own sample); `greedy_match` and `sampled_match` are the chain
    case. Rows off the path are never looked at."""
    assert parents.shape == draft.shape and target.shape[0] == draft.shape[0] + 1, "one row per token and the root"
    children: dict[int, dict[int, int]] = {}  # node -> {token: child}
    for i, (parent, token) in enumerate(zip(parents.tolist(), draft.tolist())):
        children.setdefault(parent, {}).setdefault(token, i)
    node, path = -1, []
    while True:
        choice = pick(target[node + 1])
        child = children.get(node, {}).get(choice)
        if child is None:
            return Verdict(len(path), choice, tuple(path))
        path.append(child)
        node = child


def acceptance_mass(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Probability that speculative sampling accepts: sum min(p, q) over the last dim. [..]"""
    return torch.minimum(p, q).sum(-1)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what speculative sampling draws from after a rejection. [.., vocab]

    Where p == q (nothing left), returns p itself: a rejection is then impossible, and p keeps
    the function total.
    """
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(1e-30), p)


def speculative_sample(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """draft: [k]; q: [k, vocab] draft probabilities; p: [k+1, vocab] target probabilities."""
    k = _check_step(draft, p)
    assert q.shape == (k, p.shape[1]), f"q must be [{k}, {p.shape[1]}], got {tuple(q.shape)}"
    if k:
        rows, tokens = torch.arange(k, device=p.device), draft.to(p.device)  # draft ids are host-side
        p_draft = p[rows, tokens]  # [k]
        q_draft = q[rows, tokens]  # [k]
        uniforms = torch.rand(k, generator=generator, dtype=torch.float64, device=p.device)  # [k]
        # u < p/q, written without dividing so q == 0 (impossible for a sampled draft) is safe.
        accepted = (uniforms * q_draft.double() < p_draft.double()).tolist()
        n = _leading_true(accepted)
        if n < k:
            return Verdict(n, sample(residual_distribution(p[n], q[n]), generator))
    return Verdict(k, sample(p[k], generator))


def joint_likelihood(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    tau: float,
    generator: torch.Generator,
) -> Verdict:
    """MTAD verification. draft: [k]; q: [k] draft probabilities of the drafted tokens along
    their own path; p: [k+1, vocab] target probabilities. Accept the largest L in 0..k with
    sum_{j<=L} (log p_j - log q_j) > log tau (L = 0 always passes), then sample from p_{L+1}."""
    k = _check_step(draft, p)
    assert q.shape == (k,), f"q must hold the [k] draft-token probabilities, got {tuple(q.shape)}"
    assert tau > 0, "tau must be > 0"
    n = 0
    if k:
        rows, tokens = torch.arange(k, device=p.device), draft.to(p.device)  # draft ids are host-side
        log_ratio = torch.log(p[rows, tokens].double()) - torch.log(q.double())  # [k]
        passing = (torch.cumsum(log_ratio, 0) > math.log(tau)).nonzero()
        n = int(passing[-1]) + 1 if passing.numel() else 0
    return Verdict(n, sample(p[n], generator))


def verify_lossless(
    draft: Draft, logits: "torch.Tensor | LazyRows", sampling: SamplingConfig, generator: torch.Generator
) -> Verdict:
    """The lossless rule for any draft. logits: [k+1, vocab] target logits, a tensor or
    `LazyRows` (rows computed when read: this rule reads them in order, see `reads_rows_in_order`).

    Greedy decoding compares argmaxes; under sampling, deterministic drafts use `sampled_match`
    and drafts with q use `speculative_sample`, both on the target's warped distribution. A tree
    of drafts (`Draft.parents`) goes through `tree_match`, with the argmax or one draw from p.
    """
    if draft.parents is not None:
        if sampling.greedy:
            return tree_match(draft.tokens, draft.parents, logits, argmax)
        # only the rows the walk visits are warped (one per committed token, as `ar` warps them)
        return tree_match(draft.tokens, draft.parents, logits,
                          lambda row: sample(probabilities(row.unsqueeze(0), sampling)[0], generator))
    if sampling.greedy:
        return greedy_match(draft.tokens, logits)
    if draft.q is None:
        warp = lambda rows: probabilities(rows, sampling)  # noqa: E731 - row-wise: [m, vocab] -> [m, vocab]
        p = logits.map(warp) if isinstance(logits, LazyRows) else warp(logits)  # [k+1, vocab]
        return sampled_match(draft.tokens, p, generator)
    return speculative_sample(draft.tokens, draft.q, probabilities(materialize(logits), sampling), generator)


verify_lossless.reads_rows_in_order = True  # the engine may pass LazyRows (see engine.Rule)


def verify_joint(tau: float):
    """MTAD's rule as an engine rule: `joint_likelihood` with threshold tau on the target's
    warped distribution (mtad always samples). Drafts carry q of each token (`q_tokens`)."""
    if not tau > 0:
        raise ValueError("tau must be > 0")

    def rule(draft: Draft, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> Verdict:
        p = probabilities(logits, sampling)  # [k+1, vocab]
        q = draft.q_tokens if draft.q_tokens is not None else torch.ones(len(draft), device=logits.device)
        return joint_likelihood(draft.tokens, q, p, tau, generator)

    return rule


def _leading_true(flags: list[bool]) -> int:
    """Number of leading True values."""
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
