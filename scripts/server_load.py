"""Requests/s and tokens/s of `verispec serve` under a small concurrent load, per method.

Starts `verispec serve` on the default model (127.0.0.1, a free port), waits until /health
answers, then for each method sends the same R requests (the built-in benchmark prompts, greedy,
max_tokens M) from C concurrent clients with the official `openai` package, and reports
requests/s, completion tokens/s, mean latency and the mean accepted tokens the server reported.

    python scripts/server_load.py --methods ar anpd --requests 12 --concurrency 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from verispec.bench.datasets import BUILTIN_PATH, read_questions


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["ar", "anpd"])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--port", str(port),
                               "--max-queue", str(args.requests)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        prompts = [q.prompt for q in read_questions(BUILTIN_PATH)][: args.requests]

        def one(prompt: str, method: str):
            started = time.perf_counter()
            response = client.completions.create(
                model="verispec-default", prompt=f"Question: {prompt}\n\nAnswer:", max_tokens=args.max_tokens,
                temperature=0, extra_body={"method": method},
            )
            return time.perf_counter() - started, response.usage.completion_tokens, response.model_extra["verispec"]

        one(prompts[0], args.methods[0])  # warm-up
        print(f"{args.requests} requests, {args.concurrency} concurrent clients, max_tokens {args.max_tokens}, greedy")
        print(f"{'method':8} {'req/s':>7} {'tok/s':>7} {'latency s':>10} {'mean accepted':>14}")
        for method in args.methods:
            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                results = list(pool.map(lambda p: one(p, method), prompts))
            wall = time.perf_counter() - started
            tokens = sum(r[1] for r in results)
            forwards = sum(r[2]["target_forwards"] for r in results)
            generated = sum(r[2].get("new_tokens", r[1]) for r in results)
            print(f"{method:8} {len(results) / wall:7.3f} {tokens / wall:7.2f} "
                  f"{sum(r[0] for r in results) / len(results):10.1f} {generated / forwards:14.2f}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
