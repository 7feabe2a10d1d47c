"""What one request or connection may cost `verispec serve`: the body's size (413, from the
Content-Length or as the bytes arrive, chunked bodies included) and read time (408), a prompt's
characters (400 before tokenizing), the time to send a request's headers (408, or a silent close
for a connection that sent nothing), and the connections open at once (503 for one more); and
the server answering /health and a normal request while 500 idle connections and a slow body
are open.

The real stack on raw sockets (`server_helpers.RunningServer`: uvicorn configured as `verispec
serve` configures it, over the tiny model). No test measures time: the timeouts are short (one
second) so that the tests end soon, and every wait is bounded only against a hang.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

import helpers
import server_helpers as sh
from verispec.errors import ConfigError
from verispec.server import ServerSettings

pytestmark = pytest.mark.long  # end to end; left out by make test-quick

MAX_BODY = 2048
MAX_PROMPT_CHARS = 100
VALID = {"prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer():
    return helpers.char_tokenizer()


@pytest.fixture(scope="module")
def bounded(tokenizer):
    """Small body and prompt limits, one-second header and body timeouts."""
    server = sh.RunningServer(sh.text_target(tokenizer), ServerSettings(
        model_id="m", max_body_bytes=MAX_BODY, max_prompt_chars=MAX_PROMPT_CHARS, body_timeout=1, header_timeout=1))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def crowded(tokenizer):
    """Four connections at most; no header timeout (idle connections stay)."""
    server = sh.RunningServer(sh.text_target(tokenizer), ServerSettings(model_id="m", max_connections=4,
                                                                          header_timeout=0))
    yield server
    server.stop()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=sh.HANG_GUARD_S)
    return sock


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a hang fails the test)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return data


def answer(data: bytes) -> tuple[int, dict, dict]:
    """(status, lower-cased headers, JSON body) of one raw HTTP answer."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def request_head(length: int | None = None, path: str = "/v1/completions", chunked: bool = False) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def assert_refusal(data: bytes, status: int, code: str, option: str) -> dict:
    got, headers, body = answer(data)
    assert got == status, data[:400]
    assert headers.get("connection") == "close", headers
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert option in error["message"], error
    return error


# -- the body -------------------------------------------------------------------------------------

def test_a_body_at_the_limit_is_served_and_one_byte_more_is_413(bounded):
    body = json.dumps(VALID).encode()
    exact = body[:-1] + b" " * (MAX_BODY - len(body)) + b"}"
    assert len(exact) == MAX_BODY
    ok = httpx.post(bounded.url + "/v1/completions", content=exact, timeout=sh.HANG_GUARD_S,
                    headers={"Content-Type": "application/json"})
    assert ok.status_code == 200, ok.text
    over = httpx.post(bounded.url + "/v1/completions", content=exact + b" ", timeout=sh.HANG_GUARD_S,
                      headers={"Content-Type": "application/json"})
    assert over.status_code == 413 and over.json()["error"]["code"] == "request_too_large", over.text


def test_a_declared_length_over_the_limit_is_413_before_any_of_the_body(bounded):
    """50 MB announced, none sent: the answer comes at once and the connection is closed."""
    sock = connect(bounded)
    sock.sendall(request_head(50_000_000))
    error = assert_refusal(read_to_close(sock), 413, "request_too_large", "--max-body")
    assert "50000000" in error["message"]


def test_a_chunked_body_is_413_as_soon_as_it_passes_the_limit(bounded):
    """Chunks of 1 KiB, never the last one: the 413 comes once the limit is passed."""
    sock = connect(bounded)
    sock.sendall(request_head(chunked=True))
    for _ in range(MAX_BODY // 1024 + 1):
        sock.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
    assert_refusal(read_to_close(sock), 413, "request_too_large", "--max-body")


def test_a_body_sent_too_slowly_is_408(bounded):
    sock = connect(bounded)
    sock.sendall(request_head(100) + b'{"prompt": ')  # and nothing more
    assert_refusal(read_to_close(sock), 408, "body_timeout", "--body-timeout")


def test_a_prompt_over_the_character_limit_is_refused_before_tokenizing(bounded, monkeypatch):
    import verispec.server.app as app_module

    calls = []
    for name in ("encode_prompt", "encode_messages"):
        real = getattr(app_module, name)
        monkeypatch.setattr(app_module, name, lambda *args, real=real: calls.append(args) or real(*args))
    url = bounded.url + "/v1/"
    over = [("completions", {"prompt": "a" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
            ("completions", {"prompt": ["a" * (MAX_PROMPT_CHARS + 1)]}, "prompt"),
            ("chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_PROMPT_CHARS - 3)}]}, "messages"),
            ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 60}]},
                                               {"role": "user", "content": "b" * 30, "name": "ccc"}]}, "messages")]
    for path, prompt, param in over:
        response = httpx.post(url + path, json={**prompt, "max_tokens": 2}, timeout=sh.HANG_GUARD_S)
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "prompt_too_long", response.text
        assert error["param"] == param and "--max-prompt-chars" in error["message"], error
    assert calls == []  # nothing was tokenized
    at = [("completions", {"prompt": "a" * MAX_PROMPT_CHARS}),
          ("chat/completions", {"messages": [{"role": "user", "content": "a" * (MAX_PROMPT_CHARS - 4)}]})]
    for path, prompt in at:
        response = httpx.post(url + path, json={**prompt, "max_tokens": 2}, timeout=sh.HANG_GUARD_S)
        assert response.status_code == 200, response.text
    assert len(calls) == 2


# -- the connection -------------------------------------------------------------------------------

def test_headers_not_sent_in_time_close_the_connection(bounded):
    silent = connect(bounded)
    assert read_to_close(silent) == b""  # nothing sent: closed without a word
    partial = connect(bounded)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
    assert_refusal(read_to_close(partial), 408, "header_timeout", "--header-timeout")


def test_a_kept_alive_connection_has_the_same_time_for_its_next_headers(bounded):
    sock = connect(bounded)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    first = b""
    while b"\r\n\r\n" not in first or not first.endswith(b"}"):
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /heal")  # uvicorn's keep-alive timer stops at the first byte
    assert_refusal(read_to_close(sock), 408, "header_timeout", "--header-timeout")


def test_one_connection_over_the_limit_is_503_and_the_open_ones_are_untouched(crowded):
    state = crowded.server.server_state
    sh.wait_until(lambda: len(state.connections) == 0)
    idle = [connect(crowded) for _ in range(4)]
    try:
        sh.wait_until(lambda: len(state.connections) == 4)
        error = assert_refusal(read_to_close(connect(crowded)), 503, "too_many_connections", "--max-connections")
        assert error["type"] == "server_error"
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")  # still served
        assert read_to_close(idle[0]).startswith(b"HTTP/1.1 200")
        sh.wait_until(lambda: len(state.connections) == 3)
        assert httpx.get(crowded.url + "/health", timeout=sh.HANG_GUARD_S).status_code == 200
    finally:
        for sock in idle:
            sock.close()


def test_health_and_a_request_are_served_among_500_idle_connections_and_a_slow_body(bounded):
    idle = [connect(bounded) for _ in range(500)]
    slow = connect(bounded)
    slow.sendall(request_head(1000) + b"{")  # one byte of a thousand
    try:
        assert httpx.get(bounded.url + "/health", timeout=sh.HANG_GUARD_S).json()["status"] == "ok"
        response = httpx.post(bounded.url + "/v1/completions", json=VALID, timeout=sh.HANG_GUARD_S)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
        assert_refusal(read_to_close(slow), 408, "body_timeout", "--body-timeout")
        assert all(read_to_close(sock) == b"" for sock in idle)  # each closed by the header timeout
    finally:
        for sock in idle + [slow]:
            sock.close()


@pytest.mark.parametrize("field,value", [
    ("max_body_bytes", 0), ("max_prompt_chars", -1), ("max_connections", 0), ("max_connections", True),
    ("header_timeout", -1), ("body_timeout", float("inf")), ("body_timeout", float("nan")), ("header_timeout", "5"),
])
def test_bad_limits_are_refused_by_the_settings(field, value):
    with pytest.raises(ConfigError, match=field):
        ServerSettings(**{field: value})
