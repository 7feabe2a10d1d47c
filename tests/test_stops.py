"""Stopping: EOS inside an accepted draft, the token budget, and stop strings through the text API.

Tokens after a stop are never emitted, even when the target accepted them in the same step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
import verispec
from verispec import api as api_module
from verispec.core.engine import DecodeConfig
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.request.text import TextAssembler

PROMPT = helpers.repetitive_prompt(128, 0, period=5, repeats=4)
TEXT_PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
NEW = 40


@pytest.fixture(scope="module")
def reference(llama_target) -> list[int]:
    ids, _, _ = helpers.run(llama_target, build("ar", llama_target), PROMPT, NEW)
    return ids


# -- EOS (stop token ids) -------------------------------------------------------------------------

def test_eos_inside_an_accepted_draft_ends_generation_there(llama_target, reference):
    """All-accepted scripted drafts; every token of the reference in turn is made the stop token.
    The output must be the reference up to and including the stop token's first occurrence."""
    mid_draft_cases = 0
    for k in (3, 6):
        for stop in sorted(set(reference)):
            first = reference.index(stop)
            drafter = helpers.ScriptedDrafter(reference, "all", llama_target.vocab_size)
            ids, stats, steps = helpers.run(llama_target, helpers.scripted_recipe(drafter, k), PROMPT, NEW,
                                            stop_token_ids=[stop])
            assert ids == reference[: first + 1], (k, stop)
            assert stats.stop_reason == "eos"
            assert stats.new_tokens == len(ids)
            assert stop not in ids[:-1]
            # Was the stop token proposed inside a draft whose later tokens were also accepted?
            position = 1  # the prefill committed reference[0]
            for proposed in drafter.proposed:
                if position <= first < position + len(proposed) - 1:
                    mid_draft_cases += 1
                    assert stats.accepted > first - position  # accepted past the stop...
                    assert steps[-1][-1] == stop  # ...but nothing after it was emitted
                position += len(proposed) + 1
    assert mid_draft_cases > 0  # the interesting case actually happened


@pytest.mark.parametrize("method", ["ar", "pld", "anpd"])
def test_eos_for_every_method(llama_target, reference, method):
    options = MethodOptions(controller="constant:8") if method != "ar" else MethodOptions()
    for stop in sorted(set(reference))[:6]:
        ids, stats, _ = helpers.run(llama_target, build(method, llama_target, options), PROMPT, NEW,
                                    stop_token_ids=[stop])
        assert ids == reference[: reference.index(stop) + 1]
        assert stats.stop_reason == "eos"


def test_eos_as_the_first_token(llama_target, reference):
    ids, stats, steps = helpers.run(llama_target, build("anpd", llama_target), PROMPT, NEW,
                                    stop_token_ids=[reference[0]])
    assert ids == reference[:1] and steps == [reference[:1]] and stats.target_forwards == 1


# -- the token budget ---------------------------------------------------------------------------

@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(max_new=st.integers(1, 20), k=st.integers(1, 10),
       mode=st.sampled_from(["all", "partial", "random", "none"]))
def test_scripted_drafts_never_exceed_max_new_tokens(llama_target, reference, max_new, k, mode):
    drafter = helpers.ScriptedDrafter(reference, mode, llama_target.vocab_size, right=2, seed=k)
    ids, stats, steps = helpers.run(llama_target, helpers.scripted_recipe(drafter, k), PROMPT, max_new)
    assert ids == reference[:max_new]
    assert stats.new_tokens == max_new and stats.stop_reason == "length"
    # never drafted past the budget: a step commits at most drafts + 1 tokens
    assert all(len(p) <= max_new - 1 for p in drafter.proposed)


@pytest.mark.parametrize("method", ["ar", "pld", "anpd"])
def test_methods_never_exceed_max_new_tokens(llama_target, reference, method):
    for max_new in (1, 2, 3, 5, 8, 13, 21):
        for draft_length in (1, 4, 9):
            options = MethodOptions(draft_length=draft_length)
            ids, stats, _ = helpers.run(llama_target, build(method, llama_target, options), PROMPT, max_new)
            assert ids == reference[:max_new], (max_new, draft_length)
            assert stats.new_tokens == max_new


def test_budget_and_eos_in_the_same_step(llama_target, reference):
    """The budget ends the output before a stop token that lies beyond it."""
    stop = reference[-1]
    first = reference.index(stop)
    drafter = helpers.ScriptedDrafter(reference, "all", llama_target.vocab_size)
    ids, stats, _ = helpers.run(llama_target, helpers.scripted_recipe(drafter, 8), PROMPT, max(1, first),
                                stop_token_ids=[stop])
    assert ids == reference[: max(1, first)]
    assert stats.stop_reason == ("eos" if first == 0 else "length")


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_decode_config_rejects_bad_budgets(bad):
    with pytest.raises(ConfigError):
        DecodeConfig(max_new_tokens=bad)


def test_prompt_plus_budget_beyond_the_context_is_rejected(llama_target):
    with pytest.raises(ConfigError, match="context"):
        helpers.run(llama_target, build("ar", llama_target), [1] * 500, 13)
    with pytest.raises(ConfigError, match="empty"):
        helpers.run(llama_target, build("ar", llama_target), [], 3)


# -- stop strings through the text API ----------------------------------------------------------

def expected_stop(full: verispec.GenerationResult, tokenizer, stops: list[str]):
    """What a correct implementation returns given the unstopped result: the text before the
    earliest stop string, and the ids up to the token that completed it."""
    hits = [(full.text.find(s), s) for s in stops if s in full.text]
    if not hits:
        return full.text, full.token_ids
    position, stop = min(hits, key=lambda h: (h[0], len(h[1])))
    end = position + len(stop)
    for n in range(1, len(full.token_ids) + 1):
        if len(tokenizer.decode(full.token_ids[:n], skip_special_tokens=True)) >= end:
            return full.text[:position], full.token_ids[:n]
    raise AssertionError("unreachable")


def stop_candidates(text: str) -> list[list[str]]:
    """Stop-string sets drawn from the generated text itself, so they do occur."""
    candidates = [[text[10:12]], [text[5:8]], [text[len(text) // 2 : len(text) // 2 + 2]], [text[0]],
                  [text[-3:]], ["not in the text at all ~"], [text[20:23], text[12:14]]]
    if "ing" in text:
        candidates.append(["in"])  # completed in the middle of the multi-character token "ing"
    return [c for c in candidates if all(c)]


@pytest.mark.parametrize("method", ["ar", "pld", "anpd"])
def test_stop_strings_generate_and_stream(text_target, method):
    tokenizer = text_target.tokenizer
    full = verispec.generate(text_target, TEXT_PROMPT, method=method, max_new_tokens=NEW)
    assert len(full.token_ids) == NEW and len(full.text) >= 20
    for stops in stop_candidates(full.text):
        want_text, want_ids = expected_stop(full, tokenizer, stops)
        result = verispec.generate(text_target, TEXT_PROMPT, method=method, max_new_tokens=NEW, stop=stops)
        assert result.text == want_text, stops
        assert result.token_ids == want_ids, stops
        assert not any(s in result.text for s in stops)
        text_stream = verispec.stream(text_target, TEXT_PROMPT, method=method, max_new_tokens=NEW, stop=stops)
        deltas = list(text_stream)
        assert "".join(deltas) == text_stream.result.text == want_text, stops
        assert text_stream.result.token_ids == want_ids
        assert all(deltas)  # no empty deltas
        if want_ids != full.token_ids:
            assert result.stats.stop_reason == "stop"
            assert result.stats.new_tokens == len(want_ids)


def test_stop_string_completed_mid_step_drops_the_rest_of_the_step(text_target, monkeypatch):
    """All drafts accepted (8 per step): a stop string completed in the middle of a step cuts the
    ids after its completing token and drops the accepted tokens behind it."""
    tokenizer = text_target.tokenizer
    full = verispec.generate(text_target, TEXT_PROMPT, method="ar", max_new_tokens=NEW)
    prompt_len = len(tokenizer(TEXT_PROMPT)["input_ids"])
    assert prompt_len > 0
    drafters = []

    def scripted_build(name, target, options=MethodOptions(), sampling=None):
        drafter = helpers.ScriptedDrafter(full.token_ids, "all", target.vocab_size)
        drafters.append(drafter)
        return helpers.scripted_recipe(drafter, 8)

    monkeypatch.setattr(api_module, "build", scripted_build)
    mid_step = 0
    for stops in stop_candidates(full.text):
        want_text, want_ids = expected_stop(full, tokenizer, stops)
        text_stream = verispec.stream(text_target, TEXT_PROMPT, method="anpd", max_new_tokens=NEW, stop=stops)
        deltas = list(text_stream)
        result = text_stream.result
        assert result.text == want_text and result.token_ids == want_ids, stops
        assert "".join(deltas) == want_text
        if len(want_ids) not in (1, NEW) and (len(want_ids) - 1) % 9 != 0:
            mid_step += 1  # steps commit 1, then 9 tokens each: the stop fell inside a step
    assert mid_step > 0
    assert sum(d.expected_accepted for d in drafters) > 0


def test_text_assembler_cuts_inside_a_multi_character_token(char_tokenizer):
    vocab = char_tokenizer.get_vocab()
    ids = [vocab["a"], vocab["b"], vocab["the"], vocab["x"], vocab["y"]]
    assembler = TextAssembler(char_tokenizer, stop_strings=["th"])
    emitted = assembler.push(ids[:2]) + assembler.push(ids[2:])
    assert assembler.stopped
    assert assembler.text == "ab" and emitted == "ab"
    assert assembler.ids == ids[:3]  # up to "the", which completed "th"; "x", "y" dropped
    assert assembler.push([vocab["z"]]) == "" and assembler.finish() == ""


def test_text_assembler_holds_back_a_possible_stop_prefix(char_tokenizer):
    vocab = char_tokenizer.get_vocab()
    assembler = TextAssembler(char_tokenizer, stop_strings=["xyz"])
    assert assembler.push([vocab["a"], vocab["b"], vocab["x"]]) == "a"  # "bx" could begin "xyz"
    assert assembler.push([vocab["y"]]) == "b"
    assert assembler.push([vocab["q"]]) == "x"  # the last len("xyz") - 1 characters stay held
    assert assembler.finish() == "yq"
    assert assembler.text == "abxyq" and not assembler.stopped


def test_text_assembler_earliest_stop_wins(char_tokenizer):
    vocab = char_tokenizer.get_vocab()
    assembler = TextAssembler(char_tokenizer, stop_strings=["cd", "b"])
    assembler.push([vocab[c] for c in "abcde"])
    assert assembler.text == "a" and assembler.ids == [vocab["a"], vocab["b"]]


@pytest.mark.parametrize("stops", [[""], [3]])
def test_bad_stop_strings_are_rejected(text_target, stops):
    with pytest.raises(ConfigError):
        verispec.generate(text_target, "abc", method="ar", max_new_tokens=2, stop=stops)


def test_eos_through_the_text_api(char_tokenizer):
    """A model whose EOS is a token it generates: the text API stops there and hides it."""
    config = helpers.make_config("llama", vocab_size=len(char_tokenizer), init=0.1)
    model = helpers.make_model(config, seed=3)
    probe = Target(model, char_tokenizer)
    full = verispec.generate(probe, TEXT_PROMPT, method="ar", max_new_tokens=NEW)
    eos = full.token_ids[6]
    model.generation_config.eos_token_id = eos
    target = Target(model, char_tokenizer)
    assert eos in target.eos_token_ids
    for method in ("ar", "anpd", "pld"):
        result = verispec.generate(target, TEXT_PROMPT, method=method, max_new_tokens=NEW)
        first = full.token_ids.index(eos)
        assert result.token_ids == full.token_ids[: first + 1]
        assert result.stats.stop_reason == "eos"


class _ByteSplitTokenizer:
    """Letters and a space, plus two ids that are the two bytes of "é": alone, either decodes to
    a three-character marker; together, to "é". Decoding is not concatenative at such a split,
    and a decode that starts with a space drops it (as SentencePiece's decoders do)."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 27 and i + 1 < len(ids) and ids[i + 1] == 28:
                out.append("é")
                i += 2
                continue
            out.append("<?>" if ids[i] in (27, 28) else " " if ids[i] == 26 else chr(97 + ids[i]))
            i += 1
        return "".join(out).removeprefix(" ")


def test_the_assembled_text_is_the_decode_of_every_id_however_they_arrive():
    """The assembler decodes only the ids after an anchor (with a few before it): after every push
    its text is exactly the decode of all ids so far, splits inside a character included (3,000
    seeded sequences of ids in random steps)."""
    import random

    tokenizer, rng = _ByteSplitTokenizer(), random.Random(0)
    for _ in range(3000):
        ids = [rng.choice([0, 1, 26, 27, 28]) for _ in range(rng.randrange(1, 60))]
        assembler, pushed = TextAssembler(tokenizer), 0
        while pushed < len(ids):
            size = rng.randint(1, 6)
            assembler.push(ids[pushed : pushed + size])
            pushed = min(len(ids), pushed + size)
            assert assembler.text == tokenizer.decode(ids[:pushed]), ids[:pushed]


def _byte_fallback_tokenizer():
    """A real transformers tokenizer with SentencePiece-style byte fallback (as Gemma's, Llama 2's
    and Mistral's): letters, "▁", and the 256 byte tokens <0x00>..<0xFF>. Its decoder turns a run
    of byte tokens into their UTF-8 characters only if the whole run is valid UTF-8, else into one
    U+FFFD per byte, so a run's text changes as it grows (E0 A5 B4 is "ॴ"; one more E0 turns all
    four into U+FFFD)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1, **{chr(97 + i): 2 + i for i in range(26)},
             **{f"<0x{b:02X}>": 28 + b for b in range(256)}}
    core = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


def test_streamed_text_is_the_decode_of_every_id_for_byte_fallback_tokenizers():
    """What the assembler hands out, step by step, must add up to the decode of every id however
    the ids arrive, or a streamed answer differs from the same answer unstreamed (and from the
    same request in another batch, whose steps commit other numbers of ids). Byte-token runs that
    are valid UTF-8 for a while and then are not (the ids a 270M model wrote in a soak: E0 A5 B4
    repeated, ending in E0) must not be handed out before the run ends."""
    import random

    tokenizer, rng = _byte_fallback_tokenizer(), random.Random(0)
    e0, a5, b4, letter, space = 28 + 0xE0, 28 + 0xA5, 28 + 0xB4, 2, 1
    written = [e0, a5, b4] * 8 + [e0]
    cases = [written, written[:-1] + [letter], [letter, space] + written]
    cases += [[rng.choice([e0, a5, b4, letter, space]) for _ in range(rng.randrange(1, 40))] for _ in range(1500)]
    for ids in cases:
        for _ in range(3):
            assembler, pushed, out = TextAssembler(tokenizer), 0, ""
            while pushed < len(ids):
                size = rng.randint(1, 6)
                out += assembler.push(ids[pushed : pushed + size])
                pushed = min(len(ids), pushed + size)
            out += assembler.finish()
            assert out == tokenizer.decode(ids, skip_special_tokens=True), ids
