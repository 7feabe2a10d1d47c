"""Benchmark: products on a GGUF file's own blocks (qmatmul) against the int8 block kernel (blockmm_int8).

For Qwen2.5-1.5B's matrix shapes (random valid blocks: random bits, float16 scales of a sane size),
ms per call of `qmatmul.matmul` (the file's Q4_K / Q6_K bytes) and of `blockmm`'s int8 numerics on
the same matrix's exact int8 block form (codes + float32 scales per block, packed), for several
row counts M, and the weight bytes each reads per second at M = 1. Both quantize the activations
inside the call; both give the same bits for Q4_K (the int8 kernel quantizes Q6_K's activations per
16 inputs, qmatmul per 32). Each kernel cycles through enough copies of the matrix (at least
--spread MB together) that the weights come from memory, not from the last-level cache, as in a
decode step that walks through all layers. Calls alternate between the two kernels so that both
see the same machine load; the table gives the median of each kernel's calls and, in brackets, the
fastest one (on a machine shared with other work the fastest call is the better estimate of what the
kernel does alone). Row counts whose int8-kernel call would take over --max-call seconds are skipped
(the LM head at M = 256).

    .venv/bin/python scripts/bench_qmatmul.py [--threads 2] [--rows 1,4,8,16,64,256] [--budget 0.4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from verispec.runtime import blockmm, qmatmul
from verispec.gguf.blocks import BlockWeights

SHAPES = [  # (name, N outputs, K inputs, type)
    ("attn_q/o 1536x1536", 1536, 1536, "Q4_K"),
    ("attn_k/v 256x1536", 256, 1536, "Q4_K"),
    ("ffn_gate/up 8960x1536", 8960, 1536, "Q4_K"),
    ("ffn_down 1536x8960", 1536, 8960, "Q6_K"),
    ("output 151936x1536", 151936, 1536, "Q6_K"),
]


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    block, size = qmatmul.BLOCKS[qmatmul.TYPES[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = [(0, 2), (2, 4)] if type_name in ("Q4_K", "Q5_K") else [(208, 210)]
    for low, high in fields:
        raw[:, :, low:high] = rng.uniform(1e-4, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def block_form(raw: np.ndarray, type_name: str, rows: int, cols: int) -> BlockWeights:
    """The exact int8 block form of the matrix (what gguf_blocks.exact_blocks builds from its dequantization)."""
    blocks = raw.reshape(rows, cols // 256, -1)
    half = lambda part: np.ascontiguousarray(part).view(np.float16).astype(np.float32)  # noqa: E731
    if type_name == "Q4_K":
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        scales = (half(blocks[..., 0:2]) * sc.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
        offsets = (half(blocks[..., 2:4]) * m.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
        codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, cols).astype(np.int8)
        return BlockWeights(torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(offsets), 32)
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    scales = (half(blocks[..., 208:210]) * blocks[..., 192:208].view(np.int8).astype(np.float32)).reshape(rows, -1)
    q = np.empty((rows, cols // 256, 2, 4, 32), dtype=np.int8)
    for h in range(2):
        for s in range(4):
            byte = ql[..., 64 * h + 32 * (s & 1): 64 * h + 32 * (s & 1) + 32]
            low = byte & 15 if s < 2 else byte >> 4
            q[:, :, h, s] = (low | (((qh[..., 32 * h: 32 * h + 32] >> (2 * s)) & 3) << 4)).astype(np.int8) - 32
    return BlockWeights(torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(scales), None, 16)


def timed(fn, budget: float) -> list[float]:
    """Seconds of each call of fn, for about `budget` seconds (at least 1 call)."""
    times: list[float] = []
    start = time.perf_counter()
    while not times or (time.perf_counter() - start < budget and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,8,16,64,256")
    parser.add_argument("--budget", type=float, default=0.4, help="seconds per kernel, shape and M")
    parser.add_argument("--shapes", default="", help="comma-separated indexes into SHAPES (default: all)")
    parser.add_argument("--spread", type=float, default=64.0, help="MB of weight copies each kernel cycles through")
    parser.add_argument("--max-call", type=float, default=0.3, help="skip M where one int8-kernel call takes longer")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    old, why = blockmm.kernel()
    new, why_new = qmatmul.kernel()
    if old is None or new is None:
        raise SystemExit(f"kernels unavailable: {why or why_new}")
    print(f"kernel build: {new.isa}; threads: {args.threads}; ms per call: median [fastest]")
    header = (f"{'matrix':24} {'type':5} {'M':>4} {'qmatmul ms':>17} {'int8 ms':>17} {'int8/q':>11}"
              f"   {'GB/s q / int8 (M=1)':>25}")
    print(header)
    print("-" * len(header))
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    for index, (name, n, k, type_name) in enumerate(shapes):
        raw = random_blocks(type_name, n, k, seed=index)
        form = block_form(raw, type_name, n, k)
        packed = form.packed  # packed once, as the runtime keeps it
        old_bytes = packed.codes.numel() + packed.scales.numel() * packed.scales.element_size() + (
            0 if packed.offsets is None else packed.offsets.numel() * 4)
        ws = [qmatmul.QMatrix(raw if i == 0 else raw.copy(), type_name, n, k)
              for i in range(max(1, int(np.ceil(args.spread * 1e6 / raw.nbytes))))]
        forms = [form]
        for _ in range(max(1, int(np.ceil(args.spread * 1e6 / old_bytes))) - 1):
            copy = BlockWeights(form.codes, form.scales, form.offsets, form.block)
            copy.__dict__["packed"] = type(packed)(packed.codes.clone(), packed.scales.clone(),
                                                   None if packed.offsets is None else packed.offsets.clone(),
                                                   packed.block, packed.outputs, packed.code_bias, packed.code_span)
            forms.append(copy)
        w = ws[0]
        for m in rows_list:
            x = torch.randn(m, k)
            out = torch.empty(m, n)
            turn = iter(range(1 << 30))
            t0 = time.perf_counter()
            old.matmul(x, forms[0], "int8")
            if time.perf_counter() - t0 > args.max_call:
                print(f"{name:24} {type_name:5} {m:4d}   skipped (one int8-kernel call > {args.max_call} s)")
                continue
            new_times, old_times = [], []
            for _ in range(3):  # alternate, so both kernels see the same load
                new_times += timed(lambda: new.matmul(x, ws[next(turn) % len(ws)], out=out, threads=args.threads),
                                   args.budget / 3)
                old_times += timed(lambda: old.matmul(x, forms[next(turn) % len(forms)], "int8"), args.budget / 3)
            t_new, t_old = statistics.median(new_times), statistics.median(old_times)
            b_new, b_old = min(new_times), min(old_times)
            rate = (f"{w.nbytes / t_new / 1e9:5.1f} [{w.nbytes / b_new / 1e9:4.1f}] / "
                    f"{old_bytes / t_old / 1e9:4.1f} [{old_bytes / b_old / 1e9:4.1f}]") if m == 1 else ""
            print(f"{name:24} {type_name:5} {m:4d} {t_new * 1e3:8.3f} [{b_new * 1e3:6.3f}] {t_old * 1e3:8.3f} "
                  f"[{b_old * 1e3:6.3f}] {t_old / t_new:5.2f} [{b_old / b_new:4.2f}]   {rate:>25}", flush=True)
        print(f"{'':24} bytes read: file {w.nbytes / 1e6:.1f} MB, int8 block form {old_bytes / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
