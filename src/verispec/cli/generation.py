"""`verispec generate`: one prompt, one method, optionally side by side with `ar`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from ..errors import ConfigError, VerispecError
from .shell import app, fail, out, read_stdin
from .target_options import (CONTROLLER_OPTION, DRAFT_LENGTH_OPTION, EXIT_HEAD_OPTION, NGRAM_MEMORY_OPTION, TargetOptions,
                             given_settings, refuse_unread_flags, target_options)


@app.command()
@target_options()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text, or '-' to read it from stdin."),
    method: str = typer.Option("anpd", "--method", "-m", help="Decoding method (see `verispec info`), with settings as in `bench --methods` (e.g. anpd/tree=8, pld/constant:12)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", help="Most tokens to generate."),
    temperature: Optional[float] = typer.Option(None, help="0 = greedy; > 0 samples (default: 0; mtad: 1)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample from the k most likely tokens (0 = off; default: 0; mtad: 10)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass, in (0, 1] (default: 1; mtad: 0.9)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (default: random). ar, pld and anpd give ar's sample for a seed; eesd, sps and mtad give the same sample again only under a constant or heuristic --controller (eesd's default adapts to timings; see README)."),
    stop: List[str] = typer.Option([], "--stop", help="Stop string; repeat for several."),
    draft_length: Optional[int] = DRAFT_LENGTH_OPTION,
    controller: Optional[str] = CONTROLLER_OPTION,
    exit_head: Optional[str] = EXIT_HEAD_OPTION,
    ngram_memory: bool = NGRAM_MEMORY_OPTION,
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Auxiliary draft model for sps and mtad (same tokenizer; default: the EESD exit head)."),
    beams: Optional[int] = typer.Option(None, help="mtad only: beam width W (default: 4)."),
    tau: Optional[float] = typer.Option(None, help="mtad only: joint-likelihood threshold (default: 0.5)."),
    tree: Optional[int] = typer.Option(None, "--tree", help="anpd only: draft a tree of up to N tokens, branching where the n-gram tables offer several next tokens, verified in one forward (on the fast path, and on the PyTorch path for the families it can mask; elsewhere single paths, said once; default: 0, single-path drafts)."),
    span_min: Optional[int] = typer.Option(None, "--span-min", help="anpd only: copy what followed an earlier occurrence of the context's end preceded by at least N equal tokens (4..32; 0: off; default: 8)."),
    json_schema: Optional[Path] = typer.Option(None, "--json-schema", help="Constrain the output to JSON following the JSON schema in this file (every method decodes exactly as constrained ar)."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the output to match this regular expression."),
    grammar: Optional[Path] = typer.Option(None, "--grammar", help="Constrain the output to the Lark grammar in this file (llguidance's Lark dialect)."),
    perplexity: bool = typer.Option(False, "--perplexity", help="Also score the generated tokens' perplexity under the target (temperature 1, no top-k/top-p)."),
    prompt_format: str = typer.Option("raw", help="raw: the prompt as given; chat: chat template or plain Q/A template."),
    stream: bool = typer.Option(False, "--stream", help="Print text as it is generated."),
    compare: bool = typer.Option(False, "--compare", help="Also run `ar` on the same prompt; print both stats and the speedup."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the text and all stats."),
    target: TargetOptions = None,
) -> None:
    """Generate text with one method, optionally compared side by side with `ar`."""
    settings = given_settings(draft_length=draft_length, controller=controller, exit_head=exit_head,
                              ngram_memory=ngram_memory, draft_model=draft_model, beams=beams, tau=tau, tree=tree,
                              span_min=span_min)
    try:
        # Everything that needs no model is checked before the model is loaded.
        prompt, name, request_args = _checked_request(prompt, method, stop, settings, max_new_tokens, temperature,
                                                      top_k, top_p, seed, prompt_format)
        request_args["response_format"] = response_format(json_schema, regex, grammar)
        target.check()
        model = target.load()
        results = _run(model, prompt, name, method, request_args, compare, stream and not as_json)
        scores = {}
        if perplexity:
            from ..target.score import perplexity as score

            scores = {label: score(model, r.prompt_ids, r.token_ids) for label, r in results.items()}
    except VerispecError as error:
        fail(str(error))
        return
    summary = {"model": model.name, "dtype": str(model.dtype).replace("torch.", ""), "numerics": model.numerics,
               "device": str(model.device), "method": method}
    if as_json:
        print(json.dumps(_payload(summary, results, method, scores, compare)))
    else:
        _print_results(results, method, scores, compare, streamed=stream)


def response_format(json_schema: Path | None, regex: str | None, grammar: Path | None) -> dict | None:
    """The `response_format` of `--json-schema`, `--regex` or `--grammar` (at most one), checked
    without the model (a bad file, schema, regex or grammar is a ConfigError)."""
    from ..request.grammar import checked_grammar

    given = [flag for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if value is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of {', '.join(given)}, not several")
    if json_schema is not None:
        try:
            schema = json.loads(_read(json_schema))
        except json.JSONDecodeError as error:
            raise ConfigError(f"--json-schema {json_schema}: not JSON ({error})") from None
        chosen = {"type": "json_schema", "json_schema": {"name": json_schema.stem, "schema": schema}}
    elif regex is not None:
        chosen = {"type": "regex", "regex": regex}
    elif grammar is not None:
        chosen = {"type": "grammar", "grammar": _read(grammar)}
    else:
        return None
    checked_grammar(chosen)
    return chosen


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None


def _checked_request(prompt, method, stop, settings, max_new_tokens, temperature, top_k, top_p, seed, prompt_format):
    """(prompt text, method name, the keyword arguments of `make_request`), all checked."""
    from ..api import sampling_for
    from ..core.engine import DecodeConfig
    from ..core.methods import MethodOptions, with_settings
    from ..request.text import checked_text

    prompt = read_stdin() if prompt == "-" else checked_text(prompt, "the prompt")
    if not prompt.strip():
        fail("the prompt is empty")
    for text in stop:
        checked_text(text, "--stop")
    values = {"draft_length": None, "controller": None, "exit_head": None, "draft_model": None, "ngram_memory": True}
    name, options = with_settings(method, MethodOptions(**{**values, **settings}))
    sampling = sampling_for(name, temperature, top_k, top_p, seed)  # --compare's ar samples alike
    DecodeConfig(max_new_tokens, sampling)
    refuse_unread_flags([name], settings, options)
    return prompt, name, dict(max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, seed=seed, stop=tuple(stop), prompt_format=prompt_format,
                              options=options)


def _run(model, prompt: str, name: str, label: str, request_args: dict, compare: bool, echo: bool) -> dict:
    """{method label: GenerationResult}: `ar` first when compared, then the method."""
    from .. import api

    api.make_request(model, prompt, name, **request_args)  # validate everything before any run
    model.prefix_cache = False  # --compare's second run must prefill as the first did
    results = {}
    if compare and name != "ar":
        baseline = api.stream(model, prompt, "ar", **request_args)
        for _ in baseline:
            pass
        results["ar"] = baseline.result
    text_stream = api.stream(model, prompt, name, **request_args)
    for delta in text_stream:
        if echo:
            out.print(delta, end="", highlight=False, markup=False, soft_wrap=True)
    results[label] = text_stream.result
    return results


def _payload(summary: dict, results: dict, method: str, scores: dict, compare: bool) -> dict:
    """`--json`'s object: the run's settings, the method's result, ar's beside it when compared."""
    payload = {**summary, **results[method].to_dict()}
    if scores:
        payload["perplexity"] = scores[method]
    if "ar" in results and method != "ar":
        payload["baseline"] = {"method": "ar", **results["ar"].to_dict()}
        if scores:
            payload["baseline"]["perplexity"] = scores["ar"]
    if compare:
        payload.update(_comparison(results, method))
    return payload


def _print_results(results: dict, method: str, scores: dict, compare: bool, streamed: bool) -> None:
    if streamed:
        out.print()
    else:
        out.print(results[method].text, highlight=False, markup=False)
    out.print(_stats_table(results))
    if scores:
        out.print("perplexity under the target: " + ", ".join(f"{n} {v:.3f}" for n, v in scores.items()))
    if compare:
        comparison = _comparison(results, method)
        verdict = "identical" if comparison["identical"] else f"differ from token {comparison['first_difference']}"
        out.print(f"speedup of {method} over ar: [bold]{comparison['speedup']:.2f}x[/]; outputs {verdict}")


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


def _comparison(results: dict, method: str) -> dict:
    """speedup (tokens/s ratio) and identity of `method` against `ar`."""
    baseline, chosen = results.get("ar", results[method]), results[method]
    speedup = chosen.stats.tokens_per_s / baseline.stats.tokens_per_s if baseline.stats.tokens_per_s else 0.0
    first = _first_difference(baseline.token_ids, chosen.token_ids)
    return {"speedup": round(speedup, 4), "identical": first is None, "first_difference": first}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
