"""vLLM side by side: no speculation, vLLM's own drafters and verispec's ANPD proposer, in vLLM.

Runs in vLLM's environment (`make vllm` builds it at .venv-vllm, verispec installed there without
its dependencies). Each method runs in a process of its own (a fresh `vllm.LLM`, offline,
float32, `enforce_eager`), on the same Spec-Bench prompts (every `len/N`-th question of the file,
first turn, verispec's prompt format), greedy: first one request at a time (one stream), then all
at once. Each (method, phase) runs in a fresh process, so that no method drafts a prompt from
its memory of answering it in an earlier phase; `--rounds` repeats all of them, interleaved, and
the fastest run of each counts (the load of a shared machine varies). Reports tokens per second, the ratios to no speculation and to vLLM's `ngram`, vLLM's
speculation counters (tokens committed per draft), and how many greedy outputs equal the ones
without speculation. Writes `results.json` and `report.md` to --out.

    .venv-vllm/bin/python scripts/vllm_bench.py --out runs/vllm-bench          # the benchmark
    .venv-vllm/bin/python scripts/vllm_bench.py --check                        # short end-to-end check

--check runs no speculation and the ANPD proposer on 4 prompts (48 tokens, one stream and all at
once) and exits 1 unless every greedy output equals the one without speculation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

METHODS = {
    "none": None,
    # vLLM turns asynchronous scheduling off for speculative methods that draft on the host
    # (ngram, suffix, custom_class): no speculation under the same scheduling
    "none-sync": {"_llm": {"async_scheduling": False}},
    "ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
    "anpd": {"method": "custom_class", "model": "verispec.integrations.vllm.AnpdProposer"},
    # the proposer drafts at most this many, and fewer where its cost model says so
    "anpd-k16": {"method": "custom_class", "model": "verispec.integrations.vllm.AnpdProposer",
                 "num_speculative_tokens": 16},
}
PHASES = ("one_stream", "at_once")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_model(out: Path) -> str:
    """The transformers directory verispec converted the embedded model to (its cache), as links
    to its transformers files only: vLLM would also try to load verispec's own block forms
    (blocks.safetensors) as weights."""
    from verispec.paths import cache_root

    found = sorted((cache_root() / "converted").glob("gemma-3-270m*/config.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        sys.exit("error: no converted default model under verispec's cache: run any verispec command once "
                 "(e.g. `make demo`), or pass --model DIR")
    source, view = found[-1].parent, out / "model"
    view.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (source / name).exists() and not (view / name).exists():
            (view / name).symlink_to(source / name)
    return str(view)


def prompts(model: str, count: int) -> list[dict]:
    """`count` Spec-Bench questions spread over the file (every len/count-th), as prompt ids."""
    from transformers import AutoTokenizer

    from verispec.bench.datasets import encode_question, load_dataset

    _, questions = load_dataset("spec-bench")
    if not 1 <= count <= len(questions):
        sys.exit(f"error: --prompts must be from 1 to {len(questions)}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    stride = len(questions) // count
    chosen = [questions[i * stride] for i in range(count)]
    return [{"id": q.question_id, "category": q.category, "ids": encode_question(tokenizer, q)} for q in chosen]


def counters(llm) -> dict[str, float]:
    values = {name: 0.0 for name in SPEC_COUNTERS}
    for metric in llm.get_metrics():
        if metric.name in values:
            values[metric.name] = float(getattr(metric, "value", 0.0))
    return values


def merge(into: dict, run: dict, phase: str) -> None:
    """Keep a method's fastest run of a phase (its outputs and counters), and every run's seconds;
    an error stays unless a run of the phase succeeded."""
    if "error" in run:
        if phase not in into:
            into["error"] = run["error"]
        return
    into.pop("error", None)
    new = run[phase]
    seconds = [*into.get(phase, {}).get("all_seconds", []), new["seconds"]]
    if phase not in into or new["seconds"] < into[phase]["seconds"]:
        into[phase] = new
    into[phase]["all_seconds"] = seconds
    into["speculative_config"] = run["speculative_config"]


def run_one(args) -> None:
    """One method in this process: writes its outputs, timings and counters to args.one_out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = dict(METHODS[args.one] or {})
    options = spec.pop("_llm", {})
    spec = {"num_speculative_tokens": args.k, **spec} if spec else None  # a method's own k wins
    result: dict = {"method": args.one, "speculative_config": spec}
    try:
        llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=args.max_model_len,
                  gpu_memory_utilization=args.memory_share, seed=0, max_num_seqs=max(16, args.prompts),
                  speculative_config=spec, disable_log_stats=False, **options)
    except Exception as error:  # a method this build cannot run (e.g. suffix without arctic-inference)
        result["error"] = f"{type(error).__name__}: {error}"
        Path(args.one_out).write_text(json.dumps(result))
        return
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    items = json.loads(Path(args.prompts_file).read_text())
    requests = [TokensPrompt(prompt_token_ids=item["ids"]) for item in items]
    warm_up = TokensPrompt(prompt_token_ids=[2] + list(range(1000, 1015)))  # text of no prompt
    llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = counters(llm)
    started = time.perf_counter()
    if args.phase == "one_stream":
        outputs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
    else:
        outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    after = counters(llm)
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    result[args.phase] = {"seconds": seconds, "tokens": sum(map(len, ids)), "outputs": ids,
                          "counters": {name: after[name] - before[name] for name in SPEC_COUNTERS}}
    Path(args.one_out).write_text(json.dumps(result))


def cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    sets = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(sets)}"


def summarise(results: dict, methods: list[str], prompts_count: int) -> str:
    base = results.get("none", {})
    ngram = results.get("ngram", {})
    lines = [f"vLLM {results['_vllm']} CPU build, {results['_cpu']}; {prompts_count} Spec-Bench prompts, greedy, "
             f"{results['_max_tokens']} tokens, num_speculative_tokens {results['_k']} unless the name says otherwise; "
             f"each rate the fastest of its runs (runs: one stream / at once)", "",
             "| method | one stream tok/s | x none | x ngram | at once tok/s | x none | x ngram | tokens per draft "
             "(one stream) | outputs equal to none (one stream / at once) | runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for method in methods:
        r = results.get(method, {})
        if "error" in r or any(phase not in r for phase in PHASES):
            lines.append(f"| {method} | did not run: {r.get('error', 'a phase is missing')[:160]} | | | | | | | | |")
            continue
        cells = [method]
        for phase in ("one_stream", "at_once"):
            rate = r[phase]["tokens"] / r[phase]["seconds"]
            cells.append(f"{rate:.1f}")
            for other in (base, ngram):
                if phase in other:
                    cells.append(f"{rate / (other[phase]['tokens'] / other[phase]['seconds']):.2f}")
                else:
                    cells.append("-")
        c = r["one_stream"]["counters"]
        drafts = c["vllm:spec_decode_num_drafts"]
        cells.append(f"{1 + c['vllm:spec_decode_num_accepted_tokens'] / drafts:.2f} "
                     f"({c['vllm:spec_decode_num_draft_tokens'] / drafts:.1f} drafted)" if drafts else "-")
        if method == "none" or any(phase not in base for phase in PHASES):
            cells.append("-")
        else:
            equal = [sum(a == b for a, b in zip(r[p]["outputs"], base[p]["outputs"])) for p in ("one_stream", "at_once")]
            cells.append(f"{equal[0]}/{prompts_count} / {equal[1]}/{prompts_count}")
        cells.append(" / ".join(str(len(r[p].get("all_seconds", [0]))) for p in ("one_stream", "at_once")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a transformers directory (default: verispec's converted default model)")
    parser.add_argument("--methods", default="none,none-sync,ngram,suffix,anpd,anpd-k16")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every method and phase, interleaved; each one's fastest counts")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="comma-separated: one_stream, at_once (default: both)")
    parser.add_argument("--add", action="store_true",
                        help="keep the runs already in --out (same settings) and add rounds after them")
    parser.add_argument("--memory-share", type=float, default=0.3,
                        help="gpu_memory_utilization: on vLLM's CPU build, the share of RAM it reserves")
    parser.add_argument("--out", default="runs/vllm-bench")
    parser.add_argument("--check", action="store_true", help="the short end-to-end check (exit 1 on any difference)")
    parser.add_argument("--one", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--one-out", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not set(args.phases.split(",")) <= set(PHASES):
        parser.error(f"--phases takes one_stream and/or at_once, comma-separated; got {args.phases!r}")
    if args.one:
        return run_one(args)
    if args.check:
        args.methods, args.prompts, args.max_tokens, args.rounds = "none,anpd", 4, 48, 1
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        sys.exit(f"error: unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = args.model or default_model(out)
    prompts_file = out / "prompts.json"
    prompts_file.write_text(json.dumps(prompts(args.model, args.prompts)))
    import vllm

    results: dict = {"_vllm": vllm.__version__, "_cpu": cpu_model(), "_max_tokens": args.max_tokens, "_k": args.k,
                     "_model": args.model}
    first = 0
    if args.add:  # the runs already there count too
        for done in sorted(out.glob("*-*-*.json")):
            method, phase, round_ = done.stem.rsplit("-", 2)
            if method in methods and phase in PHASES and round_.isdigit():
                merge(results.setdefault(method, {}), json.loads(done.read_text()), phase)
                first = max(first, int(round_) + 1)
    phases = [p for p in PHASES if p in args.phases.split(",")]
    for round_ in range(first, first + args.rounds):
        for phase in phases:
            for method in methods:
                name = f"{method}-{phase}-{round_}"
                one_out = out / f"{name}.json"
                command = [sys.executable, __file__, "--one", method, "--one-out", str(one_out), "--model", args.model,
                           "--prompts-file", str(prompts_file), "--prompts", str(args.prompts), "--max-tokens",
                           str(args.max_tokens), "--max-model-len", str(args.max_model_len), "--k", str(args.k),
                           "--memory-share", str(args.memory_share), "--phase", phase]
                print(f"[vllm-bench] {name} ...", file=sys.stderr, flush=True)
                started = time.perf_counter()
                with (out / f"{name}.log").open("w") as log:
                    finished = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
                if finished.returncode != 0 or not one_out.exists():
                    run = {"error": f"exit {finished.returncode}, see {out / f'{name}.log'}"}
                else:
                    run = json.loads(one_out.read_text())
                print(f"[vllm-bench] {name} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
                merge(results.setdefault(method, {}), run, phase)
    (out / "results.json").write_text(json.dumps(results))
    report = summarise(results, methods, args.prompts)
    (out / "report.md").write_text(report)
    print(report)
    if args.check:
        base, anpd = results.get("none", {}), results.get("anpd", {})
        ok = "error" not in base and "error" not in anpd and all(
            base[p]["outputs"] == anpd[p]["outputs"] for p in ("one_stream", "at_once"))
        print("check:", "greedy outputs equal" if ok else "FAILED", file=sys.stderr)
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
