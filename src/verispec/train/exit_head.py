"""Self-distillation of an early-exit head: label a corpus with the target, train, evaluate.

The target stays frozen. For every corpus position it provides the residual stream after its
first N layers (the head's input) and its final hidden state, from which the target's
next-token distribution restricted to the draft vocabulary, p_d = softmax(z[V_d]), is computed
on the fly (the renormalised restriction needs only the V_d logits). The head is trained to
minimise KL(p_d || q), the forward KL on the draft vocabulary: it is the cross-entropy against
the target's soft labels, so the head learns the whole distribution, not just the argmax;
speculative sampling accepts with probability sum min(p, q) = 1 - TV(p, q), which a small
forward KL bounds through Pinsker's inequality, and greedy acceptance follows from matching the
mode. Held-out estimates are computed against the target's full-vocabulary distribution:
greedy acceptance P(argmax q == argmax p) and sampled acceptance E[sum min(p, q)].

What is labelled: each corpus document's token ids (as the corpus file stores them where the
target wrote it, else its text tokenized), all but the last (the state after a document's last
token predicts nothing in the corpus), over the whole document at once, then cut into training
sequences of at most `sequence_length` tokens (`corpus_sequences`). A document the target wrote
with a `target.recorder.StateRecorder` attached (train-exit's own corpus) is labelled already:
its writing forwards kept those states, the bits a pass computes (batch-invariant layers), so
only the other documents are run through the target (`document_labels`).

Runs on the target's device: labelling on the fast path where the target has one (the CPU), else
through the model's own PyTorch forward (any device; a forward hook on layer N reads the head's
input, `torch_path`), and training wherever the labels' model lives, with a progress bar, checkpoints (`checkpoint.pt`: head, optimiser, step, draft
vocabulary, settings) every `checkpoint_every` steps and at the end, and resumes from them
(`resume=True`); the labelled corpus is cached as `labels.pt` next to the checkpoint so a resume
does not relabel. Both files hold only tensors and plain values (dicts, lists, numbers, strings)
and are read with `torch.load(weights_only=True)`: a file holding any other pickled object is
refused with a ConfigError, never unpickled (unpickling can run arbitrary code).
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..target import torch_path
from ..core.drafters.early_exit import ExitHead, save_head
from ..errors import ConfigError
from ..target.recorder import StateRecorder
from .corpus import read_corpus, read_corpus_ids
from .exit_layer import candidates, choose

CHECKPOINT = "checkpoint.pt"
LABELS = "labels.pt"
CHECKPOINT_KEYS = ("head", "optimizer", "step", "vocab", "config", "before")
SHARED_MLP = ("layer.mlp.",)  # a head that trains its attention and norms, its MLP the target's


AUTO = "auto"  # TrainConfig.exit_layer: chosen among `exit_layer.candidates` by short probe heads
CHOICE = "exit_layer.json"  # the probes' measurements and the chosen layer, next to the checkpoint
PROBE_EVAL_TOKENS = 1024  # held-out positions a probe head is scored on
MIN_TRAINING_SHARE = 0.2  # of --max-minutes: the training loop's least time, whatever came before it


@dataclass(frozen=True)
class TrainConfig:
    exit_layer: int | str = 4  # N, or AUTO
    init_layer: int | None = None  # target layer the head starts from (None: layer N)
    train_mlp: bool = False  # False: the head's MLP stays the target's own (not trained, not saved)
    draft_vocab: int = 4096
    sequence_length: int = 256
    batch: int = 4  # sequences per step
    steps: int = 1500
    learning_rate: float = 1e-3
    warmup: int = 30
    held_out: float = 0.1  # fraction of sequences kept for evaluation
    checkpoint_every: int = 50
    # the run's wall-time budget, counted from train_exit_head's `began` (the CLI's: before the
    # corpus is written): training stops (and saves) in time for the last evaluation
    max_minutes: float = 30.0
    eval_tokens: int = 4096  # held-out positions scored against the full vocabulary
    seed: int = 0
    probe_steps: int = 60  # with exit_layer AUTO: training steps of each candidate layer's probe head

    def __post_init__(self) -> None:
        if self.exit_layer != AUTO and (isinstance(self.exit_layer, bool) or not isinstance(self.exit_layer, int)
                                        or self.exit_layer < 1):
            raise ConfigError(f"exit-layer must be '{AUTO}' or an integer >= 1, got {self.exit_layer!r}")
        for name in ("draft_vocab", "sequence_length", "batch", "steps", "checkpoint_every", "probe_steps"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.init_layer is not None and (not isinstance(self.init_layer, int) or self.init_layer < 0):
            raise ConfigError(f"init-layer must be an integer >= 0, got {self.init_layer!r}")
        if not 0 < self.held_out < 1:
            raise ConfigError(f"held-out fraction must be in (0, 1), got {self.held_out}")
        if self.learning_rate <= 0 or self.max_minutes <= 0:
            raise ConfigError("learning rate and max minutes must be > 0")


@dataclass
class Labels:
    """Per corpus position: the head's input and the target's final hidden state."""

    exit_states: list[torch.Tensor]  # per sequence [T, hidden]: residual after N layers
    final_states: list[torch.Tensor]  # per sequence [T, hidden]: final-normed hidden states
    token_ids: list[list[int]]

    def to_dict(self) -> dict:
        """Plain containers of tensors and ints, as `labels.pt` stores them."""
        return {"exit_states": self.exit_states, "final_states": self.final_states, "token_ids": self.token_ids}


def _load_tensors(path: Path, what: str, allowed: tuple = ()):
    """`torch.load(path, weights_only=True)`: tensors, plain containers and numbers only (and the
    classes in `allowed`). Anything else, or an unreadable file, is a ConfigError naming `what`."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        found = [line.strip() for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        raise ConfigError(f"refusing to load {what} {path}: it holds objects other than tensors and plain values, "
                          f"and unpickling those could run code" + (f" ({found[0]})" if found else "")) from None
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise ConfigError(f"cannot read {what} {path}: {first_line}") from None


def _load_checkpoint(path: Path) -> dict:
    checkpoint = _load_tensors(path, "training checkpoint")
    if not isinstance(checkpoint, dict) or any(key not in checkpoint for key in CHECKPOINT_KEYS):
        raise ConfigError(f"{path} is not an exit-head training checkpoint (it needs {', '.join(CHECKPOINT_KEYS)})")
    return checkpoint


def _load_labels(path: Path, sequences: list[list[int]]) -> Labels:
    """The cached labels of `sequences`; a ConfigError when the file labels other sequences.
    (`Labels` objects, as earlier versions pickled them, are allowed too.)"""
    data = _load_tensors(path, "labels file", allowed=(Labels,))
    if isinstance(data, dict) and set(data) == {"exit_states", "final_states", "token_ids"}:
        data = Labels(**data)
    if not isinstance(data, Labels):
        raise ConfigError(f"{path} is not a labels file; delete it to label the corpus again")
    if data.token_ids != sequences or not len(data.exit_states) == len(data.final_states) == len(sequences):
        raise ConfigError(f"{path} labels other sequences than this corpus and sequence length; delete it to "
                          f"label the corpus again")
    return data


@torch.inference_mode()
def label(target, sequences: list[list[int]], exit_layer: int, progress: Callable[[int], None] | None = None) -> Labels:
    """Run the frozen target over each sequence, keeping layer-N and final states (bfloat16, on
    the host): on the fast path where the target has one, else through its PyTorch forward."""
    exits, finals = label_layers(target, sequences, [exit_layer], progress)
    return Labels(exits[exit_layer], finals, sequences)


@torch.inference_mode()
def label_layers(target, sequences: list[list[int]], exit_layers, progress: Callable[[int], None] | None = None
                 ) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """`label` for several exit layers in one pass over the corpus: ({N: per sequence [T, hidden]
    the residual stream after N layers}, per sequence [T, hidden] the final-normed states)."""
    exit_layers = sorted(set(exit_layers))
    layers = len(target.decoder.layers) if target.fast else len(torch_path.parts(target.model, "training an exit head").layers)
    if not all(1 <= n <= layers for n in exit_layers):
        raise ConfigError(f"exit layer must be in 1..{layers}, got {', '.join(map(str, exit_layers))}")
    if not target.fast:
        return _label_on_device(target, sequences, exit_layers, progress)
    fast = target.decoder
    exits: dict[int, list[torch.Tensor]] = {n: [] for n in exit_layers}
    finals = []
    for ids in sequences:
        cache = fast.new_cache(len(ids))
        x = fast.embed(torch.tensor(ids, device=target.device))
        done = 0
        for n in exit_layers:  # the layers in pieces, each ending at an exit layer
            x = fast.run(x, 0, cache, range(done, n))
            exits[n].append(x.to(torch.bfloat16))
            done = n
        x = fast.run(x, 0, cache, range(done, len(fast.layers)))
        finals.append(fast.norm(x).to(torch.bfloat16))
        if progress is not None:
            progress(1)
    return exits, finals


MIN_SEQUENCE = 16  # training sequences shorter than this are left out


def corpus_documents(tokenizer, path: Path) -> list[list[int]]:
    """Each document's token ids: stored in the corpus file where the target wrote it, else its
    text tokenized (with the tokenizer's BOS where it adds one)."""
    stored = read_corpus_ids(path)
    return [ids if ids is not None else tokenizer(text)["input_ids"] for text, ids in zip(read_corpus(path), stored)]


def corpus_sequences(documents: list[list[int]], length: int) -> list[tuple[int, int, int]]:
    """The training sequences: (document, begin, end) for each piece of at most `length` of a
    document's labelled positions (all but its last token), pieces shorter than MIN_SEQUENCE
    left out."""
    pieces = []
    for index, ids in enumerate(documents):
        labelled = len(ids) - 1
        for begin in range(0, labelled, length):
            end = min(begin + length, labelled)
            if end - begin >= MIN_SEQUENCE:
                pieces.append((index, begin, end))
    return pieces


def labelled_layers(target, config: TrainConfig) -> list[int]:
    """The exit layers whose states training needs: the configured one, or AUTO's candidates."""
    return candidates(target.config.num_hidden_layers) if config.exit_layer == AUTO else [config.exit_layer]


@torch.inference_mode()
def document_labels(target, documents: list[list[int]], exit_layers, length: int,
                    recorder: StateRecorder | None = None, progress: Callable[[int], None] | None = None
                    ) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor], int]:
    """The labels of `corpus_sequences(documents, length)`: ({N: per sequence [T, hidden] the
    residual stream after N layers}, per sequence [T, hidden] the final-normed states, bfloat16;
    how many documents came from `recorder`). A document `recorder` kept every state of is taken
    from it (and the recorder forgets it); the others are labelled whole (`label_layers`).
    `progress(1)` per document."""
    exit_layers = sorted(set(exit_layers))
    states = []  # per document: ({N: [T, hidden]}, [T, hidden]) over its labelled positions
    taken = 0
    for ids in documents:
        found = recorder.take(ids) if recorder is not None and set(exit_layers) <= set(recorder.layers) else None
        taken += found is not None
        if found is None:
            exits, finals = label_layers(target, [ids[:-1]], exit_layers)
            states.append(({n: exits[n][0] for n in exit_layers}, finals[0]))
        else:
            states.append(({n: found.exits[n][: len(ids) - 1] for n in exit_layers}, found.final[: len(ids) - 1]))
        if progress is not None:
            progress(1)
    pieces = corpus_sequences(documents, length)
    return ({n: [states[d][0][n][b:e] for d, b, e in pieces] for n in exit_layers},
            [states[d][1][b:e] for d, b, e in pieces], taken)


def _label_on_device(target, sequences: list[list[int]], exit_layers: list[int], progress
                     ) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """`label_layers` through the model's own decoder (the PyTorch path, any device): the exit
    layers' outputs are read with forward hooks, the final states are the decoder's normed output."""
    parts = torch_path.parts(target.model, "training an exit head")
    captured: dict[int, torch.Tensor] = {}

    def hook(n):
        def keep(module, args, output):
            captured[n] = output[0] if isinstance(output, tuple) else output
        return keep

    hooks = [parts.layers[n - 1].register_forward_hook(hook(n)) for n in exit_layers]
    exits: dict[int, list[torch.Tensor]] = {n: [] for n in exit_layers}
    finals = []
    try:
        for ids in sequences:
            captured.clear()
            final = parts.body(input_ids=torch.tensor([ids], device=target.device), use_cache=False).last_hidden_state[0]
            for n in exit_layers:
                exits[n].append(captured[n][0].to(torch.bfloat16).cpu())  # [T, d]
            finals.append(final.to(torch.bfloat16).cpu())  # [T, d]
            if progress is not None:
                progress(1)
    finally:
        for handle in hooks:
            handle.remove()
    return exits, finals


def draft_vocabulary(sequences: list[list[int]], size: int, always: set[int], vocab_size: int) -> list[int]:
    """V_d: `always` (e.g. EOS) and the corpus tokens, most frequent first (ties: smaller id
    first); when the corpus has fewer than `size` distinct tokens, the smallest ids not yet in
    fill the rest (subword vocabularies number their pieces roughly by frequency)."""
    counts = Counter(token for ids in sequences for token in ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    vocab = [t for t in always if t not in counts] + ranked
    chosen = set(vocab)
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(vocab) < min(size, vocab_size):
        vocab.append(next(filler))
    return vocab[:size]


def _kl(head_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(p || q) over positions; both [.., V_d] logits."""
    log_p = F.log_softmax(target_logits.float(), -1)
    log_q = F.log_softmax(head_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


@torch.no_grad()
def evaluate(head: ExitHead, labels: Labels, indices: list[int], full_logits: Callable[[torch.Tensor], torch.Tensor],
             eval_tokens: int) -> dict:
    """Held-out KL on the draft vocabulary, and acceptance estimates against the full vocabulary;
    full_logits: final-normed states [m, d] -> the target's logits [m, vocab] (`Target.full_logits`)."""
    head.eval()
    rows = head.output_rows().float()  # [V_d, d]
    kls, greedy, sampled, counted = [], 0.0, 0.0, 0
    for i in indices:
        exit_states = labels.exit_states[i].to(rows.device).float().unsqueeze(0)  # [1, T, d]
        final = labels.final_states[i].to(rows.device).float()  # [T, d]
        q_logits = head(exit_states)[0]  # [T, V_d]
        kls.append(float(_kl(q_logits, final @ rows.T)))
        for begin in range(0, final.shape[0], 64):  # 64 positions at a time: [64, vocab] rows
            if counted >= eval_tokens:
                break
            end = min(begin + 64, final.shape[0], begin + eval_tokens - counted)
            p = torch.softmax(full_logits(final[begin:end]).float(), -1)  # [m, vocab]
            q = torch.zeros_like(p)
            q[:, head.vocab] = torch.softmax(q_logits[begin:end].float(), -1)
            greedy += float((p.argmax(-1) == q.argmax(-1)).sum())
            sampled += float(torch.minimum(p, q).sum())
            counted += end - begin
    head.train()
    return {
        "kl_draft_vocab": round(sum(kls) / max(len(kls), 1), 4),
        "greedy_acceptance": round(greedy / max(counted, 1), 4),
        "sampled_acceptance": round(sampled / max(counted, 1), 4),
        "positions": counted,
    }


def _fingerprint_corpus(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def check_fits(target, config: TrainConfig) -> None:
    """A ConfigError where `config` asks for layers the target does not have: checked before
    anything long runs (generating a corpus, labelling it)."""
    layers = target.config.num_hidden_layers
    if config.exit_layer != AUTO and not 1 <= config.exit_layer <= layers:
        raise ConfigError(f"exit layer must be in 1..{layers}, got {config.exit_layer}")
    if config.init_layer is not None and config.init_layer >= layers:
        raise ConfigError(f"init layer must be in 0..{layers - 1}, got {config.init_layer}")


def check_resumable(out_dir: Path, resume: bool) -> None:
    """A ConfigError where `out_dir` holds a training that `resume` would overwrite, or none to
    resume: checked before anything long runs."""
    checkpoint_path = out_dir / CHECKPOINT
    if checkpoint_path.exists() and not resume:
        raise ConfigError(f"{checkpoint_path} exists: pass --resume to continue it, or choose another --out")
    if resume and not checkpoint_path.exists() and not (out_dir / "corpus.jsonl").is_file():
        raise ConfigError(f"nothing to resume: {checkpoint_path} does not exist")


def _vocabulary(target, sequences: list[list[int]], train_ids: list[int], config: TrainConfig) -> list[int]:
    return draft_vocabulary([sequences[i] for i in train_ids], config.draft_vocab, set(target.eos_token_ids),
                            target.vocab_size)


def _new_head(target, config: TrainConfig, vocab: list[int]) -> tuple[ExitHead, torch.optim.Optimizer]:
    """A head at config.exit_layer (float32, training mode) and its AdamW over the trained parameters."""
    head = ExitHead(target, config.exit_layer, vocab, config.init_layer,
                    shared=() if config.train_mlp else SHARED_MLP).float()
    head.train()
    parameters = [p for p in head.parameters() if p.requires_grad]
    return head, torch.optim.AdamW(parameters, lr=config.learning_rate, weight_decay=0.0)


def _train_steps(head: ExitHead, optimizer, labels: Labels, train_ids: list[int], rng: random.Random,
                 config: TrainConfig, step: int, steps: int, deadline: float, after_step: Callable[[int], None],
                 bar=None) -> tuple[int, str]:
    """Optimiser steps from `step` to `steps`, or until `deadline`; `after_step(step)` after each.
    Returns (the step reached, "steps" or "time"). The learning rate warms up, then follows a
    cosine down to 0 over the run's progress: the larger of the share of `steps` done and the
    share of the time to `deadline` spent, so that a run the deadline stops also ends annealed
    (a cosine over `steps` alone left it at 85% of the peak when 10 minutes gave 382 of 1,500
    steps)."""
    rows = head.output_rows().float()  # [V_d, d]
    parameters = [p for p in head.parameters() if p.requires_grad]
    losses: list[float] = []
    began = time.perf_counter()
    while step < steps:
        now = time.perf_counter()
        if now > deadline:
            return step, "time"
        progress = max(step / steps, (now - began) / (deadline - began) if math.isfinite(deadline) else 0.0)
        batch = [train_ids[rng.randrange(len(train_ids))] for _ in range(config.batch)]
        length = min(labels.exit_states[i].shape[0] for i in batch)
        exit_states = torch.stack([labels.exit_states[i][:length] for i in batch]).to(rows.device).float()  # [B, T, d]
        final = torch.stack([labels.final_states[i][:length] for i in batch]).to(rows.device).float()  # [B, T, d]
        scale = min(1.0, (step + 1) / config.warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate * scale
        loss = _kl(head(exit_states), final @ rows.T)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        losses.append(float(loss.detach()))
        if bar:
            bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        after_step(step)
    return step, "steps"


def _choose_exit_layer(target, sequences, train_ids, held_out, config: TrainConfig, out_dir: Path, resume: bool,
                       labelled, log) -> tuple[TrainConfig, dict, Labels | None]:
    """config with exit_layer AUTO resolved: each of `exit_layer.candidates` gets a probe head
    trained for config.probe_steps on labels from one pass over the corpus (`labelled(layers)`:
    ({N: exit states}, final states) per sequence), its held-out greedy
    acceptance is measured, and `exit_layer.choose` picks the layer of best expected speedup.
    Returns (the resolved config, the choice's record, the chosen layer's labels); on a resume
    the recorded choice is reused (labels None: read from the labels file)."""
    path = out_dir / CHOICE
    if resume and path.is_file():
        choice = json.loads(path.read_text())
        log(f"exit layer {choice['chosen']} (chosen earlier, {path})")
        return replace(config, exit_layer=int(choice["chosen"])), choice, None
    layers = candidates(target.config.num_hidden_layers)
    log(f"choosing the exit layer among {layers}: labelling {len(sequences)} sequences once, then a "
        f"{config.probe_steps}-step probe head for each")
    exits, finals = labelled(layers)
    vocab = _vocabulary(target, sequences, train_ids, config)
    acceptance = {}
    for n in layers:
        probe_config = replace(config, exit_layer=n)
        labels = Labels(exits[n], finals, sequences)
        head, optimizer = _new_head(target, probe_config, vocab)
        _train_steps(head, optimizer, labels, train_ids, random.Random(config.seed), probe_config, 0,
                     config.probe_steps, math.inf, lambda step: None)
        measured = evaluate(head, labels, held_out, target.full_logits, min(config.eval_tokens, PROBE_EVAL_TOKENS))
        acceptance[n] = measured["greedy_acceptance"]
        log(f"exit layer {n}: probe's held-out greedy acceptance {acceptance[n]:.1%}")
    chosen, table = choose(acceptance, target.config, config.draft_vocab)
    choice = {"chosen": chosen, "probe_steps": config.probe_steps, "layers": {str(n): v for n, v in table.items()}}
    path.write_text(json.dumps(choice, indent=1) + "\n")
    each = ", ".join(f"{n}: {v['speedup']:.2f}x" for n, v in table.items())
    log(f"exit layer {chosen} chosen (expected {table[chosen]['speedup']:.2f}x at drafts of "
        f"{table[chosen]['draft_length']}; per layer: {each})")
    return replace(config, exit_layer=chosen), choice, Labels(exits[chosen], finals, sequences)


def train_exit_head(target, corpus_path: Path, out_dir: Path, config: TrainConfig, *, resume: bool = False,
                    progress_factory=None, log: Callable[[str], None] = print,
                    recorder: StateRecorder | None = None, began: float | None = None) -> dict:
    """Label, train and evaluate; writes the head (and checkpoints) into `out_dir`.
    `recorder`: what the target kept while it wrote the corpus (its documents need no labelling
    pass). `began`: when the run began (`time.perf_counter()`; default: now), from which
    config.max_minutes counts. Training stops in time for the last evaluation (as long as the
    first took), but gets at least MIN_TRAINING_SHARE of the budget whatever came before it.
    Returns the training summary that is also stored in the head's JSON."""
    started = time.perf_counter()
    began = started if began is None else began
    budget_end = began + 60 * config.max_minutes
    check_fits(target, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out_dir / CHECKPOINT
    check_resumable(out_dir, resume)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    checkpoint = _load_checkpoint(checkpoint_path) if resume and checkpoint_path.exists() else None

    documents = corpus_documents(target.tokenizer, corpus_path)
    sequences = [documents[d][b:e] for d, b, e in corpus_sequences(documents, config.sequence_length)]
    if len(sequences) < 2:
        raise ConfigError(f"the corpus {corpus_path} is too small ({len(sequences)} sequences)")
    order = list(range(len(sequences)))
    rng.shuffle(order)
    held = max(1, int(len(order) * config.held_out))
    held_out, train_ids = order[:held], order[held:]

    def labelled(layers) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
        log(f"labelling {len(documents)} documents ({len(sequences)} sequences, {sum(map(len, sequences))} tokens)")
        bar = progress_factory(len(documents), "label") if progress_factory else None
        exits, finals, taken = document_labels(target, documents, layers, config.sequence_length, recorder,
                                               bar.update if bar else None)
        if bar:
            bar.close()
        if recorder is not None:
            log(f"{taken} of {len(documents)} documents were labelled by the forwards that wrote them")
        return exits, finals

    labels_path = out_dir / LABELS
    choice, labels = None, None
    if config.exit_layer == AUTO:
        config, choice, labels = _choose_exit_layer(target, sequences, train_ids, held_out, config, out_dir, resume,
                                                    labelled, log)
    if checkpoint is not None and checkpoint["config"] != asdict(config):
        changed = {k for k, v in asdict(config).items() if checkpoint["config"].get(k) != v} - {"steps", "max_minutes", "checkpoint_every"}
        if changed:
            raise ConfigError(f"--resume with different settings ({', '.join(sorted(changed))}) than the checkpoint")
    if labels is not None:  # the candidates' pass labelled the chosen layer
        pass
    elif resume and labels_path.exists():
        labels = _load_labels(labels_path, sequences)
        log(f"labels: reused {labels_path}")
    else:
        exits, finals = labelled([config.exit_layer])
        labels = Labels(exits[config.exit_layer], finals, sequences)
    if not (resume and labels_path.exists()):
        torch.save(labels.to_dict(), labels_path)

    vocab = checkpoint["vocab"] if checkpoint else _vocabulary(target, sequences, train_ids, config)
    head, optimizer = _new_head(target, config, vocab)
    step = 0
    if checkpoint:
        head.load_state_dict(checkpoint["head"], strict=False)
        optimizer.load_state_dict(checkpoint["optimizer"])
        step = checkpoint["step"]
        log(f"resumed at step {step}")
    evaluating = time.perf_counter()
    before = checkpoint["before"] if checkpoint else evaluate(head, labels, held_out, target.full_logits,
                                                              config.eval_tokens)
    log(f"held-out before training: {before}")
    now = time.perf_counter()
    # the last evaluation takes as long as the first (a resume, which skips it: a twentieth of the budget)
    reserve = 1.25 * (now - evaluating) if checkpoint is None else 0.05 * 60 * config.max_minutes
    deadline = max(budget_end - reserve, now + MIN_TRAINING_SHARE * 60 * config.max_minutes)
    log(f"training for {(deadline - now) / 60:.1f} min (--max-minutes {config.max_minutes:g}: "
        f"{(now - began) / 60:.1f} min used before training)")

    bar = progress_factory(config.steps, "train", initial=step) if progress_factory else None

    def save_checkpoint() -> None:
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "vocab": vocab, "config": asdict(config), "before": before}, checkpoint_path)

    def after_step(done: int) -> None:
        nonlocal step
        step = done
        if bar:
            bar.update(1)
        if step % config.checkpoint_every == 0:
            save_checkpoint()

    step, stopped = _train_steps(head, optimizer, labels, train_ids, rng, config, step, config.steps, deadline,
                                 after_step, bar)
    if bar:
        bar.close()
    save_checkpoint()
    after = evaluate(head, labels, held_out, target.full_logits, config.eval_tokens)
    log(f"held-out after training: {after}")
    summary = {
        "corpus": corpus_path.name,
        "corpus_sha256": _fingerprint_corpus(corpus_path),
        "sequences": len(sequences),
        "train_tokens": sum(len(sequences[i]) for i in train_ids),
        "held_out_tokens": sum(len(sequences[i]) for i in held_out),
        "steps": step,
        "stopped_by": stopped,
        "config": asdict(config),
        "loss": "KL(p_target restricted to the draft vocabulary || q_head), forward KL",
        "held_out_before": before,
        "held_out_after": after,
        **({"exit_layer_choice": choice} if choice is not None else {}),
        "train_minutes": round((time.perf_counter() - started) / 60, 2),
        "run_minutes": round((time.perf_counter() - began) / 60, 2),
    }
    save_head(head, head.spec(target, target.name, summary), out_dir)
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
