"""Requests/s, tokens/s and refusals of `verispec serve` under a concurrent load, per method.

Starts `verispec serve` (the default model, or --model; 127.0.0.1, a free port), waits until
/health answers, then for each method sends R requests (the built-in benchmark prompts, repeated
when R is larger, greedy, max_tokens M) from C concurrent clients with the official `openai`
package, never retrying. Reports requests/s and completion tokens/s of the answered requests,
their mean and slowest latency (queue wait included), the mean accepted tokens the server
reported, and how many were refused with 429 (and the Retry-After values they carried).

    python scripts/server_load.py --methods ar anpd --requests 12 --concurrency 4 --max-tokens 64
    python scripts/server_load.py --methods anpd --requests 50 --concurrency 50 --max-queue 16

--max-queue is passed to `verispec serve` (default: the server's own default); with fewer
waiting places than concurrent clients minus one, the rest are refused.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import cycle, islice

import httpx
from openai import OpenAI, RateLimitError

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
    parser.add_argument("--max-queue", type=int, default=None, help="--max-queue of the server (default: its own)")
    parser.add_argument("--model", default=None, help="--model of the server (default: the embedded model)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    port = free_port()
    command = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--dtype", args.dtype]
    if args.max_queue is not None:
        command += ["--max-queue", str(args.max_queue)]
    if args.model is not None:
        command += ["--model", args.model]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                sys.exit("the server did not start")
            time.sleep(1)
        model_id = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
        prompts = list(islice(cycle(q.prompt for q in read_questions(BUILTIN_PATH)), args.requests))

        def one(prompt: str, method: str):
            """(latency s, completion tokens, verispec metrics), or (None, Retry-After, None) for a 429."""
            started = time.perf_counter()
            try:
                response = client.completions.create(
                    model=model_id, prompt=f"Question: {prompt}\n\nAnswer:", max_tokens=args.max_tokens,
                    temperature=0, extra_body={"method": method},
                )
            except RateLimitError as error:
                return None, error.response.headers.get("retry-after"), None
            return time.perf_counter() - started, response.usage.completion_tokens, response.model_extra["verispec"]

        one(prompts[0], args.methods[0])  # warm-up
        print(f"{args.requests} requests, {args.concurrency} concurrent clients, max_tokens {args.max_tokens}, "
              f"greedy, max_queue {health.json()['max_queue']}")
        print(f"{'method':8} {'req/s':>7} {'tok/s':>7} {'mean s':>7} {'max s':>7} {'mean accepted':>14} "
              f"{'refused':>8}  Retry-After")
        for method in args.methods:
            started = time.perf_counter()
            with ThreadPoolExecutor(args.concurrency) as pool:
                outcomes = list(pool.map(lambda p: one(p, method), prompts))
            wall = time.perf_counter() - started
            answered = [o for o in outcomes if o[0] is not None]
            refused = [o[1] for o in outcomes if o[0] is None]
            if not answered:
                print(f"{method:8} all {len(refused)} refused (Retry-After {sorted(set(refused))})", flush=True)
                continue
            tokens = sum(o[1] for o in answered)
            forwards = sum(o[2]["target_forwards"] for o in answered)
            generated = sum(o[2].get("new_tokens", o[1]) for o in answered)
            latencies = [o[0] for o in answered]
            retry = ", ".join(sorted(set(refused), key=int)) if refused else "-"
            print(f"{method:8} {len(answered) / wall:7.3f} {tokens / wall:7.2f} {sum(latencies) / len(latencies):7.2f} "
                  f"{max(latencies):7.2f} {generated / forwards:14.2f} {len(refused):8}  {retry}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
