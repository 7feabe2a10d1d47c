"""`verispec serve`: the OpenAI-compatible server, started for real (uvicorn on 127.0.0.1 and a
free port, in a background thread) over a tiny random Llama and the character tokenizer, and
exercised with the official `openai` client (and httpx for raw and malformed requests).

Covered: completions, chat, streaming (chunks reassemble to the non-streamed text under greedy
decoding), the `verispec` metrics extension, stop strings and EOS, every bad input's status and
error shape (a sweep of malformed values for every field on one keep-alive connection, which must
stay usable), the documented ranges, unexpected exceptions answered completely, the API key, 429
with Retry-After on a full queue, cancellation on client disconnect (streaming and not), the
request timeout (while generating and while waiting), internal errors confined to their request,
/metrics (vLLM's spec-decode counters included), a 50-request concurrent load, and the CLI's
checks before loading a model.

No test measures time: a request that must hold the worker waits on the target's gate
(`server_helpers.BLOCK_MARKER`), and every wait has a generous limit that only guards against a
hang (`server_helpers.HANG_GUARD_S`).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading

import httpx
import openai
import pytest
import torch
from openai import OpenAI
from typer.testing import CliRunner

import helpers
import server_helpers as sh
from verispec import generate
from verispec.api import Request as GenerationRequest
from verispec.core.methods import MethodOptions
from verispec.core.sampling import SamplingConfig
from verispec.server import ServerSettings
from verispec.server.metrics import ServerMetrics
from verispec.server.worker import RECENT_JOBS, QueueFull, Ticket, Worker
from verispec.core.stats import GenerationStats
from verispec.request.text import encode_messages

pytestmark = pytest.mark.long  # end to end; left out by make test-quick

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
    """50 ms per forward and a 2 s request timeout."""
    server = sh.RunningServer(sh.text_target(tokenizer, delay=0.05), ServerSettings(
        model_id=MODEL_ID, max_queue=4, request_timeout=2.0, max_tokens_limit=200))
    yield server
    server.stop()


def client_for(server, key: str | None = KEY) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=key or "none", max_retries=0, timeout=sh.HANG_GUARD_S)


@pytest.fixture(scope="module")
def client(main_server) -> OpenAI:
    return client_for(main_server)


def extension(response) -> dict:
    """The `verispec` extension field of an openai response or chunk object."""
    data = response.model_extra or {}
    assert "verispec" in data, f"no verispec field in {response}"
    return data["verispec"]


METRIC_KEYS = {"method", "target_forwards", "drafted", "accepted", "mean_accepted_tokens", "acceptance_rate",
               "drafts", "accepted_per_position", "mean_acceptance_length", "tokens_per_s"}


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


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(url, timeout=sh.HANG_GUARD_S, **kwargs)  # httpx's default (5 s) is no hang guard


def get(url: str, **kwargs) -> httpx.Response:
    return httpx.get(url, timeout=sh.HANG_GUARD_S, **kwargs)


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def expected(reference, prompt, method="anpd", **kwargs):
    return generate(reference, prompt, method, **kwargs)


# -- the happy paths ------------------------------------------------------------------------------

def test_models_and_health(main_server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    health = get(main_server.url + "/health")  # open without the key
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
        refused = post(main_server.url + "/v1/chat/completions", headers=auth(), json={
            "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
        assert "no system role" in assert_error(refused, 400, "messages")["message"]
    finally:
        tokenizer.chat_template = None


def test_method_field_and_lossless_methods_agree(client):
    texts, drafted = {}, {}
    for method in ("ar", "pld", "anpd"):
        response = client.completions.create(model=MODEL_ID, prompt="abc abc abc", max_tokens=16,
                                             extra_body={"method": method}, **GREEDY)
        assert extension(response)["method"] == method
        texts[method], drafted[method] = response.choices[0].text, extension(response)["drafted"]
    assert drafted["pld"] > 0  # (anpd's controller drafts where its measured costs say it pays)
    assert len(set(texts.values())) == 1, texts


def test_method_variants_choose_settings_per_request(client, main_server):
    """The `method` field takes `verispec bench --methods` settings, which reach the drafter
    (`pld/constant:2` drafts 2 tokens at most, where `pld` drafts up to 10); lossless ones keep
    the text."""
    texts, longest = {}, {}
    for method in ("ar", "anpd/tree=8", "anpd/ngram_memory=false/span_min=0", "pld", "pld/constant:2"):
        response = client.completions.create(model=MODEL_ID, prompt="abc abc abc", max_tokens=16,
                                             extra_body={"method": method}, **GREEDY)
        assert extension(response)["method"] == method.split("/")[0]
        texts[method] = response.choices[0].text
        longest[method] = len(extension(response)["accepted_per_position"])  # the longest draft verified
    assert len(set(texts.values())) == 1, texts
    assert longest["pld/constant:2"] == 2 < longest["pld"], longest
    metrics = get(main_server.url + "/metrics", headers=auth()).text
    assert 'method="anpd"' in metrics and "anpd/" not in metrics  # labelled by method, not by its settings


def test_settings_a_method_refuses_while_sampling_are_a_400(main_server):
    """Valid settings that the method refuses only with the request's sampling (a controller that
    would bias sampled drafts): a 400 naming why and the field, before the request is queued."""
    body = {"prompt": "hi", "max_tokens": 4, "method": "sps/adaptive", "temperature": 1}
    error = assert_error(post(main_server.url + "/v1/completions", headers=auth(), json=body), 400)
    assert "adaptive controller" in error["message"] and error["param"] == "method", error


@pytest.mark.parametrize("path,prompt", [("/v1/completions", {"prompt": "hi"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_greedy_mtad_is_a_400_naming_the_temperature(main_server, path, prompt):
    body = {**prompt, "max_tokens": 4, "method": "mtad", "temperature": 0}
    error = assert_error(post(main_server.url + path, headers=auth(), json=body), 400, "temperature")
    assert "temperature must be > 0 for mtad" in error["message"], error


@pytest.mark.parametrize("method,fragment", [
    ("anpd/tree=8/tree=9", "tree is given twice"),
    ("mtad/tau=0.1/beams=2/tau=0.2", "tau is given twice"),
    ("pld/constant:4/constant:8", "the controller is given twice"),
])
def test_a_method_setting_given_twice_is_a_400(main_server, method, fragment):
    body = {"prompt": "hi", "max_tokens": 2, "method": method}
    error = assert_error(post(main_server.url + "/v1/completions", headers=auth(), json=body), 400, "method")
    assert fragment in error["message"], error


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
    with httpx.stream("POST", main_server.url + "/v1/completions", json=body, headers=auth(),
                      timeout=sh.HANG_GUARD_S) as response:
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
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "method": "nope"}, 400, "method", "unknown_method"),
    ("/v1/completions", {"prompt": "hi", "method": "nope/constant:4"}, 400, "method", "unknown_method"),
    ("/v1/completions", {"prompt": "hi", "method": "pld/constant:64"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "mtad/beams=17"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "mtad/no_repeat_ngram=-1"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "mtad/no_repeat_ngram=six"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "suffix/max_cached_requests=-1"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "suffix/max_cached_requests=10001"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "suffix/max_tree_depth=257"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "anpd/max_spec_factor=2"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "anpd/tree=99"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "anpd/color=red"}, 400, "method", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "method": "pld/fastest"}, 400, "method", "invalid_value"),
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
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404, "model",
     "model_not_found"),
])
def test_bad_input_gets_openai_error(main_server, path, body, status, param, code):
    for stream in (False, True):  # a streaming request fails the same way, before any event
        response = post(main_server.url + path, json={**body, "stream": body.get("stream", stream)},
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
    response = post(main_server.url + "/v1/completions", content=content,
                    headers={**auth(), "Content-Type": type_})
    assert_error(response, 400)


def test_unknown_route_and_model_are_404(main_server):
    assert_error(get(main_server.url + "/v1/nothing", headers=auth()), 404, code="not_found")
    assert_error(get(main_server.url + "/v1/models/other", headers=auth()), 404, "model", "model_not_found")
    assert_error(get(main_server.url + "/v1/completions", headers=auth()), 405)


def test_api_key_is_required(main_server, client):
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(post(main_server.url + "/v1/completions", json=body), 401, code="invalid_api_key")
    assert_error(post(main_server.url + "/v1/completions", json=body, headers=auth("wrong")), 401)
    assert_error(get(main_server.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert_error(get(main_server.url + "/metrics"), 401)
    with pytest.raises(openai.AuthenticationError):
        client_for(main_server, key="wrong").completions.create(model=MODEL_ID, prompt="hi", max_tokens=2)
    assert get(main_server.url + "/health").status_code == 200
    assert client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2).choices[0].text is not None


def test_two_authorization_headers_are_refused_whichever_comes_last(main_server):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for keys in ((KEY, "wrong"), ("wrong", KEY), (KEY, KEY)):
        headers = [("Content-Type", "application/json")] + [("Authorization", f"Bearer {key}") for key in keys]
        response = post(main_server.url + "/v1/completions", content=body, headers=headers)
        assert "exactly one" in assert_error(response, 401, code="invalid_api_key")["message"]
    assert post(main_server.url + "/v1/completions", content=body, headers=JSON_HEADERS).status_code == 200


# -- malformed input: a 4xx in OpenAI's shape on a connection that stays usable -------------------

JSON_HEADERS = {**auth(), "Content-Type": "application/json"}
VALID_COMPLETION = b'{"prompt": "fine", "max_tokens": 2, "temperature": 0}'


def assert_raw_error(answer, status: int | None = None, param: str | None = None) -> dict:
    """An http.client answer (sh.raw_exchange) is a 4xx in OpenAI's shape and kept the connection."""
    code, headers, body, kept = answer
    assert 400 <= code < 500 if status is None else code == status, (code, body)
    assert headers.get("content-type", "").startswith("application/json"), headers
    error = json.loads(body.decode("utf-8"))  # strict UTF-8: a body with lone surrogates fails here
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
    assert error["error"]["message"] and error["error"]["type"] == "invalid_request_error", error
    if param is not None:
        assert error["error"]["param"] == param, error
    assert kept and headers.get("connection") != "close", "the connection was not kept"
    return error["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi \\udcff there"}],"max_tokens":4}',
     "messages"),
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 4, "stream": true}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800", "max_tokens": 4}', "model"),
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"x"}],"model":"\\ud800","stream":true}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udc00"], "max_tokens": 4}', "stop"),
])
def test_lone_surrogate_is_400_and_the_connection_stays_usable(main_server, path, body, param):
    bad, good = sh.raw_exchange(main_server.port, [("POST", path, body, JSON_HEADERS),
                                                   ("POST", "/v1/completions", VALID_COMPLETION, JSON_HEADERS)])
    error = assert_raw_error(bad, 400, param)
    assert "surrogate" in error["message"]
    assert good[0] == 200 and json.loads(good[2])["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_is_a_complete_500_and_the_connection_stays_usable(main_server, monkeypatch,
                                                                                   stream):
    import verispec.server.app as app_module

    real = app_module.encode_prompt

    def buggy(tokenizer, prompt, *args):  # a bug the handlers do not expect
        if prompt == "explode":
            raise RuntimeError("injected bug")
        return real(tokenizer, prompt, *args)

    monkeypatch.setattr(app_module, "encode_prompt", buggy)
    bad = json.dumps({"prompt": "explode", "max_tokens": 2, "stream": stream}).encode()
    failed, good = sh.raw_exchange(main_server.port, [("POST", "/v1/completions", bad, JSON_HEADERS),
                                                      ("POST", "/v1/completions", VALID_COMPLETION, JSON_HEADERS)])
    status, headers, body, kept = failed
    assert status == 500
    assert json.loads(body)["error"] == {"message": "internal server error: RuntimeError", "type": "server_error",
                                         "param": None, "code": "internal_error"}
    assert kept or headers.get("connection") == "close"
    assert good[0] == 200 and json.loads(good[2])["usage"]["completion_tokens"] == 2


def test_an_exception_inside_a_stream_ends_it_with_an_error_event(main_server, monkeypatch):
    import verispec.server.app as app_module

    real, calls = app_module._Shape.chunk, []

    def buggy(self, delta, *args, **kwargs):
        calls.append(delta)
        if len(calls) == 3:  # the role chunk and one text chunk went out: the stream has begun
            raise RuntimeError("injected bug")
        return real(self, delta, *args, **kwargs)

    monkeypatch.setattr(app_module._Shape, "chunk", buggy)
    body = json.dumps({"messages": [{"role": "user", "content": "go"}], "max_tokens": 20, "temperature": 0,
                       "method": "ar", "stream": True}).encode()
    streamed, good = sh.raw_exchange(main_server.port, [
        ("POST", "/v1/chat/completions", body, JSON_HEADERS),
        ("POST", "/v1/completions", VALID_COMPLETION, JSON_HEADERS)])
    status, _, payload, _ = streamed
    events = [line for line in payload.decode().split("\n") if line]
    assert status == 200 and len(calls) >= 3, payload
    assert events[-1] == "data: [DONE]", events
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "internal_error", events
    assert good[0] == 200


@pytest.mark.parametrize("field,value,fragment", [
    ("seed", 2**70, "from 0 to 18446744073709551615"),
    ("seed", -1, "from 0 to 18446744073709551615"),
    ("seed", 10**40, "an integer of 41 digits"),
    ("temperature", 100, "[0, 2]"),
    ("temperature", 2.5, "[0, 2]"),
    ("temperature", float("inf"), "finite"),
    ("temperature", float("nan"), "finite"),
    ("top_p", 0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("top_p", float("-inf"), "finite"),
    ("top_k", -1, ">= 0"),
    ("max_tokens", 0, ">= 1"),
    ("presence_penalty", float("nan"), "[-2, 2]"),
    ("max_tokens", True, "valid integer"),
    ("n", True, "valid integer"),
    ("seed", False, "valid integer"),
    ("top_k", 2.0, "valid integer"),
    ("temperature", True, "valid number"),
])
def test_out_of_range_numbers_name_the_field_and_its_range(main_server, field, value, fragment):
    body = json.dumps({"prompt": "hi", "max_tokens": 2, field: value}).encode()  # NaN/Infinity as Python writes them
    for path, payload in (("/v1/completions", body),
                          ("/v1/chat/completions", body.replace(b'"prompt": "hi"',
                                                                b'"messages": [{"role": "user", "content": "hi"}]'))):
        response = post(main_server.url + path, content=payload, headers=JSON_HEADERS)
        assert fragment in assert_error(response, 400, field)["message"]


def test_chat_budget_errors_name_max_completion_tokens(main_server):
    messages = [{"role": "user", "content": "hi"}]
    for value in (0, 201):  # below 1; above the server's limit
        response = post(main_server.url + "/v1/chat/completions", headers=auth(),
                        json={"messages": messages, "max_completion_tokens": value})
        assert_error(response, 400, "max_completion_tokens")


@pytest.mark.parametrize("extra", [
    {"seed": 0}, {"seed": 2**64 - 1}, {"temperature": 2, "seed": 1}, {"temperature": 0.7, "top_p": 1, "seed": 2},
    {"temperature": 0.7, "top_k": 0, "seed": 3}, {"temperature": 0.7, "top_k": 2**70, "seed": 4},
    {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
])
def test_the_ends_of_the_ranges_are_accepted(main_server, extra):
    response = post(main_server.url + "/v1/completions", headers=auth(),
                    json={"prompt": "hi", "max_tokens": 3, **extra})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


BIG = str(2**70)
INT_BAD = ['"5"', "true", "1.5", "2.0", "-1", BIG, "-" + BIG, "1e400", "NaN", "Infinity", "-Infinity", "[1]",
           '{"a": 1}', '"\\ud800"']
FLOAT_BAD = ['"0.5"', "true", "-0.5", "3", BIG, "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "[0.5]", "{}",
             '"\\ud800"']
BOOL_BAD = ['"true"', "1", "0", "NaN", "[]", "{}", '"\\udfff"']
TEXT_BAD = ["5", "true", "NaN", "1e400", "{}", "[[]]", '"\\ud800"', '"ok \\udfff tail"', '"\\udc00\\ud800"']
SHARED_FIELDS = {
    "model": TEXT_BAD + ['"other-model"'],
    "max_tokens": INT_BAD + ["0", "100000"],
    "temperature": FLOAT_BAD,
    "top_p": FLOAT_BAD + ["0", "1.5"],
    "top_k": [v for v in INT_BAD if v != BIG],  # any integer >= 0 is a valid top_k
    "seed": INT_BAD + [str(2**64)],
    "stop": TEXT_BAD + ['[""]', '["\\ud800"]', "[5]", "[null]", '""'],
    "stream": BOOL_BAD,
    "stream_options": ["1", '"x"', "[]", '{"include_usage": "yes"}', '{"include_usage": NaN}',
                       '{"include_usage": 1}'],
    "n": INT_BAD + ["17", "0"],
    "method": TEXT_BAD + ['"nope"', '""'],
    "presence_penalty": FLOAT_BAD + ["1"],
    "frequency_penalty": FLOAT_BAD + ["1"],
    "logit_bias": ["5", '"x"', "[]", '{"1": NaN}', '{"1": 1e400}', '{"1": "x"}', '{"\\ud800": 1}', '{"1": 5}'],
}
COMPLETION_FIELDS = {
    "prompt": ["5", "NaN", "true", "null", "{}", "[]", '[""]', '["a", "b"]', "[-1]", f"[{BIG}]", "[1.5]",
               "[true]", "[[1]]", "[null]", '""', '"   "', '"\\ud800"', '["\\udc00"]', '"a\\ud800b"',
               '"' + "a" * 300 + '"'],
    "echo": BOOL_BAD + ["true"],
    "logprobs": INT_BAD + ["6"],
    "best_of": INT_BAD + ["2"],
    "suffix": TEXT_BAD + ['"x"'],
}
CHAT_FIELDS = {
    "messages": ["5", "null", '"hi"', "{}", "[]", "[5]", "[null]", "[{}]", '[{"role": "user"}]',
                 '[{"content": "x"}]', '[{"role": "wizard", "content": "x"}]', '[{"role": "user", "content": 5}]',
                 '[{"role": "user", "content": null}]', '[{"role": "user", "content": "\\ud800"}]',
                 '[{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]',
                 '[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]',
                 '[{"role": "user", "content": [5]}]', '[{"role": "\\ud800", "content": "x"}]',
                 '[{"role": "user", "content": "x", "name": "\\udc00"}]',
                 '[{"role": "user", "content": "x", "name": 5}]',
                 '[{"role": "user", "content": "' + "a" * 300 + '"}]'],
    "max_completion_tokens": INT_BAD + ["0", "100000"],
    "logprobs": BOOL_BAD,
    "top_logprobs": INT_BAD + ["21", "3"],  # 3 without logprobs: true
    "tools": ["5", '"x"', "[5]", '[{"type": "function"}]', "{}"],
    "response_format": ["5", "[]", '{"type": "json_schema"}', '{"type": "regex", "regex": "a"}',
                        '{"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}',
                        '{"type": NaN}', '{"type": "\\ud800"}'],
}
NESTED_GARBAGE = ["[[[[[[[[[[{}]]]]]]]]]]", '{"a": {"b": [NaN, {"c": "\\ud800"}, [1e400]]}}']
DEEP = b"[" * 100_000 + b"]" * 100_000
BAD_BODIES = [  # (body, Content-Type or None)
    (b"", "application/json"), (b"null", "application/json"), (b"5", "application/json"),
    (b'"text"', "application/json"), (b"true", "application/json"), (b"[]", "application/json"),
    (b"NaN", "application/json"), (b"[1, 2]", "application/json"), (b"{", "application/json"),
    (b'{"prompt": "hi",}', "application/json"), (b"{'prompt': 'hi'}", "application/json"),
    (b'{"prompt": "a\x00b"}', "application/json"), (b"\xff\xfe\xfd", "application/json"),
    (b'{"prompt": "hi \xff\xfe"}', "application/json"), (b'{"prompt": "caf\xe9"}', "application/json"),
    (b'{"prompt": "\xed\xa0\x80"}', "application/json"),  # a surrogate encoded as UTF-8 bytes
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "application/json"),  # more digits than json makes an int of
    (DEEP, "application/json"), (b'{"prompt": ' + DEEP + b"}", "application/json"),
    (b'{"prompt": "hi", "max_tokens": 2}', "text/plain"),
    (b'{"prompt": "hi", "max_tokens": 2}', "application/x-www-form-urlencoded"),
    (b"prompt=hi", "application/x-www-form-urlencoded"),
]


def _sweep_cases(path: str, base: str, fields: dict) -> list[tuple[str, str, bytes, dict, int, str | None]]:
    """(method, path, body, headers, status, param) for each bad value of each field, streamed and not."""
    cases = []
    for field, values in fields.items():
        garbage = NESTED_GARBAGE[:1] if field == "stream_options" else NESTED_GARBAGE  # it ignores unknown keys
        for value in values + garbage:
            for stream in ("false", "true"):
                body = f'{{"stream": {stream}, {base}, "{field}": {value}}}'.encode()
                status = 404 if field == "model" and value == '"other-model"' else 400
                cases.append(("POST", path, body, JSON_HEADERS, status, field))
    for body, content_type in BAD_BODIES:
        headers = {**auth(), "Content-Type": content_type}
        cases.append(("POST", path, body, headers, 400, None))
    return cases


def test_malformed_request_sweep_never_500_and_keeps_the_connection(main_server):
    """Every field of both endpoints with wrong types, out-of-range and non-finite numbers, huge
    numbers, lone surrogates, nulls and nested garbage, and bodies that are not JSON objects: each
    is a 4xx in OpenAI's shape, every answer keeps the connection, and the server stays up."""
    cases = (_sweep_cases("/v1/completions", '"prompt": "hi", "max_tokens": 2',
                          {**SHARED_FIELDS, **COMPLETION_FIELDS})
             + _sweep_cases("/v1/chat/completions", '"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2',
                            {**SHARED_FIELDS, **CHAT_FIELDS}))
    for model in ("%ED%A0%80", "%FF", "%F0%9F%98%80", "x%00y"):  # a surrogate, invalid UTF-8, an emoji, NUL
        cases.append(("GET", f"/v1/models/{model}", None, auth(), 404, "model"))
    answers = sh.raw_exchange(main_server.port, [case[:4] for case in cases] + [
        ("POST", "/v1/completions", VALID_COMPLETION, JSON_HEADERS)])
    failures = []
    for (method, path, body, _, status, param), answer in zip(cases, answers):
        try:
            assert_raw_error(answer, status, param)
        except (AssertionError, ValueError) as error:
            failures.append(f"{method} {path} {body[:120] if body else ''!r}: {answer[0]} {answer[2][:200]!r} {error}")
    assert not failures, f"{len(failures)} of {len(cases)} malformed requests:\n" + "\n".join(failures)
    assert answers[-1][0] == 200 and json.loads(answers[-1][2])["usage"]["completion_tokens"] == 2
    assert get(main_server.url + "/health").json()["status"] == "ok"


# -- faults ---------------------------------------------------------------------------------------

def test_internal_error_is_500_for_that_request_only(main_server, client):
    body = {"model": MODEL_ID, "prompt": f"x {sh.FAIL_MARKER} y", "max_tokens": 5}
    assert_error(post(main_server.url + "/v1/completions", json=body, headers=auth()), 500,
                 code="internal_error")
    assert_error(post(main_server.url + "/v1/completions", json={**body, "stream": True}, headers=auth()),
                 500, code="internal_error")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL_ID, max_tokens=5,
                                       messages=[{"role": "user", "content": sh.FAIL_MARKER}])
    assert get(main_server.url + "/health").json()["status"] == "ok"
    response = client.completions.create(model=MODEL_ID, prompt="after the fault", max_tokens=5, **GREEDY)
    assert response.usage.completion_tokens == 5


def test_full_queue_answers_429_with_retry_after(slow_server):
    """Queue of one: a request blocked in its prefill holds the worker, a second waits, a third is
    refused while the worker is still blocked (so at once, not after waiting), with a Retry-After
    of (1 waiting + 1 running) x the mean recent run time, rounded up."""
    client = client_for(slow_server, key=None)
    worker, target = slow_server.worker, slow_server.target
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0)
    results = {}

    def ask(name: str, prompt: str) -> None:
        results[name] = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, **GREEDY)

    target.gate.clear()
    threads = [threading.Thread(target=ask, args=("blocked", f"{sh.BLOCK_MARKER} first"))]
    try:
        threads[0].start()
        sh.wait_until(target.blocked.is_set)  # the worker is held in this request's prefill
        threads.append(threading.Thread(target=ask, args=("waiting", "queued")))
        threads[1].start()
        sh.wait_until(lambda: worker.queue_length == 1)  # the queue (size 1) is full
        worker.recent_run_s.clear()
        worker.recent_run_s.extend([6.0, 8.4])  # mean 7.2 s; nothing finishes while the gate is closed
        response = post(slow_server.url + "/v1/completions",
                        json={"model": MODEL_ID, "prompt": "one too many", "max_tokens": 3})
        assert_error(response, 429, code="queue_full")
        assert response.headers.get("retry-after") == "15"  # ceil(2 x 7.2)
        assert "15 s" in response.json()["error"]["message"]
        assert target.blocked.is_set()  # refused while the worker was still blocked
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_ID, prompt="one too many", max_tokens=3)
    finally:
        target.gate.set()
        for thread in threads:
            thread.join(sh.HANG_GUARD_S)
        worker.recent_run_s.clear()
    assert results["blocked"].usage.completion_tokens == 3
    assert results["waiting"].usage.completion_tokens == 3


def test_retry_after_estimate_uses_the_queue_and_recent_run_times(reference):
    worker = Worker(reference, max_queue=8)  # not started: submitted jobs stay queued
    request = GenerationRequest((1, 2, 3), "ar", 4, SamplingConfig(), (), MethodOptions())
    assert worker.estimated_wait() == 0.0  # nothing ahead
    for _ in range(3):
        worker.submit(Ticket(request, lambda event: None))
    assert worker.estimated_wait() == 0.0  # no run time known yet
    worker.recent_run_s.extend([1.0, 2.0, 6.0])
    assert worker.estimated_wait() == pytest.approx(3 * 3.0)
    worker.recent_run_s.extend([5.0] * RECENT_JOBS)  # only the recent jobs count
    assert worker.estimated_wait() == pytest.approx(3 * 5.0)
    assert len(worker.recent_run_s) == RECENT_JOBS


def test_the_choices_of_one_request_count_once_in_the_queue(reference):
    """A request with n choices takes one of --max-queue's places: with a queue of one, n=5 is
    queued (it was refused with 429 forever: a retry could never succeed), a second request is
    not, and the queue is free again once the choices have left it."""
    worker = Worker(reference, max_queue=1)  # not started: submitted jobs stay queued
    request = GenerationRequest((1, 2, 3), "ar", 4, SamplingConfig(), (), MethodOptions())
    choices = [Ticket(request, lambda event: None) for _ in range(5)]
    worker.submit_all(choices)
    assert worker.queue_length == 1 and worker.queued_jobs == 5
    with pytest.raises(QueueFull):
        worker.submit(Ticket(request, lambda event: None))
    for job in choices[:4]:
        worker.cancel(job)
    assert worker.queue_length == 1
    worker.cancel(choices[4])
    assert worker.queue_length == 0
    worker.submit(Ticket(request, lambda event: None))


def test_more_choices_than_the_queue_holds_are_served(slow_server):
    sh.wait_until(lambda: not slow_server.worker.busy and slow_server.worker.queue_length == 0)
    response = post(slow_server.url + "/v1/completions",  # --max-queue 1
                    json={"prompt": "hi", "max_tokens": 2, "n": 5, "temperature": 0.7, "seed": 1})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 5


def _metric(server, name: str, **labels: str) -> float:
    return sh.metric_value(get(server.url + "/metrics").text, name, **labels)


def test_streaming_disconnect_cancels_generation(slow_server):
    client = client_for(slow_server, key=None)
    worker = slow_server.worker
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0)
    tokens = _metric(slow_server, "verispec_generated_tokens_total", method="ar")
    cancelled = _metric(slow_server, "verispec_generations_total", method="ar", outcome="cancelled")
    finished = _metric(slow_server, "verispec_generations_total", method="ar", outcome="length")
    # 200 tokens at 50 ms each would keep the worker busy for 10 s.
    stream = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=200, stream=True,
                                       extra_body={"method": "ar"}, **GREEDY)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert worker.busy
    stream.close()
    sh.wait_until(lambda: not worker.busy)
    assert _metric(slow_server, "verispec_generations_total", method="ar", outcome="cancelled") == cancelled + 1
    assert _metric(slow_server, "verispec_generations_total", method="ar", outcome="length") == finished
    assert _metric(slow_server, "verispec_generated_tokens_total", method="ar") - tokens < 200  # stopped early


def test_non_streaming_disconnect_cancels_generation(slow_server):
    worker = slow_server.worker
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0)
    tokens = _metric(slow_server, "verispec_generated_tokens_total", method="ar")
    cancelled = _metric(slow_server, "verispec_generations_total", method="ar", outcome="cancelled")
    body = json.dumps({"model": MODEL_ID, "prompt": "hello world", "max_tokens": 200, "method": "ar",
                       "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", slow_server.port), timeout=sh.HANG_GUARD_S) as sock:
        sock.sendall(head + body)
        sh.wait_until(lambda: worker.busy)  # generating; 200 tokens would take 10 s
    # the client went away without its answer: the generation stops
    sh.wait_until(lambda: not worker.busy)
    assert _metric(slow_server, "verispec_generations_total", method="ar", outcome="cancelled") == cancelled + 1
    assert _metric(slow_server, "verispec_generated_tokens_total", method="ar") - tokens < 200


def test_request_timeout_ends_generation_cleanly(timeout_server):
    client = client_for(timeout_server, key=None)
    kwargs = dict(model=MODEL_ID, prompt="hello world", max_tokens=200, extra_body={"method": "ar"}, **GREEDY)
    response = client.completions.create(**kwargs)  # 200 tokens would take 10 s; the limit is 2 s
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
    worker, target = timeout_server.worker, timeout_server.target
    sh.wait_until(lambda: not worker.busy and worker.queue_length == 0)
    target.gate.clear()
    blocker = threading.Thread(target=lambda: client.completions.create(
        model=MODEL_ID, prompt=f"{sh.BLOCK_MARKER}", max_tokens=5))
    try:
        blocker.start()
        sh.wait_until(target.blocked.is_set)  # the worker is held until the gate opens
        response = post(timeout_server.url + "/v1/completions",
                        json={"model": MODEL_ID, "prompt": "waiting", "max_tokens": 5})
        assert_error(response, 503, code="timeout")
        assert target.blocked.is_set()  # the answer came while the worker was still blocked
    finally:
        target.gate.set()
        blocker.join(sh.HANG_GUARD_S)
    assert worker.queue_length == 0


# -- metrics and load -------------------------------------------------------------------------------

def test_metrics_endpoint(main_server, client):
    client.completions.create(model=MODEL_ID, prompt="count me", max_tokens=6, extra_body={"method": "pld"},
                              **GREEDY)
    response = get(main_server.url + "/metrics", headers=auth())
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


def test_spec_decode_counters_of_known_steps():
    """ServerMetrics turns a generation's steps into vLLM's counters, summed over generations."""
    metrics = ServerMetrics(queue_length=lambda: 0, busy=lambda: 0)
    first, second = GenerationStats(method="pld"), GenerationStats(method="pld")
    for drafted, accepted in [(3, 3), (3, 0), (0, 0), (2, 1)]:
        first.record_step(drafted, accepted)
    second.record_step(4, 2)
    metrics.finished(first, "length")
    metrics.finished(second, "eos")
    text = metrics.render().decode()
    value = lambda name, **labels: sh.metric_value(text, name, method="pld", **labels)  # noqa: E731
    assert value("verispec_spec_decode_num_drafts_total") == 4  # the step that drafted nothing is no draft
    assert value("verispec_spec_decode_num_draft_tokens_total") == 12
    assert value("verispec_spec_decode_num_accepted_tokens_total") == 6
    assert [value("verispec_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(4)] == [3, 2, 1, 0]
    assert value("verispec_drafted_tokens_total") == 12 and value("verispec_accepted_tokens_total") == 6


def test_a_request_reports_drafts_and_acceptance_by_position(main_server, client):
    def counters() -> dict:
        text = get(main_server.url + "/metrics", headers=auth()).text
        found = {name: sh.metric_value(text, f"verispec_spec_decode_num_{name}_total", method="pld")
                 for name in ("drafts", "draft_tokens", "accepted_tokens")}
        found["per_pos"] = [sh.metric_value(text, "verispec_spec_decode_num_accepted_tokens_per_pos_total",
                                            method="pld", position=str(i)) for i in range(16)]
        return found

    before = counters()
    response = client.completions.create(model=MODEL_ID, prompt="abc abc abc abc abc", max_tokens=24,
                                         extra_body={"method": "pld"}, **GREEDY)
    ext = extension(response)
    after = counters()
    assert ext["drafts"] >= 1 and ext["drafted"] >= ext["drafts"]  # the repeated prompt gets drafted
    per_pos = ext["accepted_per_position"]
    assert sum(per_pos) == ext["accepted"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # acceptance is a prefix
    assert ext["mean_acceptance_length"] == pytest.approx(1 + ext["accepted"] / ext["drafts"], abs=1e-4)
    assert after["drafts"] - before["drafts"] == ext["drafts"]
    assert after["draft_tokens"] - before["draft_tokens"] == ext["drafted"]
    assert after["accepted_tokens"] - before["accepted_tokens"] == ext["accepted"]
    assert [a - b for a, b in zip(after["per_pos"], before["per_pos"])] == per_pos + [0] * (16 - len(per_pos))


@pytest.mark.long
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
    health = get(main_server.url + "/health").json()
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
    (["--max-batch", "0"], "max_sequences"),
    (["--max-rows", "8"], "max_rows"),
    (["--kv-memory", "lots"], "memory size"),
    (["--kv-memory", "-1GiB"], "memory size"),
])
def test_serve_validates_before_loading(monkeypatch, args, fragment):
    import verispec.cli as cli

    monkeypatch.setattr("verispec.target.loading.load", lambda *a, **k: pytest.fail("loaded a model before validating"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error:") and fragment in " ".join(result.stderr.split()), result.stderr


def test_serve_reads_the_api_key_from_the_environment(monkeypatch):
    import verispec.cli as cli

    monkeypatch.setattr("verispec.target.loading.load", lambda *a, **k: pytest.fail("loaded a model before validating"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", "0"], env={"VERISPEC_API_KEY": "  "})
    assert result.exit_code == 2 and "API key" in result.stderr, result.stderr


def test_serve_refuses_a_busy_port_before_loading(monkeypatch, main_server):
    import verispec.cli as cli

    monkeypatch.setattr("verispec.target.loading.load", lambda *a, **k: pytest.fail("loaded a model with the port taken"))
    result = CliRunner().invoke(cli.app, ["serve", "--port", str(main_server.port)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error:") and "cannot listen" in result.stderr


@pytest.mark.long
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
        assert get(url.removesuffix("/v1") + "/v1/models").status_code == 401
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
