"""A reliability soak of an OpenAI-compatible verispec server under KV-memory pressure.

Owns the workload (`plan`): N mixed requests, seeded, to /v1/completions with token-id prompts
of exact lengths (multiples of the KV block and others, some sharing a prefix), every method
the server offers, `n` from 1 to 4, greedy and seeded sampling, stop strings, streamed and not,
clients that disconnect mid-stream, and a few requests that could never fit the KV memory; the
run (`run`: C concurrent clients, the server's resident memory sampled throughout), and the
verdict (`Soak.summary`):

- lost: a request that got neither its full answer nor a clear refusal (a dropped connection, a
  truncated stream, a 5xx, fewer choices than asked, a finish reason that does not add up);
- refused: 4xx answers, each checked to be one the plan expects (only a request that could
  never fit may be refused: code kv_memory_exceeded);
- solo: after the soak, each greedy or seeded request of a method whose sample a seed fixes is
  sent again alone (nothing else running), and its text compared with what it got under load;
- blocks: the KV blocks in use once the server is idle (/metrics), which must be 0;
- memory: the server's resident memory once warm and at the end.

`scripts/soak_kv.py` starts `verispec serve --kv-memory ...` and runs it; `tests/test_kv_pressure`
runs a small one against a tiny model's server.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import httpx

BLOCK = 64  # the KV block (runtime.rows.BLOCK): prompts of multiples of it are the edge cases
# methods whose output a seed (or greedy decoding) fixes, whatever shares the batch
EXACT = ("ar", "pld", "anpd", "anpd/tree=8", "suffix")
DRAWN = ("eesd", "sps")  # exact when greedy; their sampled drafts depend on their controllers' timing
APPROXIMATE = ("mtad",)
STOPS = (".", "\n\n", "the")


@dataclass
class Planned:
    """One request of the soak and what became of it."""

    index: int
    body: dict
    never_fits: bool = False  # its prompt plus max_tokens exceed the whole KV memory
    disconnect_after: int | None = None  # a streaming client that leaves after this many chunks
    status: int = 0
    texts: list[str] = field(default_factory=list)  # per choice
    finish: list[str] = field(default_factory=list)
    error: str = ""
    outcome: str = ""  # "served", "refused", "disconnected", "lost"
    solo_equal: bool | None = None
    solo_texts: list[str] = field(default_factory=list)  # what the same request got alone

    @property
    def reproducible(self) -> bool:
        """Whether the same request alone must give the same text."""
        method = self.body["method"].split("/")[0] if "/" in self.body["method"] else self.body["method"]
        greedy = self.body.get("temperature", 1.0) == 0
        return self.body["method"] in EXACT or method in ("ar", "pld", "anpd") or (method in DRAWN and greedy)


def plan(count: int, vocab: int, pool_positions: int, methods: Sequence[str], seed: int = 0,
         max_prompt: int = 320) -> list[Planned]:
    """`count` mixed requests (see the module docstring); token ids drawn from 10..vocab-1.
    `pool_positions`: the KV memory in positions (blocks * 64); a few requests ask for more."""
    rng = random.Random(seed)
    corpus = [rng.randrange(10, vocab) for _ in range(4 * max_prompt)]
    shared = corpus[:BLOCK * 2]  # a common prefix (a system prompt): prefix-cache hits
    requests = []
    for index in range(count):
        kind = rng.random()
        if kind < 0.35:
            length = BLOCK * rng.randint(1, max(1, max_prompt // BLOCK))
        else:
            length = rng.randint(1, max_prompt)
        start = rng.randrange(0, len(corpus) - length)
        prompt = corpus[start : start + length]
        if rng.random() < 0.25:
            prompt = (shared + prompt)[:max(length, len(shared) + 1)]
        method = rng.choice(list(methods))
        sampled = method in APPROXIMATE or rng.random() < 0.4
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 96), "method": method,
                "n": rng.choice([1, 1, 1, 2, 3, 4]), "stream": rng.random() < 0.5,
                "temperature": 0.8 if sampled else 0.0}
        if sampled:
            body["seed"] = rng.randrange(1 << 30)
        if rng.random() < 0.2:
            body["stop"] = [rng.choice(STOPS)]
        item = Planned(index, body)
        if rng.random() < 0.01:  # could never fit: more than the whole KV memory
            body["max_tokens"] = pool_positions
            item.never_fits = True
        elif body["stream"] and rng.random() < 0.15:
            item.disconnect_after = rng.randint(1, 4)
        requests.append(item)
    return requests


def send(client: httpx.Client, url: str, item: Planned) -> None:
    """Send one planned request and record its outcome (never raises)."""
    body = item.body
    try:
        if body["stream"]:
            _streamed(client, url, item)
        else:
            answer = client.post(url + "/v1/completions", json=body)
            item.status = answer.status_code
            payload = answer.json()
            if answer.status_code == 200:
                choices = sorted(payload["choices"], key=lambda c: c["index"])
                item.texts = [c["text"] for c in choices]
                item.finish = [c["finish_reason"] for c in choices]
            else:
                item.error = payload.get("error", {}).get("code") or str(payload)[:200]
    except Exception as error:  # noqa: BLE001 - every failure is recorded as what it is
        item.error = f"{type(error).__name__}: {error}"[:300]
    item.outcome = _outcome(item)


def _streamed(client: httpx.Client, url: str, item: Planned) -> None:
    n = item.body["n"]
    texts, finish, chunks, done = [""] * n, [""] * n, 0, False
    with client.stream("POST", url + "/v1/completions", json=item.body) as answer:
        item.status = answer.status_code
        if answer.status_code != 200:
            answer.read()
            item.error = answer.json().get("error", {}).get("code") or answer.text[:200]
            return
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                item.error = str(event["error"])[:200]
                break
            for choice in event.get("choices", []):
                texts[choice["index"]] += choice.get("text", "")
                finish[choice["index"]] = choice.get("finish_reason") or finish[choice["index"]]
            chunks += 1
            if item.disconnect_after is not None and chunks >= item.disconnect_after:
                item.outcome = "disconnected"
                return  # leaving the with-block closes the connection mid-stream
    item.texts, item.finish = texts, finish
    if not done and not item.error:
        item.error = "the stream ended without [DONE]"


def _outcome(item: Planned) -> str:
    if item.outcome == "disconnected":
        return "disconnected"
    if 400 <= item.status < 500 and item.never_fits and item.error == "kv_memory_exceeded":
        return "refused"
    if item.status != 200 or item.error or len(item.texts) != item.body["n"]:
        return "lost"
    if any(reason not in ("stop", "length") for reason in item.finish):
        return "lost"
    return "served"


@dataclass
class Soak:
    """A soak's outcome (see the module docstring)."""

    requests: list[Planned]
    seconds: float
    rss_warm: int | None
    rss_end: int | None
    rss_peak: int | None
    blocks_in_use: float | None

    def summary(self) -> dict:
        outcomes = [r.outcome for r in self.requests]
        checked = [r for r in self.requests if r.solo_equal is not None]
        statuses: dict[int, int] = {}
        for r in self.requests:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        return {
            "requests": len(self.requests), "choices": sum(r.body["n"] for r in self.requests),
            "served": outcomes.count("served"), "refused": outcomes.count("refused"),
            "disconnected": outcomes.count("disconnected"), "lost": outcomes.count("lost"),
            "statuses": statuses, "server_errors": sum(v for k, v in statuses.items() if k >= 500),
            "refused_unexpectedly": sum(1 for r in self.requests if r.outcome == "lost" and 400 <= r.status < 500),
            "solo_checked": len(checked), "solo_equal": sum(1 for r in checked if r.solo_equal),
            "methods": sorted({r.body["method"] for r in self.requests}),
            "seconds": round(self.seconds, 1), "rss_warm_mb": _mb(self.rss_warm), "rss_end_mb": _mb(self.rss_end),
            "rss_peak_mb": _mb(self.rss_peak), "kv_blocks_in_use_at_end": self.blocks_in_use,
            "lost_examples": [_example(r) for r in self.requests if r.outcome == "lost"][:5],
            "unequal_examples": [_example(r) for r in checked if not r.solo_equal][:5],
        }


def _example(item: Planned) -> dict:
    """A request as the summary shows it: everything but its prompt's ids (their count instead)."""
    body = {k: v for k, v in item.body.items() if k != "prompt"} | {"prompt_tokens": len(item.body["prompt"])}
    return asdict(item) | {"body": body}


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


def _metric(url: str, name: str) -> float | None:
    """One sample of the server's /metrics, or None where it is not reported."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


def kv_blocks_in_use(url: str) -> float | None:
    """Blocks of KV memory held now (verispec's /metrics)."""
    return _metric(url, "verispec_kv_cache_blocks_used")


def kv_blocks_total(url: str) -> float | None:
    """Blocks in the server's KV pool (verispec's /metrics)."""
    return _metric(url, "verispec_kv_cache_blocks_total")


def run(url: str, requests: list[Planned], concurrency: int, rss: Callable[[], int | None] = lambda: None,
        solo: bool = True, timeout: float = 600.0, idle: Callable[[], bool] | None = None) -> Soak:
    """Send `requests` from `concurrency` clients (each its own connection), sampling `rss` every
    second; then, with `solo`, each reproducible served request alone again. `idle`: whether the
    server has nothing queued or running (else its /health is polled)."""
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            value = rss()
            if value:
                samples.append(value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    local = threading.local()

    def one(item: Planned) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=timeout)
        send(local.client, url, item)

    started = time.perf_counter()
    warm_at = max(1, len(requests) // 10)
    rss_warm = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(one, item) for item in requests]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            future.result()
            if done == warm_at:
                rss_warm = rss()
    seconds = time.perf_counter() - started
    wait_idle(url, idle)
    stop.set()
    sampler.join()
    rss_end = rss()
    blocks = kv_blocks_in_use(url)
    if solo:
        with httpx.Client(timeout=timeout) as client:
            for item in requests:
                if item.outcome == "served" and item.reproducible:
                    again = Planned(item.index, {**item.body, "stream": False})
                    send(client, url, again)
                    item.solo_equal = again.outcome == "served" and again.texts == item.texts
                    item.solo_texts = again.texts
    return Soak(requests, seconds, rss_warm, rss_end, max(samples, default=None), blocks)


def wait_idle(url: str, idle: Callable[[], bool] | None = None, timeout: float = 120.0) -> None:
    """Until the server has nothing queued or running (cancelled streams leave at their next step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if idle is not None:
            if idle():
                return
        else:
            health = httpx.get(url + "/health", timeout=30).json()
            if not health.get("running") and not health.get("queue_length"):
                return
        time.sleep(0.2)
