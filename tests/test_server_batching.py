"""`verispec serve` as a continuous-batching server: requests decoded together give exactly what
each gives alone, whatever else runs.

Served over a tiny block-exact Llama in int8 numerics (its requests page their KV and share
each step's forward), through the real HTTP stack and the official `openai` client:
concurrent requests at 1 to 8 at once for every lossless method, greedy and seeded sampling,
equal to their solo outputs; a request joining while others decode; a cancelled stream that
leaves the others untouched and gives its blocks back; a long prompt that does not stop the
streams in flight; a KV pool too small for everyone (waits, never a 500); a soak of requests
with random cancellations and timeouts after which every block is free; `n` choices and
`logprobs` against separate requests and a plain forward; the batching metrics.

No test measures time: orderings are checked, and every wait has a limit that only guards
against a hang (`server_helpers.HANG_GUARD_S`).
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import httpx
import pytest
import torch
from openai import OpenAI

import helpers
import server_helpers as sh
from verispec import generate
from verispec.runtime.kv_pool import block_bytes
from verispec.server import ServerSettings

pytestmark = pytest.mark.long  # end to end; left out by make test-quick

MODEL_ID = "tiny-batch-model"
GREEDY = dict(temperature=0)
PROMPTS = ["the cat sat on the mat. the cat", "abc abc abc abc", "so it goes, so it goes, so",
           "hello there, hello there", "one two three one two", "x y z x y z x", "to be or not to be",
           "a rose is a rose is a"]


@pytest.fixture(scope="module")
def tokenizer():
    return helpers.char_tokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer):
    """The served model's weights in-process: each request's output alone."""
    return sh.int8_text_target(tokenizer)


@pytest.fixture(scope="module")
def server(tokenizer):
    target = sh.int8_text_target(tokenizer)
    assert target.pages_kv
    running = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_queue=512, request_timeout=60,
                                                      max_tokens_limit=120, max_sequences=8))
    yield running
    running.stop()


def client_for(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=sh.HANG_GUARD_S)


def alone(reference, prompt: str, method: str, max_tokens: int, **sampling) -> str:
    """What the request gives served alone (the library's single-request API, same weights)."""
    text = generate(reference, prompt, method, max_new_tokens=max_tokens, **sampling).text
    reference.release()
    return text


def idle(server) -> bool:
    worker = server.worker
    return not worker.busy and worker.queue_length == 0


def metric(server, name: str, **labels) -> float:
    return sh.metric_value(httpx.get(server.url + "/metrics").text, name, **labels)


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_concurrent_requests_equal_their_solo_outputs(server, reference, concurrency):
    """Every lossless method, greedy and seeded sampling, `concurrency` requests at once."""
    client = client_for(server)
    cases = []
    for i, prompt in enumerate(PROMPTS):
        for method in ("ar", "pld", "anpd", "anpd/tree=8"):
            cases.append((prompt, method, 20 + 3 * i, {"temperature": 0}))
        cases.append((prompt, ("ar", "anpd", "pld")[i % 3], 24, {"temperature": 1.0, "top_k": 20, "seed": 11 + i}))
    expected = [alone(reference, prompt, method, tokens, **{k: v for k, v in sampling.items()})
                for prompt, method, tokens, sampling in cases]

    def ask(case) -> str:
        prompt, method, tokens, sampling = case
        return client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=tokens,
                                         extra_body={"method": method, **({"top_k": sampling["top_k"]} if "top_k" in sampling else {})},
                                         **{k: v for k, v in sampling.items() if k != "top_k"}).choices[0].text

    sh.wait_until(lambda: idle(server))
    steps_before = metric(server, "verispec_batch_sequences_count")
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        got = list(pool.map(ask, cases))
    for case, text, reference_text in zip(cases, got, expected):
        assert text == reference_text, case
    assert metric(server, "verispec_batch_sequences_count") > steps_before
    sh.wait_until(lambda: idle(server))
    assert server.target.pool.used_blocks == 0  # every request gave its blocks back


def test_a_request_joins_while_others_decode_and_a_cancelled_stream_leaves_the_others_alone(tokenizer, reference):
    target = sh.int8_text_target(tokenizer, delay=0.05)  # 120 tokens take seconds
    server = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_tokens_limit=120))
    try:
        client = client_for(server)
        expected = {prompt: alone(reference, prompt, "anpd", 60, temperature=0) for prompt in PROMPTS[:3]}
        streams = {prompt: client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=tokens, stream=True,
                                                     extra_body={"method": "anpd"}, **GREEDY)
                   for prompt, tokens in ((PROMPTS[0], 60), (PROMPTS[1], 120))}
        chunks = {prompt: iter(stream) for prompt, stream in streams.items()}
        texts = {prompt: next(chunks[prompt]).choices[0].text for prompt in streams}  # both decoding
        streams[PROMPTS[1]].close()  # the client of the second stream goes away
        joined = client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=60,
                                           extra_body={"method": "anpd"}, **GREEDY)
        assert joined.choices[0].text == expected[PROMPTS[2]]
        texts[PROMPTS[0]] += "".join(chunk.choices[0].text for chunk in chunks[PROMPTS[0]])
        assert texts[PROMPTS[0]] == expected[PROMPTS[0]]
        sh.wait_until(lambda: idle(server))
        assert metric(server, "verispec_generations_total", method="anpd", outcome="cancelled") == 1
        assert target.pool.used_blocks == 0
    finally:
        server.stop()


def test_a_long_prompt_does_not_stop_the_streams_in_flight(tokenizer):
    """Prompt chunks share each step with the decoding rows (a row budget of 32): while a
    200-token prompt is prefilled, chunks of the streams already running keep arriving."""
    target = sh.int8_text_target(tokenizer, delay=0.02)
    server = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_tokens_limit=200, max_rows=32))
    try:
        client = client_for(server)
        arrivals: list[tuple[float, str]] = []
        lock = threading.Lock()

        def stream(prompt: str, tag: str, tokens: int) -> None:
            for chunk in client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=tokens, stream=True,
                                                   extra_body={"method": "ar"}, **GREEDY):
                if chunk.choices and chunk.choices[0].text:
                    with lock:
                        arrivals.append((time.monotonic(), tag))

        short = [threading.Thread(target=stream, args=(prompt, "short", 100)) for prompt in PROMPTS[:2]]
        for thread in short:
            thread.start()
        sh.wait_until(lambda: sum(tag == "short" for _, tag in arrivals) >= 4)
        sent = time.monotonic()
        stream(("so it goes. " * 20)[:200], "long", 5)
        for thread in short:
            thread.join(sh.HANG_GUARD_S)
        first_long = min(at for at, tag in arrivals if tag == "long")
        during = [tag for at, tag in arrivals if sent < at < first_long]
        assert during.count("short") >= 2, during  # the short streams went on during the long prefill
    finally:
        server.stop()


def test_a_kv_pool_too_small_for_everyone_makes_requests_wait_never_fail(tokenizer, reference):
    target = sh.int8_text_target(tokenizer)
    config = target.config
    target.kv_memory = 10 * block_bytes(config.num_hidden_layers, config.num_key_value_heads,
                                              target.decoder.head_dim)
    server = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_queue=64, max_tokens_limit=120,
                                                     max_sequences=16))
    try:
        client = client_for(server)
        cases = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 100) for i in range(16)]
        expected = [alone(reference, prompt, "anpd", tokens, temperature=0) for prompt, tokens in cases]
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            got = list(pool.map(lambda case: client.completions.create(
                model=MODEL_ID, prompt=case[0], max_tokens=case[1], extra_body={"method": "anpd"},
                **GREEDY).choices[0].text, cases))
        assert got == expected
        assert metric(server, "verispec_generations_total", method="anpd", outcome="error") == 0
        sh.wait_until(lambda: idle(server))
        assert target.pool.used_blocks == 0
    finally:
        server.stop()


def test_a_soak_with_cancellations_and_timeouts_ends_with_every_block_free(tokenizer):
    target = sh.int8_text_target(tokenizer)
    server = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_queue=512, request_timeout=1.5,
                                                     max_tokens_limit=120, max_sequences=8))
    rng = random.Random(0)
    try:
        def one(index: int) -> str:
            prompt = PROMPTS[index % len(PROMPTS)] + str(index)
            body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": rng.choice([5, 40, 120]),
                    "method": rng.choice(["ar", "anpd", "pld"]), "temperature": 0, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=sh.HANG_GUARD_S) as answer:
                if answer.status_code != 200:
                    return f"status {answer.status_code}"
                for count, _ in enumerate(answer.iter_lines()):
                    if index % 3 == 0 and count == 2:
                        return "cancelled"  # the client leaves mid-stream
                return "done"

        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            outcomes = list(pool.map(one, range(200)))
        assert len(outcomes) == 200 and not any(outcome.startswith("status 5") for outcome in outcomes), outcomes
        assert outcomes.count("cancelled") > 0
        sh.wait_until(lambda: idle(server))
        assert target.pool.used_blocks == 0
        assert metric(server, "verispec_generations_total", method="anpd", outcome="error") == 0
    finally:
        server.stop()


def test_n_choices_equal_separate_requests_with_their_seeds(server, reference):
    client = client_for(server)
    sampling = dict(temperature=1.0, seed=40)
    response = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=20, n=3,
                                         extra_body={"method": "anpd"}, **sampling)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for i, choice in enumerate(response.choices):
        assert choice.text == alone(reference, PROMPTS[0], "anpd", 20, temperature=1.0, seed=40 + i)
    assert response.usage.completion_tokens == 3 * 20  # every choice ran to its budget
    assert all(choice.finish_reason == "length" for choice in response.choices)
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=10, n=2, **GREEDY)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    streamed = list(client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=20, n=3, stream=True,
                                              extra_body={"method": "anpd"}, **sampling))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [choice.text for choice in response.choices]


@pytest.mark.parametrize("method", ["ar", "anpd"])
def test_logprobs_are_those_of_a_plain_forward_of_the_same_tokens(server, reference, method):
    client = client_for(server)
    response = client.completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=16, logprobs=3,
                                         extra_body={"method": method}, **GREEDY)
    logprobs = response.choices[0].logprobs
    prompt = reference.tokenizer(PROMPTS[1])["input_ids"]
    ids = generate(reference, PROMPTS[1], method, max_new_tokens=16).token_ids  # the same output, as ids
    assert reference.tokenizer.decode(ids) == response.choices[0].text
    assert len(ids) == len(logprobs.token_logprobs) == 16
    reference.reset()
    rows = reference.forward(prompt + ids[:-1])[len(prompt) - 1 :]  # [16, vocab]: the row before each token
    reference.release()
    plain = torch.log_softmax(rows.float(), -1)
    assert logprobs.token_logprobs == [plain[i, token].item() for i, token in enumerate(ids)]
    top = plain.topk(3, -1)
    for i, entries in enumerate(logprobs.top_logprobs):
        assert sorted(entries.values(), reverse=True) == top.values[i].tolist()
    chat = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(item.top_logprobs) == 2 for item in content)
    assert "".join(item.token for item in content) == chat.choices[0].message.content


def test_the_batching_metrics(server):
    client = client_for(server)
    sh.wait_until(lambda: idle(server))
    client.completions.create(model=MODEL_ID, prompt=PROMPTS[2] * 3, max_tokens=10, **GREEDY)
    client.completions.create(model=MODEL_ID, prompt=PROMPTS[2] * 3, max_tokens=10, **GREEDY)  # its blocks cached
    text = httpx.get(server.url + "/metrics").text
    for name in ("verispec_num_requests_running", "verispec_num_requests_waiting", "verispec_kv_cache_usage_perc",
                 "verispec_kv_cache_blocks_total", "verispec_prefix_cache_queries_total",
                 "verispec_prefix_cache_hits_total", "verispec_time_per_output_token_seconds_count",
                 "verispec_inter_token_latency_seconds_count", "verispec_batch_rows_count"):
        assert name in text, name
    assert sh.metric_value(text, "verispec_kv_cache_blocks_total") == server.target.pool.blocks
    assert sh.metric_value(text, "verispec_prefix_cache_hits_total") >= 64
    assert sh.metric_value(text, "verispec_prefix_cache_queries_total") >= sh.metric_value(
        text, "verispec_prefix_cache_hits_total")


def test_serve_with_a_draft_model_runs_sps_and_mtad_for_any_request(tokenizer, reference, tmp_path):
    """`verispec serve --draft-model DIR`: sps and mtad requests draft with that model (batched
    beside the others); greedy sps equals the target's own output."""
    draft = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=256,
                                                   num_hidden_layers=1), seed=3)
    draft.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    target = sh.int8_text_target(tokenizer)
    server = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_tokens_limit=120,
                                                     draft_model=str(tmp_path / "draft")))
    try:
        client = client_for(server)
        prompt = PROMPTS[0]
        answer = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=40, extra_body={"method": "sps"},
                                           **GREEDY)
        assert answer.choices[0].text == alone(reference, prompt, "ar", 40, temperature=0)
        assert answer.model_extra["verispec"]["drafted"] > 0
        sampled = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=20, extra_body={"method": "mtad"})
        assert sampled.model_extra["verispec"]["method"] == "mtad" and sampled.usage.completion_tokens > 0
    finally:
        server.stop()
