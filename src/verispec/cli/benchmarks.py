"""`verispec bench` (methods and peers on a prompt set) and `verispec bench-serve` (servers under
load, side by side): argument checks and presentation; the work is in `bench/`."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import VerispecError
from .shell import app, err, fail, log, names, out
from .target_options import (CONTROLLER_OPTION, DRAFT_LENGTH_OPTION, EXIT_HEAD_OPTION, NGRAM_MEMORY_OPTION, TargetOptions,
                             given_settings, refuse_unread_flags, target_options)


@app.command()
@target_options()
def bench(
    dataset: str = typer.Option("builtin", help="builtin | spec-bench | spec-bench-multiturn (its two-turn conversations) | code-edit (recurring functions to rewrite) | code-tasks (30 Python tasks checked by their tests: pass@1) | PATH.jsonl (Spec-Bench format)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories to keep (default: all)."),
    per_category: Optional[int] = typer.Option(None, "--per-category", help="At most N prompts per category (default: all)."),
    methods: str = typer.Option("ar,pld,anpd", help="Comma-separated verispec methods (any of `verispec info`); METHOD/CONTROLLER runs a method under a given controller, e.g. eesd/constant:4, METHOD/KEY=VALUE with an option, e.g. mtad/tau=0.1 or anpd/tree=8 (tree drafts of up to 8 tokens)."),
    peers: str = typer.Option("hf-ar,hf-pld", help="Comma-separated peers: hf-ar, hf-pld, hf-early-exit, hf-assisted, llamacpp-ar, llamacpp-pld (the llamacpp ones need `make llamacpp`; '' for none)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Sample from the k most likely tokens (0 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (default: random)."),
    repeats: int = typer.Option(1, help="Runs of each (prompt, method); the summary uses the median time."),
    out_dir: Optional[str] = typer.Option(None, "--out", help="Output directory (default: bench-out/<timestamp>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run in --out (same settings required)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model for sps and mtad (default: the EESD exit head) and the hf-assisted peer."),
    early_exit_layer: int = typer.Option(4, "--early-exit-layer", help="Layers the hf-early-exit peer drafts with (default: 4, the layer of the shipped EESD head)."),
    draft_length: Optional[int] = DRAFT_LENGTH_OPTION,
    controller: Optional[str] = CONTROLLER_OPTION,
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
    target: TargetOptions = None,
) -> None:
    """Benchmark methods and peer systems on a prompt set; write records, summary, report and plots."""
    options = dict(locals())  # every argument, by name
    from ..bench import aggregate, report
    from ..bench.peers import PeerSettings

    try:
        # Everything that needs no model is checked before the model is loaded.
        if resume and out_dir is None:
            fail("--resume needs --out DIR: the directory of the run to continue")
        peer_settings = PeerSettings(temperature, top_p, seed, early_exit_layer, draft_model, target.dtype, top_k)
        _check_methods_and_peers(options, peer_settings)
        settings, path, questions = _bench_settings(options, target.check())
        directory = Path(out_dir) if out_dir else _timestamped_dir()
        summary, config, probe = _run_bench(target, settings, peer_settings, path, questions, directory, resume,
                                            progress)
        report.write_report(directory, summary, config, config["info"].get("energy_meter", probe.description))
    except VerispecError as error:
        fail(str(error))
        return
    out.print(report.terminal_table(summary))
    err.print(f"records, summary.json, report.md and plots in {directory}", highlight=False)
    print(json.dumps(report.json_safe(aggregate.compact(summary))), flush=True)


def _timestamped_dir() -> Path:
    from datetime import datetime

    return Path("bench-out") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _check_methods_and_peers(options: dict, peer_settings) -> None:
    """Every method spec and peer valid, and no flag that none of them reads."""
    from ..bench.peers import get_peer
    from ..core.control import parse_controller
    from ..core.engine import DecodeConfig
    from ..core.methods import MethodOptions, parse_variant
    from ..core.sampling import SamplingConfig

    method_names, peer_names = names(options["methods"]), names(options["peers"])
    for name in method_names:
        parse_variant(name)
    for name in peer_names:
        get_peer(name).check(peer_settings)
    DecodeConfig(options["max_new_tokens"], SamplingConfig(options["temperature"], options["top_k"], options["top_p"],
                                                           options["seed"]))
    given = given_settings(**{key: options[key] for key in
                              ("draft_length", "controller", "exit_head", "draft_model", "ngram_memory")})
    method_options = MethodOptions(**{key: options[key] for key in
                                      ("draft_length", "controller", "exit_head", "draft_model", "ngram_memory")})
    if options["controller"]:
        parse_controller(options["controller"], options["draft_length"] or 1)
    refuse_unread_flags([parse_variant(name)[0] for name in method_names] + peer_names, given, method_options,
                        {"draft_model": [name for name in peer_names if get_peer(name).needs_draft_model]})


def _resolved_path_or_id(value: Optional[str]) -> Optional[str]:
    """A model argument as compared on --resume: an absolute path when it exists, else as given."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


def _bench_settings(options: dict, placement: str):
    """(runner.BenchSettings, the dataset's path, its questions) for `options`, the bench's arguments."""
    from ..bench import datasets, runner
    from ..bench.peers import get_peer
    from ..core.methods import parse_variant
    from ..target.loading import resolve_dtype, runs_on_block_kernel

    target: TargetOptions = options["target"]
    method_names, peer_names, kept = names(options["methods"]), names(options["peers"]), names(options["categories"] or "")
    path, questions = datasets.load_dataset(options["dataset"], kept, options["per_category"])
    dtype = resolve_dtype(target.dtype, block_kernel_model=runs_on_block_kernel(
        target.model, fast=target.fast, block_kernel=target.block_kernel), device=placement)
    drafts_with_a_model = (any(get_peer(p).needs_draft_model for p in peer_names)
                           or any(parse_variant(m)[0] in ("sps", "mtad") for m in method_names))
    settings = runner.BenchSettings(
        model=_resolved_path_or_id(target.model),
        # Knobs that only a peer uses are kept only when that peer runs, so that they cannot
        # block a --resume whose results they do not affect.
        draft_model=_resolved_path_or_id(options["draft_model"]) if drafts_with_a_model else None,
        dtype=str(dtype).replace("torch.", ""),
        # A named set is identified by its name and content, not by where it is installed.
        dataset=options["dataset"] if options["dataset"] in datasets.DATASET_NAMES else str(path.resolve()),
        dataset_sha256=datasets.file_digest(path),
        categories=tuple(kept), per_category=options["per_category"], methods=tuple(method_names),
        peers=tuple(peer_names), max_new_tokens=options["max_new_tokens"],
        temperature=float(options["temperature"]), top_p=float(options["top_p"]), seed=options["seed"],
        repeats=options["repeats"], draft_length=options["draft_length"], controller=options["controller"],
        early_exit_layer=options["early_exit_layer"] if "hf-early-exit" in peer_names else None,
        exit_head=_resolved_path_or_id(options["exit_head"]), fast=target.fast, block_kernel=target.block_kernel,
        top_k=options["top_k"], ngram_memory=options["ngram_memory"], numerics=target.numerics, device=placement,
        compile=target.compile,
    )
    return settings, path, questions


def _run_bench(target: TargetOptions, settings, peer_settings, path: Path, questions, directory: Path, resume: bool,
               progress: bool):
    """Load the model, run every (prompt, method) into `directory`; (summary, config, energy probe)."""
    from ..bench import aggregate, report, runner
    from ..bench.energy import EnergyProbe
    from ..bench.peers import get_peer
    from ..target.device import describe

    runner.check_run_dir(directory, settings, resume)
    model = target.load()
    model.prefix_cache = False  # every method prefills every prompt in full: equal terms
    for name in settings.peers:
        get_peer(name).check(peer_settings, model)  # checks that need the model (layer counts)
    probe = EnergyProbe()
    info = runner.invocation_info(shlex.join(["verispec", *sys.argv[1:]]), model.name, target.dtype)
    info.update(dataset_path=str(path.resolve()), machine=report.machine_info(), versions=report.versions(),
                energy_meter=probe.description, numerics_run=model.numerics, kernel=report.kernel_info(),
                device=describe(model.device))
    config = runner.start_run(directory, settings, info, resume)
    err.print(f"bench: {len(questions)} prompts x {len(settings.names)} methods x {settings.repeats} repeats "
              f"-> {directory}", highlight=False)
    saved = f"the finished runs are saved in {directory / runner.RECORDS_FILE}"
    try:
        records = runner.run_bench(model, settings, questions, directory, progress=progress, probe=probe,
                                   log=lambda message: err.print(message, highlight=False))
    except KeyboardInterrupt:
        fail(f"interrupted; {saved}: continue with --resume --out {directory}", code=130)
    except VerispecError as error:
        fail(f"{error} ({saved}; continue with --resume --out {directory})")
    return aggregate.summarize(records, settings.names, settings.greedy), config, probe


@app.command("bench-serve")
def bench_serve(
    server: List[str] = typer.Option(["verispec"], "--server", "-s", help="A server to measure; repeat for several, measured in turn: [LABEL=]TARGET [ARGS]. TARGET: http://HOST:PORT (running; ARGS: --pid N for its memory, --body JSON added to every request), verispec[:METHOD] (verispec serve METHOD ARGS), llama-server[:N] (make llama-server; --parallel N), vllm (make vllm)."),
    model: Optional[str] = typer.Option(None, help="Model the started servers serve: a .gguf file (all of them) or a transformers directory (verispec, vllm); default: the embedded Gemma 3 270M."),
    threads: int = typer.Option(2, help="Threads of each started server (OMP_NUM_THREADS; llama-server -t)."),
    dataset: str = typer.Option("builtin", help="builtin | spec-bench | code-edit | PATH.jsonl (Spec-Bench format); its multi-turn questions, if any, feed the chat workload."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated categories to keep (default: all)."),
    per_category: Optional[int] = typer.Option(None, "--per-category", help="At most N prompts per category."),
    prompts: Optional[int] = typer.Option(8, "--prompts", help="Use the first N prompts selected."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", help="max_tokens of every request (greedy, temperature 0)."),
    endpoint: str = typer.Option("chat", help="chat (/v1/chat/completions) | completions (/v1/completions, the prompt as is)."),
    concurrency: str = typer.Option("1,2,4,8,16", help="Closed-loop concurrency levels (1 always runs: the solo outputs)."),
    requests: Optional[int] = typer.Option(None, help="Requests per closed-loop level and open-loop rate (default: the prompts, at least the concurrency)."),
    rate: str = typer.Option("", help="Open-loop request rates per second, comma-separated ('' = no open loop)."),
    arrivals: str = typer.Option("poisson", help="poisson | constant: open-loop arrival times."),
    chat_conversations: int = typer.Option(4, "--chat-conversations", help="Multi-turn conversations (0 = none)."),
    chat_concurrency: int = typer.Option(1, "--chat-concurrency", help="Conversations at a time."),
    prefix_repeats: int = typer.Option(2, "--prefix-repeats", help="Cached-prefix tests (a cold long prompt, then the same with another last line; 0 = none)."),
    prefix_tokens: int = typer.Option(1000, "--prefix-tokens", help="Length of the cached-prefix prompt, in tokens (about)."),
    soak_requests: int = typer.Option(0, "--soak-requests", help="Requests of the soak with cancellations (0 = no soak)."),
    soak_concurrency: int = typer.Option(16, "--soak-concurrency", help="Concurrent clients in the soak."),
    cancel_fraction: float = typer.Option(0.2, "--cancel-fraction", help="Share of soak requests the client cancels (disconnects) mid-stream or before the first chunk."),
    seed: int = typer.Option(0, help="Seed of the open-loop arrivals and the soak's cancellations."),
    request_timeout: float = typer.Option(600.0, "--request-timeout", help="Seconds a request may take before the client gives up (an error)."),
    start_timeout: float = typer.Option(900.0, "--start-timeout", help="Seconds a started server may take to answer /health."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Bearer key sent to every server."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer directory that counts tokens where a server reports no usage (default: the model's, if on disk; else chunks are counted)."),
    llama_server: Optional[str] = typer.Option(None, "--llama-server", help="The llama-server binary (default: the one `make llama-server` builds)."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="Python of vLLM's environment (default: the one `make vllm` builds)."),
    out_dir: Optional[str] = typer.Option(None, "--out", help="Output directory (default: bench-out/serve-<timestamp>)."),
) -> None:
    """Load-test OpenAI-compatible servers side by side: closed and open loop, multi-turn chat, cached prefix, a soak with cancellations."""
    options = dict(locals())  # every option, by name, for load_test.run_command
    from ..bench import load_test, load_test_report, report

    try:
        summary, directory, started = load_test.run_command(
            command=shlex.join(["verispec", *sys.argv[1:]]), log=log, **options)
    except VerispecError as error:
        fail(str(error))
        return
    out.print(load_test_report.terminal_table(summary))
    err.print(f"records.jsonl, summary.json, report.md and plots in {directory}", highlight=False)
    print(json.dumps(report.json_safe(load_test_report.compact(summary))), flush=True)
    failed = [label for label, entry in started.items() if entry.get("error")]
    if failed:
        fail(f"{', '.join(failed)} could not be measured (see report.md and the logs in {directory / 'servers'})", 1)
