"""Helpers for the server tests: a Target with fault and delay hooks, and a real uvicorn server
(configured as `verispec serve` configures it) running in a background thread on 127.0.0.1 and a
free port.

The server is the real stack (uvicorn, the ASGI app, the worker thread); only the model is a tiny
random-weight Llama over the character tokenizer of `helpers`, so every test talks HTTP to it as
a client would.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable, Sequence

import uvicorn

import helpers
from verispec.target.model import Target
from verispec.target.sequence import TargetSequence
from verispec.server import ServerSettings, create_app
from verispec.server.connections import uvicorn_config

# Prompts containing these strings trigger a hook during their prefill (see HookedTarget).
FAIL_MARKER = "qxqxq"  # the forward raises: an internal error in generation
BLOCK_MARKER = "qzqzq"  # the prefill waits until the target's `gate` is open: a request that blocks the worker
HANG_GUARD_S = 120  # the longest any wait in these tests may take: it only guards against a hang


def _contains(tokens: Sequence[int], pattern: Sequence[int]) -> bool:
    n = len(pattern)
    return any(list(tokens[i : i + n]) == list(pattern) for i in range(len(tokens) - n + 1))


class HookedTarget(Target):
    """A Target whose forwards can be slowed (`delay` seconds per forward) and whose prefill fails
    when the prompt contains FAIL_MARKER, or waits while `gate` is closed when it contains
    BLOCK_MARKER (`blocked` is set while it waits). The hooks sit where every request's forward
    goes: its sequence's `forward` (one request at a time) and `forward_parts` (a batched step).
    The gate is open unless a test closes it:

        target.gate.clear(); ...send a BLOCK_MARKER request, target.blocked.wait(...)...
        target.gate.set()  # in a finally
    """

    def __init__(self, model, tokenizer, name: str = "", delay: float = 0.0, **kwargs):
        super().__init__(model, tokenizer, name=name, **kwargs)
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.blocked = threading.Event()
        self._fail_ids = tokenizer(FAIL_MARKER)["input_ids"]
        self._block_ids = tokenizer(BLOCK_MARKER)["input_ids"]
        self._sequence = self.new_sequence()

    def new_sequence(self) -> TargetSequence:
        return _HookedSequence(self)

    def hook(self, tokens, prefill: bool) -> None:
        """What a forward of `tokens` meets before it runs."""
        if prefill:
            if _contains(tokens, self._fail_ids):
                raise RuntimeError("injected fault in the target forward")
            if _contains(tokens, self._block_ids):
                self.blocked.set()
                try:
                    self.gate.wait(HANG_GUARD_S)
                finally:
                    self.blocked.clear()

    def forward_parts(self, parts):
        for part in parts:
            self.hook(part.tokens, part.sequence.length == 0)
        if self.delay:
            time.sleep(self.delay)
        return super().forward_parts(parts)


class _HookedSequence(TargetSequence):
    def forward(self, tokens, last_only: bool = False, lazy: bool = False):
        self.target.hook(tokens, self.length == 0)
        if self.target.delay:
            time.sleep(self.target.delay)
        return super().forward(tokens, last_only, lazy)


def int8_text_target(tokenizer, delay: float = 0.0, max_positions: int = 256, seed: int = 3) -> HookedTarget:
    """The text tests' tiny Llama with block-exact weights in int8 numerics: its requests page
    their KV and run together in one batch (`Target.pages_kv`)."""
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=max_positions)
    model = helpers.make_model(config, seed=seed)
    return HookedTarget(model, tokenizer, name="tiny-text-llama-int8", delay=delay, fast=True,
                        blocks=helpers.blockify(model), numerics="int8")


def text_target(tokenizer, delay: float = 0.0, max_positions: int = 256, cls=HookedTarget) -> Target:
    """The tiny Llama of the text tests (seed 3) over the character tokenizer; every call builds
    the same weights, so two such targets give identical outputs."""
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=max_positions)
    model = helpers.make_model(config, seed=3)
    if cls is Target:
        return Target(model, tokenizer, name="tiny-text-llama")
    return cls(model, tokenizer, name="tiny-text-llama", delay=delay)


class RunningServer:
    """`create_app(target, settings)` served by uvicorn in a daemon thread until `stop()`."""

    def __init__(self, target: Target, settings: ServerSettings):
        self.target, self.settings = target, settings
        self.app = create_app(target, settings)
        # IPPROTO_TCP as `verispec serve` has it from getaddrinfo: asyncio sets TCP_NODELAY only on
        # sockets that say so, and without it every answer waits ~40 ms for a delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))  # a free port, held from now on: no race with other tests
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, settings, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True,
                                       name=f"uvicorn-{self.port}")
        self.thread.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    @property
    def worker(self):
        return self.app.state.worker

    def stop(self) -> None:
        if isinstance(self.target, HookedTarget):
            self.target.gate.set()  # never leave the worker blocked
        self.server.should_exit = True
        self.thread.join(HANG_GUARD_S)


def wait_until(condition: Callable[[], bool], timeout: float = HANG_GUARD_S, interval: float = 0.02) -> None:
    """Poll `condition` until true; raise AssertionError if it is still false after `timeout`
    seconds (a guard against a hang, never a measurement)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def raw_exchange(port: int, requests: list[tuple[str, str, bytes, dict]]) -> list[tuple[int, dict, bytes, bool]]:
    """Send `requests` (method, path, body, headers) one after another on one keep-alive
    connection with http.client; return (status, lower-cased headers, body, kept) for each, where
    `kept` says the same connection is still open after the answer (false after a
    `Connection: close`, when http.client opens a new one for the next request). A server that
    drops the connection without saying so makes the next request raise (reset or
    RemoteDisconnected), which fails the caller's test."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
    answers = []
    try:
        for method, path, body, headers in requests:
            connection.request(method, path, body=body, headers=headers)
            sock = connection.sock
            response = connection.getresponse()
            payload = response.read()
            kept = connection.sock is not None and connection.sock is sock
            answers.append((response.status, {k.lower(): v for k, v in response.getheaders()}, payload, kept))
    finally:
        connection.close()
    return answers


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus text exposition (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0
