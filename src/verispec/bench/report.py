"""Presenting a benchmark: the terminal table, `summary.json`, `report.md` and the plots.

Owns formatting only: every number comes from `aggregate.summarize`. Missing values print as "-",
except energy, which prints "not measured" when no meter was available (never an estimate).
The pass@1 column (code tasks) appears only in tables whose prompts had tests.
Plots are drawn with matplotlib's Agg backend (no display needed): speedup per category for each
method (grouped bars), and the accepted-length histogram of each method that reports one.
Also owns the description of the machine (CPU model, cores, RAM, OS) and of the software versions
that `report.md` records.
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path
from typing import Sequence

from rich import box
from rich.table import Table

from .aggregate import has_pass_at_1

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
SPEEDUP_PLOT = "speedup_by_category.png"
HISTOGRAM_PLOT = "accepted_histogram.png"
NOT_MEASURED = "not measured"


# -- machine and versions ---------------------------------------------------------------------


def machine_info() -> dict:
    """CPU model, logical cores, noted instruction sets, RAM and OS of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except (OSError, ValueError, IndexError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "instruction_sets": instruction_sets(), "ram_gib": ram_gib,
            "os": platform.platform()}


# The CPU features that decide which kernel path runs and how fast (from /proc/cpuinfo's names).
NOTED_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def instruction_sets() -> str:
    """The noted CPU features this machine reports, e.g. 'avx2 fma avx512f avx512_vnni'."""
    from ..runtime.blockmm import cpu_flags

    return " ".join(f for f in NOTED_FEATURES if f in cpu_flags()) or "none of " + " ".join(NOTED_FEATURES)


def kernel_info() -> str:
    """Which instruction-set path the block kernel runs here, or why it does not run."""
    from ..runtime.blockmm import kernel

    found, why = kernel()
    return found.isa if found is not None else f"not used ({why})"


def versions() -> dict:
    import torch
    import transformers

    from .. import __version__

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "verispec": __version__,
        "torch_threads": torch.get_num_threads(),
    }


# -- formatting -------------------------------------------------------------------------------


def _num(value, fmt: str = "{:.2f}", missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return fmt.format(value)


COLUMNS: list[tuple[str, str, str, str]] = [
    # (header, summary key, format, text when missing)
    ("tokens/s", "tokens_per_s", "{:.2f}", "-"),
    ("speedup", "speedup", "{:.2f}x", "-"),
    ("mean speedup", "mean_speedup", "{:.2f}x", "-"),
    ("mean accepted", "mean_accepted_tokens", "{:.2f}", "-"),
    ("acceptance", "acceptance_rate", "{:.1%}", "-"),
    ("exact match", "exact_match", "{:.0%}", "-"),
    ("perplexity", "perplexity", "{:.3f}", "-"),
    ("CPU s/token", "cpu_s_per_token", "{:.4f}", "-"),
    ("energy (J)", "energy_j", "{:.1f}", NOT_MEASURED),
]


PASS_AT_1_COLUMN = ("pass@1", "pass_at_1", "{:.1%}", "-")  # after exact match, when there were tests


def _columns(group: dict) -> list[tuple[str, str, str, str]]:
    """COLUMNS, with pass@1 after exact match when the group's prompts had tests."""
    if not has_pass_at_1(group):
        return COLUMNS
    at = [c[1] for c in COLUMNS].index("exact_match") + 1
    return [*COLUMNS[:at], PASS_AT_1_COLUMN, *COLUMNS[at:]]


def _rows(group: dict) -> list[list[str]]:
    return [
        [name, str(s["prompts"]), str(s["new_tokens"]),
         *(_num(s.get(key), fmt, missing) for _, key, fmt, missing in _columns(group))]
        for name, s in group.items()
    ]


def _headers(group: dict) -> list[str]:
    return ["method", "prompts", "new tokens", *(c[0] for c in _columns(group))]


TERMINAL_COLUMNS: list[tuple[str, str, str]] = [
    # (short header, summary key, format): the headline numbers, narrow enough for 80 columns
    ("tok/s", "tokens_per_s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("mean acc", "mean_accepted_tokens", "{:.2f}"),
    ("accept", "acceptance_rate", "{:.0%}"),
    ("exact", "exact_match", "{:.0%}"),
    ("ppl", "perplexity", "{:.2f}"),
    ("CPU s/tok", "cpu_s_per_token", "{:.3f}"),
    ("energy J", "energy_j", "{:.1f}"),
]


def terminal_table(summary: dict) -> Table:
    """Overall per method, as a rich table."""
    baseline = summary["baseline"] or "none (no ar / hf-ar in the run)"
    measured = any(s["energy_j"] is not None for s in summary["overall"].values())
    caption = "mean acc = new tokens / target forwards; accept = accepted / drafted"
    if not measured:
        caption += f"; energy: {NOT_MEASURED}"
    table = Table(title=f"verispec bench, overall (speedup over {baseline})", caption=caption,
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    columns = TERMINAL_COLUMNS
    if has_pass_at_1(summary["overall"]):
        at = [c[1] for c in columns].index("exact_match") + 1
        columns = [*columns[:at], ("pass@1", "pass_at_1", "{:.0%}"), *columns[at:]]
    table.add_column("method", no_wrap=True)
    for header, _, _ in columns:
        table.add_column(header, justify="right")
    for name, s in summary["overall"].items():
        table.add_row(name, *(_num(s.get(key), fmt) for _, key, fmt in columns))
    return table


def markdown_table(group: dict) -> str:
    headers = _headers(group)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(group)]
    return "\n".join(lines)


def json_safe(value):
    """nan/inf -> null, tuples -> lists, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_summary(out_dir: Path, summary: dict) -> Path:
    path = out_dir / SUMMARY_FILE
    path.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    return path


# -- plots ------------------------------------------------------------------------------------


def write_plots(out_dir: Path, summary: dict) -> list[Path]:
    """The PNG plots that the summary supports (none without data)."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    speedup = _plot_speedups(out_dir, summary)
    if speedup:
        written.append(speedup)
    histogram = _plot_histograms(out_dir, summary)
    if histogram:
        written.append(histogram)
    return written


def _plot_speedups(out_dir: Path, summary: dict) -> Path | None:
    import matplotlib.pyplot as plt

    baseline = summary["baseline"]
    if baseline is None:
        return None
    groups = {**summary["categories"], "overall": summary["overall"]}
    methods = [m for m in summary["methods"] if m != baseline]
    if not methods:
        return None
    labels = list(groups)
    width = 0.8 / len(methods)
    figure, axes = plt.subplots(figsize=(min(16.0, max(6.0, 0.35 * len(labels) * len(methods) + 2.5)), 4.2))
    for i, method in enumerate(methods):
        values = [(groups[g].get(method) or {}).get("speedup") for g in labels]
        positions = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(labels))]
        bars = axes.bar(positions, [v if v is not None else 0.0 for v in values], width, label=method)
        for bar, value in zip(bars, values):
            if value is not None:
                axes.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                              ha="center", va="bottom", fontsize=7)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label=f"{baseline} (1.0)")
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axes.set_ylabel(f"speedup over {baseline} (ratio of tokens/s)")
    axes.set_title("speedup per category")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = out_dir / SPEEDUP_PLOT
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_histograms(out_dir: Path, summary: dict) -> Path | None:
    import matplotlib.pyplot as plt

    histograms = {m: s["accepted_histogram"] for m, s in summary["overall"].items() if s.get("accepted_histogram")}
    if not histograms:
        return None
    from matplotlib.ticker import MaxNLocator

    columns = min(3, len(histograms))
    rows = -(-len(histograms) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.8 * columns + 0.6, 3.2 * rows + 0.4), squeeze=False)
    for ax in axes.flat[len(histograms):]:
        ax.set_visible(False)
    for ax, (method, histogram) in zip(axes.flat, histograms.items()):
        steps = sum(histogram)
        shares = [count / steps if steps else 0.0 for count in histogram]
        ax.bar(range(len(histogram)), shares, color="tab:blue")
        ax.set_xlim(-0.6, max(len(histogram), 2) - 0.4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{method} ({steps} steps)")
        ax.set_xlabel("accepted draft tokens per step")
        ax.set_ylabel("share of verification steps")
    figure.suptitle("accepted-length histogram")
    figure.tight_layout()
    path = out_dir / HISTOGRAM_PLOT
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


# -- report.md --------------------------------------------------------------------------------


def perplexity_section(summary: dict) -> list[str]:
    """Markdown lines: each method's perplexity against the baseline, paired by prompt (sampled
    runs with a baseline and at least two scored prompts; greedy methods that match the baseline
    would only show zeros)."""
    baseline = summary["baseline"]
    rows = [(m, s) for m, s in summary["overall"].items()
            if m != baseline and s.get("log_perplexity_vs_baseline_se") is not None]
    if summary["greedy"] or not rows:
        return []
    lines = ["", f"## Perplexity against {baseline}, paired by prompt", "",
             f"Mean over prompts of ln ppl(method) - ln ppl({baseline}) on the same prompt, its standard "
             "error and a normal 95% interval; ratio = exp(mean), the ratio of per-prompt geometric means. "
             "Repeated 4-grams: the share of an output's 4-grams of tokens that already occurred earlier in "
             f"it, pooled over prompts ({baseline}: "
             f"{_num(summary['overall'][baseline].get('repeated_4grams'), '{:.1%}')}); text that repeats "
             "itself also scores a low perplexity.", "",
             "| method | mean ln-ppl difference | standard error | 95% interval | ratio | repeated 4-grams |",
             "|---|---:|---:|---:|---:|---:|"]
    for method, s in rows:
        mean, error = s["log_perplexity_vs_baseline"], s["log_perplexity_vs_baseline_se"]
        lines.append(f"| {method} | {mean:+.3f} | {error:.3f} | {mean - 1.96 * error:+.3f} .. "
                     f"{mean + 1.96 * error:+.3f} | {math.exp(mean):.3f} | "
                     f"{_num(s.get('repeated_4grams'), '{:.1%}')} |")
    return lines


def render_markdown(summary: dict, config: dict, energy_meter: str, plots: Sequence[Path] = ()) -> str:
    settings, info = config["settings"], config["info"]
    machine = info.get("machine") or machine_info()
    soft = info.get("versions") or versions()
    ram = "unknown" if machine.get("ram_gib") is None else f"{machine['ram_gib']} GiB"
    baseline = summary["baseline"]
    lines = [
        "# verispec bench report",
        "",
        f"- Date: {info.get('date', '')}",
        f"- Command: `{info.get('command', '')}`",
    ]
    for resumed in config.get("resumed") or []:
        lines.append(f"- Resumed {resumed.get('date', '')}: `{resumed.get('command', '')}`")
    lines += [
        "",
        "## Setup",
        "",
        f"- Model: {info.get('model_name') or settings.get('model')}",
        f"- dtype: {settings['dtype']} (requested: {info.get('dtype_requested', settings['dtype'])}); "
        f"numerics: {info.get('numerics_run', settings.get('numerics', '-'))}; "
        f"block kernel: {info.get('kernel', '-')}",
        f"- Device: {info.get('device', settings.get('device', 'cpu'))}"
        + ("; compiled decode step (--compile)" if settings.get("compile") else ""),
        f"- Dataset: `{settings['dataset']}`{' (' + info['dataset_path'] + ')' if info.get('dataset_path') and info['dataset_path'] != settings['dataset'] else ''} "
        f"(sha256 {settings['dataset_sha256'][:12]}); "
        f"categories: {', '.join(summary['categories']) or '-'}; "
        f"per category: {settings['per_category'] if settings['per_category'] is not None else 'all'}",
        f"- Methods: {', '.join(settings['methods']) or '-'}; peers: {', '.join(settings['peers']) or '-'}",
        f"- max new tokens: {settings['max_new_tokens']}; temperature: {settings['temperature']}; "
        f"top-p: {settings['top_p']}; seed: {settings['seed']}; repeats: {settings['repeats']}",
        f"- Draft length: {settings['draft_length'] or 'method default'}; controller: "
        f"{settings['controller'] or 'method default'}"
        + (f"; early-exit layer (hf-early-exit): {settings['early_exit_layer']}" if settings.get('early_exit_layer') else "")
        + (f"; draft model (hf-assisted): {settings['draft_model']}" if settings.get('draft_model') else ""),
        f"- Energy meter: {energy_meter}",
        "",
        "## Machine",
        "",
        f"- CPU: {machine.get('cpu')}; cores: {machine.get('cores')}; instruction sets: {machine.get('instruction_sets', 'not recorded')}; RAM: {ram}",
        f"- OS: {machine.get('os')}",
        f"- python {soft.get('python')}, torch {soft.get('torch')} ({soft.get('torch_threads')} threads), "
        f"transformers {soft.get('transformers')}, verispec {soft.get('verispec')}",
        "",
        "## How the numbers are computed",
        "",
        f"- Speedup: {summary['speedup_definition']}"
        + ("" if baseline else " This run has neither ar nor hf-ar, so no speedup is reported."),
        "- Each (prompt, method) ran back to back with the others in an order rotated per prompt, after one "
        "unrecorded warm-up generation per method; times are wall-clock seconds of the whole call "
        "(ours: the streaming API, detokenization included; peers: transformers `generate()`).",
        "- Mean accepted = new tokens / target forwards (prefill included). Acceptance = accepted / drafted "
        "(peers: not visible, shown as -). Peers' target forwards are counted with a forward hook.",
        "- Exact match: share of prompts whose token ids equal the baseline's"
        + (" (greedy run)." if summary["greedy"] else "; not computed for sampled runs."),
        "- Perplexity: of the generated tokens under the target model (temperature 1, no top-k/top-p), "
        "token-weighted over prompts.",
        *(["- pass@1: the share of prompts whose answer passed the task's tests: the code of its first "
           "```python block (else of its first ``` block without a language, else the whole answer) run "
           "with the tests in a separate, time- and memory-limited Python process; with repeats, each "
           "prompt counts the share of its repeats that passed. Each record's `check` gives the reason "
           "for a failure."]
          if has_pass_at_1(summary["overall"]) else []),
        f"- Energy: {'joules from ' + energy_meter if energy_meter != NOT_MEASURED else NOT_MEASURED + ' (no RAPL or NVML meter readable on this machine)'}.",
        "",
        "## Overall",
        "",
        markdown_table(summary["overall"]),
        "",
        "## Per category",
        "",
    ]
    for category, group in summary["categories"].items():
        lines += [f"### {category}", "", markdown_table(group), ""]
    lines += ["## Accepted-length histograms", "", "Steps that accepted 0, 1, 2, ... draft tokens (overall).", ""]
    any_histogram = False
    for method, s in summary["overall"].items():
        if s.get("accepted_histogram"):
            any_histogram = True
            lines.append(f"- {method}: {' '.join(map(str, s['accepted_histogram']))}")
    if not any_histogram:
        lines.append("- none reported")
    lines += perplexity_section(summary)
    differing = [(m, s) for m, s in summary["overall"].items() if s.get("first_difference_min") is not None]
    if differing:
        lines += ["", "## Outputs that differ from the baseline", ""]
        for method, s in differing:
            lines.append(f"- {method}: exact match {s['exact_match']:.0%}; first difference at token "
                         f"{s['first_difference_min']} at the earliest, {s['first_difference_mean']:.1f} on average")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, summary: dict, config: dict, energy_meter: str) -> list[Path]:
    """summary.json, the plots and report.md; returns the files written."""
    written = [write_summary(out_dir, summary)]
    plots = write_plots(out_dir, summary)
    written += plots
    path = out_dir / REPORT_FILE
    path.write_text(render_markdown(summary, config, energy_meter, plots))
    written.append(path)
    return written
