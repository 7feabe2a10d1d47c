"""Many requests in one forward (`batch.BatchEngine`, `api.generate_many` / `stream_many`):
every request's output is the one it gives alone, whatever shares its steps.

On the tiny block-exact models of every fast-path architecture, int8 numerics (paged KV in the
target's block pool): a mixed batch (prompt lengths across several KV blocks, methods that
differ, greedy and seeded sampling, budgets that end early, requests that join late, prompts
prefilled in chunks beside decoding rows) against each request run alone; a prompt's logits
and keys bit for bit whether prefilled whole, in chunks, beside another sequence or from the
prefix cache; the prefix cache on and off; a pool so small that requests wait for blocks; the API's errors in place, cancellation, and targets that cannot batch.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from verispec.api import BatchTextStream, RequestDone, TextDelta, generate, generate_many, make_request, stream_many
from verispec.core.batch import BatchEngine
from verispec.target.shared_forward import LAST, Part
from verispec.errors import ConfigError, ModelLoadError
from verispec.core.methods import MethodOptions
from verispec.target.model import Target
from verispec.runtime.kv_pool import PoolExhausted, block_bytes
from verispec.runtime.rows import BLOCK

TOKENIZER = helpers.char_tokenizer(eos=True)


def int8_target(arch: str, seed: int = 0, **config) -> Target:
    model = helpers.make_model(helpers.make_config(arch, vocab_size=len(TOKENIZER), **config), seed)
    target = Target(model, TOKENIZER, name=f"tiny-{arch}-int8", fast=True, blocks=helpers.blockify(model),
                    numerics="int8")
    assert target.pages_kv
    return target


PROMPTS = ["the cat sat on the mat. the cat sat", "abcabcabcabcabc", "hello world, " * 14,
           "so it goes. " * 30 + "and then", "q"]


def mixed_requests(target: Target) -> list:
    requests = []
    for i, prompt in enumerate(PROMPTS):
        for method in ("ar", "pld", "anpd", "anpd/tree=8"):
            requests.append(make_request(target, prompt, method, max_new_tokens=12 + 9 * i))
    for method in ("ar", "pld", "anpd"):  # seeded sampling: one draw per committed token, as ar
        requests.append(make_request(target, PROMPTS[1], method, max_new_tokens=40, temperature=1.0, top_k=20, seed=7))
    requests.append(make_request(target, PROMPTS[0], "anpd", max_new_tokens=60, stop=["at"]))
    return requests


@pytest.mark.parametrize("arch", helpers.FAST_ARCHITECTURES)
@pytest.mark.parametrize("max_rows, max_sequences", [(256, 64), (24, 5)])
def test_a_mixed_batch_gives_each_request_what_it_gives_alone(arch, max_rows, max_sequences):
    """(24, 5): at most 5 at once, so later requests join while others decode, and prompts are
    prefilled in several chunks beside verify rows."""
    target = int8_target(arch)
    requests = mixed_requests(target)
    expected = [helpers.solo(target, request) for request in requests]
    engine_steps = []
    original = BatchEngine.step

    def counted(self):
        events = original(self)
        engine_steps.append((len(self.running), self.last_rows))
        return events

    BatchEngine.step = counted
    try:
        results = generate_many(target, requests, max_rows=max_rows, max_sequences=max_sequences)
    finally:
        BatchEngine.step = original
    for request, result, reference in zip(requests, results, expected):
        assert not isinstance(result, BaseException), result
        assert result.token_ids == reference, (request.method, request.prompt_ids[:5])
    assert max(running for running, _ in engine_steps) >= min(max_sequences, 10)  # really batched
    assert max(rows for _, rows in engine_steps) <= max_rows
    assert sum(result.stats.accepted for result in results) > 0  # drafts were accepted in the batch
    assert target.pool.used_blocks == 0  # every sequence gave its blocks back


def test_requests_of_a_model_drafted_method_run_beside_the_batch(tmp_path):
    """eesd drafts with the target's own first layers and a head: it runs unbatched, one
    decode step per batch step, on a sequence of its own, beside batched requests."""
    from test_eesd import identity_head
    from verispec.core.drafters.early_exit import save_head

    target = int8_target("llama", seed=1)
    head = identity_head(target)
    save_head(head, head.spec(target.model, target.name), tmp_path)
    options = MethodOptions(exit_head=str(tmp_path), controller="constant:4")  # drafts every step
    requests = [make_request(target, PROMPTS[i], method, max_new_tokens=20, options=options if method == "eesd" else None)
                for i in range(3) for method in ("eesd", "anpd")]
    expected = [helpers.solo(target, request) for request in requests]
    results = generate_many(target, requests)
    assert [result.token_ids for result in results] == expected
    assert sum(result.stats.accepted for result in results if result.stats.method == "eesd") > 0
    assert target.pool.used_blocks == 0


@pytest.mark.parametrize("acceptance", [0.0, 0.9])
def test_hybrid_requests_with_or_without_their_head_give_what_each_gives_alone(tmp_path, monkeypatch, acceptance):
    """A hybrid request whose exit head would not pay leaves it out and joins the batch's shared
    forwards; one whose head takes part runs beside the batch (its verifies keep exit states).
    Either way each output is the request's alone."""
    from test_eesd import identity_head
    from verispec.core.drafters.early_exit import save_head
    from verispec.core.drafters.hybrid import ModelAcceptance
    from verispec.core.methods import build

    import verispec.core.methods as methods

    monkeypatch.setattr(ModelAcceptance, "draw", lambda self: acceptance)
    monkeypatch.setattr(methods, "draft_cost", lambda target, lm: 0.05)  # a head of a tiny model's 2 layers pays
    target = int8_target("llama", seed=1)
    head = identity_head(target)
    save_head(head, head.spec(target.model, target.name), tmp_path)
    options = MethodOptions(exit_head=str(tmp_path))
    assert build("hybrid", target, options).drafter.in_target_sequence == (acceptance > 0)
    requests = [make_request(target, PROMPTS[i], method, max_new_tokens=20,
                             options=options if method == "hybrid" else None)
                for i in range(3) for method in ("hybrid", "anpd")]
    expected = [helpers.solo(target, request) for request in requests]
    assert [result.token_ids for result in generate_many(target, requests)] == expected
    assert target.pool.used_blocks == 0


@pytest.mark.parametrize("prompt_blocks", [0, 2])
def test_identical_prompts_start_together_once_their_shared_blocks_are_computed(prompt_blocks):
    """n choices of one prompt: the first prefills the prompt's full blocks (the others wait to
    share them), then every other starts at once. They started one a step: each waited for the
    last one admitted, which had nothing left to share."""
    target = int8_target("llama")
    prompt = "so it goes. " * (prompt_blocks * BLOCK // 12) + "and then"
    requests = [make_request(target, prompt, "ar", max_new_tokens=12, temperature=1.0, seed=i) for i in range(8)]
    expected = [helpers.solo(target, request) for request in requests]
    waiting = []
    original = BatchEngine.step

    def counted(self):
        events = original(self)
        waiting.append(len(self.waiting))
        return events

    BatchEngine.step = counted
    try:
        results = generate_many(target, requests)
    finally:
        BatchEngine.step = original
    assert [result.token_ids for result in results] == expected
    assert waiting[1] == 0, waiting  # all eight started by the second step
    assert target.pool.used_blocks == 0


def test_draft_model_methods_join_the_batch_and_their_draft_model_runs_once_a_round_for_all(monkeypatch):
    """sps and mtad with a draft model that pages its KV: their verify rows join the shared
    forward, and the sps jobs' draft rows run together, one draft-model forward per draft
    position for all of them. Every output is the one it gives alone: greedy, and seeded
    sampling under a constant draft length (the draft model's rows are the bits they get alone,
    so every draw sees the same q). Drafts are not sized for the load here (the next test)."""
    monkeypatch.setattr(BatchEngine, "_model_draft_rooms", lambda self, jobs: {})
    target = int8_target("llama", seed=0)
    draft = int8_target("llama", seed=5, num_hidden_layers=1)
    options = MethodOptions(draft_model=draft, controller="constant:3")
    requests = [make_request(target, PROMPTS[i], "sps", max_new_tokens=16 + 5 * i, options=options) for i in range(4)]
    requests += [make_request(target, PROMPTS[i], "sps", max_new_tokens=30, temperature=1.0, top_k=20, seed=i,
                              options=options) for i in (0, 1, 3)]
    requests += [make_request(target, PROMPTS[2], "mtad", max_new_tokens=20, seed=4, options=options),
                 make_request(target, PROMPTS[1], "anpd", max_new_tokens=20)]
    expected = [helpers.solo(target, request) for request in requests]
    draft.release()
    calls = {"target": [], "draft": []}

    def counting(name, forward_parts):
        def counted(parts):
            calls[name].append(len(parts))
            return forward_parts(parts)
        return counted

    target.backend.forward_parts = counting("target", target.backend.forward_parts)
    draft.backend.forward_parts = counting("draft", draft.backend.forward_parts)
    results = generate_many(target, requests)
    for request, result, reference in zip(requests, results, expected):
        assert not isinstance(result, BaseException), result
        assert result.token_ids == reference, (request.method, request.sampling)
    assert max(calls["draft"]) >= 6  # the sps jobs drafted in shared forwards of the draft model
    assert max(calls["target"]) >= 8  # their verify rows (and mtad's) joined the target's forward
    assert sum(result.stats.drafted for result in results) > 0
    assert target.pool.used_blocks == 0 and draft.pool.used_blocks == 0


def test_under_load_model_drafts_are_sized_before_drafting_and_seeded_samples_keep_their_own(monkeypatch):
    """Once both models' costs are measured, the jobs drafting with a draft model draft the
    length `control.model_draft_length` gives (here: none, as when the draft model's rows cost
    more than they save), decided before drafting; a seeded sampled job keeps its own lengths,
    so its output stays the one it gives alone."""
    import verispec.core.batch as batch

    target = int8_target("llama", seed=0)
    draft = int8_target("llama", seed=5, num_hidden_layers=1)
    options = MethodOptions(draft_model=draft, controller="constant:3")
    greedy = [make_request(target, PROMPTS[i], "sps", max_new_tokens=24, options=options) for i in range(3)]
    seeded = [make_request(target, PROMPTS[i], "sps", max_new_tokens=24, temperature=1.0, top_k=20, seed=i,
                           options=options) for i in range(2)]
    expected = [helpers.solo(target, request) for request in greedy + seeded]
    asked = []

    def none_pays(rates, *args, **kwargs):
        asked.append(len(rates))
        return 0

    monkeypatch.setattr(batch, "model_draft_length", none_pays)
    results = generate_many(target, greedy + seeded)
    assert [result.token_ids for result in results] == expected
    assert asked and max(asked) == 3  # the greedy jobs, every step once the costs were known
    assert all(result.stats.drafted <= 3 for result in results[:3])  # their first step's draft only
    assert all(result.stats.drafted > 10 for result in results[3:])


def test_a_draft_forward_that_fails_for_one_job_ends_that_job_only(monkeypatch):
    """The draft rows of several jobs share one forward of the draft model; where it fails, each
    part runs again alone, so only the job whose own rows fail ends (with the error, its blocks
    given back in both pools) and the others give what they give alone."""
    monkeypatch.setattr(BatchEngine, "_model_draft_rooms", lambda self, jobs: {})
    target = int8_target("llama", seed=0)
    draft = int8_target("llama", seed=5, num_hidden_layers=1)
    options = MethodOptions(draft_model=draft, controller="constant:3")
    requests = [make_request(target, PROMPTS[i], "sps", max_new_tokens=20, options=options) for i in range(3)]
    requests.append(make_request(target, PROMPTS[3], "anpd", max_new_tokens=20))
    expected = [helpers.solo(target, request) for request in requests]
    poisoned, forward_parts = set(), draft.backend.forward_parts
    start = list(requests[1].prompt_ids[:8])

    def failing(parts):  # fails wherever the second request's draft sequence has rows
        poisoned.update(id(part.sequence) for part in parts if list(part.tokens[:8]) == start)
        if any(id(part.sequence) in poisoned for part in parts):
            raise RuntimeError("a fault in the draft model's forward")
        return forward_parts(parts)

    draft.backend.forward_parts = failing
    results = generate_many(target, requests)
    assert isinstance(results[1], RuntimeError)
    assert [results[i].token_ids for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert results[0].stats.drafted > 0
    assert target.pool.used_blocks == 0 and draft.pool.used_blocks == 0


def test_a_draft_models_tokenizer_is_compared_once_per_pair(monkeypatch):
    """Each request builds its own draft LM; comparing a 150k-entry vocabulary took 0.4 s, so
    the comparison is made for the first request of a (draft, target) pair only."""
    from verispec.core.methods import build

    target = int8_target("llama", seed=0)
    draft = int8_target("llama", seed=5, num_hidden_layers=1)
    reads = []
    get_vocab = TOKENIZER.get_vocab
    monkeypatch.setattr(TOKENIZER, "get_vocab", lambda: reads.append(1) or get_vocab())
    for _ in range(3):
        build("sps", target.new_sequence(), MethodOptions(draft_model=draft))
    assert len(reads) == 2  # the draft's vocabulary and the target's, once


@pytest.mark.parametrize("arch", helpers.FAST_ARCHITECTURES)
def test_a_prompts_logits_and_keys_are_the_same_bits_however_it_is_prefilled(arch):
    """Prefilled whole, in 2 and in 7 chunks, beside another sequence's rows, or extended from
    cached blocks: the last position's logits and every position's keys are the same bits."""
    target = int8_target(arch, seed=2)
    prompt = torch.randint(3, len(TOKENIZER), (3 * BLOCK - 5,), generator=torch.Generator().manual_seed(2)).tolist()
    target.prefix_cache = False

    def keys_of(sequence) -> list[torch.Tensor]:
        table, length = sequence.cache.block_table, sequence.cache.length
        slots = torch.tensor([int(table[p // BLOCK]) * BLOCK + p % BLOCK for p in range(length)])
        return [layer[:, slots] for layer in target.pool.keys + target.pool.values]

    def chunked(pieces: int):
        sequence = target.new_sequence()
        sequence.reset()
        cuts = torch.linspace(0, len(prompt), pieces + 1).round().long().tolist()
        for a, b in zip(cuts, cuts[1:]):
            logits = sequence.forward(prompt[a:b])
        result = (logits[-1:].clone(), keys_of(sequence))
        sequence.release()
        return result

    whole = chunked(1)
    for pieces in (2, 7):
        logits, keys = chunked(pieces)
        assert torch.equal(logits, whole[0]), pieces
        assert all(torch.equal(a, b) for a, b in zip(keys, whole[1])), pieces
    # beside another sequence's rows in one forward
    one, other = target.new_sequence(), target.new_sequence()
    one.reset(), other.reset()
    other.forward(prompt[:40])
    together = target.forward_parts([Part(other, prompt[40:50]), Part(one, prompt, logits=LAST)])
    assert torch.equal(together[1], whole[0])
    assert all(torch.equal(a, b) for a, b in zip(keys_of(one), whole[1]))
    one.release(), other.release()
    # from the prefix cache: two full blocks shared, the tail of the third copied, the last token computed
    target.prefix_cache = True
    first = target.new_sequence()
    first.reset()
    first.forward(prompt)
    first.release()
    again = target.new_sequence()
    again.reset()
    logits = again.forward(prompt, last_only=True)
    assert again.cache._shared == 2 and target.pool.prefix.hit_tokens == len(prompt) - 1
    assert torch.equal(logits, whole[0])
    assert all(torch.equal(a, b) for a, b in zip(keys_of(again), whole[1]))
    again.release()


def test_the_prefix_cache_changes_nothing_but_the_work_and_never_writes_shared_blocks():
    target = int8_target("gemma3", seed=3)
    system = "you are a helpful assistant. answer briefly. " * 5  # 225 characters: three full blocks
    questions = ["what is the cat", "where is the mat", "why so", "how now brown cow"]
    requests = [make_request(target, system + q, method, max_new_tokens=30) for q in questions for method in ("ar", "anpd")]
    target.prefix_cache = False
    without = generate_many(target, requests)
    assert len(target.pool.prefix) == 0
    target.prefix_cache = True
    first = generate_many(target, requests[:1])  # fills the cache with the system prompt's blocks
    cached = {block: [layer[:, block * BLOCK : (block + 1) * BLOCK].clone() for layer in target.pool.keys]
              for block in target.pool.prefix.match(list(requests[0].prompt_ids))}
    assert len(cached) == 3
    hits_before = target.pool.prefix.hit_tokens
    with_cache = generate_many(target, requests)
    assert [r.token_ids for r in with_cache] == [r.token_ids for r in without]
    assert first[0].token_ids == without[0].token_ids
    assert target.pool.prefix.hit_tokens - hits_before >= 3 * BLOCK * len(requests)
    for block, layers in cached.items():  # shared by every request, written by none
        assert all(torch.equal(layer[:, block * BLOCK : (block + 1) * BLOCK], before)
                   for layer, before in zip(target.pool.keys, layers))


def test_a_pool_too_small_for_everyone_makes_requests_wait_and_still_gives_identical_outputs():
    """Room for about three sequences: requests wait for blocks (evicting cached ones as they
    go), none is refused or preempted; outputs stay identical and every block comes back."""
    target = int8_target("qwen2", seed=4)
    requests = [make_request(target, PROMPTS[i % len(PROMPTS)] + "xyz"[i % 3], method, max_new_tokens=70)
                for i in range(6) for method in ("ar", "anpd")]
    expected = [helpers.solo(target, request) for request in requests]
    fresh = int8_target("qwen2", seed=4)
    config = fresh.config
    per_block = block_bytes(config.num_hidden_layers, config.num_key_value_heads, fresh.decoder.head_dim)
    fresh.kv_memory = 12 * per_block
    stream = BatchTextStream(fresh, requests)
    most = [0]
    original = stream._engine.step

    def step():
        most[0] = max(most[0], len(stream._engine.running))
        return original()

    stream._engine.step = step
    for _ in stream:
        pass
    assert [r.token_ids for r in stream.results] == expected
    assert most[0] < len(requests)  # the pool really ran short: some waited
    assert fresh.pool.used_blocks == 0


def test_a_request_that_could_never_fit_is_refused_in_its_place():
    fresh = int8_target("llama")
    config = fresh.config
    fresh.kv_memory = 3 * block_bytes(config.num_hidden_layers, config.num_key_value_heads, fresh.decoder.head_dim)
    requests = [make_request(fresh, "hello", "ar", max_new_tokens=10),
                make_request(fresh, "hello", "ar", max_new_tokens=400)]
    results = generate_many(fresh, requests)
    assert isinstance(results[1], PoolExhausted) and "needs" in str(results[1])
    assert results[0].token_ids == helpers.solo(fresh, requests[0])


def test_the_batch_api_gives_errors_in_place_and_keeps_the_good_results():
    target = int8_target("gemma3")
    assert generate_many(target, []) == []
    with pytest.raises(ConfigError, match="make_request"):
        generate_many(target, ["a prompt"])
    good = [make_request(target, PROMPTS[0], "anpd", max_new_tokens=20),
            make_request(target, PROMPTS[1], "ar", max_new_tokens=20)]
    too_long = make_request(target, "x" * 500, "ar", max_new_tokens=100)  # past the model's 512 positions
    no_head = make_request(target, PROMPTS[2], "eesd", max_new_tokens=20)  # no exit head for this model
    results = generate_many(target, [good[0], too_long, no_head, good[1]])
    assert isinstance(results[1], ConfigError) and "context" in str(results[1])
    assert isinstance(results[2], ModelLoadError)
    assert results[0].token_ids == helpers.solo(target, good[0]) and results[3].token_ids == helpers.solo(target, good[1])


def test_cancelling_one_stream_leaves_the_others_untouched():
    target = int8_target("llama", seed=5)
    requests = [make_request(target, prompt, "anpd", max_new_tokens=50) for prompt in PROMPTS[:3]]
    expected = [helpers.solo(target, request) for request in requests]
    batch = stream_many(target, requests)
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    done = {}
    for event in batch:
        if isinstance(event, TextDelta):
            pieces[event.index].append(event.text)
            if event.index == 1 and len(pieces[1]) == 2:
                batch.cancel(1)
        else:
            assert isinstance(event, RequestDone)
            done[event.index] = event.result
    assert done[1].stats.stop_reason == "cancelled" and len(done[1].token_ids) < len(expected[1])
    assert done[1].token_ids == expected[1][: len(done[1].token_ids)]
    assert done[0].token_ids == expected[0] and done[2].token_ids == expected[2]
    assert "".join(pieces[0]) == done[0].text  # the streamed text is the result's
    assert target.pool.used_blocks == 0
    # leaving the loop early cancels the rest and gives every block back
    for event in stream_many(target, requests):
        break
    assert target.pool.used_blocks == 0
    with pytest.raises(ConfigError, match="no request 5"):
        batch.cancel(5)


@pytest.mark.parametrize("path", ["llama-blocks", "gemma3", "qwen2-eager"])
def test_targets_without_paged_kv_serve_the_batch_one_at_a_time(path):
    """float32 numerics, the fast path's PyTorch layers, transformers' forward: no exact batching,
    so the requests run one after another, each as it runs alone."""
    target = helpers.make_target_for_path(path, seed=6, vocab_size=len(TOKENIZER))
    target.tokenizer = TOKENIZER
    assert not target.pages_kv
    requests = [make_request(target, prompt, method, max_new_tokens=15) for prompt in PROMPTS[:2]
                for method in ("ar", "pld")]
    results = generate_many(target, requests)
    assert [r.token_ids for r in results] == [helpers.solo(target, request) for request in requests]


def test_the_row_cost_fit_sees_decode_steps_only():
    """Prompt chunks' rows cost less each than decode and draft rows (they fill the kernel's tiles);
    fitted together, they pulled the slope under a draft row's real cost and the batch verified
    drafts that did not pay. Steps that carry a prompt chunk are left out of `RowCosts`."""
    from verispec.api import BatchTextStream

    target = int8_target("llama")
    requests = [make_request(target, PROMPTS[1], "anpd", max_new_tokens=30),
                make_request(target, PROMPTS[3], "ar", max_new_tokens=4)]  # 368 characters: chunks of 24 rows
    stream = BatchTextStream(target, requests, max_rows=24)
    engine = stream._engine
    steps = []  # per forward: did it carry a prompt chunk?
    forward, observe = target.forward_parts, engine.row_costs.observe
    observed = []

    def spy_forward(parts):
        steps.append(any(part.logits != "all" for part in parts))
        return forward(parts)

    target.forward_parts = spy_forward
    engine.row_costs.observe = lambda rows, seconds: (observed.append(len(steps)), observe(rows, seconds))
    for _ in stream:
        pass
    assert any(steps) and not all(steps), "both kinds of step ran"
    assert observed == [i + 1 for i, chunk in enumerate(steps) if not chunk]


def test_log_probabilities_are_one_entry_per_output_token_alone_and_in_a_batch():
    """A step's log-probabilities are recorded after its stop token cut it (`engine.Decoding`, the
    accept step alone and in a batch share): one entry per output token, the same bits alone
    (`engine.decode`) and in a batch beside another request. Every draft is accepted (8 a step),
    and the stop token falls inside a step, so that the step's later tokens are dropped."""
    from verispec.core.engine import DecodeConfig, Logprobs, decode
    from verispec.core.methods import build
    from verispec.core.stats import GenerationStats

    target = int8_target("llama")
    prompt = list(make_request(target, PROMPTS[2], "ar").prompt_ids)
    reference = [t for step in decode(target, build("ar", target), prompt, DecodeConfig(40), GenerationStats())
                 for t in step]  # greedy, no stop token
    target.release()
    stop = next(j for j in range(2, 9) if reference[j] not in reference[:j])  # inside the second step (tokens 1-9)
    config = DecodeConfig(40, stop_token_ids=frozenset({reference[stop]}))

    def recipe():
        return helpers.scripted_recipe(helpers.ScriptedDrafter(reference, "all", target.vocab_size), 8)

    alone = Logprobs(2)
    steps = list(decode(target, recipe(), prompt, config, GenerationStats(), alone))
    target.release()
    output = [t for step in steps for t in step]
    assert output == reference[: stop + 1] and len(steps) == 2 and len(alone.entries) == len(output)

    engine = BatchEngine(target)
    sequence = target.new_sequence()
    job = engine.submit(prompt, recipe(), config, GenerationStats(), sequence=sequence, logprobs=Logprobs(2))
    other = engine.submit(list(make_request(target, PROMPTS[0], "ar").prompt_ids), build("ar", target),
                          DecodeConfig(20), GenerationStats(), logprobs=Logprobs(0))
    batched = []
    while not engine.idle:
        batched += [t for event_job, committed in engine.step() if event_job is job for t in committed]
    assert batched == output and job.logprobs.entries == alone.entries
    assert len(other.logprobs.entries) == other.stats.new_tokens
