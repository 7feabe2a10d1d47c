"""The `verispec` command line: a thin shell over the library.

Owns argument parsing (typer), turning user errors into one clear line and a non-zero exit code
(never a traceback), and presenting results (rich tables, JSON). All work is done by `api`,
`methods` and `model`.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from .errors import VerispecError

try:  # typer 0.29 (pinned) carries its own copy of click: its usage errors are these classes
    from typer._click import exceptions as usage
except ImportError:  # typer releases that use click itself
    from click import exceptions as usage


class _OneLineErrors(typer.core.TyperGroup):
    """The command group, with a usage mistake (a missing argument, an unknown option, a value of
    the wrong type) reported as every other mistake is: one `error:` line on stderr naming where
    help is, and exit status 2 (typer's own report is a framed box after the usage line)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except usage.NoArgsIsHelpError as error:  # `verispec` alone: the help
            typer.echo(error.ctx.get_help())
            sys.exit(2)
        except usage.UsageError as error:
            where = error.ctx.command_path if error.ctx is not None else "verispec"
            _error_line(f"{error.format_message().rstrip('.')}; see '{where} --help'")
            sys.exit(error.exit_code)
        except usage.ClickException as error:
            _error_line(error.format_message())
            sys.exit(error.exit_code)
        except typer.Abort:  # end of input where an answer was expected
            _error_line("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="verispec: faster LLM generation by drafting cheaply and verifying in one target forward.",
)
out = Console()
err = Console(stderr=True)

DEMO_PROMPT = (
    "Summarize the article below in three sentences.\n\n"
    "Article: The city council of Riverton voted on Tuesday to expand the public library's opening "
    "hours. Starting next month, the main library will open at 8 a.m. instead of 10 a.m. on "
    "weekdays, and it will stay open until 9 p.m. on Saturdays. The council said the change "
    "responds to a survey in which residents asked for more time to study and work in the "
    "library. The expansion will cost about 120,000 dollars a year, paid from the city's "
    "education budget. Library staff will hire four new part-time workers.\n\nSummary:"
)


# Options several commands share.
MODEL_OPTION = typer.Option(None, help="Model directory, .gguf file or cached hub id (default: embedded Gemma 3 270M).")
DTYPE_OPTION = typer.Option("auto", help="auto | float32 | bfloat16 | float16 (auto: float32 for a GGUF model on the block kernel, e.g. the default; otherwise bf16 only on CPUs with native bf16).")
FAST_OPTION = typer.Option(True, "--fast/--no-fast", help="Use the fast forward path where the model supports it (--no-fast: transformers' eager forward).")
BLOCK_OPTION = typer.Option(
    True, "--block-kernel/--no-block-kernel",
    help="On the fast path in float32, run a GGUF model's linears on their exact int8 blocks (the same weights, a quarter of the bytes; --no-block-kernel: float32 weights).",
)
NUMERICS_OPTION = typer.Option(
    "int8", "--numerics",
    help="int8 | fp32: how the block kernel multiplies (int8: activations quantized per block, each position's logits the same whatever the verify width, so wide verifies are cheap and exact against ar, which runs the same numerics; fp32: float32 activations).",
)
DEVICE_OPTION = typer.Option(
    "auto", "--device",
    help="auto | cpu | cuda | cuda:N | auto-map (auto: the first GPU if CUDA is available, else the CPU; auto-map: spread a model too large for one GPU over every GPU, accelerate's device_map='auto'). The fast path and block kernel run on the CPU only; on a GPU the PyTorch forward runs (dtype auto: bfloat16).",
)
COMPILE_OPTION = typer.Option(
    False, "--compile",
    help="CUDA only: run the one-token decode step compiled (torch.compile, CUDA graphs, static KV cache of 4096 positions); falls back with a message where it cannot.",
)
EXIT_HEAD_OPTION = typer.Option(None, "--exit-head", help="Exit-head directory for eesd (default: the head shipped for the default model).")
DRAFT_LENGTH_OPTION = typer.Option(None, "--draft-length", "-k", help="Most tokens drafted per step (default: the method's).")
CONTROLLER_OPTION = typer.Option(None, help="Draft-length controller: constant[:K], heuristic[:K], adaptive[:K], beta-ts[:K], calibrated-ts[:K].")
NGRAM_MEMORY_OPTION = typer.Option(
    True, "--ngram-memory/--no-ngram-memory",
    help="Memory across requests: anpd also drafts from the n-grams of earlier requests on the same model, suffix from its tree of earlier outputs (outputs never change; in a server one user's text can change another's speed).",
)


def _quiet_transformers() -> None:
    """Keep transformers' own progress bars and warnings out of the CLI's output."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _error_line(message: str) -> None:
    """One `error:` line on stderr (never wrapped; the message is not read as markup)."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _fail(message: str, code: int = 2) -> None:
    """One `error:` line on stderr, then exit."""
    _error_line(message)
    raise typer.Exit(code)


def _load(model: Optional[str], dtype: str, fast: bool = True, block_kernel: bool = True, numerics: str = "int8",
          device: str = "auto", compile: bool = False):
    from .target.loading import load

    _quiet_transformers()
    return load(model, dtype, fast=fast, block_kernel=block_kernel, numerics=numerics, device=device, compile=compile)


def _check_device(device: str, compile: bool = False) -> str:
    """The device `--device` names on this machine ('cpu', 'cuda:N' or 'auto-map'); a ConfigError
    for a misspelt one, a GPU that is not here, or --compile on the CPU, before anything loads."""
    from .target.device import resolve_device

    return resolve_device(device, compile)


def check_numerics(numerics: str) -> None:
    from .runtime.blockmm import NUMERICS

    if numerics not in NUMERICS:
        _fail(f"--numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")


def _read_stdin() -> str:
    """Standard input as UTF-8 text, whatever the locale; a ConfigError at the first byte that is
    not UTF-8."""
    from .request.text import checked_text, decode_utf8

    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream
        return checked_text(sys.stdin.read(), "standard input")
    return decode_utf8(raw.read(), "standard input")


def _refuse_unused_options(methods: Sequence[str], *, draft_length: Optional[int] = None,
                           controller: Optional[str] = None, exit_head: Optional[str] = None,
                           draft_model: Optional[str] = None, beams: Optional[int] = None,
                           tau: Optional[float] = None, draft_model_peers: Sequence[str] = (),
                           ngram_memory: Optional[bool] = None, tree: Optional[int] = None,
                           span_min: Optional[int] = None) -> None:
    """A ConfigError for an option that none of `methods` uses, or for a draft length given twice
    (--draft-length and --controller NAME:K): a silently ignored option makes a run, a benchmark
    above all, measure something other than what was asked. Users: --beams, --tau: mtad; --tree, --span-min: anpd;
    --draft-model: sps, mtad (and `draft_model_peers`); --exit-head: eesd, and sps and mtad when
    they draft with the head (no --draft-model); --draft-length, --controller: every method that
    drafts (all but ar)."""
    from .errors import ConfigError
    from .core.methods import METHODS

    drafting = [name for name, method in METHODS.items() if method.default_length > 0]
    head_users, head_note = ["eesd", "sps", "mtad"], ""
    if draft_model is not None:
        head_users, head_note = ["eesd"], " (sps and mtad draft with --draft-model, not with the exit head)"
    for option, value, users, note in (
        ("--beams", beams, ["mtad"], ""),
        ("--tau", tau, ["mtad"], ""),
        ("--no-ngram-memory", None if ngram_memory in (None, True) else False, ["anpd", "suffix"], ""),
        ("--tree", tree, ["anpd"], ""),
        ("--span-min", span_min, ["anpd"], ""),
        ("--draft-model", draft_model, ["sps", "mtad", *draft_model_peers], ""),
        ("--exit-head", exit_head, head_users, head_note),
        ("--draft-length", draft_length, drafting, ""),
        ("--controller", controller, drafting, ""),
    ):
        if value is not None and not set(users) & set(methods):
            raise ConfigError(f"{option} is used only by {', '.join(users)}, not by {', '.join(methods)}{note}")
    if draft_length is not None and controller is not None and ":" in controller:
        raise ConfigError(f"--draft-length {draft_length} and --controller {controller} both set the draft length; "
                          f"give only one")


def _stats_table(results: dict) -> Table:
    """A table with one column per method: counts and metrics of each GenerationStats."""
    table = Table(title="generation stats", show_lines=False)
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    rows = [
        ("prompt tokens", lambda s: f"{s.prompt_tokens}"),
        ("new tokens", lambda s: f"{s.new_tokens}"),
        ("target forwards", lambda s: f"{s.target_forwards}"),
        ("drafted / accepted", lambda s: f"{s.drafted} / {s.accepted}"),
        ("mean accepted tokens", lambda s: f"{s.mean_accepted_tokens:.2f}"),
        ("acceptance rate", lambda s: "-" if s.acceptance_rate is None else f"{s.acceptance_rate:.1%}"),
        ("accepted-length histogram", lambda s: " ".join(map(str, s.accepted_histogram))),
        ("prefill (s)", lambda s: f"{s.prefill_s:.3f}"),
        ("decode (s)", lambda s: f"{s.decode_s:.3f}"),
        ("tokens/s", lambda s: f"{s.tokens_per_s:.2f}"),
        ("stop reason", lambda s: s.stop_reason),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(result.stats) for result in results.values()))
    return table


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or '-' to read it from stdin."),
    method: str = typer.Option("anpd", "--method", "-m", help="Decoding method (see `verispec info`), with settings as in `bench --methods` (e.g. anpd/tree=8, pld/constant:12)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most tokens to generate."),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy; > 0 samples (default: 0; mtad: 1)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0 = off; default: 0; mtad: 10)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass, in (0, 1] (default: 1; mtad: 0.9)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (default: random). ar, pld and anpd give ar's sample for a seed; eesd, sps and mtad give the same sample again only under a constant or heuristic --controller (eesd's default adapts to timings; see README)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string; repeat for several."),
    model: Optional[str] = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    fast: bool = FAST_OPTION,
    block_kernel: bool = BLOCK_OPTION,
    numerics: str = NUMERICS_OPTION,
    device: str = DEVICE_OPTION,
    compile: bool = COMPILE_OPTION,
    draft_length: Optional[int] = DRAFT_LENGTH_OPTION,
    controller: Optional[str] = CONTROLLER_OPTION,
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Auxiliary draft model for sps and mtad (same tokenizer; default: the EESD exit head)."),
    beams: Optional[int] = typer.Option(None, help="mtad only: beam width W (default: 4)."),
    tau: Optional[float] = typer.Option(None, help="mtad only: joint-likelihood threshold (default: 0.5)."),
    tree: Optional[int] = typer.Option(None, "--tree", help="anpd only: draft a tree of up to N tokens, branching where the n-gram tables offer several next tokens, verified in one forward (on the fast path, and on the PyTorch path for the families it can mask; elsewhere single paths, said once; default: 0, single-path drafts)."),
    span_min: Optional[int] = typer.Option(None, "--span-min", help="anpd only: copy what followed an earlier occurrence of the context's end preceded by at least N equal tokens (4..32; 0: off; default: 8)."),
    perplexity: bool = typer.Option(False, "--perplexity", help="Also score the generated tokens' perplexity under the target (temperature 1, no top-k/top-p)."),
    prompt_format: str = typer.Option("raw", help="raw: the prompt as given; chat: chat template or plain Q/A template."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it is generated."),
    compare: bool = typer.Option(False, "--compare", help="Also run `ar` on the same prompt; print both stats and the speedup."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text and all stats."),
) -> None:
    """Generate text with one method, optionally compared side by side with `ar`."""
    from .api import make_request, sampling_for, stream as stream_text
    from .core.engine import DecodeConfig
    from .core.methods import MethodOptions, with_settings
    from .request.text import checked_text

    try:
        # Everything that needs no model is checked before the model is loaded.
        prompt = _read_stdin() if prompt == "-" else checked_text(prompt, "the prompt")
        if not prompt.strip():
            _fail("the prompt is empty")
        for text in stop:
            checked_text(text, "--stop")
        check_numerics(numerics)
        _check_device(device, compile)
        mtad_knobs = {name: value for name, value in (("beams", beams), ("tau", tau)) if value is not None}
        name, options = with_settings(method, MethodOptions(
            draft_length=draft_length, controller=controller, exit_head=exit_head, draft_model=draft_model,
            ngram_memory=ngram_memory, **mtad_knobs, **({"tree": tree} if tree is not None else {}),
            **({"span_min": span_min} if span_min is not None else {})))
        sampling = sampling_for(name, temperature, top_k, top_p, seed)  # --compare's ar samples alike
        DecodeConfig(max_new_tokens, sampling)
        _refuse_unused_options([name], draft_length=draft_length, controller=controller, exit_head=exit_head,
                               draft_model=draft_model, beams=beams, tau=tau, ngram_memory=ngram_memory, tree=tree,
                               span_min=span_min)
        target = _load(model, dtype, fast, block_kernel, numerics, device, compile)
        request_args = dict(
            max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
            top_p=sampling.top_p, seed=seed, stop=tuple(stop), prompt_format=prompt_format, options=options,
        )
        make_request(target, prompt, name, **request_args)  # validate everything before any run
        target.prefix_cache = False  # --compare's second run must prefill as the first did
        results = {}
        if compare and name != "ar":
            baseline = stream_text(target, prompt, "ar", **request_args)
            for _ in baseline:
                pass
            results["ar"] = baseline.result
        text_stream = stream_text(target, prompt, name, **request_args)
        for delta in text_stream:
            if stream and not as_json:
                out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)
        results[method] = text_stream.result
        scores = {}
        if perplexity:
            from .target.score import perplexity as score

            scores = {name: score(target, r.prompt_ids, r.token_ids) for name, r in results.items()}
    except VerispecError as error:
        _fail(str(error))
        return
    chosen = results[method]
    summary = {"model": target.name, "dtype": str(target.dtype).replace("torch.", ""), "numerics": target.numerics,
               "device": str(target.device), "method": method}
    if as_json:
        payload = {**summary, **chosen.to_dict()}
        if perplexity:
            payload["perplexity"] = scores[method]
        if "ar" in results and method != "ar":
            payload["baseline"] = {"method": "ar", **results["ar"].to_dict()}
            if perplexity:
                payload["baseline"]["perplexity"] = scores["ar"]
        if compare:
            payload.update(_comparison(results, method))
        print(json.dumps(payload))
        return
    if stream:
        out.print()
    else:
        out.print(chosen.text, highlight=False, markup=False)
    out.print(_stats_table(results))
    if perplexity:
        out.print("perplexity under the target: " + ", ".join(f"{n} {v:.3f}" for n, v in scores.items()))
    if compare:
        comparison = _comparison(results, method)
        verdict = "identical" if comparison["identical"] else f"differ from token {comparison['first_difference']}"
        out.print(f"speedup of {method} over ar: [bold]{comparison['speedup']:.2f}x[/]; outputs {verdict}")


def _comparison(results: dict, method: str) -> dict:
    """speedup (tokens/s ratio) and identity of `method` against `ar`."""
    baseline, chosen = results.get("ar", results[method]), results[method]
    speedup = chosen.stats.tokens_per_s / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0
    first = _first_difference(baseline.token_ids, chosen.token_ids)
    return {"speedup": round(speedup, 4), "identical": first is None, "first_difference": first}


def _names(value: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [part.strip() for part in value.split(",") if part.strip()]


def _resolved_path_or_id(value: Optional[str]) -> Optional[str]:
    """A model argument as compared on --resume: an absolute path when it exists, else as given."""
    if value is None:
        return None
    from pathlib import Path

    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value


@app.command()
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
    dtype: str = DTYPE_OPTION,
    fast: bool = FAST_OPTION,
    block_kernel: bool = BLOCK_OPTION,
    numerics: str = NUMERICS_OPTION,
    device: str = DEVICE_OPTION,
    compile: bool = COMPILE_OPTION,
    repeats: int = typer.Option(1, help="Runs of each (prompt, method); the summary uses the median time."),
    out_dir: Optional[str] = typer.Option(None, "--out", help="Output directory (default: bench-out/<timestamp>)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the interrupted run in --out (same settings required)."),
    model: Optional[str] = MODEL_OPTION,
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model for sps and mtad (default: the EESD exit head) and the hf-assisted peer."),
    early_exit_layer: int = typer.Option(4, "--early-exit-layer", help="Layers the hf-early-exit peer drafts with (default: 4, the layer of the shipped EESD head)."),
    draft_length: Optional[int] = DRAFT_LENGTH_OPTION,
    controller: Optional[str] = CONTROLLER_OPTION,
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr."),
) -> None:
    """Benchmark methods and peer systems on a prompt set; write records, summary, report and plots."""
    import shlex
    from datetime import datetime
    from pathlib import Path

    from .bench import aggregate, datasets, report, runner
    from .bench.energy import EnergyProbe
    from .bench.peers import PeerSettings, get_peer
    from .core.control import parse_controller
    from .core.engine import DecodeConfig
    from .core.methods import MethodOptions, parse_variant
    from .target.device import describe
    from .target.loading import resolve_dtype, runs_on_block_kernel
    from .core.sampling import SamplingConfig

    command = shlex.join(["verispec", *sys.argv[1:]])
    try:
        # Everything that needs no model is checked before the model is loaded.
        if resume and out_dir is None:
            _fail("--resume needs --out DIR: the directory of the run to continue")
        method_names, peer_names = _names(methods), _names(peers)
        check_numerics(numerics)
        placement = _check_device(device, compile)
        for name in method_names:
            parse_variant(name)
        peer_settings = PeerSettings(temperature, top_p, seed, early_exit_layer, draft_model, dtype, top_k)
        for name in peer_names:
            get_peer(name).check(peer_settings)
        DecodeConfig(max_new_tokens, SamplingConfig(temperature, top_k, top_p, seed))
        MethodOptions(draft_length=draft_length, controller=controller, exit_head=exit_head,
                      draft_model=draft_model, ngram_memory=ngram_memory)
        if controller:
            parse_controller(controller, draft_length or 1)
        _refuse_unused_options([parse_variant(name)[0] for name in method_names] + peer_names,
                               draft_length=draft_length, controller=controller, exit_head=exit_head,
                               draft_model=draft_model,
                               draft_model_peers=[name for name in peer_names if get_peer(name).needs_draft_model],
                               ngram_memory=ngram_memory)
        path, questions = datasets.load_dataset(dataset, _names(categories or ""), per_category)
        settings = runner.BenchSettings(
            model=_resolved_path_or_id(model),
            # Knobs that only a peer uses are kept only when that peer runs, so that they cannot
            # block a --resume whose results they do not affect.
            draft_model=_resolved_path_or_id(draft_model) if (
                any(get_peer(p).needs_draft_model for p in peer_names)
                or any(parse_variant(m)[0] in ("sps", "mtad") for m in method_names)) else None,
            dtype=str(resolve_dtype(dtype, block_kernel_model=runs_on_block_kernel(
                model, fast=fast, block_kernel=block_kernel), device=placement)).replace("torch.", ""),
            # A named set is identified by its name and content, not by where it is installed.
            dataset=dataset if dataset in datasets.DATASET_NAMES else str(path.resolve()),
            dataset_sha256=datasets.file_digest(path),
            categories=tuple(_names(categories or "")),
            per_category=per_category,
            methods=tuple(method_names),
            peers=tuple(peer_names),
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            seed=seed,
            repeats=repeats,
            draft_length=draft_length,
            controller=controller,
            early_exit_layer=early_exit_layer if "hf-early-exit" in peer_names else None,
            exit_head=_resolved_path_or_id(exit_head),
            fast=fast,
            block_kernel=block_kernel,
            top_k=top_k,
            ngram_memory=ngram_memory,
            numerics=numerics,
            device=placement,
            compile=compile,
        )
        directory = Path(out_dir) if out_dir else Path("bench-out") / datetime.now().strftime("%Y%m%d-%H%M%S")
        runner.check_run_dir(directory, settings, resume)
        target = _load(model, dtype, fast, block_kernel, numerics, device, compile)
        target.prefix_cache = False  # every method prefills every prompt in full: equal terms
        for name in peer_names:
            get_peer(name).check(peer_settings, target)  # checks that need the model (layer counts)
        probe = EnergyProbe()
        info = runner.invocation_info(command, target.name, dtype)
        info.update(dataset_path=str(path.resolve()), machine=report.machine_info(), versions=report.versions(),
                    energy_meter=probe.description, numerics_run=target.numerics, kernel=report.kernel_info(),
                    device=describe(target.device))
        config = runner.start_run(directory, settings, info, resume)
        err.print(f"bench: {len(questions)} prompts x {len(settings.names)} methods x {repeats} repeats "
                  f"-> {directory}", highlight=False)
        try:
            records = runner.run_bench(target, settings, questions, directory, progress=progress, probe=probe,
                                       log=lambda message: err.print(message, highlight=False))
        except KeyboardInterrupt:
            _fail(f"interrupted; the finished runs are saved in {directory / runner.RECORDS_FILE}: "
                  f"continue with --resume --out {directory}", code=130)
            return
        except VerispecError as error:
            _fail(f"{error} (the finished runs are saved in {directory / runner.RECORDS_FILE}; "
                  f"continue with --resume --out {directory})")
            return
        summary = aggregate.summarize(records, settings.names, settings.greedy)
        report.write_report(directory, summary, config, config["info"].get("energy_meter", probe.description))
    except VerispecError as error:
        _fail(str(error))
        return
    out.print(report.terminal_table(summary))
    err.print(f"records, summary.json, report.md and plots in {directory}", highlight=False)
    print(json.dumps(report.json_safe(aggregate.compact(summary))), flush=True)


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
    options = dict(locals())  # every option, by name, for serve.run_command
    import shlex

    from .bench import report, load_test as serve, load_test_report as load_test_report

    try:
        summary, directory, started = serve.run_command(
            command=shlex.join(["verispec", *sys.argv[1:]]),
            log=lambda m: err.print(m, highlight=False, markup=False, soft_wrap=True), **options)
    except VerispecError as error:
        _fail(str(error))
        return
    out.print(load_test_report.terminal_table(summary))
    err.print(f"records.jsonl, summary.json, report.md and plots in {directory}", highlight=False)
    print(json.dumps(report.json_safe(load_test_report.compact(summary))), flush=True)
    failed = [label for label, entry in started.items() if entry.get("error")]
    if failed:
        _fail(f"{', '.join(failed)} could not be measured (see report.md and the logs in {directory / 'servers'})", 1)


@app.command()
def info(
    model: Optional[str] = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    fast: bool = FAST_OPTION,
    block_kernel: bool = BLOCK_OPTION,
    numerics: str = NUMERICS_OPTION,
    device: str = DEVICE_OPTION,
) -> None:
    """Print the model, dtype, threads, methods and library versions."""
    import torch
    import transformers

    from . import __version__
    from .core.methods import METHODS
    from .target.device import spread_over_devices
    from .target.loading import cpu_has_native_bf16
    from .paths import cache_root

    from .bench.report import kernel_info
    from .target.device import describe

    check_numerics(numerics)
    try:
        _check_device(device)
        target = _load(model, dtype, fast, block_kernel, numerics, device)
    except VerispecError as error:
        _fail(str(error))
        return
    import psutil

    table = Table(title="verispec info", show_header=False)
    own_blocks = target.model is None
    spread = not own_blocks and spread_over_devices(target.model)
    path = ("GGUF blocks (the file memory-mapped; every layer in C over paged KV)" if own_blocks else
            "fast (static KV cache, prepacked linears)" if target.fast else f"PyTorch (transformers) on {target.device}")
    for key, value in [
        ("model", target.name),
        ("architecture", target.config.model_type if own_blocks else type(target.model).__name__),
        ("layers / hidden / vocabulary", f"{target.config.num_hidden_layers} / {target.config.hidden_size} / {target.vocab_size}"),
        ("dtype", str(target.dtype).replace("torch.", "")),
        ("device", describe(target.device) + (" (spread over several devices)" if spread else "")),
        ("CUDA available", str(torch.cuda.is_available())),
        ("CPU native bf16", str(cpu_has_native_bf16())),
        ("torch threads", str(torch.get_num_threads())),
        ("forward path", path),
        ("weight bytes read a token", f"{target.weight_bytes_per_token / 1e6:.1f} MB"),
        ("resident memory", f"{psutil.Process().memory_info().rss / 1e6:.0f} MB"),
        ("own LM head", str(target.uses_own_head)),
        ("block kernel", target.block_kernel_summary),
        ("numerics", target.numerics),
        ("kernel instruction set", kernel_info()),
        ("cache directory", str(cache_root())),
        ("methods", ", ".join(METHODS)),
        ("verispec", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
    ]:
        table.add_row(key, value)
    out.print(table)


def _listen(host: str, port: int):
    """A listening TCP socket on (host, port), bound before the model loads so that a busy port
    fails at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise VerispecError(f"cannot resolve host {host!r}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise VerispecError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(2048)
    return sock


@app.command()
def serve(
    model: Optional[str] = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    fast: bool = FAST_OPTION,
    block_kernel: bool = BLOCK_OPTION,
    numerics: str = NUMERICS_OPTION,
    device: str = DEVICE_OPTION,
    compile: bool = COMPILE_OPTION,
    method: str = typer.Option("anpd", "--method", "-m", help="Default decoding method, with settings as in `bench --methods` (e.g. anpd/tree=8); a request may choose another with the `method` field."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8000, help="TCP port (0 = any free port)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="VERISPEC_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' (except on /health)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for the worker; more get 429."),
    request_timeout: float = typer.Option(300.0, "--request-timeout", help="Seconds a request may take from arrival, queue wait included (0 = no limit)."),
    max_tokens_limit: int = typer.Option(1024, "--max-tokens-limit", help="Largest max_tokens a request may ask for (also the default)."),
    model_id: Optional[str] = typer.Option(None, "--model-id", help="Model id clients send (default: verispec-default, or the model path's basename)."),
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    max_batch: int = typer.Option(16, "--max-batch", help="Requests decoded together (each choice of n counts); more wait in the queue."),
    max_rows: int = typer.Option(256, "--max-rows", help="Rows of one step's forward: the running requests' verify rows, then prompt chunks."),
    kv_memory: Optional[str] = typer.Option(None, "--kv-memory", help="KV memory of the batch, e.g. 2GiB (default: a quarter of the available memory, at most 2 GiB)."),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Keep computed prompt blocks for later requests that start with them (outputs are identical either way)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model of sps and mtad requests (same tokenizer; default: the EESD exit head)."),
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    max_body: str = typer.Option("4MiB", "--max-body", help="Largest request body (e.g. 4MiB, 500000); a larger one gets 413 before it is read."),
    max_prompt_chars: int = typer.Option(1_000_000, "--max-prompt-chars", help="Most characters of a prompt (or of a chat's messages), checked before tokenizing; more get 400."),
    max_connections: int = typer.Option(1000, "--max-connections", help="Connections open at once; one more gets 503 and is closed."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", help="Seconds a connection may take to send a request's headers (0 = no limit)."),
    body_timeout: float = typer.Option(60.0, "--body-timeout", help="Seconds a request may take to send its body once the headers are in; 408 after (0 = no limit)."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API: requests are decoded together in a continuous batch."""
    from .target.loading import resolve_dtype
    from .runtime.kv_pool import parse_bytes
    from .server import ServerSettings, create_app, default_model_id
    from .server.app import served_method
    from .server.connections import ensure_file_limit, uvicorn_config
    from .request.text import checked_text

    try:
        # Everything that needs no model is checked before the model is loaded.
        served_method(method)
        check_numerics(numerics)
        _check_device(device, compile)
        for option, value in (("--api-key", api_key), ("--model-id", model_id)):
            if value is not None:
                checked_text(value, option)
        resolve_dtype(dtype)
        if not 0 <= port <= 65535:
            _fail(f"--port must be in 0..65535, got {port}")
        try:
            max_body_bytes = parse_bytes(max_body)
        except VerispecError as error:
            _fail(f"--max-body: {error}")
        settings = ServerSettings(
            model_id=model_id if model_id is not None else default_model_id(model),
            default_method=method,
            api_key=api_key,
            max_queue=max_queue,
            request_timeout=request_timeout,
            max_tokens_limit=max_tokens_limit,
            max_sequences=max_batch,
            max_rows=max_rows,
            draft_model=draft_model,
            exit_head=exit_head,
            max_body_bytes=max_body_bytes,
            max_prompt_chars=max_prompt_chars,
            max_connections=max_connections,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
        )
        ensure_file_limit(max_connections)
        for option, path in (("--draft-model", draft_model), ("--exit-head", exit_head)):
            if path is not None and not Path(path).expanduser().exists():
                _fail(f"{option}: {path} not found")
        kv_bytes = None if kv_memory is None else parse_bytes(kv_memory)
        sock = _listen(host, port)
        target = _load(model, dtype, fast, block_kernel, numerics, device, compile)
        target.kv_memory, target.prefix_cache = kv_bytes, prefix_cache
        if target.pages_kv:
            target.pool  # noqa: B018 - made now: a budget too small for one block is refused before serving
        if not ngram_memory:  # for every request, whatever method it asks for
            from .core.drafters.base import switch_off_memory

            switch_off_memory(target.attachments)
        if draft_model is not None or exit_head is not None:  # loaded now, not in the first request
            from .core.methods import MethodOptions, draft_lm, prepared_exit_head

            if draft_model is not None:
                draft_lm(target, MethodOptions(draft_model=draft_model))
            if exit_head is not None:
                prepared_exit_head(target, exit_head)
    except VerispecError as error:
        _fail(str(error))
        return
    import uvicorn

    bound_host, bound_port = sock.getsockname()[:2]
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"http://{shown_host}:{bound_port}/v1"
    batching = (f"up to {max_batch} requests together, KV {target.pool.blocks * target.pool.block_bytes / 2**30:.2f} GiB, "
                f"prefix cache {'on' if prefix_cache else 'off'}" if target.pages_kv
                else "one request at a time (no exact batching for this target: it needs the block kernel in int8 numerics)")
    err.print(f"serving {target.name} as '{settings.model_id}' ({str(target.dtype).replace('torch.', '')} on "
              f"{target.device}, method {method}; {batching}) at {url}", highlight=False, soft_wrap=True)
    print(url, flush=True)
    config = uvicorn_config(create_app(target, settings), settings, log_level="info", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


@app.command()
def profile(
    model: Optional[str] = MODEL_OPTION,
    dtype: str = DTYPE_OPTION,
    fast: bool = FAST_OPTION,
    block_kernel: bool = BLOCK_OPTION,
    numerics: str = NUMERICS_OPTION,
    device: str = DEVICE_OPTION,
    compile: bool = COMPILE_OPTION,
    context: int = typer.Option(256, help="Tokens in the cache before the timed forwards."),
    widths: str = typer.Option("2,4,8,16,32", help="Comma-separated verify widths to time besides 1."),
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    repeats: int = typer.Option(15, help="Timed calls per width and round (the median is kept)."),
    sequences: str = typer.Option("1,2,4,8,16", help="Comma-separated numbers of sequences for the batched decode curve (empty: none)."),
    prefill: int = typer.Option(1000, help="Tokens of the prompt whose prefill rate is timed (0: none)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Time a 1-token step and verify forwards of several widths on this machine (can drafting pay here?), and
    where the target batches, the aggregate decode rate of many sequences and a prompt's prefill rate."""
    import torch

    from .bench.profile import batched_decode, format_batched, format_profile, prefill_rate, profile_target
    from .bench.report import kernel_info, machine_info

    try:
        check_numerics(numerics)
        try:
            chosen = sorted({int(w) for w in _names(widths)})
        except ValueError:
            _fail(f"--widths must be comma-separated integers, got {widths!r}")
            return
        if not chosen or min(chosen) < 1 or max(chosen) > 64:
            _fail(f"--widths must lie in 1..64, got {widths!r}")
        if context < 1 or repeats < 1:
            _fail("--context and --repeats must be >= 1")
        try:
            counts = sorted({int(n) for n in _names(sequences)})
        except ValueError:
            _fail(f"--sequences must be comma-separated integers, got {sequences!r}")
            return
        if counts and not 1 <= min(counts) <= max(counts) <= 64:
            _fail(f"--sequences must lie in 1..64, got {sequences!r}")
        if prefill < 0:
            _fail(f"--prefill must be >= 0, got {prefill}")
        _check_device(device, compile)
        target = _load(model, dtype, fast, block_kernel, numerics, device, compile)
        if context + max(chosen) > target.max_length:
            _fail(f"--context {context} + width {max(chosen)} exceeds the model's context of {target.max_length}")
        from .errors import ConfigError, ModelLoadError
        from .core.methods import prepared_exit_head

        head = None
        try:  # on either path: the PyTorch path's draft step runs through the model's own modules
            head = prepared_exit_head(target, exit_head)
        except (ModelLoadError, ConfigError) as error:
            if exit_head is not None:
                raise
            err.print(f"no EESD draft step timed: {error}", highlight=False)
        if prefill > target.max_length:
            _fail(f"--prefill {prefill} exceeds the model's context of {target.max_length}")
        result = profile_target(target, context, chosen, head, repeats)
        if target.pages_kv:
            result["batched"] = batched_decode(target, counts, context) if counts else None
            result["prefill"] = prefill_rate(target, prefill) if prefill else None
    except VerispecError as error:
        _fail(str(error))
        return
    result.update(model=target.name, dtype=str(target.dtype).replace("torch.", ""), kernel=kernel_info(),
                  threads=torch.get_num_threads(), machine=machine_info())
    if as_json:
        print(json.dumps(result))
        return
    out.print(f"{target.name} on {result['machine']['cpu']} ({result['threads']} threads, kernel: {result['kernel']})",
              highlight=False)
    out.print(format_profile(result), highlight=False)
    if result.get("batched") or result.get("prefill"):
        out.print(format_batched(result["batched"], result["prefill"]), highlight=False)


@app.command("train-exit")
def train_exit(
    model: Optional[str] = MODEL_OPTION,
    exit_layer: int = typer.Option(4, "--exit-layer", help="N: the head reads the residual stream after the target's first N layers."),
    draft_vocab: int = typer.Option(32768, "--draft-vocab", help="V_d: the head predicts over the V_d most frequent corpus tokens."),
    init_layer: Optional[int] = typer.Option(None, "--init-layer", help="Target layer the head's layer starts from (default: layer N, the first one the draft skips)."),
    corpus: Optional[str] = typer.Option(None, help="Training text: JSONL with a 'text' field, or plain text (default: the shipped corpus the default model generated)."),
    generate_corpus: bool = typer.Option(False, "--generate-corpus", help="First let the target continue the shipped training prompts, and train on that."),
    corpus_tokens: int = typer.Option(256, "--corpus-tokens", help="With --generate-corpus: tokens generated per prompt (an article: twice that, its summary and answer: half)."),
    corpus_samples: int = typer.Option(1, "--corpus-samples", help="With --generate-corpus: continuations sampled per prompt."),
    steps: int = typer.Option(1500, help="Optimiser steps."),
    batch: int = typer.Option(4, help="Sequences per step."),
    sequence_length: int = typer.Option(256, "--sequence-length", help="Tokens per training sequence."),
    learning_rate: float = typer.Option(3e-4, "--learning-rate", help="Peak learning rate (AdamW, warm-up then cosine)."),
    max_minutes: float = typer.Option(40.0, "--max-minutes", help="Stop training (and save) after this much wall time."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", help="Steps between checkpoints."),
    out_dir: Optional[str] = typer.Option(None, "--out", help="Directory for the head, checkpoints and labels (default: the cache, where eesd finds it for this model with no --exit-head)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --out."),
    seed: int = typer.Option(0, help="Seed for the data split, batches and corpus generation."),
    device: str = DEVICE_OPTION,
) -> None:
    """Train an EESD exit head by self-distillation (the target stays frozen)."""
    from pathlib import Path

    from tqdm import tqdm

    from .train.corpus import CORPUS_PATH, PROMPTS_PATH, check_generation, generate_corpus as make_corpus, read_prompts
    from .train.exit_head import TrainConfig, check_fits, train_exit_head
    from .request.text import decode_utf8

    try:
        config = TrainConfig(exit_layer=exit_layer, init_layer=init_layer, draft_vocab=draft_vocab, sequence_length=sequence_length,
                             batch=batch, steps=steps, learning_rate=learning_rate, max_minutes=max_minutes,
                             checkpoint_every=checkpoint_every, seed=seed)
        corpus_path = Path(corpus) if corpus else CORPUS_PATH
        if corpus and generate_corpus:
            _fail("--corpus and --generate-corpus each choose the training text; give only one")
        if corpus and not corpus_path.is_file():
            _fail(f"corpus file not found: {corpus}")
        if corpus:
            try:
                decode_utf8(corpus_path.read_bytes(), f"corpus file {corpus}")
            except OSError as error:
                _fail(f"cannot read corpus file {corpus}: {error.strerror or error}")
        if generate_corpus:
            check_generation(corpus_tokens, corpus_samples)
        _check_device(device)
        target = _load(model, "float32", device=device)
        check_fits(target, config)
        if out_dir is None:
            from .core.methods import trained_head_dir

            directory = trained_head_dir(target)
        else:
            directory = Path(out_dir)
        if generate_corpus:
            prompts = read_prompts(PROMPTS_PATH)
            corpus_path = directory / "corpus.jsonl"
            with tqdm(total=len(prompts) * corpus_samples, desc="corpus", unit="sample") as bar:
                make_corpus(target, prompts, corpus_tokens, corpus_path, samples=corpus_samples, seed=seed,
                            progress=bar.update)

        def progress(total, desc, initial=0):
            return tqdm(total=total, desc=desc, initial=initial, unit="step" if desc == "train" else "seq")

        summary = train_exit_head(target, corpus_path, directory, config, resume=resume,
                                  progress_factory=progress, log=lambda m: err.print(m, highlight=False))
    except VerispecError as error:
        _fail(str(error))
        return
    after = summary["held_out_after"]
    out.print(f"exit head written to {directory} ({summary['steps']} steps, {summary['train_minutes']} min); "
              f"held-out greedy acceptance {after['greedy_acceptance']:.1%}, sampled acceptance "
              f"{after['sampled_acceptance']:.1%}, KL {after['kl_draft_vocab']:.3f} "
              f"(before training: {summary['held_out_before']['greedy_acceptance']:.1%})")
    if out_dir is None:
        out.print("eesd uses it for this model from now on (no --exit-head needed)")
    else:
        out.print(f"use it with: verispec generate ... --method eesd --exit-head {directory}")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
