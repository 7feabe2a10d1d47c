"""`verispec profile`: what a target forward costs on this machine, by width.

Owns the timing of a loaded target's forwards: a 1-token step and verify forwards of several
widths after a context, as milliseconds and as ratios to the 1-token step, plus one draft step
of an EESD exit head where one is given. These ratios decide whether drafting can pay here (a
draft of k tokens must commit more than the cost ratio of a (k + 1)-token forward), and they are
what the controllers' cost models learn online (`control.CostModel`). A verify costs less when
its first draft token is rejected, where only the rows the rule reads are computed
(`lazy_logits`): the "rejected" figures. On the block kernel it also times the kernel's arithmetic
alone (`arithmetic_rate`): about what each extra verify row costs in arithmetic, whatever the
memory.

Each figure is the median of `repeats` timed calls after 3 warm-ups, the widths measured in
interleaved rounds so that a slow period of the machine shows in every width alike.

On a target that batches (`Target.pages_kv`) it also times the batched decode curve
(`batched_decode`: `ar`'s aggregate tokens per second with 1, 2, 4, 8 and 16 sequences decoding
together, each after its own context), the KV memory a position takes, and a prompt's prefill
rate (`prefill_rate`: a 1,000-token prompt through the same kernels as decode); on a GGUF
file's own blocks the integer roof (`integer_roof`: the multiply-adds per second a wide product of
the GGUF-block kernel reaches here) and the share of it the prefill reaches (`roof_fraction`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32)
DEFAULT_CONTEXT = 256


def _seconds(fn: Callable[[], object]) -> float:
    """Seconds of one call of `fn()`."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median_time(fn: Callable[[], object], repeats: int = 15) -> float:
    """Median seconds of `fn()` over `repeats` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return statistics.median(_seconds(fn) for _ in range(repeats))


def timing_context(length: int = DEFAULT_CONTEXT, vocab_size: int = 20000) -> list[int]:
    """A fixed pseudo-random context of `length` ids (what is attended to, not what it says)."""
    low = min(1000, vocab_size // 4)
    return torch.randint(low, max(low + 1, vocab_size), (length,), generator=torch.Generator().manual_seed(0)).tolist()


def target_step_seconds(target, context: list[int], width: int = 1, repeats: int = 15,
                        rejected: bool = False) -> float:
    """Median seconds of a target forward of `width` tokens after `context` (left in the cache).
    rejected=True: a verify whose first draft token is rejected, as the engine runs it (the
    logits asked for lazily and row 0 read: where that is exact, only the first chunk of rows is
    computed, `lazy_logits`)."""
    target.reset()
    target.forward(context, last_only=True)

    def step():
        logits = target.forward(context[:width], lazy=rejected)
        logits[0]  # noqa: B018 - reading row 0 computes it
        target.crop(len(context))

    return median_time(step, repeats)


def draft_step_seconds(target, prepared, context: list[int], repeats: int = 15, width: int = 1) -> float:
    """Median seconds of one EESD draft step (layers 1..N of the target, the head's layer, norm
    and the draft-vocabulary projection) after `context`; `prepared`: a `PreparedHead`. width 1:
    one draft token; width W: one step of MTAD's W beams (W rows at the same position, each
    seeing the context and itself, placed as `BeamDrafter` places them). On the PyTorch path each
    timed step is also taken back out of both caches (a crop), as a finished draft is.
    Afterwards the target's cache holds `context` in every layer."""
    from ..runtime.static_kv import Tree
    from ..core.drafters.early_exit import ExitHeadLM
    from ..core.drafters.draft_model import tree_for_beams

    device = target.device
    tokens = torch.tensor(context[:width], device=device)  # [W]
    if width == 1:
        tree = Tree.contiguous(len(context), 1, device)
    else:
        tree = tree_for_beams(len(context), 1, width, [[] for _ in range(width)], [], device)
    if not target.fast:
        from ..target import torch_path

        target.reset()
        lm = ExitHeadLM(target, prepared)
        lm.begin(context)
        target.forward(context[:-1], last_only=True)
        lm.sync(context)  # the head's cache and the target's first layers hold the context

        def step():
            lm.extend(tokens, tree)
            torch_path.crop_layers(target.cache, range(prepared.exit_layer), len(context))
            lm.keep(0)

        seconds = median_time(step, repeats)
        lm.end_draft()  # the last context token's rows leave layers 0..N-1 (the drafter ran them)
        target.forward(context[-1:], last_only=True)  # every layer holds the context, as on the fast path
        return seconds
    target.reset()
    target.forward(context, last_only=True)
    lm = ExitHeadLM(target, prepared)
    lm.begin(context)
    target.capture_exit(prepared.exit_layer)
    lm.assume_head_cache(len(context), width + 1)

    def fast_step():
        lm.extend(tokens, tree)  # scratch positions past the context, overwritten by the next call
        lm.keep(0)

    return median_time(fast_step, repeats)


def arithmetic_rate(target, rows: int = 16, repeats: int = 5) -> dict | None:
    """The block kernel's multiply-adds per second in the target's numerics, on the largest of its
    block forms (the default model's LM head) with `rows` rows (arithmetic-bound: each tile of 4
    rows reuses the codes it loads; the fastest of `repeats` calls, the rate when nothing else
    runs), at 1 thread and at the process's thread count, and what each
    verify row adds at the faster rate: {"rows", "multiply_adds_per_s": {"1": r, "N": r},
    "row_multiply_adds": every block form's multiply-adds for one row, "row_ms"}: a verify of w
    tokens does about (w - 1) x row_ms more arithmetic than a one-token step (the rate is the
    largest form's; smaller forms' codes may run faster or slower). None off the block kernel."""
    from ..runtime import blockmm

    forms = target.block_forms
    kernel, _ = blockmm.kernel()
    if not forms or kernel is None:
        return None
    largest = max(forms, key=lambda form: form.codes.numel())
    x = torch.randn(rows, largest.codes.shape[1], generator=torch.Generator().manual_seed(0))  # [rows, in]
    threads, rates = torch.get_num_threads(), {}
    try:
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            kernel.matmul(x, largest, target.numerics)  # warm-up
            seconds = min(_seconds(lambda: kernel.matmul(x, largest, target.numerics)) for _ in range(repeats))
            rates[str(count)] = largest.codes.numel() * rows / seconds
    finally:
        torch.set_num_threads(threads)
    row = sum(form.codes.numel() for form in forms)
    return {"rows": rows, "multiply_adds_per_s": {count: round(rate) for count, rate in rates.items()},
            "row_multiply_adds": row, "row_ms": round(row / max(rates.values()) * 1e3, 3)}


def profile_target(target, context_length: int = DEFAULT_CONTEXT, widths: Sequence[int] = DEFAULT_WIDTHS,
                   prepared_head=None, repeats: int = 15, rounds: int = 3) -> dict:
    """Forward costs of `target` after a context of `context_length` tokens:
    {"numerics", "context", "widths": {"1": ms, ...}, "ratios": {"2": r, ...}, "rejected":
    {"2": ms, ...}, "rejected_ratios": {"2": r, ...}, "draft_ms", "draft_ratio", "arithmetic"}
    (the draft's None without `prepared_head`; "rejected": a verify of that width whose first
    draft token is rejected, see `target_step_seconds`; "arithmetic": `arithmetic_rate`, None off
    the block kernel). Each width's figure is the median over `rounds` interleaved rounds of
    medians of `repeats` calls."""
    widths = sorted(set(int(w) for w in widths) | {1})
    context = timing_context(context_length, target.vocab_size)
    cases = [(width, False) for width in widths] + [(width, True) for width in widths if width > 1]
    per_round = [[target_step_seconds(target, context, width, repeats, rejected) for width, rejected in cases]
                 for _ in range(rounds)]
    times = {case: statistics.median(run[i] for run in per_round) for i, case in enumerate(cases)}
    seconds = {width: times[(width, False)] for width in widths}
    rejected = {width: times[(width, True)] for width in widths if width > 1}
    draft = None
    if prepared_head is not None:
        draft = draft_step_seconds(target, prepared_head, context, repeats)
    base = seconds[1]
    import psutil

    weight_bytes = getattr(target, "weight_bytes_per_token", None)
    return {
        "numerics": getattr(target, "numerics", None),
        "context": context_length,
        "weight_bytes_per_token": weight_bytes,
        "read_gb_per_s": None if not weight_bytes else round(weight_bytes / base / 1e9, 2),
        "resident_mb": round(psutil.Process().memory_info().rss / 1e6),
        "weight_pages": getattr(target, "weight_pages", None),
        "widths": {str(w): round(s * 1e3, 3) for w, s in seconds.items()},
        "ratios": {str(w): round(s / base, 3) for w, s in seconds.items() if w != 1},
        "rejected": {str(w): round(s * 1e3, 3) for w, s in rejected.items()},
        "rejected_ratios": {str(w): round(s / base, 3) for w, s in rejected.items()},
        "draft_ms": None if draft is None else round(draft * 1e3, 3),
        "draft_ratio": None if draft is None else round(draft / base, 3),
        "arithmetic": arithmetic_rate(target),
    }


def format_profile(profile: dict) -> str:
    """The profile as a small table for a terminal."""
    lines = [f"numerics {profile['numerics']}, context {profile['context']} tokens; rejected: a verify whose "
             f"first draft token is rejected",
             f"{'width':>6} {'ms':>9} {'x 1-token':>10} {'rejected ms':>12} {'x 1-token':>10}"]
    if profile.get("weight_bytes_per_token"):
        lines.insert(1, f"weights read a one-token step: {profile['weight_bytes_per_token'] / 1e6:.1f} MB "
                        f"({profile['read_gb_per_s']} GB/s); resident memory {profile['resident_mb']} MB")
    pages = profile.get("weight_pages")
    if pages:
        huge = pages["huge_page_bytes"]
        lines.insert(2, f"matrices copied into huge pages: {pages['copied_bytes'] / 1e6:.0f} MB"
                        + ("" if huge is None else f", {huge / 1e6:.0f} MB of them in 2 MiB pages"))
    for width, ms in profile["widths"].items():
        line = f"{width:>6} {ms:9.2f} {profile['ratios'].get(width, 1.0):10.2f}"
        if width in profile["rejected"]:
            line += f" {profile['rejected'][width]:12.2f} {profile['rejected_ratios'][width]:10.2f}"
        lines.append(line)
    if profile["draft_ms"] is not None:
        lines.append(f"EESD draft token: {profile['draft_ms']:.2f} ms ({profile['draft_ratio']:.2f} x 1-token)")
    if profile.get("arithmetic"):
        lines.append(describe_arithmetic(profile["arithmetic"], profile["numerics"]))
    return "\n".join(lines)


def describe_arithmetic(arithmetic: dict, numerics: str) -> str:
    """`arithmetic_rate`'s result as one line."""
    rates = ", ".join(f"{rate / 1e9:.1f} G on {count} thread{'' if count == '1' else 's'}"
                      for count, rate in arithmetic["multiply_adds_per_s"].items())
    return (f"{numerics} products, multiply-adds/s: {rates}; each verify row adds about {arithmetic['row_ms']:.2f} ms "
            f"of arithmetic ({arithmetic['row_multiply_adds'] / 1e6:.0f} M multiply-adds a row)")


DEFAULT_SEQUENCES = (1, 2, 4, 8, 16)
DEFAULT_PREFILL = 1000


def batched_decode(target, sequences: Sequence[int] = DEFAULT_SEQUENCES, context_length: int = DEFAULT_CONTEXT,
                   repeats: int = 10) -> dict:
    """`ar`'s aggregate decode rate with n sequences decoding together (each its own context of
    `context_length` distinct tokens, one row each per step, `shared_forward.forward_parts`):
    {"context", "ms": {"n": ms per step}, "tokens_per_s": {"n": n / step}, "ratios": {"n": rate
    over 1 sequence's}, "kv_bytes_per_token"}. The sequences are released afterwards."""
    from ..target.shared_forward import Part
    from ..runtime.rows import BLOCK

    counts = sorted(set(int(n) for n in sequences) | {1})
    live = []
    try:
        for index in range(max(counts)):
            sequence = target.new_sequence()
            sequence.reset()
            sequence.forward(timing_context(context_length + index, target.vocab_size)[index:], last_only=True)
            live.append(sequence)
        seconds = {}
        for n in counts:
            chosen = live[:n]

            def step():
                target.forward_parts([Part(sequence, [3 + i]) for i, sequence in enumerate(chosen)])
                for sequence in chosen:
                    sequence.crop(sequence.length - 1)  # the same positions every time

            seconds[n] = median_time(step, repeats)
    finally:
        for sequence in live:
            sequence.release()
    rate = {n: n / s for n, s in seconds.items()}
    return {"context": context_length, "ms": {str(n): round(s * 1e3, 3) for n, s in seconds.items()},
            "tokens_per_s": {str(n): round(r, 1) for n, r in rate.items()},
            "ratios": {str(n): round(r / rate[1], 3) for n, r in rate.items()},
            "kv_bytes_per_token": target.pool.block_bytes // BLOCK}


def prefill_rate(target, length: int = DEFAULT_PREFILL, repeats: int = 3) -> dict:
    """Tokens per second of a prompt of `length` tokens prefilled on a fresh sequence (the
    prefix cache not consulted; the fastest of `repeats` after a short warm-up): {"tokens",
    "ms", "tokens_per_s"}."""
    prompt = timing_context(length, target.vocab_size)
    saved, target.prefix_cache = target.prefix_cache, False
    try:
        _timed_prefill(target, prompt[:64])
        best = min(_timed_prefill(target, prompt) for _ in range(repeats))
    finally:
        target.prefix_cache = saved
    return {"tokens": length, "ms": round(best * 1e3, 3), "tokens_per_s": round(length / best, 1)}


def _layer_matrices(target) -> list:
    """The GGUF layers' matrices of a target on a file's own blocks (`qmatmul.QMatrix`), else []."""
    from ..runtime.qmatmul import QMatrix

    layers = getattr(getattr(target, "decoder", None), "layers", None) or []
    return [m for layer in layers for m in getattr(layer, "keep", []) if isinstance(m, QMatrix)]


def integer_roof(target, rows: int = 64, repeats: int = 5) -> dict | None:
    """The integer roof of a wide forward on this machine: the multiply-adds per second the
    GGUF-block kernel reaches on the target's largest quantized layer matrix with `rows` rows of
    activations (quantized once, outside the timing; the fastest of `repeats` calls on the process's
    threads; arithmetic-bound: each weight is decoded once for all rows), and the multiply-adds of one
    token through every layer matrix: {"rows", "type", "shape", "multiply_adds_per_s",
    "token_multiply_adds"}. None off the GGUF runtime (no such matrices, or no kernel)."""
    from ..runtime import qmatmul

    matrices = _layer_matrices(target)
    quantized = [m for m in matrices if m.type not in qmatmul.FLOAT_TYPES]
    kernel, _ = qmatmul.kernel()
    if not quantized or kernel is None:
        return None
    largest = max(quantized, key=lambda m: m.rows * m.cols)
    x = torch.randn(rows, largest.cols, generator=torch.Generator().manual_seed(0))
    activations = kernel.quantize(x)
    out = torch.empty(rows, largest.rows)
    kernel.matmul(activations, largest, out=out)  # warm-up (and the activations' quantization)
    seconds = min(_seconds(lambda: kernel.matmul(activations, largest, out=out)) for _ in range(repeats))
    return {"rows": rows, "type": largest.type_name, "shape": [largest.rows, largest.cols],
            "multiply_adds_per_s": round(largest.rows * largest.cols * rows / seconds),
            "token_multiply_adds": sum(m.rows * m.cols for m in matrices)}


def roof_fraction(prefill: dict, roof: dict) -> float:
    """The share of the integer roof a prefill reaches: its tokens per second times a token's
    multiply-adds through the layer matrices, over the roof's multiply-adds per second (the LM head,
    run for the last row only, and attention are left out)."""
    return prefill["tokens_per_s"] * roof["token_multiply_adds"] / roof["multiply_adds_per_s"]


def _timed_prefill(target, prompt: list[int]) -> float:
    """Seconds of one prefill of `prompt` (the last row's logits) on a fresh sequence."""
    sequence = target.new_sequence()
    sequence.reset()
    try:
        return _seconds(lambda: sequence.forward(prompt, last_only=True))
    finally:
        sequence.release()


def format_batched(batched: dict | None, prefill: dict | None, roof: dict | None = None) -> str:
    """The batched decode curve and the prefill rate (either may be None) as lines for a terminal,
    with the integer roof and the share of it the prefill reaches where `roof` is given."""
    lines = []
    if batched is not None:
        lines += [f"batched decode ({batched['context']}-token contexts, one row each per step; KV "
                  f"{batched['kv_bytes_per_token'] / 1024:.1f} KiB a position):",
                  f"{'sequences':>10} {'ms/step':>9} {'tok/s':>8} {'x 1 seq':>8}"]
        for n, ms in batched["ms"].items():
            lines.append(f"{n:>10} {ms:9.2f} {batched['tokens_per_s'][n]:8.1f} {batched['ratios'][n]:8.2f}")
    if prefill is not None:
        lines.append(f"prefill of {prefill['tokens']} tokens: {prefill['ms'] / 1e3:.2f} s "
                     f"({prefill['tokens_per_s']:.0f} tok/s)")
    if roof is not None:
        n, k = roof["shape"]
        line = (f"integer roof: {roof['multiply_adds_per_s'] / 1e9:.1f} G multiply-adds/s ({roof['rows']} rows x "
                f"{roof['type']} [{n}, {k}])")
        if prefill is not None:
            reached = prefill["tokens_per_s"] * roof["token_multiply_adds"]
            line += (f"; prefill reaches {reached / 1e9:.1f} G/s, {100 * roof_fraction(prefill, roof):.0f}% of it "
                     f"({roof['token_multiply_adds'] / 1e6:.0f} M multiply-adds a token in the layers)")
        lines.append(line)
    return "\n".join(lines)
