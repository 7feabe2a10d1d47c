"""`verispec train-exit`: train an EESD exit head by self-distillation; the work is in `train/`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import VerispecError
from .shell import err, app, fail, out
from .target_options import TargetOptions, target_options


@app.command("train-exit")
@target_options("model", "device")
def train_exit(
    exit_layer: str = typer.Option("4", "--exit-layer", help="N: the head reads the residual stream after the target's first N layers; 'auto': the layer whose short probe head gives the best expected speed, among about 1/14, 1/7 and 2/7 of the depth."),
    probe_steps: int = typer.Option(60, "--probe-steps", help="With --exit-layer auto: training steps of each candidate layer's probe."),
    draft_vocab: int = typer.Option(4096, "--draft-vocab", help="V_d: the head predicts over the V_d most frequent corpus tokens."),
    init_layer: Optional[int] = typer.Option(None, "--init-layer", help="Target layer the head's layer starts from (default: layer N, the first one the draft skips)."),
    train_mlp: bool = typer.Option(False, "--train-mlp", help="Train the head's MLP too (a whole layer: 94 MB for Qwen2.5-1.5B in bf16); by default it stays the target's own and the head file holds its attention and norms (11 MB there)."),
    corpus: Optional[str] = typer.Option(None, help="Training text: JSONL with a 'text' field, or plain text (default: text the target writes itself, see --generate-corpus)."),
    generate_corpus: Optional[bool] = typer.Option(None, "--generate-corpus/--shipped-corpus", help="Let the target continue the shipped training prompts and train on its own text (self-distillation; the default for any model but the embedded one), or train on the shipped corpus the embedded model wrote (its default)."),
    corpus_tokens: int = typer.Option(256, "--corpus-tokens", help="With --generate-corpus: tokens generated per prompt (an article: twice that, its summary and answer: half)."),
    corpus_samples: int = typer.Option(1, "--corpus-samples", help="With --generate-corpus: continuations sampled per prompt."),
    steps: int = typer.Option(1500, help="Optimiser steps."),
    batch: int = typer.Option(4, help="Sequences per step."),
    sequence_length: int = typer.Option(256, "--sequence-length", help="Tokens per training sequence."),
    learning_rate: float = typer.Option(1e-3, "--learning-rate", help="Peak learning rate (AdamW, warm-up then cosine)."),
    max_minutes: float = typer.Option(30.0, "--max-minutes", help="The whole run's time: the corpus the model writes takes at most 65% of it (each sample kept as far as it was written by then), then labelling, training and the last evaluation; the head is saved when it is used up."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", help="Steps between checkpoints."),
    out_dir: Optional[str] = typer.Option(None, "--out", help="Directory for the head, checkpoints and labels (default: the cache, where eesd finds it for this model with no --exit-head)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
    seed: int = typer.Option(0, help="Seed for the data split, batches and corpus generation."),
    target: TargetOptions = None,
) -> None:
    """Train an EESD exit head by self-distillation (the target stays frozen)."""
    import time

    from tqdm import tqdm

    from ..train.corpus import BUDGET_SHARE, CORPUS_PATH
    from ..train.exit_head import TrainConfig, check_fits, check_resumable, train_exit_head

    began = time.perf_counter()  # --max-minutes counts from here
    if generate_corpus is None:  # the embedded model wrote the shipped corpus; any other model writes its own
        generate_corpus = corpus is None and target.model is not None
    try:
        config = TrainConfig(exit_layer=int(exit_layer) if exit_layer.isdigit() else exit_layer, probe_steps=probe_steps,
                             init_layer=init_layer, train_mlp=train_mlp, draft_vocab=draft_vocab, sequence_length=sequence_length,
                             batch=batch, steps=steps, learning_rate=learning_rate, max_minutes=max_minutes,
                             checkpoint_every=checkpoint_every, seed=seed)
        corpus_path = _checked_corpus(corpus, generate_corpus, corpus_tokens, corpus_samples) or CORPUS_PATH
        target.check()
        model = target.load(dtype="float32")
        check_fits(model, config)
        directory = Path(out_dir) if out_dir is not None else _default_head_dir(model)
        check_resumable(directory, resume)
        recorder = None
        if generate_corpus:  # on --resume, the samples a stopped run wrote are kept
            corpus_path, recorder = _write_corpus(model, directory, config, corpus_tokens, corpus_samples, resume,
                                                  corpus_end=began + BUDGET_SHARE * 60 * max_minutes)

        def progress(total, desc, initial=0):
            return tqdm(total=total, desc=desc, initial=initial, unit="step" if desc == "train" else "doc")

        summary = train_exit_head(model, corpus_path, directory, config, resume=resume,
                                  progress_factory=progress, log=lambda m: err.print(m, highlight=False),
                                  recorder=recorder, began=began)
    except VerispecError as error:
        fail(str(error))
        return
    after = summary["held_out_after"]
    out.print(f"exit head written to {directory} ({summary['steps']} steps; {summary['run_minutes']} min in all); "
              f"held-out greedy acceptance {after['greedy_acceptance']:.1%}, sampled acceptance "
              f"{after['sampled_acceptance']:.1%}, KL {after['kl_draft_vocab']:.3f} "
              f"(before training: {summary['held_out_before']['greedy_acceptance']:.1%})")
    if out_dir is None:
        out.print("eesd uses it for this model from now on (no --exit-head needed)")
    else:
        out.print(f"use it with: verispec generate ... --method eesd --exit-head {directory}")


def _write_corpus(model, directory: Path, config, tokens: int, samples: int, resume: bool, corpus_end: float):
    """The model continues the shipped prompts into `directory`/corpus.jsonl until `corpus_end`
    (`time.perf_counter()`), while its forwards keep the labels: (the corpus path, the recorder)."""
    import time

    from tqdm import tqdm

    from ..target.recorder import StateRecorder, recording
    from ..train.corpus import BUDGET_SHARE, PROMPTS_PATH, generate_corpus, read_prompts
    from ..train.exit_head import labelled_layers

    prompts = read_prompts(PROMPTS_PATH)
    corpus_path = directory / "corpus.jsonl"
    recorder = StateRecorder(labelled_layers(model, config))  # no labelling pass for what it writes
    stopped = False

    def corpus_stop() -> bool:
        nonlocal stopped
        stopped = time.perf_counter() > corpus_end
        return stopped

    with tqdm(total=len(prompts) * samples, desc="corpus", unit="sample") as bar, recording(model, recorder):
        generate_corpus(model, prompts, tokens, corpus_path, samples=samples, seed=config.seed, resume=resume,
                        progress=bar.update, stop=corpus_stop)
    if stopped:
        err.print(f"the corpus used its {BUDGET_SHARE:.0%} of --max-minutes: the samples in flight stand as far "
                  f"as they were written (more minutes write more text)", highlight=False)
    return corpus_path, recorder


def _checked_corpus(corpus: Optional[str], generate: bool, tokens: int, samples: int) -> Optional[Path]:
    """The corpus file a user named (readable UTF-8), or None; the generation's settings checked."""
    from ..request.text import decode_utf8
    from ..train.corpus import check_generation

    if corpus and generate:
        fail("--corpus and --generate-corpus each choose the training text; give only one")
    if generate:
        check_generation(tokens, samples)
    if not corpus:
        return None
    path = Path(corpus)
    if not path.is_file():
        fail(f"corpus file not found: {corpus}")
    try:
        decode_utf8(path.read_bytes(), f"corpus file {corpus}")
    except OSError as error:
        fail(f"cannot read corpus file {corpus}: {error.strerror or error}")
    return path


def _default_head_dir(model) -> Path:
    from ..core.methods import trained_head_dir

    return trained_head_dir(model)
