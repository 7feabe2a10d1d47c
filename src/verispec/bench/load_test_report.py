"""The report of `verispec bench-serve`: records -> summary, `summary.json`, `report.md`, plots.

Owns the serving metrics and their presentation. Per server and workload level: aggregate
tokens/s (completion tokens of the answered and cancelled requests over the level's wall time)
and its ratio to concurrency 1 and to the first server at the same level; time to first token
(TTFT); time per output token after the first (TPOT, per request: (end-to-end - TTFT) / (tokens
- 1)); inter-token latency per streamed chunk (ITL, the gaps between chunks with text, pooled);
end-to-end latency; tokens per chunk; outputs identical to their solo output; the CPU share of
the client (this process) and of the server. Chat: TTFT per turn; prefix: cold over warm TTFT;
soak: requests lost (errors and streams cut short that the client did not cancel), mixed
(closer to another prompt's solo output than to their own), resident memory against its warm
level. Plots (matplotlib, Agg): aggregate tokens/s against concurrency, and latency (TPOT, end
to end) against aggregate tokens/s. Every number comes from the records and phase entries
`serve` writes; the machine's description is `report.machine_info`'s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from .report import json_safe

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
THROUGHPUT_PLOT = "throughput_vs_concurrency.png"
LATENCY_PLOT = "latency_vs_throughput.png"
MEMORY_TOLERANCE = 0.10  # the soak passes when the server's memory at the end is within 10% of its warm level


def _stats(values: Sequence[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    array = np.asarray(values, dtype=float)
    return {"n": len(values), "mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def _ratio(a, b):
    return a / b if a is not None and b else None


def level_stats(records: Sequence[dict], phase: dict | None) -> dict:
    """The metrics of one workload level (see the module docstring)."""
    answered = [r for r in records if r["status"] == "ok"]
    delivered = [r for r in records if r["status"] in ("ok", "cancelled")]
    tokens = sum(r["completion_tokens"] or 0 for r in delivered)
    wall = phase["wall_s"] if phase else None
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in answered
            if r["ttft_s"] is not None and (r["completion_tokens"] or 0) > 1]
    itl = [b - a for r in answered for a, b in zip(r["chunk_offsets_s"], r["chunk_offsets_s"][1:])]
    compared = [r for r in records if r["solo_identical"] is not None]
    chunks = sum(r["chunks"] for r in answered)
    return {
        "requests": len(records),
        "answered": len(answered),
        "cancelled": sum(r["status"] == "cancelled" for r in records),
        "errors": sum(r["status"] == "error" for r in records),
        "incomplete": sum(r["status"] == "incomplete" for r in records),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": _ratio(tokens, wall),
        "requests_per_s": _ratio(len(answered), wall),
        "ttft_s": _stats([r["ttft_s"] for r in answered]),
        "tpot_s": _stats(tpot),
        "itl_s": _stats(itl),
        "e2e_s": _stats([r["e2e_s"] for r in answered]),
        "tokens_per_chunk": _ratio(sum(r["completion_tokens"] or 0 for r in answered), chunks),
        "identical": sum(bool(r["solo_identical"]) for r in compared),
        "compared": len(compared),
        "mixed": sum(bool(r["mixed"]) for r in records),
        "prompt_tokens_mean": _stats([r["prompt_tokens"] for r in answered])["mean"],
        "client_cpu_share": _ratio(phase["client_cpu_s"], wall) if phase else None,
        "server_cpu_share": _ratio(phase.get("server_cpu_s"), wall) if phase else None,
    }


def summarize(records: Sequence[dict], phases: Sequence[dict], servers: dict) -> dict:
    """summary.json: per server and workload level, the metrics of `level_stats`, plus chat turns,
    the prefix test and the soak."""
    labels = list(servers)
    by_level: dict[tuple, list[dict]] = {}
    for record in records:
        by_level.setdefault((record["server"], record["phase"], record["level"]), []).append(record)
    phase_of = {(p["server"], p["phase"], p["level"]): p for p in phases}
    summary = {"servers": servers, "closed": [], "open": [], "chat": [], "prefix": [], "soak": []}
    for label in labels:
        closed = sorted((level for (s, ph, level) in by_level if s == label and ph == "closed"))
        base = None
        for level in closed:
            row = {"server": label, "concurrency": level,
                   **level_stats(by_level[(label, "closed", level)], phase_of.get((label, "closed", level)))}
            if level == 1:
                base = row["tokens_per_s"]
            row["vs_concurrency_1"] = _ratio(row["tokens_per_s"], base)
            summary["closed"].append(row)
        for level in sorted(level for (s, ph, level) in by_level if s == label and ph == "open"):
            summary["open"].append({"server": label, "rate": level,
                                    **level_stats(by_level[(label, "open", level)], phase_of.get((label, "open", level)))})
        chat = [r for (s, ph, _), rs in by_level.items() if s == label and ph == "chat" for r in rs]
        for turn in sorted({r["turn"] for r in chat}):
            turns = [r for r in chat if r["turn"] == turn and r["status"] == "ok"]
            summary["chat"].append({"server": label, "turn": turn, "answered": len(turns),
                                    "requests": sum(r["turn"] == turn for r in chat),
                                    "prompt_tokens_mean": _stats([r["prompt_tokens"] for r in turns])["mean"],
                                    "ttft_s": _stats([r["ttft_s"] for r in turns])})
        prefix = [r for (s, ph, _), rs in by_level.items() if s == label and ph == "prefix" for r in rs]
        if prefix:
            cold = [r for r in prefix if r["variant"] == "cold" and r["status"] == "ok"]
            warm = [r for r in prefix if r["variant"] == "warm" and r["status"] == "ok"]
            cold_ttft, warm_ttft = _stats([r["ttft_s"] for r in cold]), _stats([r["ttft_s"] for r in warm])
            summary["prefix"].append({"server": label, "repeats": len(warm),
                                      "prompt_tokens_mean": _stats([r["prompt_tokens"] for r in warm])["mean"],
                                      "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft,
                                      "cold_over_warm": _ratio(cold_ttft["p50"], warm_ttft["p50"])})
        for (s, ph, level), rs in by_level.items():
            if s == label and ph == "soak":
                summary["soak"].append(_soak_row(label, level, rs, phase_of.get((s, ph, level)),
                                                 by_level.get((label, "after-soak", 1), [])))
    _versus_first(summary["closed"], "concurrency", labels)
    _versus_first(summary["open"], "rate", labels)
    sources: dict[str, int] = {}
    for record in records:
        if record["tokens_source"]:
            sources[record["tokens_source"]] = sources.get(record["tokens_source"], 0) + 1
    summary["tokens_sources"] = sources
    wall, cpu = sum(p["wall_s"] for p in phases), sum(p["client_cpu_s"] for p in phases)
    summary["client"] = {"cpu_s": cpu, "wall_s": wall, "cpu_share": _ratio(cpu, wall)}
    return summary


def _versus_first(rows: list[dict], key: str, labels: Sequence[str]) -> None:
    """Each row's tokens/s over that of the first server (in run order) at the same level."""
    first: dict = {}
    for label in labels:
        for row in rows:
            if row["server"] == label:
                first.setdefault(row[key], row["tokens_per_s"])
    for row in rows:
        row["vs_first_server"] = _ratio(row["tokens_per_s"], first.get(row[key]))


def _soak_row(label: str, level, records: list[dict], phase: dict | None, after: list[dict]) -> dict:
    stats = level_stats(records, phase)
    phase = phase or {}
    warm, end, peak = phase.get("rss_warm"), phase.get("rss_end"), phase.get("rss_peak")
    planned = sum(r["cancel_plan"] is not None for r in records)
    unplanned = sum(r["status"] == "cancelled" and r["cancel_plan"] is None for r in records)
    return {"server": label, "concurrency": level, **stats, "planned_cancellations": planned,
            "lost": stats["errors"] + stats["incomplete"] + unplanned,
            "rss_warm_mib": _mib(warm), "rss_peak_mib": _mib(peak), "rss_end_mib": _mib(end),
            "rss_end_vs_warm": _ratio(end, warm), "rss_peak_vs_warm": _ratio(peak, warm),
            "memory_within_tolerance": (end <= warm * (1 + MEMORY_TOLERANCE)) if warm and end else None,
            "after_soak_identical": after[0]["solo_identical"] if after else None}


def _mib(value):
    return round(value / 2**20, 1) if value else None


# -- markdown --------------------------------------------------------------------------------------


def _f(value, fmt: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _ms(stats: dict, key: str) -> str:
    return _f(stats.get(key) * 1000 if stats.get(key) is not None else None, "{:.0f}")


def _pct(value) -> str:
    return _f(value * 100 if value is not None else None, "{:.0f}%")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---" if i < 2 else "---:" for i in range(len(headers))]
    return ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |",
            *("| " + " | ".join(row) + " |" for row in rows)]


LEVEL_HEADERS = ["prompt tokens", "tok/s", "vs first server", "req/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "ITL p50/p99 ms",
                 "E2E p50/p99 ms", "tokens/chunk", "identical to solo", "errors", "client CPU", "server CPU"]


def _level_cells(row: dict) -> list[str]:
    return [_f(row["prompt_tokens_mean"], "{:.0f}"), _f(row["tokens_per_s"]), _f(row["vs_first_server"], "{:.2f}x"),
            _f(row["requests_per_s"], "{:.2f}"),
            f"{_ms(row['ttft_s'], 'p50')} / {_ms(row['ttft_s'], 'p99')}",
            f"{_ms(row['tpot_s'], 'p50')} / {_ms(row['tpot_s'], 'p99')}",
            f"{_ms(row['itl_s'], 'p50')} / {_ms(row['itl_s'], 'p99')}",
            f"{_ms(row['e2e_s'], 'p50')} / {_ms(row['e2e_s'], 'p99')}",
            _f(row["tokens_per_chunk"], "{:.2f}"), f"{row['identical']}/{row['compared']}",
            str(row["errors"] + row["incomplete"]), _pct(row["client_cpu_share"]), _pct(row["server_cpu_share"])]


def render_markdown(summary: dict, config: dict, plots: Sequence[Path] = ()) -> str:
    machine, settings = config.get("machine", {}), config.get("settings", {})
    lines = ["# Serving benchmark", "", "```sh", config.get("command", "verispec bench-serve"), "```", "",
             f"- CPU: {machine.get('cpu')}; {machine.get('cores')} logical cores; instruction sets: "
             f"{machine.get('instruction_sets')}; RAM: {machine.get('ram_gib')} GiB; {machine.get('os')}",
             f"- Prompts: {config.get('prompts')} from {config.get('dataset')} ({settings.get('endpoint')} endpoint), "
             f"greedy, max_tokens {settings.get('max_tokens')}; threads per server: {config.get('threads')}",
             f"- Token counts: " + (", ".join(f"{n} from {s}" for s, n in summary.get("tokens_sources", {}).items()) or "none"),
             f"- This client used {_pct(summary['client']['cpu_share'])} of one core over the run "
             f"({_f(summary['client']['cpu_s'])} CPU s in {_f(summary['client']['wall_s'])} s).", "", "## Servers", ""]
    for label, server in summary["servers"].items():
        what = f"`{server['command']}`" if server.get("command") else (server.get("url") or "")
        lines.append(f"- **{label}**: {what}" + (f"; model id `{server['model_id']}`" if server.get("model_id") else "")
                     + (f"; started in {server['start_s']} s" if server.get("start_s") is not None else "")
                     + (f"; **failed**: {server['error'].splitlines()[0]}" if server.get("error") else ""))
    if summary["closed"]:
        lines += ["", "## Closed loop", "",
                  "C clients, each sending its next request when its last one ended. Aggregate tok/s: "
                  "completion tokens over the level's wall time; \"vs C=1\": over the same server at "
                  "concurrency 1; \"vs first server\": over the first server at the same concurrency. "
                  "TTFT: time to first token; TPOT: time per output token after the first; ITL: the gap "
                  "between streamed chunks; E2E: end to end. Identical to solo: outputs equal to the same "
                  "prompt's output at concurrency 1.", ""]
        rows = [[r["server"], str(r["concurrency"]), str(r["requests"]), _f(r["vs_concurrency_1"], "{:.2f}x"),
                 *_level_cells(r)] for r in summary["closed"]]
        lines += _table(["server", "C", "requests", "vs C=1", *LEVEL_HEADERS], rows)
    if summary["open"]:
        lines += ["", "## Open loop", "", "Requests sent at a given rate, whatever the answers.", ""]
        rows = [[r["server"], _f(r["rate"], "{:g}/s"), str(r["requests"]), *_level_cells(r)] for r in summary["open"]]
        lines += _table(["server", "rate", "requests", *LEVEL_HEADERS], rows)
    if summary["chat"]:
        lines += ["", "## Multi-turn chat", "", "Each turn re-sends the conversation so far (the server's own "
                  "answers included) plus a new question.", ""]
        rows = [[r["server"], str(r["turn"]), f"{r['answered']}/{r['requests']}", _f(r["prompt_tokens_mean"], "{:.0f}"),
                 _ms(r["ttft_s"], "p50"), _ms(r["ttft_s"], "mean"), _ms(r["ttft_s"], "p99")] for r in summary["chat"]]
        lines += _table(["server", "turn", "answered", "prompt tokens", "TTFT p50 ms", "TTFT mean ms", "TTFT p99 ms"], rows)
    if summary["prefix"]:
        lines += ["", "## Cached prefix", "", "A long prompt sent once (cold: it begins with text no server has "
                  "seen), then again with a different last line (warm).", ""]
        rows = [[r["server"], str(r["repeats"]), _f(r["prompt_tokens_mean"], "{:.0f}"), _ms(r["cold_ttft_s"], "p50"),
                 _ms(r["warm_ttft_s"], "p50"), _f(r["cold_over_warm"], "{:.1f}x")] for r in summary["prefix"]]
        lines += _table(["server", "repeats", "prompt tokens", "cold TTFT p50 ms", "warm TTFT p50 ms", "cold / warm"], rows)
    if summary["soak"]:
        lines += ["", "## Soak with cancellations", "", "Lost: errors, and streams cut short that the client did not "
                  "cancel; mixed: outputs closer to another prompt's solo output than to their own; memory: resident "
                  f"memory of the server's processes, at the end against its level before the soak (within "
                  f"{MEMORY_TOLERANCE:.0%}: yes/no).", ""]
        rows = [[r["server"], str(r["concurrency"]), str(r["requests"]), str(r["answered"]),
                 f"{r['cancelled']} ({r['planned_cancellations']} planned)", str(r["lost"]), str(r["mixed"]),
                 f"{r['identical']}/{r['compared']}", _f(r["tokens_per_s"]),
                 f"{_f(r['rss_warm_mib'], '{:.0f}')} / {_f(r['rss_peak_mib'], '{:.0f}')} / {_f(r['rss_end_mib'], '{:.0f}')}",
                 "-" if r["memory_within_tolerance"] is None else ("yes" if r["memory_within_tolerance"] else "no"),
                 "-" if r["after_soak_identical"] is None else str(r["after_soak_identical"]).lower()]
                for r in summary["soak"]]
        lines += _table(["server", "C", "requests", "answered", "cancelled", "lost", "mixed", "identical to solo",
                         "tok/s", "memory warm/peak/end MiB", "end within", "next request identical"], rows)
    if plots:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


# -- plots -----------------------------------------------------------------------------------------


def write_plots(out_dir: Path, summary: dict) -> list[Path]:
    if not summary["closed"] and not summary["open"]:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    labels = list(dict.fromkeys(r["server"] for r in summary["closed"] + summary["open"]))
    if summary["closed"]:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for label in labels:
            rows = [r for r in summary["closed"] if r["server"] == label and r["tokens_per_s"] is not None]
            if rows:
                axes.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=label)
        axes.set_xscale("log", base=2)
        levels = sorted({r["concurrency"] for r in summary["closed"]})
        axes.set_xticks(levels, [str(level) for level in levels])
        axes.minorticks_off()
        _label(axes, "concurrent clients (closed loop)", "aggregate tokens/s", "Throughput against concurrency", 8)
        written.append(_save(plt, figure, out_dir / THROUGHPUT_PLOT))
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5))
    for panel, (key, title) in zip(panels, (("tpot_s", "time per output token"), ("e2e_s", "end-to-end latency"))):
        for index, label in enumerate(labels):
            color = f"C{index}"
            for phase, style in (("closed", "-"), ("open", ":")):
                rows = [r for r in summary[phase] if r["server"] == label and r["tokens_per_s"] is not None
                        and r[key]["p50"] is not None]
                if not rows:
                    continue
                x = [r["tokens_per_s"] for r in rows]
                panel.plot(x, [r[key]["p50"] * 1000 for r in rows], style, marker="o", color=color,
                           label=f"{label} {phase} p50")
                panel.plot(x, [r[key]["p99"] * 1000 for r in rows], style, marker="^", color=color, alpha=0.5,
                           label=f"{label} {phase} p99")
        _label(panel, "aggregate tokens/s", "ms", f"{title.capitalize()} against throughput", 6)
    written.append(_save(plt, figure, out_dir / LATENCY_PLOT))
    return written


def _label(axes, x: str, y: str, title: str, legend_size: int) -> None:
    axes.set_xlabel(x)
    axes.set_ylabel(y)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=legend_size)


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_report(out_dir: Path, summary: dict, config: dict) -> list[Path]:
    """summary.json, report.md and the plots in `out_dir`; -> the files written."""
    plots = write_plots(out_dir, summary)
    (out_dir / SUMMARY_FILE).write_text(json.dumps(json_safe({"config": config, **summary}), indent=2) + "\n")
    (out_dir / REPORT_FILE).write_text(render_markdown(summary, config, plots))
    return [out_dir / SUMMARY_FILE, out_dir / REPORT_FILE, *plots]


def compact(summary: dict) -> dict:
    """The headline numbers, for the CLI's last line: tok/s per server and concurrency, identical
    counts, prefix ratios, soak verdicts."""
    return {
        "closed": {f"{r['server']}@{r['concurrency']}": {"tokens_per_s": r["tokens_per_s"],
                                                          "identical": f"{r['identical']}/{r['compared']}"}
                   for r in summary["closed"]},
        "prefix_cold_over_warm": {r["server"]: r["cold_over_warm"] for r in summary["prefix"]},
        "soak": {r["server"]: {"lost": r["lost"], "mixed": r["mixed"], "memory_within_tolerance": r["memory_within_tolerance"]}
                 for r in summary["soak"]},
        "failed": [label for label, s in summary["servers"].items() if s.get("error")],
    }


def terminal_table(summary: dict):
    """The closed-loop rows as a rich table, for the terminal."""
    from rich.table import Table

    table = Table(title="closed loop")
    for column in ("server", "C", "tok/s", "vs C=1", "TTFT p50 ms", "TPOT p50 ms", "identical to solo"):
        table.add_column(column, justify="left" if column == "server" else "right")
    for row in summary["closed"]:
        table.add_row(row["server"], str(row["concurrency"]), _f(row["tokens_per_s"]), _f(row["vs_concurrency_1"], "{:.2f}x"),
                      _ms(row["ttft_s"], "p50"), _ms(row["tpot_s"], "p50"), f"{row['identical']}/{row['compared']}")
    return table
