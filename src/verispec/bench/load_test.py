"""`verispec bench-serve`: a load generator for OpenAI-compatible servers, and the run it makes.

Owns the workloads, the streaming client and the records. Every request is a streamed (`stream:
true`), greedy (temperature 0) completion with a fixed `max_tokens`, asking for the usage
(`stream_options.include_usage`); the client times it: time to first token (the first chunk
with text), the arrival of every chunk with text (speculative servers commit tokens in bursts,
so inter-token latency is measured per streamed chunk), and the end. Token counts come from
the server's usage where it reports one, else from a tokenizer, else the number of chunks (the
record says which, `tokens_source`).

Workloads, run against each server in this order (`measure`):
- `warmup`: one request, not counted.
- `closed`: for each concurrency C, C clients each sending its next request as soon as its last
  one ended, R requests in all (the prompts in turn). Concurrency 1 always runs first: its
  outputs are each prompt's solo output, which every later output of the same prompt is
  compared with (`solo_identical`; a cancelled request: whether its partial text is a prefix).
- `open`: for each rate, R requests sent at that many per second (Poisson or evenly spaced
  arrivals, seeded), whatever the answers.
- `chat`: multi-turn conversations on /v1/chat/completions; each turn re-sends the history (the
  earlier questions and the server's own answers) plus a new question.
- `prefix`: a prompt of about N tokens sent once (cold: it starts with a random marker no server
  has seen), then again with a different last line: a server that caches prefixes answers the
  second sooner (time to first token, cold over warm).
- `soak`: N requests at concurrency C, a share of them cancelled (the client disconnects after
  1 to 4 chunks, or after up to a second, queued or not); the server's resident memory is
  sampled throughout, and one request is sent after it (`after-soak`).

Writes `records.jsonl` (one line a request) and `phases.jsonl` (one line a workload level: wall
time, client and server CPU seconds, memory samples). The summary, report and plots are
`load_test_report`'s; starting and stopping the servers is `servers`'.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ConfigError
from . import servers as srv

RECORDS_FILE = "records.jsonl"
PHASES_FILE = "phases.jsonl"
ENDPOINTS = ("chat", "completions")
ARRIVALS = ("poisson", "constant")
PREFIX_MAX_TOKENS = 16  # the prefix test measures the time to the first token only
PREFIX_QUESTIONS = ("Which sentence of the text above is the longest? Answer briefly.",
                    "Which word appears most often in the text above? Answer briefly.")
SYNTHETIC_FOLLOW_UPS = ("Summarize your answer in two sentences.", "Now give one more example, briefly.")
DEFAULT_CHARS_PER_TOKEN = 4.0
URL_READY_S = 30.0  # how long a running server (a URL) may take to answer /health
CANCEL_AFTER_CHUNKS = (1, 4)  # a soak cancellation: 3 in 4 after this many chunks (uniform)...
CANCEL_AFTER_S = (0.05, 1.0)  # ...1 in 4 after this many seconds, whether it waits or streams
MEMORY_SAMPLE_S = 0.25
SETTLE_S = 1.0  # wait after the soak before the memory is read again
# An output is "mixed" when it begins with more of another prompt's solo output than of its own,
# and that shared beginning is at least this share of its text.
MIXED_SHARE = 0.5


@dataclass(frozen=True)
class Prompt:
    key: str
    category: str
    text: str


@dataclass(frozen=True)
class Conversation:
    key: str
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class ServeSettings:
    """What to send. `requests`: per closed-loop level and open-loop rate (None: the number of
    prompts, and at least the concurrency)."""

    endpoint: str = "chat"
    max_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests: int | None = None
    rates: tuple[float, ...] = ()
    arrivals: str = "poisson"
    chat_conversations: int = 4
    chat_concurrency: int = 1
    prefix_repeats: int = 2
    prefix_tokens: int = 1000
    soak_requests: int = 0
    soak_concurrency: int = 16
    cancel_fraction: float = 0.2
    seed: int = 0
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        def integer(name, value, low, high=None):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
                limit = f">= {low}" if high is None else f"in {low}..{high}"
                raise ConfigError(f"--{name} must be an integer {limit}, got {value!r}")

        if self.endpoint not in ENDPOINTS:
            raise ConfigError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.arrivals not in ARRIVALS:
            raise ConfigError(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        integer("max-tokens", self.max_tokens, 1)
        if not self.concurrency:
            raise ConfigError("--concurrency needs at least one level")
        for level in self.concurrency:
            integer("concurrency", level, 1, 1024)
        if self.requests is not None:
            integer("requests", self.requests, 1)
        for rate in self.rates:
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
                raise ConfigError(f"--rate must be positive request rates per second, got {rate!r}")
        integer("chat-conversations", self.chat_conversations, 0)
        integer("chat-concurrency", self.chat_concurrency, 1, 1024)
        integer("prefix-repeats", self.prefix_repeats, 0)
        integer("prefix-tokens", self.prefix_tokens, 16)
        integer("soak-requests", self.soak_requests, 0)
        integer("soak-concurrency", self.soak_concurrency, 1, 1024)
        if isinstance(self.cancel_fraction, bool) or not isinstance(self.cancel_fraction, (int, float)) \
                or not 0 <= self.cancel_fraction <= 1:
            raise ConfigError(f"--cancel-fraction must be in [0, 1], got {self.cancel_fraction!r}")
        integer("seed", self.seed, 0)
        if not isinstance(self.request_timeout, (int, float)) or not self.request_timeout > 0:
            raise ConfigError(f"--request-timeout must be positive, got {self.request_timeout!r}")

    @property
    def levels(self) -> list[int]:
        """The closed-loop levels in the order they run: 1 first (the solo reference)."""
        return sorted({1, *self.concurrency})

    def requests_at(self, concurrency: int, prompts: int) -> int:
        return self.requests if self.requests is not None else max(prompts, concurrency)

    def to_json(self) -> dict:
        return {**asdict(self), "concurrency": list(self.concurrency), "rates": list(self.rates)}


@dataclass
class Endpoint:
    """A ready server: where it is, the model id it serves, fields added to every request, and a
    watch on its process (None: memory and server CPU are not measured)."""

    label: str
    base_url: str
    model: str
    api_key: str | None = None
    body: dict = field(default_factory=dict)
    watch: srv.ProcessWatch | None = None


# -- prompts ---------------------------------------------------------------------------------------


def load_prompts(dataset: str, categories: Sequence[str] | None, per_category: int | None,
                 count: int | None) -> tuple[Path, list[Prompt]]:
    """The single-turn prompts of a dataset (datasets.load_dataset), the first `count` of them."""
    from .datasets import MULTITURN, load_dataset

    if dataset == MULTITURN:
        raise ConfigError(f"--dataset {MULTITURN} is a set of conversations: use --dataset spec-bench "
                          f"(its multi-turn questions feed the chat workload)")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ConfigError(f"--prompts must be an integer >= 1, got {count!r}")
    path, questions = load_dataset(dataset, categories, per_category)
    prompts = [Prompt(q.key, q.category, q.prompt) for q in questions]
    if count is not None:
        prompts = prompts[:count]
    if not prompts:
        raise ConfigError("no prompts selected")
    return path, prompts


def load_conversations(path: Path, prompts: Sequence[Prompt], count: int) -> list[Conversation]:
    """`count` conversations: the multi-turn questions of the question file (Spec-Bench's), one
    category after another in turn; a file without any gets synthetic ones, each prompt followed
    by SYNTHETIC_FOLLOW_UPS."""
    from .datasets import DatasetError, read_conversations

    if count == 0:
        return []
    try:
        questions = read_conversations(path)
    except DatasetError:
        return [Conversation(f"{p.key}-chat", p.category, (p.text, *SYNTHETIC_FOLLOW_UPS))
                for p in [prompts[i % len(prompts)] for i in range(count)]]
    conversations: dict[str, list] = {}
    for question in questions:
        root = question.key.rsplit("-", 1)[0]
        conversations.setdefault(root, [question.category]).append(question.prompt)
    by_category: dict[str, list[Conversation]] = {}
    for key, (category, *turns) in conversations.items():
        by_category.setdefault(category, []).append(Conversation(key, category, tuple(turns)))
    chosen, queues = [], [list(items) for items in by_category.values()]
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen


# -- the client ------------------------------------------------------------------------------------


def _record(endpoint: Endpoint, phase: str, level, index: int, key: str, chat: bool) -> dict:
    return {"server": endpoint.label, "phase": phase, "level": level, "index": index, "key": key, "turn": None,
            "variant": None, "endpoint": "chat" if chat else "completions", "start_s": None, "ttft_s": None,
            "e2e_s": None, "chunk_offsets_s": [], "chunks": 0, "prompt_tokens": None, "completion_tokens": None,
            "tokens_source": None, "text": "", "finish_reason": None, "done": False, "status": None,
            "http_status": None, "error": None, "cancel_plan": None, "solo_identical": None, "mixed": None}


async def send(client, endpoint: Endpoint, record: dict, content, max_tokens: int, zero: float,
               cancel_after_chunks: int | None = None, cancel_after_s: float | None = None) -> dict:
    """Stream one request, filling `record` (see `_record`) in place; times are seconds from
    `zero` (the start of the phase) or from the request's own start (ttft, e2e, chunk offsets).
    `cancel_after_chunks` / `cancel_after_s`: disconnect after that many chunks with text, or
    after that many seconds, waiting or streaming (status `cancelled`, unless it ended first)."""
    chat = record["endpoint"] == "chat"
    body = {"model": endpoint.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **endpoint.body}
    body["messages" if chat else "prompt"] = content
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    started = time.perf_counter()
    record["start_s"] = started - zero
    pieces: list[str] = []

    async def consume() -> None:
        async with client.stream("POST", endpoint.base_url + path, json=body, headers=headers) as response:
            record["http_status"] = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record["status"], record["error"] = "error", f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    record["done"] = True
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    record["status"], record["error"] = "error", f"not JSON: {data[:200]}"
                    return
                if "error" in event:
                    record["status"], record["error"] = "error", json.dumps(event["error"])[:300]
                    return
                if event.get("usage"):
                    record["prompt_tokens"] = event["usage"].get("prompt_tokens")
                    record["completion_tokens"] = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter() - started
                        if record["ttft_s"] is None:
                            record["ttft_s"] = now
                        record["chunk_offsets_s"].append(now)
                        pieces.append(text)
                    if choice.get("finish_reason"):
                        record["finish_reason"] = choice["finish_reason"]
                if cancel_after_chunks is not None and len(record["chunk_offsets_s"]) >= cancel_after_chunks \
                        and record["finish_reason"] is None:
                    record["status"] = "cancelled"
                    return  # leaving the block closes the connection mid-stream

    try:
        if cancel_after_s is not None:
            try:
                await asyncio.wait_for(consume(), cancel_after_s)
            except asyncio.TimeoutError:
                record["status"] = "cancelled"
        else:
            await consume()
    except Exception as error:  # httpx's transport errors, a reset connection
        record["status"], record["error"] = "error", f"{type(error).__name__}: {error}"[:300]
    record["e2e_s"] = time.perf_counter() - started
    record["text"] = "".join(pieces)
    record["chunks"] = len(record["chunk_offsets_s"])
    if record["status"] is None:
        record["status"] = "ok" if record["finish_reason"] is not None else "incomplete"
    if record["completion_tokens"] is not None:
        record["tokens_source"] = "usage"
    return record


def prompt_content(prompt_text: str, chat: bool):
    return [{"role": "user", "content": prompt_text}] if chat else prompt_text


# -- the workloads ---------------------------------------------------------------------------------


class Measurement:
    """One server's workloads: the client, the records and the per-level phase entries."""

    def __init__(self, endpoint: Endpoint, settings: ServeSettings, prompts: Sequence[Prompt],
                 conversations: Sequence[Conversation], log: Callable[[str], None] = lambda m: None):
        self.endpoint, self.settings, self.prompts, self.conversations = endpoint, settings, list(prompts), list(conversations)
        self.log = log
        self.records: list[dict] = []
        self.phases: list[dict] = []
        self.solo: dict[str, str] = {}
        self.client = None

    # a level: its requests run inside `timed`, which notes wall, client and server CPU
    async def _timed(self, phase: str, level, run) -> list[dict]:
        watch = self.endpoint.watch
        server_cpu = watch.cpu_s() if watch else None
        client_cpu, started = time.process_time(), time.perf_counter()
        records = await run(started)
        wall = time.perf_counter() - started
        entry = {"server": self.endpoint.label, "phase": phase, "level": level, "wall_s": wall,
                 "client_cpu_s": time.process_time() - client_cpu,
                 "server_cpu_s": (watch.cpu_s() - server_cpu) if watch and server_cpu is not None else None}
        self.phases.append(entry)
        self._compare(records)
        self.records += records
        ok = [r for r in records if r["status"] == "ok"]
        tokens = sum(r["completion_tokens"] or 0 for r in ok)
        self.log(f"{self.endpoint.label}: {phase} {level}: {len(ok)}/{len(records)} answered, "
                 f"{tokens} tokens in {wall:.1f} s ({tokens / wall if wall else 0:.1f} tok/s)")
        return records

    async def _pool(self, jobs: list[Callable], concurrency: int) -> list[dict]:
        """Run the jobs (coroutine functions -> record) with `concurrency` workers, in order."""
        queue = list(enumerate(jobs))
        results: list[dict | None] = [None] * len(jobs)

        async def worker():
            while queue:
                index, job = queue.pop(0)
                results[index] = await job()

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
        return results

    def _request(self, phase: str, level, index: int, prompt: Prompt, zero: float, **cancel):
        chat = self.settings.endpoint == "chat"

        async def job():
            record = _record(self.endpoint, phase, level, index, prompt.key, chat)
            return await send(self.client, self.endpoint, record, prompt_content(prompt.text, chat),
                              self.settings.max_tokens, zero, **cancel)

        return job

    async def single(self, phase: str) -> list[dict]:
        """One request of the first prompt (the warm-up, and the request after the soak)."""
        return await self._timed(phase, 1, lambda zero: self._pool([self._request(phase, 1, 0, self.prompts[0], zero)], 1))

    async def closed(self, concurrency: int) -> list[dict]:
        count = self.settings.requests_at(concurrency, len(self.prompts))

        async def run(zero):
            jobs = [self._request("closed", concurrency, i, self.prompts[i % len(self.prompts)], zero) for i in range(count)]
            return await self._pool(jobs, concurrency)

        return await self._timed("closed", concurrency, run)

    async def open(self, rate: float) -> list[dict]:
        count = self.settings.requests_at(1, len(self.prompts))
        rng = random.Random(f"{self.settings.seed}-open-{rate}")
        arrivals, at = [], 0.0
        for _ in range(count):
            arrivals.append(at)
            at += rng.expovariate(rate) if self.settings.arrivals == "poisson" else 1.0 / rate

        async def run(zero):
            async def arrive(i):
                await asyncio.sleep(max(0.0, zero + arrivals[i] - time.perf_counter()))
                return await self._request("open", rate, i, self.prompts[i % len(self.prompts)], zero)()

            return list(await asyncio.gather(*(arrive(i) for i in range(count))))

        return await self._timed("open", rate, run)

    async def chat(self) -> list[dict]:
        level = self.settings.chat_concurrency

        def conversation_job(number: int, conversation: Conversation, zero: float):
            async def job():
                messages, records = [], []
                for turn, question in enumerate(conversation.turns, 1):
                    messages.append({"role": "user", "content": question})
                    record = _record(self.endpoint, "chat", level, number, conversation.key, True)
                    record["turn"] = turn
                    await send(self.client, self.endpoint, record, list(messages), self.settings.max_tokens, zero)
                    records.append(record)
                    if record["status"] != "ok":
                        break
                    messages.append({"role": "assistant", "content": record["text"]})
                return records

            return job

        async def run(zero):
            jobs = [conversation_job(i, c, zero) for i, c in enumerate(self.conversations)]
            return [r for records in await self._pool(jobs, level) for r in records]

        return await self._timed("chat", level, run)

    def chars_per_token(self) -> float:
        """Characters per prompt token on this server, from the solo requests' usage."""
        pairs = [(len(p.text), r["prompt_tokens"]) for r in self.records if r["phase"] == "closed" and r["level"] == 1
                 and r["prompt_tokens"] for p in self.prompts if p.key == r["key"]]
        chars, tokens = sum(c for c, _ in pairs), sum(t for _, t in pairs)
        return chars / tokens if tokens else DEFAULT_CHARS_PER_TOKEN

    def prefix_document(self, marker: str) -> str:
        """A text of about `prefix_tokens` tokens (the prompts, repeated), starting with `marker`."""
        header = f"Reference text {marker}.\n\n"
        wanted = max(0, int(self.settings.prefix_tokens * self.chars_per_token()) - len(header))
        body, i = "", 0
        while len(body) < wanted:
            body += self.prompts[i % len(self.prompts)].text.strip() + "\n\n"
            i += 1
        return header + body[:wanted]

    async def prefix(self) -> list[dict]:
        chat = self.settings.endpoint == "chat"

        async def run(zero):
            records = []
            for repeat in range(self.settings.prefix_repeats):
                document = self.prefix_document(os.urandom(8).hex())  # never seen: the first request is cold
                for variant, question in zip(("cold", "warm"), PREFIX_QUESTIONS):
                    record = _record(self.endpoint, "prefix", self.settings.prefix_tokens, repeat, f"prefix-{repeat}", chat)
                    record["variant"] = variant
                    content = document + "\n\n" + question
                    await send(self.client, self.endpoint, record, prompt_content(content, chat), PREFIX_MAX_TOKENS, zero)
                    records.append(record)
            return records

        return await self._timed("prefix", self.settings.prefix_tokens, run)

    async def soak(self) -> list[dict]:
        settings, watch = self.settings, self.endpoint.watch
        rng = random.Random(f"{settings.seed}-soak")
        plans = []
        for _ in range(settings.soak_requests):
            plan = {}
            if rng.random() < settings.cancel_fraction:
                if rng.random() < 0.25:
                    plan = {"cancel_after_s": round(rng.uniform(*CANCEL_AFTER_S), 3)}
                else:
                    plan = {"cancel_after_chunks": rng.randint(*CANCEL_AFTER_CHUNKS)}
            plans.append(plan)
        samples: list[tuple[float, int]] = []
        warm = await self._memory(4)

        async def run(zero):
            stop = asyncio.Event()

            async def sample():
                while not stop.is_set():
                    rss = watch.rss()
                    if rss:
                        samples.append((time.perf_counter() - zero, rss))
                    try:
                        await asyncio.wait_for(stop.wait(), MEMORY_SAMPLE_S)
                    except asyncio.TimeoutError:
                        pass

            sampler = asyncio.ensure_future(sample()) if watch else None
            jobs = []
            for i, plan in enumerate(plans):
                job = self._request("soak", settings.soak_concurrency, i, self.prompts[i % len(self.prompts)], zero, **plan)
                jobs.append(self._with_plan(job, plan))
            try:
                return await self._pool(jobs, settings.soak_concurrency)
            finally:
                stop.set()
                if sampler is not None:
                    await sampler

        records = await self._timed("soak", settings.soak_concurrency, run)
        await asyncio.sleep(SETTLE_S)
        end = await self._memory(4)
        self.phases[-1].update(rss_warm=warm, rss_end=end, rss_peak=max((s for _, s in samples), default=None),
                               rss_samples=samples)
        await self.single("after-soak")
        return records

    @staticmethod
    def _with_plan(job, plan):
        async def planned():
            record = await job()
            record["cancel_plan"] = plan or None
            return record

        return planned

    async def _memory(self, samples: int) -> int | None:
        """The median of a few resident-memory samples of the server, MEMORY_SAMPLE_S apart."""
        if self.endpoint.watch is None:
            return None
        values = []
        for _ in range(samples):
            rss = self.endpoint.watch.rss()
            if rss:
                values.append(rss)
            await asyncio.sleep(MEMORY_SAMPLE_S)
        return int(statistics.median(values)) if values else None

    # solo comparison
    def _compare(self, records: list[dict]) -> None:
        """Fill `solo_identical` and `mixed` of the records of prompts with a solo output. The
        first answered request of each prompt at closed-loop concurrency 1 is its solo output."""
        for record in records:
            if record["phase"] in ("chat", "prefix", "warmup"):
                continue
            key = record["key"]
            if record["phase"] == "closed" and record["level"] == 1 and record["status"] == "ok" and key not in self.solo:
                self.solo[key] = record["text"]
            if key not in self.solo or record["status"] not in ("ok", "cancelled"):
                continue
            own, text = self.solo[key], record["text"]
            record["solo_identical"] = text == own if record["status"] == "ok" else own.startswith(text)
            if record["solo_identical"]:
                record["mixed"] = False
                continue
            shared_own = _common_prefix(text, own)
            shared_other = max((_common_prefix(text, other) for k, other in self.solo.items() if k != key), default=0)
            record["mixed"] = shared_other > shared_own and shared_other >= MIXED_SHARE * len(text)

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.settings.request_timeout, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as self.client:
            await self.single("warmup")
            for level in self.settings.levels:
                await self.closed(level)
            for rate in self.settings.rates:
                await self.open(rate)
            if self.conversations:
                await self.chat()
            if self.settings.prefix_repeats:
                await self.prefix()
            if self.settings.soak_requests:
                await self.soak()


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def count_missing_tokens(records: list[dict], counter: Callable[[str], int] | None) -> None:
    """Give every record without the server's usage a token count: `counter(text)` (a tokenizer)
    where there is one, else its number of chunks with text."""
    for record in records:
        if record["completion_tokens"] is None and record["status"] in ("ok", "cancelled"):
            if counter is not None:
                record["completion_tokens"], record["tokens_source"] = counter(record["text"]), "tokenizer"
            else:
                record["completion_tokens"], record["tokens_source"] = record["chunks"], "chunks"


def tokenizer_counter(directory: str | Path | None) -> Callable[[str], int] | None:
    """A token counter from a tokenizer directory, loaded on first use; None without one."""
    if directory is None:
        return None
    loaded = {}

    def count(text: str) -> int:
        if "tokenizer" not in loaded:
            from transformers import AutoTokenizer

            loaded["tokenizer"] = AutoTokenizer.from_pretrained(str(directory))
        return len(loaded["tokenizer"](text, add_special_tokens=False)["input_ids"])

    return count


# -- a run: every server in turn -------------------------------------------------------------------


def _file_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("_")[:80] or "server"


def measure(endpoint: Endpoint, settings: ServeSettings, prompts: Sequence[Prompt],
            conversations: Sequence[Conversation], counter: Callable[[str], int] | None = None,
            log: Callable[[str], None] = lambda m: None) -> tuple[list[dict], list[dict]]:
    """Every workload against one ready server -> (request records, phase entries)."""
    measurement = Measurement(endpoint, settings, prompts, conversations, log)
    asyncio.run(measurement.run())
    count_missing_tokens(measurement.records, counter)
    return measurement.records, measurement.phases


@dataclass(frozen=True)
class RunOptions:
    """How servers are started and reached."""

    model: srv.ModelFiles = srv.ModelFiles(None)
    threads: int = 2
    api_key: str | None = None
    start_timeout: float = 900.0
    llama_server: str | None = None
    vllm_python: str | None = None
    tokenizer: str | None = None


def run_servers(specs: Sequence[srv.ServerSpec], settings: ServeSettings, prompts: Sequence[Prompt],
                conversations: Sequence[Conversation], out_dir: Path, options: RunOptions,
                log: Callable[[str], None] = lambda m: None) -> dict:
    """Measure each server in turn (starting and stopping those bench-serve manages), appending
    to RECORDS_FILE and PHASES_FILE in `out_dir` -> {label: what was started and how it went}."""
    import signal

    def stop_on_term(signum, frame):  # SIGTERM: leave as Ctrl-C does, stopping the started server
        raise KeyboardInterrupt

    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread handles signals
        return _run_servers(specs, settings, prompts, conversations, out_dir, options, log)
    previous = signal.signal(signal.SIGTERM, stop_on_term)
    try:
        return _run_servers(specs, settings, prompts, conversations, out_dir, options, log)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_servers(specs, settings, prompts, conversations, out_dir, options, log) -> dict:
    given = tokenizer_counter(options.tokenizer)
    own: list = []  # the started servers' model's tokenizer, looked up once
    started: dict[str, dict] = {}
    for spec in specs:
        entry = {**spec.to_json(), "command": None, "model_id": None, "error": None, "log": None}
        started[spec.label] = entry
        server = None
        try:
            if spec.managed:
                port = srv.free_port()
                argv, env = srv.server_command(spec, options.model, options.threads, port,
                                               llama_server=options.llama_server, vllm_python=options.vllm_python,
                                               scratch=out_dir / "servers")
                entry["command"] = shlex.join(argv)
                entry["environment"] = env
                entry["log"] = f"servers/{_file_name(spec.label)}.log"
                log(f"starting {spec.label}: {entry['command']}")
                server = srv.ManagedServer(argv, env, out_dir / entry["log"], port)
                began = time.perf_counter()
                try:
                    model_id = srv.wait_ready(server.base_url, options.start_timeout, server.alive, options.api_key)
                except srv.ServerStartError as error:
                    raise srv.ServerStartError(f"{error}; the end of its log:\n{server.log_tail()}") from None
                entry["start_s"] = round(time.perf_counter() - began, 1)
                base_url, pid = server.base_url, server.pid
            else:
                model_id = srv.wait_ready(spec.url, min(options.start_timeout, URL_READY_S), api_key=options.api_key)
                base_url, pid = spec.url, spec.pid
            entry["model_id"] = model_id
            counter = given
            if counter is None and spec.managed:
                own = own or [tokenizer_counter(options.model.tokenizer_dir())]
                counter = own[0]
            watch = srv.ProcessWatch(pid) if pid is not None else None
            endpoint = Endpoint(spec.label, base_url, model_id, options.api_key, dict(spec.body), watch)
            records, phases = measure(endpoint, settings, prompts, conversations, counter, log)
            _append(out_dir / RECORDS_FILE, records)
            _append(out_dir / PHASES_FILE, phases)
        except srv.ServerStartError as error:
            entry["error"] = str(error)
            log(f"{spec.label}: {error}")
        finally:
            if server is not None:
                server.stop()
    return started


def _append(path: Path, items: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as file:
        for item in items:
            file.write(json.dumps(item) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# -- the command -----------------------------------------------------------------------------------


def _numbers(value: str, kind, option: str) -> tuple:
    try:
        return tuple(kind(part.strip()) for part in value.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated {'integers' if kind is int else 'numbers'}, got {value!r}") from None


def run_command(*, server: Sequence[str], model: str | None, threads: int, dataset: str, categories: str | None,
                per_category: int | None, prompts: int | None, max_tokens: int, endpoint: str, concurrency: str,
                requests: int | None, rate: str, arrivals: str, chat_conversations: int, chat_concurrency: int,
                prefix_repeats: int, prefix_tokens: int, soak_requests: int, soak_concurrency: int,
                cancel_fraction: float, seed: int, request_timeout: float, start_timeout: float, api_key: str | None,
                tokenizer: str | None, llama_server: str | None, vllm_python: str | None, out_dir: str | None,
                command: str = "verispec bench-serve", log: Callable[[str], None] = lambda m: None) -> tuple[dict, Path, dict]:
    """`verispec bench-serve`: check every option (a ConfigError before anything starts), measure
    each server, write the report -> (summary, the run directory, the servers' entries)."""
    from datetime import datetime

    from . import load_test_report, report

    settings = ServeSettings(
        endpoint=endpoint, max_tokens=max_tokens, concurrency=_numbers(concurrency, int, "--concurrency"),
        requests=requests, rates=_numbers(rate, float, "--rate"), arrivals=arrivals,
        chat_conversations=chat_conversations, chat_concurrency=chat_concurrency, prefix_repeats=prefix_repeats,
        prefix_tokens=prefix_tokens, soak_requests=soak_requests, soak_concurrency=soak_concurrency,
        cancel_fraction=cancel_fraction, seed=seed, request_timeout=request_timeout)
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
        raise ConfigError(f"--threads must be in 1..1024, got {threads!r}")
    if not start_timeout > 0:
        raise ConfigError(f"--start-timeout must be positive, got {start_timeout!r}")
    if not server:
        raise ConfigError("give at least one --server")
    specs = [srv.parse_server(text, max(settings.levels)) for text in server]
    srv.check_labels(specs)
    if model is not None and not Path(model).expanduser().exists():
        raise ConfigError(f"--model {model} not found")
    files = srv.ModelFiles(model)
    for spec in specs:
        if spec.pid is not None:
            srv.ProcessWatch(spec.pid)  # a ConfigError for a process that is not there
        if spec.kind == "llama-server":
            files.gguf()
            srv.llama_binary("llama-server", llama_server)
        elif spec.kind == "vllm":
            srv.find_peer(vllm_python, srv.VLLM_PYTHON_RELATIVE, "vllm")
    if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
        raise ConfigError(f"--tokenizer {tokenizer} is not a directory")
    names = [c.strip() for c in (categories or "").split(",") if c.strip()]
    path, chosen = load_prompts(dataset, names, per_category, prompts)
    conversations = load_conversations(path, chosen, chat_conversations)
    directory = Path(out_dir) if out_dir else Path("bench-out") / f"serve-{datetime.now():%Y%m%d-%H%M%S}"
    if (directory / RECORDS_FILE).exists():
        raise ConfigError(f"{directory} already holds a serving run; give another --out")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"cannot create {directory}: {error.strerror or error}") from None
    config = {"command": command, "settings": settings.to_json(), "threads": threads, "model": model,
              "dataset": str(path), "prompts": len(chosen), "conversations": len(conversations),
              "machine": report.machine_info()}
    options = RunOptions(model=files, threads=threads, api_key=api_key, start_timeout=start_timeout,
                         llama_server=llama_server, vllm_python=vllm_python, tokenizer=tokenizer)
    started = run_servers(specs, settings, chosen, conversations, directory, options, log)
    summary = load_test_report.summarize(read_jsonl(directory / RECORDS_FILE), read_jsonl(directory / PHASES_FILE), started)
    load_test_report.write_report(directory, summary, config)
    return summary, directory, started
