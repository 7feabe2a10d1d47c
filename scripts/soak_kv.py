"""The reliability soak: `verispec serve` on a few blocks of KV memory, under 1,000 mixed requests.

    .venv/bin/python scripts/soak_kv.py [--kv-memory 24MiB] [--requests 1000] [--concurrency 12]
                                        [--model PATH] [--methods ar,pld,...] [--out soak.json]

Starts `verispec serve --kv-memory KV --max-batch 8` on the model (the embedded default unless
--model), runs `verispec.bench.soak` (every method, n up to 4, prompts of 64 * k tokens and others,
stops, streaming, clients that disconnect, a few requests that could never fit; then every
reproducible request alone again), prints the summary and writes it to --out. Exits 1 if any
request was lost, any answer was a 5xx, a blocks stayed in use, or an output differed from solo.

Run it alone: on 2 cores it serves about 35 requests a minute, but anything else busy on the
machine (a test run, a build, a training) makes the server's two OpenMP threads wait on each
other, and it fell to about 7 a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verispec.bench import servers, soak
from verispec.runtime.kv_pool import parse_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-memory", default="24MiB")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--model", default=None)
    parser.add_argument("--methods", default="ar,pld,anpd,anpd/tree=8,eesd,sps,mtad")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="soak.json")
    args = parser.parse_args()
    port = servers.free_port()
    argv = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--kv-memory", args.kv_memory,
            "--max-batch", "8", "--max-queue", str(args.requests + 16), "--request-timeout", "0"]
    if args.model:
        argv += ["--model", args.model]
    log = Path(args.out).with_suffix(".server.log")
    server = servers.ManagedServer(argv, env={}, log_path=log, port=port)
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_ready(url, 900, server.alive)
        info = soak.httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        vocab = int(info["verispec"].get("vocab_size", 32000))
        blocks = int(soak.kv_blocks_total(url))
        watch = servers.ProcessWatch(server.pid)
        requests = soak.plan(args.requests, vocab, blocks * soak.BLOCK, args.methods.split(","), args.seed)
        result = soak.run(url, requests, args.concurrency, rss=watch.rss)
    finally:
        server.stop()
    summary = result.summary() | {"kv_memory": args.kv_memory, "kv_blocks": blocks, "concurrency": args.concurrency}
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if not k.endswith("_examples")}, indent=1))
    for example in summary["unequal_examples"]:
        print("not equal to solo:", json.dumps(example))
    bad = (summary["lost"] or summary["server_errors"] or summary["kv_blocks_in_use_at_end"]
           or summary["solo_equal"] != summary["solo_checked"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
