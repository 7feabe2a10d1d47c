"""Nothing lost under KV-memory pressure: the batch engine, `generate_many` and the worker on
pools of a few blocks.

Each test is one way requests used to be lost, on the tiny block-exact models in int8 numerics
(paged KV): a fully cached, block-aligned context (its copy-on-write block taken before the
admission check), a step that raises (the worker left the failed jobs in the engine, holding
their blocks), a request that fits alone but reserved past the pool at every step (preempting
itself forever), model-drafted methods admitted without a block check, and the library's KV
size knob. Every output is checked against the request run alone; no test measures time (a
loop that might not end is bounded by a step count that only guards against a hang).
"""

from __future__ import annotations

import pytest
import torch

import helpers
import server_helpers as sh
from verispec.api import BatchTextStream, RequestDone, generate, generate_many, make_request
from verispec.core.batch import BatchEngine
from verispec.core.engine import DecodeConfig
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.runtime.kv_pool import PoolExhausted, block_bytes
from verispec.runtime.rows import BLOCK
from verispec.server.worker import Failed, Finished, Ticket, Worker
from verispec.core.stats import GenerationStats

TOKENIZER = helpers.char_tokenizer(eos=False)  # no EOS: every request runs its whole budget


def int8_target(arch: str = "llama", seed: int = 0, blocks: int | None = None, **config) -> Target:
    model = helpers.make_model(helpers.make_config(arch, vocab_size=len(TOKENIZER), **config), seed)
    target = Target(model, TOKENIZER, name=f"tiny-{arch}-int8", fast=True, blocks=helpers.blockify(model),
                    numerics="int8")
    if blocks is not None:
        target.kv_memory = blocks * block_bytes(target.config.num_hidden_layers, target.config.num_key_value_heads,
                                                target.decoder.head_dim)
    return target


def bounded(stream: BatchTextStream, steps: int) -> list:
    """Run `stream` to its end, failing if the engine takes more than `steps` steps (a livelock)."""
    engine, original, count = stream._engine, stream._engine.step, [0]

    def step():
        count[0] += 1
        assert count[0] <= steps, f"no end after {steps} steps"
        return original()

    engine.step = step
    for _ in stream:
        pass
    return list(stream.results)


def block_aligned_prompt(target: Target, length: int = BLOCK) -> str:
    text = ("the cat sat on the mat. " * 10)[:length]
    assert len(make_request(target, text, "ar").prompt_ids) == length
    return text


@pytest.mark.parametrize("pool_blocks", [4, 5, 7])
@pytest.mark.parametrize("copies", [2, 3])
def test_a_fully_cached_block_aligned_prompt_never_crashes_the_batch(pool_blocks, copies):
    """The second copy of a 64-token prompt finds all its blocks cached: its start copies the
    last one (copy on write) and used to take that block before any capacity check, so a full
    pool raised out of the step and `generate_many` returned nothing at all."""
    reference = int8_target(seed=1)
    target = int8_target(seed=1, blocks=pool_blocks)
    prompt = block_aligned_prompt(target)
    requests = [make_request(target, prompt, method, max_new_tokens=60) for method in ("ar", "anpd", "pld")[:copies]]
    expected = [helpers.solo(reference, request) for request in requests]
    results = bounded(BatchTextStream(target, requests), 2000)
    assert [r.token_ids for r in results] == expected
    assert target.pool.used_blocks == 0


def test_a_request_that_fits_alone_never_preempts_itself_forever():
    """11 prompt tokens and 200 new ones need 4 blocks; the engine used to reserve
    length + 2 * (room + 1) positions with room up to 255 at every step: more than a 6-block
    pool, so the request preempted itself forever."""
    reference = int8_target(seed=2)
    target = int8_target(seed=2, blocks=6)
    request = make_request(target, "hello world", "anpd", max_new_tokens=200)
    results = bounded(BatchTextStream(target, [request]), 400)
    assert results[0].token_ids == helpers.solo(reference, request)
    assert target.pool.used_blocks == 0


@pytest.mark.parametrize("method", ["eesd", "sps", "mtad"])
def test_model_drafted_methods_wait_for_blocks_instead_of_failing(method, tmp_path):
    """eesd (beside the batch), sps and mtad (in it, their draft model's sequences in its own
    pool) hold sequences of the target's pool; they were admitted without a block check and
    failed with PoolExhausted though each fits alone."""
    reference = int8_target(seed=3)
    target = int8_target(seed=3, blocks=6)
    options = _draft_options(method, reference, tmp_path)
    sampling = dict(temperature=1.0, top_k=20, seed=5) if method == "mtad" else dict(temperature=0.0)
    requests = [make_request(target, prompt, method, max_new_tokens=90, options=options, **sampling)
                for prompt in ("hello world", "the cat sat", "so it goes. so it goes")]
    requests.append(make_request(target, "abcabcabc", "anpd", max_new_tokens=90))
    expected = [helpers.solo(reference, request) for request in requests]
    results = bounded(BatchTextStream(target, requests), 3000)
    assert not [r for r in results if isinstance(r, BaseException)], results
    if method != "mtad":  # mtad's drafts (and so its sample) depend on its controller's timing
        assert [r.token_ids for r in results] == expected
    assert target.pool.used_blocks == 0


def _draft_options(method: str, reference: Target, folder) -> MethodOptions:
    """A draft model for sps and mtad (a second tiny model with the same tokenizer, saved), or an
    exit head for eesd (an untrained one on layer 1)."""
    if method == "eesd":
        from verispec.core.drafters.early_exit import ExitHead, save_head

        head = ExitHead(reference.model, 1, list(range(reference.vocab_size)))
        save_head(head, head.spec(reference.model, reference.name), folder / "head", dtype=torch.float32)
        return MethodOptions(exit_head=str(folder / "head"), controller="constant:4")
    draft = helpers.make_model(helpers.make_config("llama", vocab_size=len(TOKENIZER), num_hidden_layers=1), 9)
    draft.save_pretrained(folder / "draft")
    TOKENIZER.save_pretrained(folder / "draft")
    return MethodOptions(draft_model=str(folder / "draft"), controller="constant:4")


@pytest.mark.parametrize("where", ["admission", "_shared_step", "admit"])
def test_a_step_that_raises_leaves_nothing_behind_in_the_worker(where):
    """A fault in a step used to escape it; the worker then failed its jobs without cancelling
    them in the engine: they kept their blocks and their places, and a job that raised at its
    admission stayed at the head of the queue, raising at every step: every later request
    failed. Faults: the admission of copies of a block-aligned prompt to a nearly full pool
    (which raised `PoolExhausted` out of the step), and one-off faults injected inside the
    engine's step and in the admission the worker calls itself. The next requests succeed."""
    target = int8_target(seed=4, blocks=5)
    worker = Worker(target, max_queue=8)
    engine = worker.engine
    if where != "admission":
        original, armed = getattr(engine, where), [True]

        def faulty(*args):
            if armed[0] and (where != "admit" or engine.running):
                armed[0] = False
                raise RuntimeError("injected fault in a step")
            return original(*args)

        setattr(engine, where, faulty)
    events: dict[str, list] = {}
    reference = int8_target(seed=4)

    def submit(prompt: str, method: str, key: str) -> None:
        request = make_request(target, prompt, method, max_new_tokens=60)
        worker.submit(Ticket(request, notify=lambda event: events.setdefault(key, []).append(event)))

    def ended(key: str):
        sh.wait_until(lambda: any(isinstance(e, (Failed, Finished)) for e in events.get(key, [])))
        return events[key][-1]

    def served_as_alone(key: str, prompt: str, method: str) -> None:
        last = ended(key)
        assert isinstance(last, Finished), last
        assert last.result.token_ids == helpers.solo(reference, make_request(reference, prompt, method, max_new_tokens=60))

    worker.start()
    try:
        if where == "admission":
            aligned = block_aligned_prompt(target)
            for i, method in enumerate(("ar", "anpd", "pld")):
                submit(aligned, method, f"copy {i}")
            for i, method in enumerate(("ar", "anpd", "pld")):
                served_as_alone(f"copy {i}", aligned, method)
        else:
            submit("hello world", "pld", "first")
            assert isinstance(ended("first"), Failed)
        for prompt in ("the cat sat", "so it goes"):
            submit(prompt, "anpd", prompt)
            served_as_alone(prompt, prompt, "anpd")
        sh.wait_until(lambda: engine.idle)
        assert target.pool.used_blocks == 0
    finally:
        worker.stop()


def test_the_library_sizes_the_kv_memory():
    """`Target.kv_memory` (and `verispec.load(kv_memory=...)`) sets the pool: bytes or a size."""
    target = int8_target(seed=5)
    per_block = block_bytes(target.config.num_hidden_layers, target.config.num_key_value_heads, target.decoder.head_dim)
    target.kv_memory = f"{9 * per_block}B"
    assert target.pool.blocks == 9
    with pytest.raises(Exception, match="memory size"):
        target.kv_memory = "lots"


def test_the_server_queues_what_fits_and_refuses_only_what_never_can(tmp_path):
    """With 3 blocks of KV memory (192 positions): two choices of a 64-token prompt with 40 new
    tokens each need 2 blocks apiece and were refused as 8 ("at most half the pool"); they wait
    and both complete. A request that needs more than the whole pool is refused with a 400
    (kv_memory_exceeded) naming max_tokens, or the prompt where the prompt alone could never fit;
    one that names no max_tokens gets what the pool leaves."""
    import httpx

    from verispec.server import ServerSettings

    tokenizer = helpers.char_tokenizer()
    target = sh.int8_text_target(tokenizer)
    reference = sh.int8_text_target(tokenizer)
    target.kv_memory = 3 * block_bytes(target.config.num_hidden_layers, target.config.num_key_value_heads,
                                       target.decoder.head_dim)
    server = sh.RunningServer(target, ServerSettings(model_id="m", max_queue=16, max_tokens_limit=300))
    try:
        prompt = ("so it goes, " * 8)[:BLOCK]
        body = {"prompt": prompt, "max_tokens": 40, "n": 2, "temperature": 1.0, "seed": 11}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=sh.HANG_GUARD_S)
        assert answer.status_code == 200, answer.text
        texts = [choice["text"] for choice in sorted(answer.json()["choices"], key=lambda c: c["index"])]
        expected = [generate(reference, prompt, "anpd", max_new_tokens=40, temperature=1.0, seed=11 + i).text
                    for i in range(2)]
        assert texts == expected
        huge = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * 100, "max_tokens": 120})
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "kv_memory_exceeded", huge.text
        assert huge.json()["error"]["param"] == "max_tokens" and "lower max_tokens" in huge.text
        for path, prompt, param in (("/v1/completions", {"prompt": "a" * 200}, "prompt"),  # 4 blocks alone
                                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 200}]},
                                     "messages")):
            too_long = httpx.post(server.url + path, json={**prompt, "max_tokens": 5})
            error = too_long.json()["error"]
            assert too_long.status_code == 400 and error["code"] == "kv_memory_exceeded", too_long.text
            assert error["param"] == param and "shorten it" in error["message"], error
            assert "max_tokens" not in error["message"], error  # no max_tokens would do
        unsized = httpx.post(server.url + "/v1/completions", json={"prompt": "a" * 100, "temperature": 0},
                             timeout=sh.HANG_GUARD_S)
        assert unsized.status_code == 200 and unsized.json()["usage"]["completion_tokens"] == 3 * BLOCK - 100
        sh.wait_until(lambda: server.worker.engine.idle)
        assert target.pool.used_blocks == 0
    finally:
        server.stop()


@pytest.fixture(scope="module")
def drafting(tmp_path_factory):
    """Options for the model-drafted methods on the seed-6 tiny Llama (an exit head, a draft model)."""
    folder = tmp_path_factory.mktemp("drafting")
    reference = int8_target(seed=6)
    return {method: _draft_options(method, reference, folder / method) for method in ("eesd", "sps")}


@pytest.mark.long
def test_random_mixes_on_a_real_model_equal_their_solo_outputs(drafting):
    """Random mixes on the tiny model (prompts of 64 * k tokens and others, n copies, every
    lossless method with greedy and seeded sampling, stop strings, cancellations) on pools from
    1 block up: each request that fits alone gives its solo output (a cancelled one a prefix of
    it), each that never can is refused in its place, and every block comes back."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    reference = int8_target(seed=6)
    texts = ["the cat sat on the mat. " * 12, "so it goes, " * 24, "abcabcabc" * 30]
    request = st.tuples(st.sampled_from([1, 7, 63, 64, 65, 128, 129]), st.integers(0, 2), st.integers(1, 3),
                        st.integers(1, 100), st.sampled_from(["ar", "pld", "anpd", "anpd/tree=8", "eesd", "sps"]),
                        st.booleans(), st.sampled_from([(), ("at",), ("so",)]), st.one_of(st.none(), st.integers(1, 30)))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(pool=st.integers(1, 8), mix=st.lists(request, min_size=1, max_size=6))
    def check(pool, mix):
        target = int8_target(seed=6, blocks=pool)
        requests, cancels = [], {}
        for length, text, copies, tokens, method, sampled, stop, cancel_at in mix:
            options = drafting.get(method)
            sampling = dict(temperature=0.9, top_k=12, seed=length + tokens) if sampled else dict(temperature=0.0)
            for _ in range(copies):
                if cancel_at is not None:
                    cancels[len(requests)] = cancel_at
                requests.append(make_request(target, texts[text][:length], method, max_new_tokens=tokens,
                                             stop=stop, options=options, **sampling))
        stream = BatchTextStream(target, requests)
        seen = {i: 0 for i in range(len(requests))}
        for event in stream:
            if isinstance(event, RequestDone):
                continue
            seen[event.index] += 1
            if cancels.get(event.index) == seen[event.index]:
                stream.cancel(event.index)
        for index, (request, result) in enumerate(zip(requests, stream.results)):
            need = -(-(len(request.prompt_ids) + request.max_new_tokens) // BLOCK)
            if need > pool:
                assert isinstance(result, PoolExhausted) and "never fit" in str(result)
                continue
            assert not isinstance(result, BaseException), result
            expected = helpers.solo(reference, request)
            if result.stats.stop_reason == "cancelled":
                assert result.token_ids == expected[: len(result.token_ids)]
            elif request.method in ("eesd", "sps") and request.sampling.temperature > 0:
                assert len(result.token_ids) == len(expected) or result.stats.stop_reason == "stop"
            else:
                assert result.token_ids == expected
        assert target.pool.used_blocks == 0

    check()


@pytest.mark.long
def test_a_small_soak_under_a_few_blocks_loses_nothing():
    """`verispec.bench.soak` (what scripts/soak_kv.py runs on the real model) against the tiny
    model's server with 4 blocks of KV memory: 80 mixed requests from 6 clients (n up to 4,
    prompts of 64 * k tokens and others, stops, streaming, clients that disconnect, requests
    that can never fit): nothing lost, no 5xx, every reproducible output equal to its solo one,
    no block held at the end."""
    from verispec.bench import soak
    from verispec.server import ServerSettings

    tokenizer = helpers.char_tokenizer()
    target = sh.int8_text_target(tokenizer, max_positions=512)
    target.kv_memory = 4 * block_bytes(target.config.num_hidden_layers, target.config.num_key_value_heads,
                                       target.decoder.head_dim)
    server = sh.RunningServer(target, ServerSettings(model_id="m", max_queue=256, max_tokens_limit=256,
                                                     max_sequences=4, request_timeout=0))
    try:
        requests = soak.plan(80, len(tokenizer), 4 * BLOCK, ["ar", "pld", "anpd", "anpd/tree=8"], seed=3,
                             max_prompt=160)
        assert any(r.never_fits for r in soak.plan(300, len(tokenizer), 4 * BLOCK, ["ar"], seed=3))
        result = soak.run(server.url, requests, concurrency=6, idle=lambda: server.worker.engine.idle)
        summary = result.summary()
        assert summary["lost"] == 0 and summary["server_errors"] == 0, summary["lost_examples"]
        assert summary["served"] + summary["refused"] + summary["disconnected"] == 80
        assert summary["solo_checked"] > 20 and summary["solo_equal"] == summary["solo_checked"]
        assert summary["kv_blocks_in_use_at_end"] == 0
    finally:
        server.stop()
