"""What an oversized or idle client costs `verispec serve`: the figures of docs/server.md's bounds.

    .venv/bin/python scripts/server_bounds.py [--model PATH] [--mb 50] [--idle 500] [--out bounds.json]

Starts `verispec serve` (the embedded default unless --model; default bounds) and measures, each
with the server's resident memory (its process tree) before and after:

- a body of --mb MB sent with its Content-Length (refused 413 before it is read), and the same
  body sent in chunks without one (refused as the chunks pass --max-body): status, seconds from
  the first byte sent to the answer, resident memory growth;
- the same prompt in a server started with --max-body large enough for it (the prompt-characters
  bound refuses it before tokenizing): status, seconds, memory growth;
- --idle idle connections and one client dripping a body a byte a second, while `/health` and a
  normal 16-token request are served: their status and seconds.

Prints and writes a JSON summary. Exits 1 if any answer is not the expected one.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from verispec.bench import servers


def _serve(extra: list[str], model: str | None, log: Path) -> tuple[servers.ManagedServer, str]:
    port = servers.free_port()
    argv = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--max-connections", "1000", *extra]
    if model:
        argv += ["--model", model]
    server = servers.ManagedServer(argv, env={}, log_path=log, port=port)
    url = f"http://127.0.0.1:{port}"
    servers.wait_ready(url, 900, server.alive)
    return server, url


def _body(megabytes: int) -> bytes:
    prompt = "word " * (megabytes * 2**20 // 5)
    return json.dumps({"prompt": prompt, "max_tokens": 4}).encode()


def _timed_post(url: str, content, headers: dict | None = None) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        response = httpx.post(url + "/v1/completions", content=content, timeout=600,
                              headers={"Content-Type": "application/json", **(headers or {})})
        status = response.status_code
    except httpx.HTTPError as error:  # the server may close while the client still sends
        status = f"closed: {type(error).__name__}"
    return status, round(time.perf_counter() - start, 3)


def _chunks(body: bytes, size: int = 2**16):
    for start in range(0, len(body), size):
        yield body[start:start + size]


def _measured(watch: servers.ProcessWatch, send) -> dict:
    """The answer to `send()`, its seconds, and the server's resident memory at its highest while
    it was handled (sampled every 5 ms) and after it, over what it was before."""
    before = watch.rss()
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], watch.rss() or 0)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        status, seconds = send()
        time.sleep(0.5)
    finally:
        done.set()
        sampler.join()
    after = watch.rss()
    return {"status": status, "seconds": seconds, "rss_peak_growth_mb": round((peak[0] - before) / 2**20, 1),
            "rss_growth_after_mb": round((after - before) / 2**20, 1)}


def _normal_request(url: str) -> tuple[int, float]:
    start = time.perf_counter()
    status = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 16,
                                                        "temperature": 0}, timeout=300).status_code
    return status, round(time.perf_counter() - start, 3)


def _under_idle_connections(url: str, port: int, idle: int) -> dict:
    """/health and a normal request with `idle` connections open and a body dripping, beside the
    same request alone (timed first)."""
    _, alone_s = _normal_request(url)
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
    drip = socket.create_connection(("127.0.0.1", port))
    drip.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    try:
        start = time.perf_counter()
        health = httpx.get(url + "/health", timeout=60).status_code
        health_s = time.perf_counter() - start
        normal, normal_s = _normal_request(url)
        drip.sendall(b" ")
    finally:
        for sock in sockets + [drip]:
            sock.close()
    return {"idle_connections": idle, "health": health, "health_s": round(health_s, 3), "request": normal,
            "request_s": normal_s, "request_alone_s": alone_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--mb", type=int, default=50)
    parser.add_argument("--idle", type=int, default=500)
    parser.add_argument("--out", default="bounds.json")
    args = parser.parse_args()
    body = _body(args.mb)
    log = Path(args.out).with_suffix(".server.log")
    summary: dict = {"body_mb": round(len(body) / 2**20, 1)}
    server, url = _serve([], args.model, log)
    try:
        watch = servers.ProcessWatch(server.pid)
        summary["rss_mb"] = round(watch.rss() / 2**20)
        summary["with_length"] = _measured(watch, lambda: _timed_post(url, body))
        summary["chunked"] = _measured(watch, lambda: _timed_post(url, _chunks(body)))
        summary["idle"] = _under_idle_connections(url, int(url.rsplit(":", 1)[1]), args.idle)
    finally:
        server.stop()
    server, url = _serve(["--max-body", f"{args.mb + 8}MiB"], args.model, log)
    try:
        watch = servers.ProcessWatch(server.pid)
        summary["prompt_in_a_large_body"] = _measured(watch, lambda: _timed_post(url, body))
    finally:
        server.stop()
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    ok = (summary["with_length"]["status"] == 413 and summary["chunked"]["status"] in (413, "closed: WriteError")
          and summary["prompt_in_a_large_body"]["status"] == 400
          and summary["idle"]["health"] == 200 and summary["idle"]["request"] == 200)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
