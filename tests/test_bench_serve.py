"""`verispec bench-serve`: the load generator, its records and report, and the server specs.

The load generator runs against a small in-process OpenAI-compatible fake (FastAPI + uvicorn in a
thread) whose answers are known in advance and which can change one answer, drop one stream, or
omit the usage; and against the real verispec HTTP app on a tiny random model, whose outputs are
checked against the library's. Also covered: closed- and open-loop counts, token counts with and
without the server's usage, the solo comparison and the `mixed` rule, cancellation accounting
(the client's cancellations against the disconnections the server saw), memory sampling, the
CLI end to end and its one-line errors, parsing server specs, the command lines that start the
peers, and starting and stopping a server process.

No test measures or limits time: the fake server's small sleeps only make requests overlap, and
every wait has a generous limit that only guards against a hang.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from verispec.bench import load_test, load_test_report, servers as srv
from verispec.cli import app
from verispec.errors import ConfigError
from verispec.runtime.build import cpu_flags

HANG_GUARD_S = 120
MODEL_ID = "fake-model"
PROMPTS = [load_test.Prompt("p0", "cat", "the first question"), load_test.Prompt("p1", "cat", "a second, longer question here"),
           load_test.Prompt("p2", "dog", "and a third one")]


# -- a fake OpenAI-compatible server ---------------------------------------------------------------


class FakeServer:
    """Answers every prompt with WORDS words derived from it (one token per word), streamed
    `chunk_words` words a chunk. `mutate=(text, n)`: the n-th answer (0-based) to that prompt
    has its last word changed; `drop=(text, n)`: that answer's stream breaks after one chunk;
    `usage=False`: no usage is reported. Waits `first_delay` seconds before the first chunk and
    `delay` before each. Counts how each stream ended (`outcomes`)."""

    WORDS = 8

    def __init__(self, chunk_words: int = 2, usage: bool = True, mutate=None, drop=None, delay: float = 0.002,
                 first_delay: float = 0.0):
        self.chunk_words, self.usage, self.mutate, self.drop, self.delay = chunk_words, usage, mutate, drop, delay
        self.first_delay = first_delay
        self.answered = collections.Counter()
        self.outcomes = collections.Counter()
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.app = self._app()

    @staticmethod
    def answer(text: str, max_tokens: int) -> list[str]:
        digest = hashlib.sha256(text.encode()).hexdigest()
        return [f"w{digest[i:i + 3]} " for i in range(FakeServer.WORDS)][:max_tokens]

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

        async def complete(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            text = body["messages"][-1]["content"] if chat else body["prompt"]
            with self.lock:
                count = self.answered[text]
                self.answered[text] += 1
            words = self.answer(text, body["max_tokens"])
            if self.mutate == (text, count):
                words[-1] = "changed "
            dropping = self.drop == (text, count)
            prompt_tokens = len(json.dumps(body.get("messages", body.get("prompt"))).split())
            return StreamingResponse(self._events(words, chat, prompt_tokens, dropping), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await complete(request, False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await complete(request, True)

        return app

    async def _events(self, words: list[str], chat: bool, prompt_tokens: int, dropping: bool):
        import asyncio

        finished = False
        try:
            await asyncio.sleep(self.first_delay)
            for start in range(0, len(words), self.chunk_words):
                await asyncio.sleep(self.delay)
                piece = "".join(words[start:start + self.chunk_words])
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                choice["finish_reason"] = None
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if dropping:
                    raise RuntimeError("the fake server breaks this stream")
            last = {"index": 0, "delta": {}, "finish_reason": "length"} if chat else {"index": 0, "text": "", "finish_reason": "length"}
            yield f"data: {json.dumps({'choices': [last]})}\n\n"
            if self.usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words), "total_tokens": prompt_tokens + len(words)}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            with self.lock:
                self.outcomes["finished" if finished else ("dropped" if dropping else "disconnected")] += 1


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1 and a free port in a daemon thread."""

    def __init__(self, asgi_app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(asgi_app, log_level="critical", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)


@pytest.fixture
def fake():
    """A factory: fake(**FakeServer options) -> (FakeServer, its URL); stopped after the test."""
    started = []

    def make(**options):
        server = FakeServer(**options)
        started.append(Served(server.app))
        return server, started[-1].url

    yield make
    for served in started:
        served.stop()


def endpoint(url: str, watch: bool = False) -> load_test.Endpoint:
    return load_test.Endpoint("fake", url, MODEL_ID, watch=srv.ProcessWatch(os.getpid()) if watch else None)


def settings(**overrides) -> load_test.ServeSettings:
    base = dict(endpoint="completions", max_tokens=8, concurrency=(1, 2), chat_conversations=0, prefix_repeats=0)
    return load_test.ServeSettings(**{**base, **overrides})


def by_phase(records, phase, level=None):
    return [r for r in records if r["phase"] == phase and (level is None or r["level"] == level)]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S} s"
        time.sleep(0.02)


# -- records and the solo comparison ---------------------------------------------------------------


def test_records_counts_and_solo_comparison(fake):
    # p0's 4th answer changes: the warm-up, then twice at concurrency 1 (5 requests over 3 prompts), then
    # its first request at concurrency 2
    server, url = fake(mutate=(PROMPTS[0].text, 3))
    records, phases = load_test.measure(endpoint(url), settings(concurrency=(2, 4), requests=5), PROMPTS, [])
    assert [len(by_phase(records, "closed", c)) for c in (1, 2, 4)] == [5, 5, 5]  # level 1 runs though not asked
    assert len(by_phase(records, "warmup")) == 1
    assert [(p["phase"], p["level"]) for p in phases] == [("warmup", 1), ("closed", 1), ("closed", 2), ("closed", 4)]
    for record in records:
        want = "".join(FakeServer.answer(PROMPTS[int(record["key"][1])].text, 8))
        assert record["status"] == "ok" and record["done"] and record["finish_reason"] == "length"
        assert record["completion_tokens"] == 8 and record["tokens_source"] == "usage"
        assert record["chunks"] == 4 and len(record["chunk_offsets_s"]) == 4
        assert 0 <= record["ttft_s"] == record["chunk_offsets_s"][0] <= record["chunk_offsets_s"][-1] <= record["e2e_s"]
        assert record["chunk_offsets_s"] == sorted(record["chunk_offsets_s"])
        assert (record["text"] == want) == (record["solo_identical"] is not False)
    changed = [r for r in records if r["solo_identical"] is False]
    assert len(changed) == 1 and changed[0]["phase"] == "closed" and changed[0]["level"] == 2
    assert changed[0]["key"] == "p0" and changed[0]["mixed"] is False
    summary = load_test_report.summarize(records, phases, {"fake": {}})
    rows = {r["concurrency"]: r for r in summary["closed"]}
    assert (rows[1]["identical"], rows[2]["identical"], rows[4]["identical"]) == (5, 4, 5)
    assert all(r["compared"] == 5 and r["tokens"] == 40 and r["answered"] == 5 for r in rows.values())
    assert rows[1]["vs_concurrency_1"] == 1.0
    assert rows[2]["tokens_per_s"] == pytest.approx(40 / phases[2]["wall_s"])
    assert rows[2]["tokens_per_chunk"] == 2.0
    assert rows[2]["itl_s"]["n"] == 5 * 3 and rows[2]["tpot_s"]["n"] == 5
    assert "| fake | 2 | 5 |" in load_test_report.render_markdown(summary, {}) and "| 4/5 |" in load_test_report.render_markdown(summary, {})


def test_open_loop_sends_every_request(fake):
    server, url = fake()
    records, phases = load_test.measure(endpoint(url), settings(concurrency=(1,), rates=(200.0, 50.0), requests=6,
                                                            arrivals="constant"), PROMPTS, [])
    for rate in (200.0, 50.0):
        sent = by_phase(records, "open", rate)
        assert len(sent) == 6 and all(r["status"] == "ok" and r["solo_identical"] for r in sent)
        starts = [r["start_s"] for r in sorted(sent, key=lambda r: r["index"])]
        assert starts == sorted(starts) and starts[-1] >= 0.9 * 5 / rate  # evenly spaced arrivals: the last at 5/rate s
    assert sum(server.answered.values()) == 1 + 6 + 12  # warm-up, closed loop at 1, two rates


def test_token_counts_without_usage(fake):
    server, url = fake(usage=False)
    records, _ = load_test.measure(endpoint(url), settings(concurrency=(1,)), PROMPTS, [],
                               counter=lambda text: len(text.split()) * 10)
    assert {(r["tokens_source"], r["completion_tokens"]) for r in records} == {("tokenizer", 80)}
    records, _ = load_test.measure(endpoint(url), settings(concurrency=(1,)), PROMPTS, [])
    assert {(r["tokens_source"], r["completion_tokens"]) for r in records} == {("chunks", 4)}


def test_chat_resends_the_history_and_prefix_changes_the_last_line(fake):
    server, url = fake()
    conversations = load_test.load_conversations(Path(load_test.__file__).parent / "data" / "builtin.jsonl", PROMPTS, 2)
    assert [c.turns for c in conversations] == [(p.text, *load_test.SYNTHETIC_FOLLOW_UPS) for p in PROMPTS[:2]]
    run = settings(endpoint="chat", concurrency=(1,), chat_conversations=2, prefix_repeats=2, prefix_tokens=60)
    records, _ = load_test.measure(endpoint(url), run, PROMPTS, conversations)
    chat = by_phase(records, "chat")
    assert [(r["index"], r["turn"]) for r in chat] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    third = [b["messages"] for b in server.bodies if len(b.get("messages", [])) == 5]
    assert len(third) == 2
    assert [m["role"] for m in third[0]] == ["user", "assistant", "user", "assistant", "user"]
    assert third[0][1]["content"] == chat[0]["text"] and third[0][3]["content"] == chat[1]["text"]
    prefix = by_phase(records, "prefix")
    assert [r["variant"] for r in prefix] == ["cold", "warm", "cold", "warm"]
    sent = [b["messages"][0]["content"] for b in server.bodies if b["messages"][0]["content"].startswith("Reference text")]
    assert len(sent) == 4
    for cold, warm in (sent[:2], sent[2:]):
        document = cold.rsplit("\n\n", 1)[0]
        assert warm.startswith(document) and cold != warm
        assert cold.rsplit("\n\n", 1)[1] == load_test.PREFIX_QUESTIONS[0] and warm.rsplit("\n\n", 1)[1] == load_test.PREFIX_QUESTIONS[1]
    assert sent[0].split("\n\n")[0] != sent[2].split("\n\n")[0]  # each repeat starts with a fresh marker
    summary = load_test_report.summarize(records, [], {"fake": {}})
    assert [r["turn"] for r in summary["chat"]] == [1, 2, 3] and summary["prefix"][0]["repeats"] == 2


def test_multiturn_conversations_from_a_question_file(tmp_path):
    path = tmp_path / "q.jsonl"
    lines = [{"question_id": 1, "category": "a", "turns": ["one", "two"]},
             {"question_id": 2, "category": "a", "turns": ["three", "four"]},
             {"question_id": 3, "category": "b", "turns": ["five", "six", "seven"]},
             {"question_id": 4, "category": "b", "turns": ["single"]}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    chosen = load_test.load_conversations(path, PROMPTS, 3)
    assert [(c.key, c.turns) for c in chosen] == [("1", ("one", "two")), ("3", ("five", "six", "seven")),
                                                   ("2", ("three", "four"))]
    assert load_test.load_conversations(path, PROMPTS, 0) == []


@pytest.mark.long  # a few seconds of streams: left out by make test-quick
def test_soak_accounts_for_every_request(fake, monkeypatch):
    # Streams of 8 chunks, 40 ms apart, after 0.3 s: a cancellation after 1 to 4 chunks cuts a stream
    # with at least 4 chunks to go, one after 0.15 s cuts it before its first chunk; either way the
    # server is still streaming when the client leaves.
    monkeypatch.setattr(load_test, "CANCEL_AFTER_S", (0.15, 0.15))
    monkeypatch.setattr(load_test, "MEMORY_SAMPLE_S", 0.05)
    monkeypatch.setattr(load_test, "SETTLE_S", 0.1)
    server, url = fake(chunk_words=1, delay=0.04, first_delay=0.3)
    run = settings(concurrency=(1,), soak_requests=24, soak_concurrency=12, cancel_fraction=0.5, seed=3)
    records, phases = load_test.measure(endpoint(url, watch=True), run, PROMPTS, [])
    soak = by_phase(records, "soak")
    assert len(soak) == 24 and sorted(r["index"] for r in soak) == list(range(24))
    statuses = collections.Counter(r["status"] for r in soak)
    assert statuses["ok"] + statuses["cancelled"] == 24
    planned = [r for r in soak if r["cancel_plan"]]
    assert 0 < len(planned) < 24
    by_chunks = [r for r in planned if "cancel_after_chunks" in r["cancel_plan"]]
    by_time = [r for r in planned if "cancel_after_s" in r["cancel_plan"]]
    assert by_chunks and all(r["status"] == "cancelled" and r["chunks"] == r["cancel_plan"]["cancel_after_chunks"]
                             for r in by_chunks)  # 8 chunks a stream: each is cut where planned
    assert by_time and all(r["status"] == "cancelled" and r["chunks"] == 0 for r in by_time)
    assert all(r["cancel_plan"] for r in soak if r["status"] == "cancelled")
    assert all(r["solo_identical"] for r in soak)  # complete ones equal, cancelled ones a prefix
    # every stream the client cut short, the server saw end without finishing (eventually)
    total = 1 + 3 + 24 + 1  # warm-up, solo, soak, after the soak
    wait_until(lambda: sum(server.outcomes.values()) == total, "every stream ended on the server")
    assert server.outcomes["disconnected"] == statuses["cancelled"]
    assert server.outcomes["finished"] == total - statuses["cancelled"]
    summary = load_test_report.summarize(records, phases, {"fake": {}})
    row = summary["soak"][0]
    assert (row["lost"], row["mixed"], row["cancelled"]) == (0, 0, statuses["cancelled"])
    assert row["rss_warm_mib"] and row["rss_end_mib"] and row["rss_peak_mib"]
    assert row["memory_within_tolerance"] is (row["rss_end_mib"] <= row["rss_warm_mib"] * 1.1 + 0.1)
    assert row["after_soak_identical"] is True
    assert phases[-2]["rss_samples"] and phases[-1]["phase"] == "after-soak"


def test_a_broken_stream_is_lost(fake):
    server, url = fake(drop=(PROMPTS[1].text, 2))  # p1's 3rd answer: its solo, then the soak's first and second p1
    run = settings(concurrency=(1,), soak_requests=6, soak_concurrency=2, cancel_fraction=0)
    records, phases = load_test.measure(endpoint(url), run, PROMPTS, [])
    broken = [r for r in records if r["status"] != "ok"]
    assert len(broken) == 1 and broken[0]["phase"] == "soak" and broken[0]["key"] == "p1"
    assert broken[0]["status"] in ("error", "incomplete") and broken[0]["chunks"] <= 1
    row = load_test_report.summarize(records, phases, {"fake": {}})["soak"][0]
    assert row["lost"] == 1 and row["answered"] == 5 and row["memory_within_tolerance"] is None  # no process watched


def test_mixed_outputs_are_those_closer_to_another_prompt():
    measurement = load_test.Measurement(load_test.Endpoint("x", "http://unused", MODEL_ID), settings(), PROMPTS, [])
    measurement.solo = {"p0": "alpha beta gamma delta", "p1": "one two three four"}

    def record(key, text, status="ok"):
        r = load_test._record(measurement.endpoint, "closed", 2, 0, key, False)
        r.update(text=text, status=status)
        return r

    records = [record("p0", "alpha beta gamma delta"), record("p0", "alpha beta gamma DELTA"),
               record("p0", "one two three four"), record("p1", "one two"), record("p1", "one three", "cancelled"),
               record("p1", "alpha beta", "cancelled"), record("p2", "no solo"), record("p0", "x", "error")]
    measurement._compare(records)
    assert [r["solo_identical"] for r in records] == [True, False, False, False, False, False, None, None]
    assert [r["mixed"] for r in records] == [False, False, True, False, False, True, None, None]


@pytest.mark.long  # a few seconds of streams: left out by make test-quick
def test_verispec_app_outputs_match_the_library():
    """The real server stack on a tiny random model: every output equals the library's greedy
    output for its prompt, token counts come from the usage."""
    import helpers
    import server_helpers as sh
    from verispec import generate
    from verispec.server import ServerSettings

    tokenizer = helpers.char_tokenizer()
    reference = sh.text_target(tokenizer, cls=sh.Target)
    server = sh.RunningServer(sh.text_target(tokenizer), ServerSettings(model_id="tiny", max_queue=64,
                                                                        request_timeout=HANG_GUARD_S, max_tokens_limit=64))
    prompts = [load_test.Prompt("a", "x", "hello world"), load_test.Prompt("b", "x", "abc abc abc"), load_test.Prompt("c", "y", "the cat")]
    try:
        run = settings(max_tokens=12, concurrency=(1, 3), requests=4, soak_requests=6, soak_concurrency=3, cancel_fraction=0.5)
        records, phases = load_test.measure(load_test.Endpoint("verispec", server.url, "tiny", watch=srv.ProcessWatch(os.getpid())),
                                        run, prompts, [])
    finally:
        server.stop()
    want = {p.key: generate(reference, p.text, "ar", max_new_tokens=12).text for p in prompts}
    answered = [r for r in records if r["status"] == "ok"]
    assert len(answered) >= 1 + 4 + 4 + 1
    for record in answered:
        assert record["text"] == want[record["key"]]
        assert record["completion_tokens"] == 12 and record["tokens_source"] == "usage"
        assert record["prompt_tokens"] == len(next(p.text for p in prompts if p.key == record["key"]))
    assert all(r["solo_identical"] for r in records if r["phase"] != "warmup")
    summary = load_test_report.summarize(records, phases, {"verispec": {}})
    assert [(r["concurrency"], r["identical"], r["compared"]) for r in summary["closed"]] == [(1, 4, 4), (3, 4, 4)]
    assert summary["soak"][0]["lost"] == 0


# -- the command -----------------------------------------------------------------------------------


@pytest.mark.long  # a few seconds of streams: left out by make test-quick
def test_cli_end_to_end(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(load_test, "MEMORY_SAMPLE_S", 0.05)
    monkeypatch.setattr(load_test, "SETTLE_S", 0.1)
    server, url = fake()
    out = tmp_path / "run"
    args = ["bench-serve", "--server", f"my-fake={url} --pid {os.getpid()}", "--dataset", "builtin", "--prompts", "2",
            "--max-tokens", "6", "--concurrency", "1,2", "--rate", "100", "--chat-conversations", "1",
            "--prefix-repeats", "1", "--prefix-tokens", "50", "--soak-requests", "4", "--soak-concurrency", "2",
            "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    compact = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(compact["closed"]) == {"my-fake@1", "my-fake@2"} and compact["failed"] == []
    for name in ("records.jsonl", "phases.jsonl", "summary.json", "report.md", load_test_report.THROUGHPUT_PLOT,
                 load_test_report.LATENCY_PLOT):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["machine"]["cpu"] and "instruction_sets" in summary["config"]["machine"]
    assert [r["concurrency"] for r in summary["closed"]] == [1, 2] and summary["open"][0]["requests"] == 2
    report = (out / "report.md").read_text()
    for section in ("## Closed loop", "## Open loop", "## Multi-turn chat", "## Cached prefix", "## Soak with cancellations",
                    "instruction sets:", "my-fake"):
        assert section in report
    again = CliRunner().invoke(app, args)  # the same --out again
    assert again.exit_code == 2 and "already holds a serving run" in again.stderr


def test_cli_reports_a_server_it_could_not_reach(tmp_path):
    port = srv.free_port()  # nothing listens there
    result = CliRunner().invoke(app, ["bench-serve", "--server", f"http://127.0.0.1:{port}", "--start-timeout", "1",
                                      "--chat-conversations", "0", "--prefix-repeats", "0", "--out", str(tmp_path / "r")])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and "could not be measured" in result.stderr
    assert "was not ready" in (tmp_path / "r" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--concurrency", "0"], "--concurrency must be an integer in 1..1024"),
    (["--rate", "-1"], "--rate must be positive"),
    (["--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
    (["--endpoint", "embeddings"], "--endpoint must be one of chat, completions"),
    (["--arrivals", "bursty"], "--arrivals must be one of poisson, constant"),
    (["--cancel-fraction", "1.5"], "--cancel-fraction must be in [0, 1]"),
    (["--threads", "0"], "--threads must be in 1..1024"),
    (["--prompts", "0"], "--prompts must be an integer >= 1"),
    (["--server", "llama-server:x"], "llama-server:N needs N"),
    (["--server", "vllm", "--vllm-python", "/nonexistent/python"], "/nonexistent/python not found"),
    (["--server", "llama-server", "--llama-server", "/nonexistent/llama-server"], "/nonexistent/llama-server not found"),
    (["--server", "nginx"], "the target must be http://HOST:PORT"),
    (["--server", "verispec:nomethod"], "unknown method"),
    (["--server", "a=verispec", "--server", "a=verispec:ar"], "two servers are labelled 'a'"),
    (["--server", "http://127.0.0.1:1 --color"], "a running server takes only --pid N and --body JSON"),
    (["--server", "http://127.0.0.1:1 --body [1]"], "--body must be a JSON object"),
    (["--dataset", "spec-bench-multiturn"], "is a set of conversations"),
    (["--dataset", "nothing-here.jsonl"], "neither builtin"),
    (["--model", "/nonexistent/model.gguf"], "not found"),
    (["--tokenizer", "/nonexistent"], "is not a directory"),
    (["--no-such-option"], "No such option"),
])
def test_cli_refuses_bad_arguments_in_one_line(args, message, tmp_path, monkeypatch):
    import helpers

    def refuse(*a, **k):
        raise AssertionError("bench-serve started measuring before checking its arguments")

    monkeypatch.setattr(load_test, "run_servers", refuse)
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, ["bench-serve", *args], message)
    assert not (tmp_path / "bench-out").exists()


def test_llama_server_from_the_native_build_alone_is_accepted(tmp_path, monkeypatch):
    """`make llama-native` alone (no portable `make llama-server` build) is enough for a
    llama-server peer: the argument check finds the same binary the run starts."""
    native = tmp_path / srv.LLAMA_NATIVE_RELATIVE / "llama-server"
    native.parent.mkdir(parents=True)
    native.write_text("#!/bin/sh\n")
    native.chmod(0o755)
    monkeypatch.chdir(tmp_path)

    class Started(Exception):
        pass

    def started(*a, **k):
        raise Started

    monkeypatch.setattr(load_test, "run_servers", started)
    result = CliRunner().invoke(app, ["bench-serve", "--server", "llama-server:8", "--out", str(tmp_path / "r")])
    assert isinstance(result.exception, Started), result.output


# -- server specs and processes --------------------------------------------------------------------


def test_parse_server_specs():
    spec = srv.parse_server("verispec:anpd --no-ngram-memory", 16)
    assert (spec.kind, spec.method, spec.args, spec.label) == ("verispec", "anpd", ("--no-ngram-memory",),
                                                                "verispec:anpd --no-ngram-memory")
    assert srv.parse_server("llama-server", 16).parallel == 16
    spec = srv.parse_server("ls=llama-server:8 --cache-reuse 256", 16)
    assert (spec.label, spec.parallel, spec.args) == ("ls", 8, ("--cache-reuse", "256"))
    spec = srv.parse_server("""run=http://127.0.0.1:8000/v1/ --pid 7 --body '{"method": "ar"}'""", 16)
    assert (spec.kind, spec.url, spec.pid, spec.body, spec.managed) == ("url", "http://127.0.0.1:8000", 7, {"method": "ar"}, False)
    assert srv.parse_server("vllm --enforce-eager", 1).args == ("--enforce-eager",)
    for bad in ("", "vllm:2", "=verispec", "verispec:anpd/bogus=1", "http://x --pid -3", "'unclosed"):
        with pytest.raises(ConfigError):
            srv.parse_server(bad, 1)


def write_gguf(path: Path, chat_template: str | None) -> Path:
    """A GGUF file without tensors, with a chat template or none."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_servers_repack_off_where_the_cpu_has_amx():
    """llama.cpp's repacked AMX path dies in prompt processing on AMX Xeons: off there, else its default."""
    assert srv.llama_environment(frozenset({"avx2", "amx_tile", "amx_int8"})) == {"LLAMA_ARG_REPACK": "0"}
    assert srv.llama_environment(frozenset({"avx2", "avx512_vnni"})) == {}


def test_server_commands(tmp_path):
    gguf = write_gguf(tmp_path / "m.gguf", None)
    binary, python = tmp_path / "llama-server", tmp_path / "python"
    binary.write_text(""), python.write_text("")
    files = srv.ModelFiles(str(gguf))
    argv, env = srv.server_command(srv.parse_server("llama-server:8 --foo", 16), files, 2, 1234, llama_server=str(binary),
                                   scratch=tmp_path / "scratch")
    assert argv[0] == str(binary) and argv[-1] == "--foo" and env["OMP_NUM_THREADS"] == "2"
    assert argv[argv.index("-m") + 1] == str(gguf) and argv[argv.index("--parallel") + 1] == "8"
    assert argv[argv.index("-c") + 1] == str(8 * srv.SLOT_CONTEXT) and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("--port") + 1] == "1234"
    assert env.get("LLAMA_ARG_REPACK") == ("0" if "amx_int8" in cpu_flags() else None)
    # no chat template in the file: llama-server gets verispec's plain chat format
    template = Path(argv[argv.index("--chat-template-file") + 1])
    assert "--jinja" in argv and template.read_text() == srv.PLAIN_CHAT_TEMPLATE
    with_template = srv.ModelFiles(str(write_gguf(tmp_path / "t.gguf", "{{ messages }}")))
    argv, _ = srv.server_command(srv.parse_server("llama-server:1", 1), with_template, 2, 1, llama_server=str(binary))
    assert "--chat-template-file" not in argv
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="cannot read GGUF file"):
        srv.server_command(srv.parse_server("llama-server:1", 1), srv.ModelFiles(str(tmp_path / "bad.gguf")), 2, 1,
                           llama_server=str(binary))
    argv, env = srv.server_command(srv.parse_server("verispec:ar", 1), files, 3, 99)
    assert argv[1:4] == ["-m", "verispec.cli", "serve"] and ["--method", "ar"] == argv[argv.index("--method"):][:2]
    assert argv[argv.index("--model") + 1] == str(gguf) and env == {"OMP_NUM_THREADS": "3"}
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    argv, env = srv.server_command(srv.parse_server("vllm", 1), srv.ModelFiles(str(model_dir)), 2, 5, vllm_python=str(python))
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"] and "--chat-template" not in argv
    assert argv[argv.index("--model") + 1] == str(model_dir) and argv[argv.index("--dtype") + 1] == "float32"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == min(2, len(os.sched_getaffinity(0)))
    # verispec's cached int8 blocks next to a converted model are hidden from vLLM, which would load them
    (model_dir / "tokenizer_config.json").write_text("{}")
    for name in ("config.json", "model.safetensors", srv.VERISPEC_BLOCKS):
        (model_dir / name).write_text(name)
    argv, _ = srv.server_command(srv.parse_server("vllm", 1), srv.ModelFiles(str(model_dir)), 2, 5, vllm_python=str(python),
                                 scratch=tmp_path / "scratch")
    seen = Path(argv[argv.index("--model") + 1])
    assert seen != model_dir and sorted(p.name for p in seen.iterdir()) == ["config.json", "model.safetensors",
                                                                            "tokenizer_config.json"]
    assert (seen / "model.safetensors").read_text() == "model.safetensors"
    assert Path(argv[argv.index("--chat-template") + 1]).read_text() == srv.PLAIN_CHAT_TEMPLATE
    with pytest.raises(ConfigError, match="serves a GGUF file"):
        srv.ModelFiles(str(model_dir)).gguf()


FAKE_PROCESS = """
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ok"} if self.path == "/health" else {"data": [{"id": "proc-model"}]}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_managed_server_starts_is_watched_and_stops(tmp_path):
    port = srv.free_port()
    server = srv.ManagedServer([sys.executable, "-c", FAKE_PROCESS, str(port)], {}, tmp_path / "logs" / "s.log", port)
    try:
        assert srv.wait_ready(server.base_url, HANG_GUARD_S, server.alive) == "proc-model"
        watch = srv.ProcessWatch(server.pid)
        assert watch.rss() > 0 and watch.cpu_s() >= 0
    finally:
        server.stop()
    assert not server.alive()
    crashed = srv.ManagedServer([sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"], {}, tmp_path / "c.log", port)
    try:
        with pytest.raises(srv.ServerStartError, match="exited before it was ready"):
            srv.wait_ready(crashed.base_url, HANG_GUARD_S, crashed.alive)
        assert "bad flag" in crashed.log_tail()
    finally:
        crashed.stop()
    with pytest.raises(ConfigError, match="no process"):
        srv.ProcessWatch(2**22 + 12345)


def test_plain_chat_template_is_verispecs_chat_format():
    """The template peers get for a model without one renders what verispec tokenizes for a chat
    (`encode_messages`' fallback), after the BOS its tokenizer adds."""
    import jinja2

    from verispec.request.text import encode_messages

    class Recording:
        chat_template = None
        texts: list = []

        def __call__(self, text):
            self.texts.append(text)
            return {"input_ids": [0]}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour.\n\nOne."}]
    tokenizer = Recording()
    encode_messages(tokenizer, messages)
    rendered = jinja2.Template(srv.PLAIN_CHAT_TEMPLATE).render(messages=messages, bos_token="<bos>")
    assert rendered == "<bos>" + tokenizer.texts[-1]
