"""`verispec serve`: the OpenAI-compatible server, started for real (uvicorn on 127.0.0.1 and a
free port, in a background thread) over a tiny random Llama and the character tokenizer, and
exercised with the official `openai` client (and httpx for raw and malformed requests).

Covered: completions, chat, streaming (chunks reassemble to the non-streamed text under greedy
decoding), the `verispec` metrics extension, stop strings and EOS, every bad input's status and
error shape, the API key, 429 on a full queue, cancellation on client disconnect (streaming and
not), the request timeout (while generating and while waiting), internal errors confined to their
request, /metrics, a 50-request concurrent load, and the CLI's checks before loading a model.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from typer.testing import CliRunner

import helpers
import server_helpers as sh
from verispec import generate
from verispec.server import ServerSettings
from verispec.text import encode_messages

torch.set_num_threads(1)

KEY = "test-key"
MODEL_ID = "tiny-test-model"
GREEDY = dict(temperature=0)


# -- servers ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return helpers.char_tokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer):
    """A Target with the served model's weights, used in-process for expected outputs."""
    return sh.text_target(tokenizer, cls=sh.Target)


@pytest.fixture(scope="module")
def main_server(tokenizer):
    """API key, room for the 50-request load test, no artificial delay."""
    server = sh.RunningServer(sh.text_target(tokenizer), ServerSettings(
        model_id=MODEL_ID, api_key=KEY, max_queue=64, request_timeout=30, max_tokens_limit=200))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_server(tokenizer):
    """50 ms per forward, a queue of one, no key: for 429 and disconnects."""
    server = sh.RunningServer(sh.text_target(tokenizer, delay=0.05), ServerSettings(
        model_id=MODEL_ID, max_queue=1, request_timeout=60, max_tokens_limit=200))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def timeout_server(tokenizer):
    """50 ms per forward and a 1 s request timeout."""
    server = sh.RunningServer(sh.text_target(tokenizer, delay=0.05), ServerSettings(
        model_id=MODEL_ID, max_queue=4, request_timeout=1.0, max_tokens_limit=200))
    yield server
    server.stop()


def client_for(server, key: str | None = KEY) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key or "none", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def client(main_server) -> OpenAI:
    return client_for(main_server)


def extension(response) -> dict:
    """The `verispec` extension field of an openai response or chunk object."""
    data = response.model_extra or {}
    assert "verispec" in data, f"no verispec field in {response}"
    return data["verispec"]


METRIC_KEYS = {"method", "target_forwards", "drafted", "accepted", "mean_accepted_tokens", "acceptance_rate",
               "tokens_per_s"}


def assert_metrics(ext: dict, method: str, completion_tokens: int) -> None:
    assert METRIC_KEYS <= set(ext), ext
    assert ext["method"] == method
    assert ext["new_tokens"] == completion_tokens
    assert ext["target_forwards"] >= 1
    assert ext["accepted"] <= ext["drafted"]
    assert ext["mean_accepted_tokens"] == pytest.approx(completion_tokens / ext["target_forwards"], abs=1e-3)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def expected(reference, prompt, method="anpd", **kwargs):
    return generate(reference, prompt, method, **kwargs)


# -- the happy paths ------------------------------------------------------------------------------

def test_models_and_health(main_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    health = httpx.get(main_server.url + "/health")  # open without the key
    assert health.status_code == 200
    assert health.json()["status"] == "ok"


def test_completion_matches_the_library(client, reference):
    response = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=24, **GREEDY)
    want = expected(reference, "hello world", max_new_tokens=24)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.text == want.text and choice.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len("hello world")
    assert response.usage.completion_tokens == 24
    assert response.usage.total_tokens == len("hello world") + 24
    assert_metrics(extension(response), "anpd", 24)


def test_chat_uses_encode_messages(client, reference, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say something"}]
    response = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=20, **GREEDY)
    ids = encode_messages(tokenizer, messages)
    want = expected(reference, ids, max_new_tokens=20)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == want.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(ids)
    assert_metrics(extension(response), "anpd", 20)


def test_chat_uses_the_chat_template_when_there_is_one(client, reference, tokenizer, main_server):
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    assert main_server.target.tokenizer is tokenizer
    tokenizer.chat_template = template  # read per request; removed below
    try:
        messages = [{"role": "user", "content": "hi there"}]
        response = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=10, **GREEDY)
        ids = encode_messages(tokenizer, messages)
        assert ids == tokenizer("user: hi there\nassistant:")["input_ids"]
        assert response.usage.prompt_tokens == len(ids)
        assert response.choices[0].message.content == expected(reference, ids, max_new_tokens=10).text
        refused = httpx.post(main_server.url + "/v1/chat/completions", headers=auth(), json={
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
        assert "no system role" in assert_error(refused, 400, "messages")["message"]
    finally:
        tokenizer.chat_template = None


def test_method_field_and_lossless_methods_agree(client):
    texts = {}
    for method in ("ar", "pld", "anpd"):
        response = client.completions.create(model=MODEL_ID, prompt="abc abc abc", max_tokens=16,
                                             extra_body={"method": method}, **GREEDY)
        assert extension(response)["method"] == method
        texts[method] = response.choices[0].text
    assert extension(response)["drafted"] > 0
    assert len(set(texts.values())) == 1, texts


def test_completion_stream_reassembles(client):
    kwargs = dict(model=MODEL_ID, prompt="the cat sat", max_tokens=30, **GREEDY)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length"
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert_metrics(extension(last), "anpd", 30)
    assert last.usage.completion_tokens == 30


def test_chat_stream_reassembles_with_usage_chunk(client):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "tell me"}], max_tokens=25, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finish = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]  # OpenAI's usage-only chunk, carrying the metrics too
    assert last.choices == [] and last.usage.completion_tokens == 25
    assert_metrics(extension(last), "anpd", 25)


def test_raw_sse_format_ends_with_done(main_server):
    body = {"model": MODEL_ID, "prompt": "hello", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", main_server.url + "/v1/completions", json=body, headers=auth()) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2][len("data: "):])
    assert final["choices"][0]["finish_reason"] == "length"
    assert METRIC_KEYS <= set(final["verispec"])


def test_stop_string_gives_finish_reason_stop(client, reference):
    full = expected(reference, "hello world", max_new_tokens=30).text
    stop = full[10:13]
    cut = full.index(stop)
    for stream in (False, True):
        response = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=30, stop=[stop],
                                             stream=stream, **GREEDY)
        if stream:
            chunks = list(response)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert text == full[:cut]
        assert finish == "stop"


def test_eos_gives_finish_reason_stop(client, reference, main_server):
    want = expected(reference, "abc", max_new_tokens=12)
    eos = want.token_ids[4]
    config = main_server.target.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = eos  # read per request (Target.eos_token_ids); restored below
    try:
        response = client.completions.create(model=MODEL_ID, prompt="abc", max_tokens=12, **GREEDY)
    finally:
        config.eos_token_id = saved
    first = want.token_ids.index(eos)
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == first + 1
    assert extension(response)["stop_reason"] == "eos"


def test_sampling_with_seed_is_reproducible(client):
    kwargs = dict(model=MODEL_ID, prompt="once upon", max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    second = client.completions.create(**kwargs).choices[0].text
    assert first == second


# -- bad input ------------------------------------------------------------------------------------

LONG = "a" * 300  # the served model's context is 256 tokens (one per character)


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 201}, 400, "max_tokens", None),  # over --max-tokens-limit
    ("/v1/completions", {"prompt": "a" * 100, "max_tokens": 180}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 5}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "method": "nope"}, 400, "method", "unknown_method"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 2, 9999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
     "model_not_found"),
])
def test_bad_input_gets_openai_error(main_server, path, body, status, param, code):
    for stream in (False, True):  # a streaming request fails the same way, before any event
        response = httpx.post(main_server.url + path, json={**body, "stream": body.get("stream", stream)},
                              headers=auth())
        assert_error(response, status, param, code)


@pytest.mark.parametrize("content,type_", [
    (b'{"prompt": "hi", ', "application/json"),  # malformed JSON
    (b"not json at all", "application/json"),
    (b"[1, 2, 3]", "application/json"),  # JSON, but not an object
    (b"", "application/json"),  # no body
    (b"prompt=hi", "application/x-www-form-urlencoded"),  # not JSON
])
def test_malformed_body_is_400(main_server, content, type_):
    response = httpx.post(main_server.url + "/v1/completions", content=content,
                          headers={**auth(), "Content-Type": type_})
    assert_error(response, 400)


def test_unknown_route_and_model_are_404(main_server):
    assert_error(httpx.get(main_server.url + "/v1/nothing", headers=auth()), 404, code="not_found")
    assert_error(httpx.get(main_server.url + "/v1/models/other", headers=auth()), 404, "model", "model_not_found")
    assert_error(httpx.get(main_server.url + "/v1/completions", headers=auth()), 405)


def test_api_key_is_required(main_server, client):
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(main_server.url + "/v1/completions", json=body), 401, code="invalid_api_key")
    assert_error(httpx.post(main_server.url + "/v1/completions", json=body, headers=auth("wrong")), 401)
    assert_error(httpx.get(main_server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert_error(httpx.get(main_server.url + "/metrics"), 401)
    with pytest.raises(openai.AuthenticationError):
        client_for(main_server, key="wrong").completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)
    assert httpx.get(main_server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2).choices[0].text is not None


# -- faults ---------------------------------------------------------------------------------------

def test_internal_error_is_500_for_that_request_only(main_server, client):
    body = {"model": MODEL_ID, "prompt": f"x {sh.FAIL_MARKER} y", "max_tokens": 5}
    assert_error(httpx.post(main_server.url + "/v1/completions", json=body, headers=auth()), 500,
                 code="internal_error")
    assert_error(httpx.post(main_server.url + "/v1/completions", json={**body, "stream": True}, headers=auth()),
                 500, code="internal_error")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL_ID, max_tokens=5,
                                       messages=[{"role": "user", "content": sh.FAIL_MARKER}])
    assert httpx.get(main_server.url + "/health").json()["status"] == "ok"
    response = client.completions.create(model=MODEL_ID, prompt="after the fault", max_tokens=5, **GREEDY)
    assert response.usage.completion_tokens == 5


def test_full_queue_answers_429_at_once(slow_server):
    client = client_for(slow_server, key=None)
    worker = slow_server.worker
    running = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=200, stream=True,
                                        extra_body={"method": "ar"}, **GREEDY)
    next(iter(running))  # the first text arrived: this request occupies the worker
    waiting_result = []
    waiting = threading.Thread(target=lambda: waiting_result.append(client.completions.create(
        model=MODEL_ID, prompt="queued", max_tokens=3, **GREEDY)))
    waiting.start()
    sh.wait_until(lambda: worker.queue_length == 1, timeout=5)  # the queue (size 1) is full
    try:
        started = time.monotonic()
        response = httpx.post(slow_server.url + "/v1/completions",
                              json={"model": MODEL_ID, "prompt": "one too many", "max_tokens": 3})
        assert time.monotonic() - started < 1.0  # refused at once, not after waiting
        assert_error(response, 429, code="queue_full")
        assert response.headers.get("retry-after") == "1"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_ID, prompt="one too many", max_tokens=3)
    finally:
        running.close()  # disconnect: the worker moves on to the queued request
    waiting.join(10)
    assert waiting_result and waiting_result[0].usage.completion_tokens == 3


def _generated_tokens(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sh.metric_value(text, "verispec_generated_tokens_total", method="ar")


def test_streaming_disconnect_cancels_generation(slow_server):
    client = client_for(slow_server, key=None)
    worker = slow_server.worker
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0, timeout=10)
    before = _generated_tokens(slow_server)
    # 200 tokens at 50 ms each would keep the worker busy for 10 s.
    stream = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=200, stream=True,
                                       extra_body={"method": "ar"}, **GREEDY)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert worker.busy
    stream.close()
    freed_after = sh.wait_until(lambda: not worker.busy, timeout=3)
    assert freed_after < 3
    metrics = httpx.get(slow_server.url + "/metrics").text
    assert sh.metric_value(metrics, "verispec_generations_total", method="ar", outcome="cancelled") >= 1
    assert _generated_tokens(slow_server) - before < 100  # stopped long before its 200 tokens


def test_non_streaming_disconnect_cancels_generation(slow_server):
    worker = slow_server.worker
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0, timeout=10)
    body = {"model": MODEL_ID, "prompt": "hello world", "max_tokens": 200, "method": "ar", "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/v1/completions", json=body, timeout=0.6)  # the client gives up
    assert sh.wait_until(lambda: not worker.busy, timeout=3) < 3


def test_request_timeout_ends_generation_cleanly(timeout_server):
    client = client_for(timeout_server, key=None)
    kwargs = dict(model=MODEL_ID, prompt="hello world", max_tokens=200, extra_body={"method": "ar"}, **GREEDY)
    started = time.monotonic()
    response = client.completions.create(**kwargs)
    assert time.monotonic() - started < 3
    assert response.choices[0].finish_reason == "length"
    assert 0 < response.usage.completion_tokens < 200
    assert response.choices[0].text
    assert extension(response)["stop_reason"] == "timeout"

    chunks = list(client.completions.create(stream=True, **kwargs))  # ends with [DONE], no error
    assert chunks[-1].choices[0].finish_reason == "length"
    assert extension(chunks[-1])["stop_reason"] == "timeout"
    assert "".join(c.choices[0].text for c in chunks)


def test_request_timeout_while_waiting_is_503(timeout_server):
    client = client_for(timeout_server, key=None)
    worker = timeout_server.worker
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0, timeout=10)
    blocker = threading.Thread(target=lambda: client.completions.create(
        model=MODEL_ID, prompt=f"{sh.SLOW_MARKER}", max_tokens=5))  # its prefill takes 2.5 s
    blocker.start()
    sh.wait_until(lambda: worker.busy, timeout=5)
    started = time.monotonic()
    response = httpx.post(timeout_server.url + "/v1/completions",
                          json={"model": MODEL_ID, "prompt": "waiting", "max_tokens": 5})
    assert time.monotonic() - started < 2.0
    assert_error(response, 503, code="timeout")
    blocker.join(10)
    assert worker.queue_length == 0


# -- metrics and load -------------------------------------------------------------------------------

def test_metrics_endpoint(main_server, client):
    client.completions.create(model=MODEL_ID, prompt="count me", max_tokens=6, extra_body={"method": "pld"},
                              **GREEDY)
    response = httpx.get(main_server.url + "/metrics", headers=auth())
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("verispec_requests_total", "verispec_generated_tokens_total", "verispec_drafted_tokens_total",
                 "verispec_accepted_tokens_total", "verispec_target_forwards_total", "verispec_queue_length",
                 "verispec_request_duration_seconds_bucket", "verispec_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert sh.metric_value(text, "verispec_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert sh.metric_value(text, "verispec_requests_total", endpoint="/v1/completions", status="401") >= 0
    assert sh.metric_value(text, "verispec_generated_tokens_total", method="pld") >= 6
    assert sh.metric_value(text, "verispec_target_forwards_total", method="pld") >= 1
    assert sh.metric_value(text, "verispec_time_to_first_token_seconds_count") >= 1
    assert sh.metric_value(text, "verispec_queue_length") == 0


def test_fifty_concurrent_requests_are_complete_and_unmixed(main_server, client):
    words = [a + b for a in "bcdfghklmnprstvw" for b in "aeiou"][:50]
    prompts = [f"{word} {word[::-1]} and {word}" for word in words]
    assert len(set(prompts)) == 50
    kwargs = dict(model=MODEL_ID, max_tokens=16, **GREEDY)
    single = {p: client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts}
    assert len(set(single.values())) > 25  # distinct prompts give mostly distinct outputs

    def one(index: int) -> tuple[str, str, str]:
        prompt = prompts[index]
        if index % 2:  # half streamed, half not
            chunks = list(client.completions.create(prompt=prompt, stream=True, **kwargs))
            assert chunks[-1].choices[0].finish_reason == "length"
            return prompt, "".join(c.choices[0].text for c in chunks), "length"
        response = client.completions.create(prompt=prompt, **kwargs)
        return prompt, response.choices[0].text, response.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(one, range(50)))
    assert len(results) == 50
    for prompt, text, finish in results:
        assert finish == "length"
        assert text == single[prompt], prompt
    health = httpx.get(main_server.url + "/health").json()
    assert health == {**health, "status": "ok", "busy": False, "queue_length": 0}


# -- the CLI ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["--method", "nope"], "unknown method"),
    (["--max-queue", "0"], "max_queue"),
    (["--request-timeout", "-1"], "request_timeout"),
    (["--max-tokens-limit", "0"], "max_tokens_limit"),
    (["--dtype", "int3"], "dtype"),
    (["--port", "70000"], "--port"),
    (["--api-key", " "], "API key"),
])
def test_serve_validates_before_loading(monkeypatch, args, fragment):
    import verispec.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded a model before validating"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error:") and fragment in " ".join(result.stderr.split()), result.stderr


def test_serve_reads_the_api_key_from_the_environment(monkeypatch):
    import verispec.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded a model before validating"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", "0"], env={"VERISPEC_API_KEY": "  "})
    assert result.exit_code == 2 and "API key" in result.stderr, result.stderr


def test_serve_refuses_a_busy_port_before_loading(monkeypatch, main_server):
    import verispec.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded a model with the port taken"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", str(main_server.port)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error:") and "cannot listen" in result.stderr


def test_serve_command_end_to_end(tmp_path, tokenizer):
    """`verispec serve` as a process: loads a saved model, prints its URL, answers with the key,
    and stops cleanly on SIGINT."""
    import os
    import signal
    import subprocess
    import sys

    model_dir = tmp_path / "tiny-model"
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=256)
    helpers.make_model(config, seed=3).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    log = open(tmp_path / "serve.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "verispec.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
         "--port", "0", "--method", "pld"],
        stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "VERISPEC_API_KEY": "k"})
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1"), (url, log.seek(0) or log.read())
        client = OpenAI(base_url=url, api_key="k", max_retries=0, timeout=30)
        response = client.completions.create(model="tiny-model", prompt="hello world", max_tokens=8, **GREEDY)
        assert response.usage.completion_tokens == 8
        assert extension(response)["method"] == "pld"  # the --method default
        assert httpx.get(url.removesuffix("/v1") + "/v1/models").status_code == 401
    finally:
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(timeout=20)
        finally:
            process.kill()
            log.seek(0)
            output = log.read()
            log.close()
    assert code in (0, 130), output  # uvicorn re-raises SIGINT after its graceful shutdown: 130
    assert "Traceback" not in output and "Application shutdown complete" in output, output
