"""Drafting with a model: an auxiliary LM or an exit head, by sampling or by beam sampling.

Owns three things:
- `DraftLM`, the small interface a drafting model offers: `sync(context)` brings its own state
  up to the committed context and returns the logits for the next token; `extend(tokens, tree)`
  runs draft tokens placed past the context (one path, or several beams side by side in scratch
  cache slots) and returns their next-token logits; `end_draft()` says the draft is complete
  (before the target verifies it); `keep(m)` commits the first m tokens of a single-path
  extension. `AuxLM` implements it for an auxiliary causal LM with its own KV cache
  (`--draft-model`: any transformers model with the target's tokenizer, on the fast path where
  it has one, else on its PyTorch path on the target's device); `early_exit.ExitHeadLM` for the
  target's first layers plus an exit head. Where the draft model pages its KV (a GGUF file or
  int8 numerics), `AuxLM.syncing` / `extending` are the same two calls as steps
  (`shared_forward.Steps`): they yield the rows to run as a `shared_forward.Part`, so the batch
  runs the draft model once for all its requests' drafts (the same bits: its rows are
  batch-invariant) and a request alone runs them with `run_alone`.
- `SampledDrafter`: one token at a time, greedy (argmax, q = None) or sampled from the warped
  draft distribution q, which it returns with the draft so that speculative sampling stays
  lossless (`sps`, and EESD's drafter); `proposing` is its `propose` as steps.
- `BeamDrafter`: MTAD's beam sampling (Qin et al., ICLR 2025): the first step draws W distinct
  tokens from q; each later step draws W (beam, token) pairs without replacement with
  probability proportional to beam weight x q(token | beam) (Gumbel top-W), and the new weights
  are those products, renormalised. After gamma steps the draft is the beam of largest weight,
  with the q of each of its tokens along its own path (`Draft.q_tokens`) for the joint rule.
  With `no_repeat_ngram` n > 0, no beam may extend into an n-gram that the output (the tokens
  after the prompt) or the beam itself already holds (`OutputNgrams`): beam search's
  no-repeat-n-gram constraint (Paulus et al. 2018). Choosing the likeliest beam is mode-seeking,
  and without it MTAD's drafts fall into loops that the joint rule then accepts.
  All W beams of a step run in one forward, as a tree over scratch cache slots (on the PyTorch
  path: rows appended to the draft model's cache under a custom 4D attention mask, `torch_path`).

Draft distributions use the request's temperature / top-k / top-p, the same warping as the
target's p. Vocabularies: an auxiliary model must share the target's tokenizer (checked); its
embedding rows may be padded to another size than the target's, so its logits are cut or padded
to the target's width, and ids past the tokenizer's never get draft mass. Logits, q and the
draft generator live on the draft model's device (`DraftLM.device`); draft ids on the host.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch

from ...target import torch_path
from ...target.shared_forward import LAST, Part, Steps, run_alone
from ...runtime.static_kv import Tree
from ...errors import ConfigError
from ..scheduler import kv_positions
from ..sampling import DRAFT_STREAM, SamplingConfig, probabilities, sample
from .base import EMPTY_DRAFT, HOST, Draft, Keep, keep_all


class DraftLM(Protocol):
    vocab: torch.Tensor | None  # [V_d] target ids of the draft logits' columns; None = identity
    vocab_size: int  # the target's vocabulary size (q rows are this wide)
    device: torch.device  # where its logits (and so q and the draft generator) are

    def begin(self, prompt: Sequence[int]) -> None: ...

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Logits [V_d] for the token after `context` (committed tokens)."""

    def extend(self, tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
        """Logits [n, V_d] after each of `tokens` [n] placed by `tree` (scratch, uncommitted)."""

    def end_draft(self) -> None:
        """The draft is complete: what drafting left in a cache the target shares goes (called
        before the target verifies it)."""

    def keep(self, m: int) -> None:
        """Commit the first m tokens of the last single-path extension (0 after beams)."""


def tree_for_beams(context_length: int, step: int, width: int, paths: list[list[int]], earlier: list[int],
                   device: torch.device | str = "cpu") -> Tree:
    """Placement of one beam step: `width` tokens at logical position context_length + step - 1,
    in the scratch slots after those of the earlier steps; beam b sees the context, the slots of
    its own path (`paths[b]`) and its new slot. `earlier`: the position of each scratch slot the
    earlier steps used, in slot order (steps differ in width where top-p left fewer tokens with
    probability). On `device` (the draft model's cache's)."""
    base = context_length + len(earlier)
    slots = torch.arange(base, base + width, device=device)
    total = base + width
    visible = torch.zeros(width, total, dtype=torch.bool, device=device)
    visible[:, :context_length] = True
    for b, path in enumerate(paths):
        visible[b, path] = True
        visible[b, base + b] = True
    slot_positions = torch.arange(total, device=device)
    # scratch slots: the logical position of the beam step they hold
    slot_positions[context_length:base] = torch.tensor(earlier, dtype=torch.long, device=device)
    slot_positions[base:] = context_length + step - 1
    positions = torch.full((width,), context_length + step - 1, dtype=torch.long, device=device)
    return Tree(positions, slots, visible, slot_positions)


MIN_DRAFT_VOCAB = 1


def frequent_vocabulary(draft_target, size: int) -> torch.Tensor:
    """A draft model's draft vocabulary: its tokenizer's `size` lowest ids (subword vocabularies
    number their pieces by merge order, about by frequency) and every special or added token
    (the end of a turn, tool-call markers), ascending. [<= size + specials] int64."""
    tokenizer = draft_target.tokenizer
    vocab_size = draft_target.vocab_size
    ids = set(range(min(size, vocab_size)))
    if tokenizer is not None:
        ids |= {int(i) for i in tokenizer.all_special_ids}
        ids |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    ids |= {int(i) for i in getattr(draft_target, "eos_token_ids", ()) or ()}
    return torch.tensor(sorted(i for i in ids if 0 <= i < vocab_size), dtype=torch.int64)


class AuxLM:
    """An auxiliary causal LM (a `Target`) as a draft model, with its own KV cache: its fast path
    where it has one, else its PyTorch path (beams need a model `torch_path` can mask)."""

    def __init__(self, draft_target, target):
        check_same_tokenizer(draft_target, target)
        if draft_target.device != target.device:
            raise ConfigError(f"the draft model {draft_target.name} is on {draft_target.device}, the target on "
                              f"{target.device}: load both on one device")
        self.model = draft_target.new_sequence()  # this request's own cache on the draft model
        self.device = draft_target.device
        self.vocab = None
        self.vocab_size = target.vocab_size
        # Same-tokenizer pairs often differ in embedding rows (vocabularies padded to another
        # size): draft logits are cut or padded to the target's width, and ids past the
        # tokenizer's (padding rows) never get draft mass.
        tokenizer = target.tokenizer  # the draft's is the same one (checked above) where both have one
        if tokenizer is not None and draft_target.vocab_size < len(tokenizer):
            raise ConfigError(
                f"the draft model {draft_target.name} has {draft_target.vocab_size} embedding rows, fewer "
                f"than the tokenizer's {len(tokenizer)} tokens"
            )
        self._real = min(target.vocab_size, draft_target.vocab_size, len(tokenizer) if tokenizer else target.vocab_size)
        self._length = 0  # committed positions in the draft model's cache
        self._scratch_start = 0

    @property
    def sequence(self):
        """The draft model's sequence this request drafts in (its KV cache)."""
        return self.model

    def begin(self, prompt: Sequence[int]) -> None:
        self.model.reset()
        self._length = 0

    def close(self) -> None:
        self.model.release()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._widen(self.model.head(hidden))

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft model's logits [n, V_draft] -> [n, V], the target's width."""
        if logits.shape[1] == self.vocab_size == self._real:
            return logits  # the same vocabulary, no padding rows: nothing to cut or mask
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # [n, V]
        full[:, : self._real] = logits[:, : self._real]
        return full

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        return run_alone(self.syncing(context))

    @torch.inference_mode()
    def syncing(self, context: Sequence[int]) -> Steps[torch.Tensor]:
        """`sync` as steps: on a paged draft model the missing tokens are yielded as a part."""
        fast = self.model.decoder
        self.model.crop(min(self.model.length, self._length))
        missing = torch.tensor(list(context[self._length:]), dtype=torch.long, device=self.device)
        # an id the draft model has no row for (only a target's padding rows can be such) is
        # shown to it as id 0: its drafts stay samples of the q it reports
        missing = torch.where(missing < self.model.vocab_size, missing, 0)
        if self.model.paged:
            logits = self._widen((yield Part(self.model, missing.tolist(), logits=LAST, prefix_cache=False)))  # [1, V]
        elif fast is None:  # the PyTorch path: the draft sequence's own forward
            logits = self._widen(self.model.forward(missing.tolist(), last_only=True))  # [1, V]
        else:
            hidden = fast.hidden_states(missing, self.model.cache)  # appends, advances the length
            logits = self._logits(hidden[-1:])
        self._length = self.model.length
        self._scratch_start = self._length
        return logits[0]

    def extend(self, tokens: torch.Tensor, tree: Tree) -> torch.Tensor:
        return run_alone(self.extending(tokens, tree))

    @torch.inference_mode()
    def extending(self, tokens: torch.Tensor, tree: Tree) -> Steps[torch.Tensor]:
        """`extend` as steps: on a paged draft model a single path is yielded as a part (appended
        to the cache; `keep` crops it back)."""
        fast = self.model.decoder
        if self.model.paged and tree.slots is None:
            assert int(tree.positions[0]) == self.model.length, "a single path extends the draft cache's end"
            return self._widen((yield Part(self.model, tokens.tolist(), prefix_cache=False)))  # [n, V]
        if fast is None:  # rows appended to the draft model's cache; beams under a custom mask
            if tree.slots is None:
                return self._widen(self.model.forward(tokens.tolist()))
            torch_path.parts(self.model.model, "beam drafting (mtad)")  # refuses a model it cannot mask
            logits, _ = torch_path.through(self.model.model, self.model.decoder_body, self.model.head, self.model.cache,
                                             tokens, tree, logits=0)  # [W, V_draft]
            return self._widen(logits)
        x = fast.run(fast.embed(tokens), int(tree.positions[0]), self.model.cache, tree=tree)
        return self._logits(fast.norm(x))

    def end_draft(self) -> None:
        pass  # its cache is its own: drafts are cut in `keep`

    def keep(self, m: int) -> None:
        self._length = self._scratch_start + m
        if self.model.decoder is None or self.model.paged:  # single paths were appended to the cache
            self.model.crop(self._length)
        else:
            self.model.cache.length = self._length


def lm_claims(lm: DraftLM, positions: int) -> list:
    """[(the draft model's sequence, positions)] where the draft LM keeps a cache of its own
    (`AuxLM`), else [] (an exit head drafts in the target's own sequence)."""
    sequence = getattr(lm, "sequence", None)
    return [] if sequence is None else [(sequence, positions)]


def lm_sync(lm: DraftLM, context: Sequence[int]) -> Steps[torch.Tensor]:
    """`lm.sync(context)` as steps where the LM offers them (`AuxLM.syncing`)."""
    steps = getattr(lm, "syncing", None)
    return (yield from steps(context)) if steps is not None else lm.sync(context)


def lm_extend(lm: DraftLM, tokens: torch.Tensor, tree: Tree) -> Steps[torch.Tensor]:
    """`lm.extend(tokens, tree)` as steps where the LM offers them (`AuxLM.extending`)."""
    steps = getattr(lm, "extending", None)
    return (yield from steps(tokens, tree)) if steps is not None else lm.extend(tokens, tree)


def in_target_sequence(lm: DraftLM) -> bool:
    """Whether `lm` drafts with the target's own layers in the request's target sequence (an
    exit head: its verify must capture exit states, so it cannot join a shared forward), rather
    than in a draft model's sequence of its own (`AuxLM`)."""
    return getattr(lm, "sequence", None) is None


def close_lm(lm: DraftLM) -> None:
    """End a request's draft model: give back what its sequence holds (`AuxLM.close`)."""
    close = getattr(lm, "close", None)
    if close is not None:
        close()


def check_same_tokenizer(draft_target, target) -> None:
    """Refuse a draft model whose tokenizer differs from the target's (compared once per pair:
    reading a 150k-entry vocabulary twice took 0.4 s, on every request)."""
    a, b = draft_target.tokenizer, target.tokenizer
    if a is None or b is None:
        return  # ids are taken to mean the same tokens; the sizes may differ (padding)
    key = ("same-tokenizer", id(a), id(b))
    if target.attachments.get(key) is a:
        return
    if a.get_vocab() != b.get_vocab():
        raise ConfigError(
            f"the draft model {draft_target.name} does not use the target's tokenizer: its ids would mean "
            f"other tokens (vocabularies of {len(a)} and {len(b)} entries differ)"
        )
    target.attachments[key] = a  # held, so that its id is not reused while the entry lives


# The longest draft of beams: each step past the first writes up to `width` rows in scratch slots
# of the draft model's cache, so this bounds what a request claims there (`BeamDrafter.kv_claims`).
MAX_BEAM_DRAFT = 16


class SampledDrafter:
    """Drafts one token at a time from a `DraftLM`: argmax under greedy decoding, else a sample
    from the warped draft distribution q (returned with the draft)."""

    def __init__(self, lm: DraftLM, sampling: SamplingConfig = SamplingConfig()):
        self.lm = lm
        self.sampling = sampling
        self._generator = sampling.generator(DRAFT_STREAM, lm.device)  # fresh per request unless seeded
        self._fed = 0
        self._synced = False

    def begin(self, prompt: Sequence[int]) -> None:
        self.lm.begin(prompt)

    def close(self) -> None:
        close_lm(self.lm)

    def kv_claims(self, prompt_tokens: int, max_new_tokens: int) -> list:
        """(sequence, positions) the draft model's cache may hold for a request of this size (a
        draft of k tokens extends the context by k - 1, within the token budget)."""
        return lm_claims(self.lm, kv_positions(prompt_tokens, max_new_tokens))

    @property
    def in_target_sequence(self) -> bool:
        return in_target_sequence(self.lm)

    @property
    def draft_sequence(self):
        """The draft model's sequence it drafts in (`AuxLM`), or None (an exit head)."""
        return getattr(self.lm, "sequence", None)

    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        return run_alone(self.proposing(context, k, keep))

    @torch.inference_mode()
    def proposing(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Steps[Draft]:
        """`propose` as steps: the draft model's forwards yielded as parts where it pages its KV."""
        self._fed = 0  # draft tokens fed back through the draft model (all but the last)
        self._synced = k > 0 and keep(0, None)
        if not self._synced:
            return EMPTY_DRAFT  # no draft, no draft-model work: the next sync catches up
        logits = yield from lm_sync(self.lm, context)  # [V_d]
        tokens, rows, confidence = [], [], []
        go_on = True
        while go_on:
            token, q_row, top1 = self._choose(logits)
            tokens.append(token)
            rows.append(q_row)
            confidence.append(top1)
            go_on = len(tokens) < k and keep(len(tokens), top1)
            if not go_on:
                break  # the last draft token is not fed: nothing will be drafted after it
            position = len(context) + self._fed
            logits = (yield from lm_extend(self.lm, torch.tensor([token], device=self.lm.device),
                                           Tree.contiguous(position, 1, self.lm.device)))[0]
            self._fed += 1
        self.lm.end_draft()
        q = None
        if rows and rows[0] is not None:
            q = _full_rows(torch.stack(rows), self.lm)  # [k, vocab], zero outside the draft vocabulary
        return Draft(torch.tensor(tokens, dtype=torch.long, device=HOST), q=q, confidence=tuple(confidence))

    def _choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None, float]:
        """Draft token (a target id), its q row over the draft vocabulary (None when greedy) and
        the draft model's top-1 probability (the confidence controllers calibrate)."""
        if self.sampling.greedy:
            top1, index = torch.softmax(logits.float(), -1).max(-1)
            return _target_id(int(index), self.lm), None, float(top1)
        q = probabilities(logits.unsqueeze(0), self.sampling)[0]  # [V_d]
        index = sample(q, self._generator)
        return _target_id(index, self.lm), q, float(q.max())

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        """Keep the draft model's entries of the accepted tokens that were fed through it."""
        if self._synced:
            self.lm.keep(min(len(committed) - 1, self._fed))
        self._fed, self._synced = 0, False


class OutputNgrams:
    """The n-grams of a request's output (its tokens after the prompt), indexed as
    (n-1)-gram -> the tokens that followed it, for the no-repeat constraint on beams. Pure:
    `update` indexes what the committed context added since the last call."""

    def __init__(self, n: int):
        if n < 1:
            raise ConfigError(f"no_repeat_ngram must be >= 1 (0: off), got {n}")
        self.n = n
        self._next: dict[tuple[int, ...], set[int]] = {}
        self._start = self._indexed = 0  # output starts at _start; n-grams ending before _indexed are in

    def begin(self, prompt_length: int) -> None:
        self._next.clear()
        self._start = self._indexed = prompt_length

    def update(self, context: Sequence[int]) -> None:
        """Index the n-grams of the output that end in context[_indexed:] (committed tokens)."""
        first = max(self._indexed, self._start + self.n - 1)
        for end in range(first, len(context)):
            self._next.setdefault(tuple(context[end - self.n + 1 : end]), set()).add(context[end])
        self._indexed = max(self._indexed, len(context))

    def banned(self, context: Sequence[int], path: Sequence[int]) -> set[int]:
        """Tokens that would repeat an n-gram if appended to context + path (path: a beam's draft
        tokens, target ids), counting the n-grams of the output and of the path itself."""
        tail = list(context[max(self._start, len(context) - self.n + 1):]) + list(path)
        if len(tail) < self.n - 1:
            return set()
        key = tuple(tail[len(tail) - self.n + 1:])
        banned = set(self._next.get(key, ()))
        for end in range(max(self.n - 1, len(tail) - len(path)), len(tail)):  # n-grams ending in the path
            if tuple(tail[end - self.n + 1 : end]) == key:
                banned.add(tail[end])
        return banned


class BeamDrafter:
    """MTAD's beam-sampled drafts (see the module docstring)."""

    def __init__(self, lm: DraftLM, width: int = 4, sampling: SamplingConfig = SamplingConfig(),
                 no_repeat_ngram: int = 0):
        if width < 1:
            raise ConfigError(f"beam width must be >= 1, got {width}")
        if sampling.greedy:
            raise ConfigError("beam sampling needs temperature > 0 (mtad samples; its default is 1)")
        self.lm, self.width, self.sampling = lm, width, sampling
        self._ngrams = OutputNgrams(no_repeat_ngram) if no_repeat_ngram else None
        self._generator = sampling.generator(DRAFT_STREAM, lm.device)  # fresh per request unless seeded

    @property
    def in_target_sequence(self) -> bool:
        return in_target_sequence(self.lm)

    def begin(self, prompt: Sequence[int]) -> None:
        self.lm.begin(prompt)
        if self._ngrams is not None:
            self._ngrams.begin(len(prompt))

    def _banned(self, context: Sequence[int], paths: list[list[int]]) -> list[set[int]] | None:
        """Per beam (its draft tokens so far, draft-vocabulary indices): target ids it may not take."""
        if self._ngrams is None:
            return None
        return [self._ngrams.banned(context, [_target_id(t, self.lm) for t in path]) for path in paths]

    def close(self) -> None:
        close_lm(self.lm)

    def kv_claims(self, prompt_tokens: int, max_new_tokens: int) -> list:
        """(sequence, positions) the draft model's cache may hold for a request of this size:
        the context, and the scratch slots of up to MAX_BEAM_DRAFT steps of `width` beams."""
        scratch = (self.width - 1) * (MAX_BEAM_DRAFT - 1)
        return lm_claims(self.lm, kv_positions(prompt_tokens, max_new_tokens, scratch))

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int, keep: Keep = keep_all) -> Draft:
        k = min(k, MAX_BEAM_DRAFT)
        if k <= 0 or not keep(0, None):
            return EMPTY_DRAFT  # no draft, no draft-model work: the next sync catches up
        if self._ngrams is not None:
            self._ngrams.update(context)
        q = probabilities(self.lm.sync(context).unsqueeze(0), self.sampling)  # [1, V_d]
        beams = beam_step(torch.zeros(1, dtype=torch.float64, device=q.device), q, self.width, self._generator,
                          self._banned(context, [[]]), self.lm)
        # beams: (parent [W], token index [W], log weight [W], q of the token [W])
        parents, tokens, log_weights, token_q = beams
        if not len(tokens):  # every token the draft model would take repeats the output
            self._end_draft()
            return EMPTY_DRAFT
        paths = [[] for _ in range(len(tokens))]
        history_tokens = [[int(t)] for t in tokens]
        history_q = [[float(p)] for p in token_q]
        earlier: list[int] = []  # position of each scratch slot used so far (steps may have fewer beams)
        for step in range(1, k):
            best = int(torch.argmax(log_weights))
            if not keep(step, float(math.exp(float(log_weights[best])))):
                break
            tree = tree_for_beams(len(context), step, len(tokens), paths, earlier, self.lm.device)
            earlier += [len(context) + step - 1] * len(tokens)
            logits = self.lm.extend(_target_ids(tokens, self.lm), tree)  # [W, V_d]
            slots = tree.slots.tolist()  # the scratch slot each beam's newest token was written to
            q = probabilities(logits, self.sampling)  # [W, V_d]
            step_beams = beam_step(log_weights, q, self.width, self._generator,
                                   self._banned(context, history_tokens), self.lm)
            if not len(step_beams[1]):  # every extension repeats the output: the draft ends here
                break
            parents, tokens, log_weights, token_q = step_beams
            paths = [paths[int(p)] + [slots[int(p)]] for p in parents]
            history_tokens = [history_tokens[int(p)] + [int(t)] for p, t in zip(parents, tokens)]
            history_q = [history_q[int(p)] + [float(x)] for p, x in zip(parents, token_q)]
        self._end_draft()
        best = int(torch.argmax(log_weights))
        chosen = _target_ids(torch.tensor(history_tokens[best], device=self.lm.device), self.lm).to(HOST)
        confidence = tuple(history_q[best])
        q_tokens = torch.tensor(history_q[best], dtype=torch.float32, device=self.lm.device)
        return Draft(chosen, q_tokens=q_tokens, confidence=confidence)

    def _end_draft(self) -> None:
        self.lm.end_draft()
        self.lm.keep(0)  # no beam row is committed: the next sync recomputes the accepted tokens

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        pass  # beams live in scratch slots; the next sync recomputes the committed tokens


def beam_step(log_weights: torch.Tensor, q: torch.Tensor, width: int, generator: torch.Generator,
              banned: Sequence[set[int]] | None = None, lm: DraftLM | None = None):
    """Draw `width` distinct (beam, token) pairs without replacement, with probability
    proportional to weight[beam] * q[beam, token] (Gumbel top-k), and renormalise.

    log_weights: [B] log beam weights; q: [B, V] draft probabilities; banned: per beam, target
    ids it may not take (`lm` maps draft indices to them). Returns (parent [W], token [W], new
    log weights [W] (log-sum-exp 0), q of the token [W]); fewer than `width` when fewer pairs
    are allowed, none when none is."""
    vocab = q.shape[1]
    # Only pairs with q > 0 can be drawn (top-k leaves a few dozen of B * V), so the Gumbel keys
    # are drawn for those alone: the same law, without B * V logarithms per step.
    # log_weights are normalised (finite) and q > 0 on the support, so every joint is finite.
    flat_q = q.flatten()  # [B * V]
    support = torch.nonzero(flat_q > 0).squeeze(1)  # [S] flat indices
    if banned is not None and any(banned):  # a few banned ids per beam; the support may be B * V
        span = vocab if lm is None else lm.vocab_size  # past every target id
        ids = support % vocab if lm is None else _target_ids(support % vocab, lm)  # [S] target ids
        pairs = [beam * span + token for beam, tokens in enumerate(banned) for token in tokens]
        forbidden = torch.isin((support // vocab) * span + ids, torch.tensor(pairs, device=support.device))
        support = support[~forbidden]
    joint = log_weights[support // vocab] + torch.log(flat_q[support].double())  # [S]
    take = min(width, support.shape[0])
    uniform = torch.rand(joint.shape, generator=generator, dtype=torch.float64, device=joint.device).clamp_(1e-300, 1.0)
    keys = joint - torch.log(-torch.log(uniform))  # + Gumbel(0, 1)
    picked = torch.topk(keys, take).indices  # [W] positions in the support
    chosen = support[picked]
    parents, tokens = chosen // vocab, chosen % vocab
    new = joint[picked]
    new = new - torch.logsumexp(new, 0)
    return parents, tokens, new, q[parents, tokens]


def _target_id(index: int, lm: DraftLM) -> int:
    return index if lm.vocab is None else int(lm.vocab[index])


def _target_ids(indices: torch.Tensor, lm: DraftLM) -> torch.Tensor:
    return indices.long() if lm.vocab is None else lm.vocab[indices]


def _full_rows(rows: torch.Tensor, lm: DraftLM) -> torch.Tensor:
    """Draft-vocabulary rows [k, V_d] -> target-vocabulary rows [k, vocab] (zeros elsewhere)."""
    if lm.vocab is None:
        return rows.float()
    full = torch.zeros(rows.shape[0], lm.vocab_size, device=rows.device)
    full[:, lm.vocab] = rows.float()
    return full
