"""Forward paths side by side in one run, on the default model: transformers' eager forward,
the fast path on float32 weights, and the fast path on the exact int8 block forms of the GGUF
weights (the block kernel), with its layers as PyTorch operators (`blocks-torch`) and as one C
call each (`blocks`, the default; `native_layer.py`).

1. Step times: a 1-token decode step and 4/8/16-token verify steps after a 256-token context,
   on every path (same weights, same process), against each path's bandwidth floor (the bytes of
   the weights it reads per step / the measured read bandwidth).
2. Generation: `ar` and `anpd` on every path, transformers' `generate()` (greedy) and, with
   --llamacpp, llama.cpp's autoregressive and prompt-lookup decoding on the same GGUF file, on
   the first N questions of each chosen Spec-Bench category, in rotating order per prompt.
   Prints tokens/s (ratio of totals) and the exact-match rate against `ar` on the fast path
   (float32 weights).

    python scripts/fastpath_speed.py --per-category 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import time

import torch

import verispec
from verispec.api import stream
from verispec.bench.datasets import encode_question, load_dataset
from verispec.bench.peers import PeerSettings, get_peer
from verispec.model import Target

from verispec.bench.profile import target_step_seconds
from profile_step import native_layers, read_bandwidth, weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--categories", default="")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--llamacpp", action="store_true", help="include llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--no-eager", action="store_true", help="skip ar/anpd on the eager path in part 2")
    args = parser.parse_args()

    blocks = verispec.load(None, args.dtype)
    print(f"block kernel: {blocks.block_kernel_summary}")
    fast = Target(blocks.model, blocks.tokenizer, blocks.name, fast=True)
    eager = Target(blocks.model, blocks.tokenizer, blocks.name, fast=False)
    context = torch.randint(1000, 20000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    bandwidth = read_bandwidth()
    print(f"dtype {fast.dtype}, threads {torch.get_num_threads()}, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name, target, native in (("eager", eager, True), ("fast", fast, True), ("blocks-torch", blocks, False),
                                 ("blocks", blocks, True)):
        size = weight_bytes(target)
        floor = size / bandwidth
        with native_layers(target, native):
            times = {width: target_step_seconds(target, context, width) for width in (1, 4, 8, 16)}
        verify = ", ".join(f"{w}-token {t * 1e3:.1f} ms ({t / times[1]:.2f}x)" for w, t in times.items() if w > 1)
        print(f"{name:12} weights {size / 1e9:.3f} GB, floor {floor * 1e3:5.1f} ms | 1-token step "
              f"{times[1] * 1e3:6.1f} ms ({times[1] / floor:.2f}x floor) | verify {verify}", flush=True)

    categories = [c for c in args.categories.split(",") if c] or None
    _, questions = load_dataset("spec-bench", categories, args.per_category)
    runs = {
        "ar (blocks)": lambda ids: _ours(blocks, ids, "ar", args.max_new_tokens),
        "anpd (blocks)": lambda ids: _ours(blocks, ids, "anpd", args.max_new_tokens),
        "ar (blocks-torch)": lambda ids: _ours(blocks, ids, "ar", args.max_new_tokens, native=False),
        "anpd (blocks-torch)": lambda ids: _ours(blocks, ids, "anpd", args.max_new_tokens, native=False),
        "ar (fast)": lambda ids: _ours(fast, ids, "ar", args.max_new_tokens),
        "anpd (fast)": lambda ids: _ours(fast, ids, "anpd", args.max_new_tokens),
        "ar (eager)": lambda ids: _ours(eager, ids, "ar", args.max_new_tokens),
        "anpd (eager)": lambda ids: _ours(eager, ids, "anpd", args.max_new_tokens),
    }
    peers = ["hf-ar"] + (["llamacpp-ar", "llamacpp-pld"] if args.llamacpp else [])
    if args.no_eager:
        del runs["ar (eager)"], runs["anpd (eager)"]
    for peer in peers:
        prepared = get_peer(peer).prepare(fast, PeerSettings())
        runs[peer] = lambda ids, run=prepared: _peer(run, ids, args.max_new_tokens)
    names = list(runs)
    for name in names:  # warm-up
        runs[name](encode_question(fast.tokenizer, questions[0])[:64])
    totals = {name: [0, 0.0, 0] for name in names}  # tokens, seconds, exact matches
    for index, question in enumerate(questions):
        ids = encode_question(fast.tokenizer, question)
        outputs = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            tokens, seconds = runs[name](ids)
            outputs[name] = tokens
            totals[name][0] += len(tokens)
            totals[name][1] += seconds
        for name in names:
            totals[name][2] += outputs[name] == outputs["ar (fast)"]
        print(f"question {question.question_id} ({question.category}) done", flush=True)
    base = totals["ar (fast)"][0] / totals["ar (fast)"][1]
    print(f"\n{'run':20} {'tokens/s':>9} {'vs ar (fast)':>13} {'exact vs ar (fast)':>19}")
    for name, (tokens, seconds, same) in totals.items():
        rate = tokens / seconds
        print(f"{name:20} {rate:9.2f} {rate / base:13.2f} {same:>12}/{len(questions)}")


def _ours(target: Target, ids: list[int], method: str, budget: int, native: bool = True) -> tuple[list[int], float]:
    with native_layers(target, native):
        started = time.perf_counter()
        text_stream = stream(target, ids, method, max_new_tokens=budget)
        for _ in text_stream:
            pass
        return text_stream.result.token_ids, time.perf_counter() - started


def _peer(run, ids: list[int], budget: int) -> tuple[list[int], float]:
    started = time.perf_counter()
    output = run(ids, budget)
    return output.token_ids, time.perf_counter() - started


if __name__ == "__main__":
    main()
