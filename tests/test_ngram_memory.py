"""ANPD's memory across requests (`drafters.ngram.NgramMemory`): lossless over runs of requests
on one target, bounded, actually drafted from, tracked under confidence kinds of its own, off
when asked (per request or per target), and isolated per method and repeat in the benchmark.

Targets here are built fresh per test (not the session fixtures): the memory lives on the
target, so a shared target would carry other tests' requests."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import helpers
from verispec.bench import runner
from verispec.bench.datasets import Question
from verispec.core.drafters import ngram
from verispec.errors import ConfigError
from verispec.core.drafters.base import memory_switched_off, switch_off_memory
from verispec.core.drafters.ngram import MEMORY_ATTACHMENT, AnpdDrafter, NgramConfig, NgramMemory, shared_memory
from verispec.core.methods import MethodOptions, build, parse_variant
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig

NEW_TOKENS = 40
CONFIG = NgramConfig()


def fresh(arch: str = "llama"):
    return helpers.make_target_for_path(arch, seed=0)


def prompts() -> list[list[int]]:
    """Repeated, overlapping and unrelated prompts, in the order they are asked."""
    a = helpers.repetitive_prompt(128, 0, period=5, repeats=4)
    b = helpers.repetitive_prompt(128, 1, period=7, repeats=3)
    return [a, a, b, a[:12] + b[:9], b, [5, 9, 2] + a[-10:], a]


def memory_of(target) -> NgramMemory:
    return target.attachments[MEMORY_ATTACHMENT][CONFIG]


# -- pure: the store ---------------------------------------------------------------------------


def test_requests_index_through_their_own_tails():
    """No n-gram spans two requests, even when they interleave."""
    memory = NgramMemory(NgramConfig(max_n=3))
    first, second = memory.new_tail(), memory.new_tail()
    memory.index(first, [1, 2, 3])
    memory.index(second, [7, 8])
    memory.index(first, [4])
    assert memory.tables.lookup([2, 3]) == 4  # the first request's own continuation
    assert memory.tables.lookup([8]) is None  # nothing followed 8 in the second request
    levels = memory.tables._levels
    assert set(levels[3]) == {(1, 2), (2, 3)}  # no (3, 7) -> 8, no (8, 4)
    assert set(levels[2]) == {(1,), (2,), (3,), (7,)}  # no 3 -> 7, no 8 -> 4


def test_the_memory_drafts_where_it_matches_a_longer_n_gram_than_the_own_tables():
    """Own tables match (7, 8) -> 20; the memory saw (3, 4, 7, 8) -> 30 in an earlier request: the
    longer context wins (an edit of text seen before), and ties go to the request's own tables."""
    memory = NgramMemory(CONFIG)
    memory.index(memory.new_tail(), [3, 4, 7, 8, 30, 31])
    drafter = AnpdDrafter(CONFIG, memory)
    drafter.begin([7, 8, 20, 5, 3, 4, 7, 8])
    draft = drafter.propose([], 2)
    assert draft.tokens.tolist() == [30, 31]
    assert drafter._last_kinds[0][2] is True  # remembered: its own confidence kind
    drafter.begin([7, 8, 20, 5, 9, 7, 8])  # the memory's (9, 7, 8) does not exist: own (7, 8) -> 20 wins
    assert drafter.propose([], 1).tokens.tolist() == [20]


def test_drafts_take_the_own_tables_on_equal_matches_and_the_memory_where_they_miss():
    memory = NgramMemory(CONFIG)
    memory.index(memory.new_tail(), [10, 11, 12, 13, 14, 15])
    drafter = AnpdDrafter(CONFIG, memory)
    drafter.begin([1, 2, 10, 11, 99, 1, 2])  # own: 2 -> 10 -> 11 -> 99; memory: 11 -> 12 ...
    draft = drafter.propose([], 6)
    assert draft.tokens.tolist() == [10, 11, 99, 1, 2, 10]  # own tables win wherever they match
    drafter.commit([10, 11, 99, 1, 2, 10, 11], 6)
    drafter.begin([50, 12])  # own tables miss after 12: the memory drafts, up to its own miss
    assert drafter.propose([], 4).tokens.tolist() == [13, 14, 15]


def test_memory_tokens_have_their_own_confidence_kinds():
    memory = NgramMemory(CONFIG)
    memory.index(memory.new_tail(), list(range(100, 140)))
    drafter = AnpdDrafter(CONFIG, memory)
    drafter.begin([5, 6, 7, 100])  # own tables: 5 -> 6 -> 7 -> 100; after 100 only the memory
    before = drafter.propose([], 4)
    assert before.tokens.tolist() == [101, 102, 103, 104] and before.confidence == (0.5,) * 4
    drafter.commit([101, 102, 103, 104, 105], 4)  # all four accepted: memory kinds gain trust
    after = drafter.propose([], 3)
    assert after.tokens.tolist() == [106, 107, 108]
    assert all(c > 0.5 for c in after.confidence)
    drafter.commit([106, 107, 108, 109], 3)
    drafter.commit([5], 0)
    # The request's own match 5 -> 6 (level 2, seen once): the memory's level-2 token (101) was
    # accepted, but the own kind has seen nothing yet, so it keeps its prior.
    own = drafter.propose([], 1)
    assert own.tokens.tolist() == [6] and own.confidence == (0.5,)


def test_shared_memory_is_per_config_bounded_and_can_be_switched_off():
    attachments: dict = {}
    first = shared_memory(attachments, CONFIG)
    assert shared_memory(attachments, CONFIG) is first
    assert shared_memory(attachments, NgramConfig(max_n=3)) is not first
    for max_n in range(2, 2 + ngram.MEMORY_STORES + 3):
        shared_memory(attachments, NgramConfig(max_n=max_n))
    assert len(attachments[MEMORY_ATTACHMENT]) == ngram.MEMORY_STORES
    switch_off_memory(attachments)
    assert shared_memory(attachments, CONFIG) is None
    assert AnpdDrafter.for_target(attachments, CONFIG).memory is None
    assert AnpdDrafter.for_target({}, CONFIG, memory=False).memory is None
    with pytest.raises(ConfigError, match="config"):
        AnpdDrafter(NgramConfig(max_n=3), NgramMemory(CONFIG))


def test_the_store_never_exceeds_its_bound_over_many_requests(monkeypatch):
    """Fill the store with far more n-grams than it may hold, request by request (a bound of
    2^10 keys per level instead of the default, to keep the test fast; the same code path)."""
    monkeypatch.setattr(ngram, "MEMORY_MAX_KEYS", 1 << 10)
    attachments: dict = {}
    rng = random.Random(0)
    for request in range(30):
        drafter = AnpdDrafter.for_target(attachments, CONFIG)
        drafter.begin([rng.randrange(50_000) for _ in range(100)])
        for _ in range(10):
            drafter.propose([], 4)
            drafter.commit([rng.randrange(50_000) for _ in range(5)], 4)
        levels = attachments[MEMORY_ATTACHMENT][CONFIG].tables._levels
        assert all(len(level) <= 1 << 10 for level in levels.values()), request
    # 30 x 150 random tokens: every level filled to the bound and evicting.
    assert all(len(level) == 1 << 10 for level in levels.values())
    assert len(shared_memory(attachments, CONFIG)) == len(levels) << 10


def test_the_store_bound_holds_through_the_engine(monkeypatch):
    monkeypatch.setattr(ngram, "MEMORY_MAX_KEYS", 16)
    target = fresh()
    for prompt in prompts():
        helpers.run(target, build("anpd", target), prompt, NEW_TOKENS)
        assert all(len(level) <= 16 for level in memory_of(target).tables._levels.values())
    assert len(memory_of(target)) == 16 * len(memory_of(target).tables._levels)


# -- through the engine: lossless, used, off -------------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_outputs_equal_ar_over_a_run_of_requests(arch):
    target = fresh(arch)
    for i, prompt in enumerate(prompts()):
        reference, _, _ = helpers.run(target, build("ar", target), prompt, NEW_TOKENS)
        for options in (MethodOptions(), MethodOptions(controller="constant:8"), MethodOptions(ngram_max_n=3)):
            ids, stats, _ = helpers.run(target, build("anpd", target, options), prompt, NEW_TOKENS)
            assert ids == reference, f"request {i}, {options}"
            assert stats.new_tokens == stats.target_forwards + stats.accepted
    assert len(memory_of(target)) > 0


def test_sampled_outputs_equal_ar_with_the_same_seed():
    target = fresh()
    for i, prompt in enumerate(prompts()[:4]):
        sampling = SamplingConfig(temperature=0.8, seed=i)
        reference, _, _ = helpers.run(target, build("ar", target, sampling=sampling), prompt, NEW_TOKENS, sampling)
        ids, _, _ = helpers.run(target, build("anpd", target, sampling=sampling), prompt, NEW_TOKENS, sampling)
        assert ids == reference, f"request {i}"


def _second_request_stats(options: MethodOptions):
    """A request, then another whose answer repeats the first's output: its prompt is the
    first's followed by the first 5 output tokens, so greedy decoding goes on with the rest."""
    target = fresh()
    prompt = helpers.repetitive_prompt(128, 2, period=9, repeats=2)
    first, _, _ = helpers.run(target, build("anpd", target, options), prompt, NEW_TOKENS)
    ids, stats, _ = helpers.run(target, build("anpd", target, options), prompt + first[:5], NEW_TOKENS)
    assert ids[: NEW_TOKENS - 5] == first[5:]
    return stats


def test_a_repeated_answer_is_drafted_from_the_memory():
    # constant controllers: the adaptive one cuts drafts by measured timings, not reproducible
    on = _second_request_stats(MethodOptions(controller="constant:8"))
    off = _second_request_stats(MethodOptions(controller="constant:8", ngram_memory=False))
    assert on.accepted > off.accepted, (on.accepted, off.accepted)
    assert on.target_forwards < off.target_forwards


def steps_of(target, options, prompt):
    options = replace(options, controller="constant:8")  # adaptive cuts by timings: not reproducible
    _, stats, steps = helpers.run(target, build("anpd", target, options), prompt, NEW_TOKENS)
    return steps, stats.drafted, list(stats.accepted_histogram)


def old_steps(target, prompt):
    """The drafter without any memory, as it was before the memory existed."""
    recipe = build("anpd", target, MethodOptions(controller="constant:8", ngram_memory=False))
    recipe = recipe._replace(drafter=AnpdDrafter(CONFIG))
    _, stats, steps = helpers.run(target, recipe, prompt, NEW_TOKENS)
    return steps, stats.drafted, list(stats.accepted_histogram)


def test_off_drafts_exactly_as_without_memory_after_other_requests():
    target, reference = fresh(), fresh()
    for prompt in prompts():
        helpers.run(target, build("anpd", target), prompt, NEW_TOKENS)  # fills the memory
        assert steps_of(target, MethodOptions(ngram_memory=False), prompt) == old_steps(reference, prompt)


def test_switched_off_target_ignores_the_option():
    target, reference = fresh(), fresh()
    switch_off_memory(target.attachments)
    for prompt in prompts()[:3]:
        assert steps_of(target, MethodOptions(), prompt) == old_steps(reference, prompt)
    assert not target.attachments.get(MEMORY_ATTACHMENT)  # no store was made


def test_a_first_request_drafts_as_without_memory():
    """An empty store holds only the request's own n-grams: nothing the own tables miss."""
    target, reference = fresh(), fresh()
    prompt = prompts()[0]
    assert steps_of(target, MethodOptions(), prompt) == old_steps(reference, prompt)


def test_options_and_variants():
    assert MethodOptions().ngram_memory is True
    with pytest.raises(Exception, match="ngram_memory"):
        MethodOptions(ngram_memory="no")
    assert parse_variant("anpd/ngram_memory=false") == ("anpd", None, {"ngram_memory": False})
    assert parse_variant("anpd/constant:8/ngram_memory=yes") == ("anpd", "constant:8", {"ngram_memory": True})


# -- the benchmark: one memory per method and repeat ----------------------------------------


def text_target():
    """A fresh tiny Llama over the character tokenizer (no chat template: the plain templates)."""
    tokenizer = helpers.char_tokenizer()
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1)
    return Target(helpers.make_model(config, seed=3), tokenizer, name="tiny-text-llama")


def _bench(target, tmp_path, methods, questions, repeats=1):
    settings = runner.BenchSettings(
        model=None, draft_model=None, dtype="float32", dataset="test", dataset_sha256="0", categories=(),
        per_category=None, methods=tuple(methods), peers=(), max_new_tokens=24, temperature=0.0, top_p=1.0,
        seed=None, repeats=repeats, draft_length=None, controller=None, early_exit_layer=None,
    )
    return runner.run_bench(target, settings, questions, tmp_path, progress=False)


def test_bench_gives_each_method_and_repeat_its_own_memory(tmp_path):
    """The same prompt three times, two repeats, two memory-using variants: each variant's first
    prompt of each repeat drafts as with an empty memory (it never sees the other variant's
    outputs, the earlier repeat's or the warm-up's), and its later prompts draft from the memory."""
    target = text_target()
    questions = [Question(i, "c", "the cat sat on the mat " * 2) for i in range(3)]
    methods = ["anpd/constant:8", "anpd/constant:6", "anpd/constant:8/ngram_memory=false"]
    records = _bench(target, tmp_path, methods, questions, repeats=2)
    by = {(r["question_id"], r["method"], r["repeat"]): r for r in records}
    off = by[(0, methods[2], 0)]
    assert all(by[(i, methods[2], r)]["accepted"] == off["accepted"] for i in range(3) for r in (0, 1))
    for method in methods[:2]:
        for repeat in (0, 1):
            first, later = by[(0, method, repeat)], by[(2, method, repeat)]
            assert first["token_ids"] == later["token_ids"] == off["token_ids"]
            assert later["accepted"] > first["accepted"], (method, repeat)
    # constant:8 with an empty memory drafts exactly as without memory
    assert by[(0, methods[0], 0)]["accepted"] == by[(0, methods[0], 1)]["accepted"] == off["accepted"]
    assert MEMORY_ATTACHMENT not in target.attachments  # restored as it was


def test_bench_switched_off_target_stays_off(tmp_path):
    target = text_target()
    switch_off_memory(target.attachments)
    questions = [Question(i, "c", "the cat sat on the mat " * 2) for i in range(2)]
    records = _bench(target, tmp_path, ["anpd/constant:8"], questions)
    assert records[0]["accepted"] == records[1]["accepted"]
    assert memory_switched_off(target.attachments) and MEMORY_ATTACHMENT not in target.attachments


# -- the command line ------------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-m", "pld", "--no-ngram-memory"], "--no-ngram-memory is used only by anpd, hybrid, suffix, not by pld"),
    (["bench", "--methods", "ar,pld", "--peers", "", "--no-ngram-memory"],
     "--no-ngram-memory is used only by anpd, hybrid, suffix, not by ar, pld"),
    (["bench", "--methods", "anpd/ngram_memory=maybe", "--peers", ""], "ngram_memory must be true or false"),
    # a variant's setting against the run's switch: refused before a run directory or a model
    (["bench", "--methods", "ar,suffix/max_cached_requests=5", "--peers", "", "--no-ngram-memory"],
     "max_cached_requests=5 sizes suffix's memory across requests, which ngram_memory=false turns off"),
])
def test_cli_refuses_the_switch_where_nothing_uses_it(monkeypatch, tmp_path, args, message):
    from typer.testing import CliRunner

    from verispec import cli

    monkeypatch.setattr("verispec.target.loading.load", lambda *a, **k: pytest.fail("loaded a model before validating"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.stderr
    assert not (tmp_path / "bench-out").exists()


def test_cli_switch_reaches_the_options_and_the_server_target(monkeypatch, tmp_path):
    """generate passes --no-ngram-memory into MethodOptions; serve switches the target's memory
    off for every request (its requests carry default options)."""
    from typer.testing import CliRunner

    from verispec import cli

    target = text_target()
    seen = {}
    monkeypatch.setattr("verispec.target.loading.load", lambda *a, **k: target)
    import verispec.api as api

    real_stream = api.stream

    def spy(target, prompt, method, **kwargs):
        seen.setdefault("options", []).append(kwargs["options"])
        return real_stream(target, prompt, method, **kwargs)

    monkeypatch.setattr(api, "stream", spy)
    result = CliRunner().invoke(cli.app, ["generate", "the cat", "-n", "4", "--no-ngram-memory"])
    assert result.exit_code == 0, result.output
    assert [o.ngram_memory for o in seen["options"]] == [False]
    result = CliRunner().invoke(cli.app, ["generate", "the cat", "-n", "4"])
    assert [o.ngram_memory for o in seen["options"]] == [False, True]
    result = CliRunner().invoke(cli.app, ["generate", "the cat", "-n", "4", "-m", "suffix", "--no-ngram-memory"])
    assert [o.ngram_memory for o in seen["options"]][2:] == [False], result.output  # suffix's switch too

    import uvicorn

    monkeypatch.setattr("verispec.cli.serving.listen", lambda host, port: type("S", (), {"getsockname": lambda self: ("127.0.0.1", 1)})())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    result = CliRunner().invoke(cli.app, ["serve", "--no-ngram-memory"])
    assert result.exit_code == 0, result.output
    assert memory_switched_off(target.attachments)
