"""Constrained decoding (`response_format`): outputs follow the format, and every lossless method
decodes exactly as constrained `ar` (the target's logits masked by the grammar, then greedy or
sampling as usual).

- the format holds: JSON schema, regex and Lark outputs parse and match;
- constrained `ar` equals a hand-written oracle (a full forward per token, the mask of a fresh
  llguidance matcher, argmax), and differs from unconstrained `ar` (the mask matters);
- greedy: pld, anpd (linear and tree drafts), eesd, sps, hybrid (and suffix where installed)
  equal constrained `ar` token for token, on several prompts and formats, accepting drafts;
- sampled (long): on a micro model with an 8-token vocabulary, the exact masked distribution of
  the first three tokens by enumeration; `ar`, `anpd` and a drafter with q (speculative sampling,
  its drafts leaving the grammar) fit it by chi-square;
- a draft leaving the grammar is cut before the verify (the rule sees the valid prefix only);
- forced tokens are drafted and accepted (counted in `stats.forced`), and never by `ar`;
- `generate_many` under constraints equals each request alone;
- a bad schema, regex or grammar is a ConfigError before decoding, and the CLI's one `error:` line.
"""

from __future__ import annotations

import importlib.util
import json
import re
import string
from collections import Counter

import pytest
import torch

import helpers
import verispec
import verispec.core.constraint as constraint_module
from verispec.core.acceptance import verify_lossless
from verispec.core.constraint import constrain, mask_logits
from verispec.core.control import ConstantLength
from verispec.core.drafters.base import Draft
from verispec.core.drafters.early_exit import ExitHead, save_head
from verispec.core.engine import DecodeConfig, Logprobs, Recipe, decode, next_draft
from verispec.core.stats import GenerationStats
from verispec.core.methods import MethodOptions, build
from verispec.core.sampling import SamplingConfig, probabilities
from verispec.errors import ConfigError
from verispec.request.grammar import compile_format
from verispec.target.model import Target

SPECIALS = ["<pad>", "<unk>", "</s>"]
PIECES = ['{"', '":', '",', "true", "false"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
ENUM_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "size"],
               "properties": {"colour": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["small", "large"]}}}
REGEX = "[a-c]{2,5}-[0-9]{1,3}"
LARK = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,4}/'
FORMATS = {
    "schema": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    "enum": {"type": "json_schema", "json_schema": {"name": "item", "schema": ENUM_SCHEMA}},
    "regex": {"type": "regex", "regex": REGEX},
    "lark": {"type": "grammar", "grammar": LARK},
}
PROMPTS = ['Give {"name":"bob","age":31,"ok":true} and {"name":"al","age":7,"ok":false} then ',
           "abc-12 bb-7 aaa-100 and ",
           'colour {"colour":"red","size":"small"} and ']
NEW = 60


def symbol_tokenizer(symbols: list[str]):
    """A PreTrainedTokenizerFast with one token per symbol (SPECIALS first, </s> its EOS)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def json_tokenizer():
    return symbol_tokenizer([c for c in string.printable if c not in "\r\x0b\x0c"] + PIECES)


@pytest.fixture(scope="module")
def target() -> Target:
    tokenizer = json_tokenizer()
    model = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1), seed=3)
    return Target(model, tokenizer, name="json-llama")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("constraint-draft")
    tokenizer = json_tokenizer()
    helpers.make_model(helpers.micro_llama_config(len(tokenizer), init=0.1, max_positions=512), seed=5).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    """An untrained exit head after layer 1 over the whole vocabulary."""
    path = tmp_path_factory.mktemp("constraint-head")
    head = ExitHead(target.model, 1, list(range(target.vocab_size)))
    save_head(head, head.spec(target.model, target.name), path)
    return path


def lossless_methods(draft_dir, head_dir) -> dict:
    methods = {"pld": ("pld", MethodOptions()),
               "anpd": ("anpd", MethodOptions()),
               "anpd-constant": ("anpd", MethodOptions(controller="constant:8")),
               "anpd-tree": ("anpd", MethodOptions(controller="constant:6", tree=8)),
               "eesd": ("eesd", MethodOptions(exit_head=str(head_dir), controller="constant:3")),
               "sps": ("sps", MethodOptions(draft_model=str(draft_dir), controller="constant:3")),
               "hybrid": ("hybrid", MethodOptions(draft_model=str(draft_dir)))}
    if importlib.util.find_spec("arctic_inference") is not None:
        methods["suffix"] = ("suffix", MethodOptions())
    return methods


def check_format(name: str, text: str) -> None:
    """Fail unless `text` is a complete output of format `name`."""
    if name == "schema":
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 6
        assert type(value["age"]) is int and 0 <= value["age"] <= 120
        assert type(value["ok"]) is bool
    elif name == "enum":
        value = json.loads(text)
        assert value["colour"] in ("red", "green", "blue") and value["size"] in ("small", "large"), value
        assert set(value) == {"colour", "size"}
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]{1,4}", text), text


def oracle(target: Target, prompt: str, response_format: dict, new: int) -> list[int]:
    """Constrained greedy decoding written plainly: a full forward of the whole sequence per
    token, the mask of a fresh matcher that consumed the output so far, argmax; stops at EOS."""
    constraint = compile_format(target, response_format)
    matcher = constraint.matcher()
    ids = target.tokenizer.encode(prompt, add_special_tokens=False)
    out: list[int] = []
    eos = target.tokenizer.eos_token_id
    with torch.inference_mode():
        for _ in range(new):
            logits = target.model(input_ids=torch.tensor([ids + out])).logits[0, -1:]  # [1, vocab]
            token = int(mask_logits(logits, matcher.allowed().unsqueeze(0))[0].argmax())
            out.append(token)
            if token == eos:
                break
            assert matcher.consume([token]) == 1
    return out


# -- the format holds, and constrained ar is the masked argmax ---------------------------------------

@pytest.mark.parametrize("name", list(FORMATS))
def test_outputs_follow_the_format_and_ar_is_the_masked_argmax(target, name):
    for prompt in PROMPTS[:2]:
        result = verispec.generate(target, prompt, "ar", max_new_tokens=NEW, response_format=FORMATS[name])
        assert result.stats.stop_reason == "eos", result.text
        check_format(name, result.text)
        expected = oracle(target, prompt, FORMATS[name], NEW)
        assert result.token_ids[: len(expected)] == expected
        free = verispec.generate(target, prompt, "ar", max_new_tokens=len(expected)).token_ids
        assert free != expected  # the random model alone writes no such thing: the mask decided
        fast = verispec.generate(target, prompt, "anpd", max_new_tokens=NEW, response_format=FORMATS[name])
        check_format(name, fast.text)


def test_json_is_written_as_json_dumps_writes_it(target):
    """One line, ", " and ": " between items and nothing else: the separators models learned
    (without the spaces a real model writes stray commas into the next string)."""
    for name in ("schema", "enum"):
        text = verispec.generate(target, PROMPTS[0], "anpd", max_new_tokens=NEW, response_format=FORMATS[name]).text
        assert text == json.dumps(json.loads(text)), text


# -- greedy: every lossless method equals constrained ar ---------------------------------------------

def test_every_lossless_method_equals_constrained_ar(target, draft_dir, head_dir):
    methods = lossless_methods(draft_dir, head_dir)
    accepted = dict.fromkeys(methods, 0)
    for name in ("schema", "regex", "enum"):
        for prompt in PROMPTS:
            reference = verispec.generate(target, prompt, "ar", max_new_tokens=NEW, response_format=FORMATS[name])
            assert reference.stats.drafted == 0 and reference.stats.forced == 0
            for label, (method, options) in methods.items():
                result = verispec.generate(target, prompt, method, max_new_tokens=NEW, options=options,
                                           response_format=FORMATS[name])
                assert result.token_ids == reference.token_ids, (label, name, prompt)
                accepted[label] += result.stats.accepted - result.stats.forced
    # not vacuous: each method's own drafts (beyond the forced tokens) were accepted somewhere
    assert all(accepted[label] > 0 for label in ("pld", "anpd", "anpd-constant", "anpd-tree")), accepted


def test_every_lossless_method_under_sampling_reproduces_constrained_ar_or_follows_the_grammar(target, draft_dir,
                                                                                             head_dir):
    """Seeded sampling: deterministic drafts draw one sample per committed token, as `ar`, so
    pld and anpd give `ar`'s own sample; every method's output follows the format."""
    for seed in range(3):
        reference = verispec.generate(target, PROMPTS[0], "ar", max_new_tokens=NEW, temperature=1.0, seed=seed,
                                      response_format=FORMATS["schema"])
        check_format("schema", reference.text)
        for label, (method, options) in lossless_methods(draft_dir, head_dir).items():
            result = verispec.generate(target, PROMPTS[0], method, max_new_tokens=NEW, temperature=1.0, seed=seed,
                                       options=options, response_format=FORMATS["schema"])
            check_format("schema", result.text)
            if method in ("pld", "anpd"):
                assert result.token_ids == reference.token_ids, (label, seed)


# -- drafts cut at the grammar, forced tokens ------------------------------------------------------

class FixedDrafter:
    """Proposes the same tokens every step (recording what it was asked)."""

    def __init__(self, tokens):
        self.tokens, self.commits = tokens, []

    def begin(self, prompt):
        pass

    def propose(self, context, k, keep=None):
        return Draft.of(self.tokens[:k])

    def commit(self, committed, n_proposed):
        self.commits.append((list(committed), n_proposed))


class SpyRule:
    """verify_lossless, recording each draft and the logits rows it was given."""

    def __init__(self):
        self.drafts, self.rows = [], []

    def __call__(self, draft, logits, sampling, generator):
        self.drafts.append(draft.tokens.tolist())
        self.rows.append(logits)
        return verify_lossless(draft, logits, sampling, generator)


def test_a_draft_leaving_the_grammar_is_cut_before_the_verify(target):
    tokenizer = target.tokenizer
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    constraint = compile_format(target, FORMATS["regex"])
    drafter, rule = FixedDrafter(encode("ab-x12")), SpyRule()  # "ab-" fits the regex, "x" does not
    recipe = constrain(Recipe(drafter, ConstantLength(6), rule), constraint.matcher(), force=False)
    ids, stats, _ = helpers.run(target, recipe, encode("go "), 8)
    first = ids[0]
    verified = rule.drafts[1]  # the first draft (rule call 0: the token after the prompt)
    valid = compile_format(target, FORMATS["regex"]).matcher()
    assert valid.consume([first]) == 1
    allowed = valid.consume(drafter.tokens)
    assert verified == drafter.tokens[:allowed] and allowed < len(drafter.tokens)
    # each verified row is masked by the grammar's state after the tokens before it
    rows = rule.rows[1]
    assert rows.shape[0] == len(verified) + 1
    assert torch.isinf(rows).any(dim=-1).all()


def test_forced_tokens_are_drafted_and_accepted(target):
    for method in ("pld", "anpd"):
        result = verispec.generate(target, PROMPTS[0], method, max_new_tokens=NEW, response_format=FORMATS["enum"])
        check_format("enum", result.text)
        stats = result.stats
        assert stats.forced >= len('{"colour":"') - 1, stats  # the schema's fixed text, at least its start
        assert stats.accepted >= stats.forced and stats.drafted >= stats.forced
        assert stats.target_forwards <= len(result.token_ids) - stats.forced  # a forward saved per forced token
    ar = verispec.generate(target, PROMPTS[0], "ar", max_new_tokens=NEW, response_format=FORMATS["enum"])
    assert ar.stats.stop_reason == "eos"  # the grammar ended it: its end of sequence came without a forward
    assert ar.stats.forced == 0 and ar.stats.target_forwards == len(ar.token_ids) - 1


@pytest.mark.parametrize("name", ["schema", "enum", "regex"])
def test_the_end_a_complete_grammar_leaves_no_choice_in_costs_no_forward(target, name):
    """Where the grammar is complete and allows only the end of sequence, that token is committed
    without a forward: the same tokens as a loop that runs it (asking for log-probabilities keeps
    the forward, its row is needed), one forward fewer."""
    encode = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode(PROMPTS[0])
    config = DecodeConfig(NEW, SamplingConfig(), frozenset(target.eos_token_ids))
    runs = {}
    for logprobs in (None, Logprobs(0)):
        recipe = constrain(Recipe(OracleDrafter([], 0), ConstantLength(0), verify_lossless),
                           compile_format(target, FORMATS[name]).matcher(), force=False)  # as `ar`
        stats = GenerationStats()
        ids = [t for step in decode(target, recipe, prompt, config, stats, logprobs) for t in step]
        runs[logprobs is None] = (ids, stats.target_forwards, stats.stop_reason)
    (ids, forwards, reason), (full_ids, full_forwards, full_reason) = runs[True], runs[False]
    assert ids == full_ids and reason == full_reason and full_forwards == len(ids)
    ended = compile_format(target, FORMATS[name]).matcher()
    assert ended.consume(ids[:-1]) == len(ids) - 1
    no_choice = ended.stopped and int(ended.allowed().sum()) == 1  # what the grammar left at the end
    assert forwards == full_forwards - (1 if no_choice else 0)
    if name == "enum":  # not vacuous: this one ends where its grammar leaves no choice
        assert no_choice and reason == "eos"


class OracleDrafter:
    """Proposes the tokens a reference output has next (it knows the answer)."""

    def __init__(self, reference, prompt_length):
        self.reference, self.prompt_length = reference, prompt_length

    def begin(self, prompt):
        pass

    def propose(self, context, k, keep=None):
        done = len(context) - self.prompt_length
        return Draft.of(self.reference[done : done + k])

    def commit(self, committed, n_proposed):
        pass


class OracleAheadDrafter(OracleDrafter):
    """The same, also after uncommitted tokens: it continues a grammar's forced text."""

    def propose_ahead(self, context, ahead, k, keep=None):
        return self.propose([*context, *ahead], k)


def test_a_forced_step_also_verifies_the_drafters_continuation(target):
    """Where the drafter can draft after uncommitted tokens, a step with forced text verifies its
    draft after them in the same forward: same output, fewer forwards, and steps whose drafts go
    past the forced text; a drafter that cannot, drafts nothing in such steps."""
    encode = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode(PROMPTS[2])
    fmt = FORMATS["enum"]
    reference, _, _ = helpers.run(target, constrain(Recipe(OracleDrafter([], 0), ConstantLength(0), verify_lossless),
                                                    compile_format(target, fmt).matcher()), prompt, NEW)
    forwards, past_forced = {}, {}
    for drafter in (OracleDrafter(reference, len(prompt)), OracleAheadDrafter(reference, len(prompt))):
        rule = SpyRule()
        constraint = compile_format(target, fmt)
        ids, stats, steps = helpers.run(target, constrain(Recipe(drafter, ConstantLength(8), rule),
                                                          constraint.matcher()), prompt, NEW)
        assert ids == reference
        name = type(drafter).__name__
        forwards[name] = stats.target_forwards
        matcher = constraint.matcher()  # replays the steps: what was forced before each
        matcher.consume(steps[0])
        past_forced[name] = 0
        for draft, step in zip(rule.drafts[1:], steps[1:]):
            forced = matcher.forced()
            if forced and draft[: len(forced)] == forced and len(draft) > len(forced):
                past_forced[name] += 1
            matcher.consume(step)
    assert past_forced == {"OracleDrafter": 0, "OracleAheadDrafter": past_forced["OracleAheadDrafter"]}
    assert past_forced["OracleAheadDrafter"] > 0
    assert forwards["OracleAheadDrafter"] < forwards["OracleDrafter"], forwards


def test_the_text_forced_after_a_whole_draft_joins_it(target):
    """A drafter's draft that the grammar accepts whole is followed, in the same draft, by the
    text the grammar forces after it (here the enum's value, then the next key)."""
    encode = lambda text: target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    constraint = compile_format(target, FORMATS["enum"])
    matcher = constraint.matcher()
    start = encode('{"colour": "')
    assert matcher.consume(start) == len(start) and not matcher.forced()  # the value is the model's choice
    value = encode("red")
    drafter = OracleAheadDrafter(start + value, 0)
    recipe = constrain(Recipe(drafter, ConstantLength(len(value)), verify_lossless), matcher)
    draft = next_draft(recipe.drafter, recipe.controller, start, 40, False).tokens.tolist()
    replay = constraint.matcher()
    replay.consume(start + value)
    forced = replay.forced()
    assert len(forced) > 2 and target.tokenizer.decode(forced).startswith('", "size": "')
    assert draft == value + forced
    assert matcher.consume([]) == 0 and matcher.forced() == []  # the request's matcher is where it was


# -- many requests --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def paged_target() -> Target:
    """The same tiny Llama with block-exact weights in int8 numerics: its requests page their KV
    and decode together in one batch (`Target.pages_kv`)."""
    tokenizer = json_tokenizer()
    model = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1), seed=3)
    return Target(model, tokenizer, name="json-llama-int8", fast=True, blocks=helpers.blockify(model), numerics="int8")


def test_generate_many_under_constraints_equals_each_alone(paged_target, draft_dir):
    target = paged_target
    assert target.pages_kv  # the batch's shared forwards, not one request at a time
    sps = MethodOptions(draft_model=str(draft_dir), controller="constant:3")
    specs = [(prompt, method, options, name, temperature)
             for prompt in PROMPTS[:2]
             for method, options in (("ar", None), ("pld", None), ("anpd", None), ("sps", sps))
             for name in ("schema", "regex", None)
             for temperature in (0.0, 1.0)]
    def request(prompt, method, options, name, temperature):
        return dict(max_new_tokens=40, options=options, temperature=temperature, seed=7,
                    response_format=FORMATS[name] if name else None)
    requests = [verispec.make_request(target, spec[0], spec[1], **request(*spec)) for spec in specs]
    results = verispec.generate_many(target, requests)
    for spec, result in zip(specs, results):
        assert not isinstance(result, BaseException), result
        prompt, method, options, name, temperature = spec
        if temperature == 0.0 or method in ("ar", "pld", "anpd"):  # seeded: ar's own sample
            alone = verispec.generate(target, prompt, method, **request(*spec))
            assert result.token_ids == alone.token_ids, spec
        if name and result.stats.stop_reason == "eos":
            check_format(name, result.text)
    assert sum(r.stats.forced for r in results) > 0


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("response_format,message", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "invalid json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "regex", "regex": "[0-9"}, "invalid regex"),
    ({"type": "grammar", "grammar": 'start: "a" missing'}, "invalid grammar"),
    ({"type": "yaml"}, "not one of"),
    ({"kind": "json"}, "type"),
])
def test_a_bad_format_is_refused_before_decoding(target, response_format, message):
    with pytest.raises(ConfigError, match=message):
        verispec.make_request(target, "x", "anpd", response_format=response_format)


@pytest.mark.parametrize("args,message", [
    (["--json-schema", "bad.json"], "invalid json_schema: Invalid type: nonsense"),
    (["--json-schema", "notjson.json"], "not JSON"),
    (["--json-schema", "missing.json"], "cannot read missing.json"),
    (["--regex", "[0-9"], "invalid regex"),
    (["--grammar", "bad.lark"], "invalid grammar"),
    (["--regex", "a", "--grammar", "bad.lark"], "give one of --regex, --grammar"),
])
def test_the_cli_refuses_a_bad_format_in_one_line_before_loading(monkeypatch, tmp_path, args, message):
    (tmp_path / "bad.json").write_text('{"type": "nonsense"}')
    (tmp_path / "notjson.json").write_text("{type: object")
    (tmp_path / "bad.lark").write_text('start: "a" missing')
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, ["generate", *args, "hello"], message)


def test_a_model_without_a_tokenizer_or_eos_is_refused(micro):
    with pytest.raises(ConfigError, match="tokenizer"):
        verispec.make_request(micro, [1, 2], "ar", response_format={"type": "json_object"})


# -- sampled: the masked distribution, by enumeration ---------------------------------------------

MICRO_SYMBOLS = ["a", "b", "-", "0", "1"]  # with SPECIALS: 8 tokens
MICRO_REGEX = "(a|b)(a|-)[01ab]+"
LENGTH = 3


@pytest.fixture(scope="module")
def micro_text() -> Target:
    tokenizer = symbol_tokenizer(MICRO_SYMBOLS)
    model = helpers.make_model(helpers.micro_llama_config(len(tokenizer), init=0.3), seed=0)
    return Target(model, tokenizer, name="micro-text")


def exact_masked_distribution(target, prompt, response_format, sampling) -> dict:
    """P(first LENGTH tokens) under constrained ar sampling, by enumerating every prefix."""
    constraint = compile_format(target, response_format)
    dist = {(): 1.0}
    for _ in range(LENGTH):
        new = {}
        for prefix, weight in dist.items():
            matcher = constraint.matcher()
            assert matcher.consume(list(prefix)) == len(prefix)
            with torch.inference_mode():
                logits = target.model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1:]  # [1, vocab]
            probs = probabilities(mask_logits(logits, matcher.allowed().unsqueeze(0)), sampling)[0].double()
            probs = probs / probs.sum()
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    new[prefix + (token,)] = weight * p
        dist = new
    return dist


@pytest.mark.long
def test_sampled_methods_follow_the_masked_distribution(micro_text, monkeypatch):
    sampling = SamplingConfig(temperature=1.0)
    response_format = {"type": "regex", "regex": MICRO_REGEX}
    constraint = compile_format(micro_text, response_format)
    prompt = [3, 4, 3, 4, 3, 4, 3]
    exact = exact_masked_distribution(micro_text, prompt, response_format, sampling)
    vocab = micro_text.vocab_size

    table = {}  # (generated prefix, token) -> probability, for the most likely valid next token
    for outcome, probability in exact.items():
        for cut in range(LENGTH):
            table[outcome[:cut], outcome[cut]] = table.get((outcome[:cut], outcome[cut]), 0.0) + probability

    def plausible(context):  # the most likely valid token: q's point mass, its random rest often invalid
        generated = tuple(context[len(prompt):])
        options = {t: table.get((generated, t), 0.0) for t in range(vocab)}
        return max(options, key=options.get) if any(options.values()) else 3

    def runs(make_recipe, seeds):
        outcomes, accepted = [], 0
        for seed in range(seeds):
            config = SamplingConfig(1.0, 0, 1.0, seed)
            recipe = constrain(make_recipe(seed), constraint.matcher(), force=True)
            ids, stats, _ = helpers.run(micro_text, recipe, prompt, LENGTH + 2, config, (2,))
            outcomes.append(tuple(ids[:LENGTH]))
            accepted += stats.accepted
        return outcomes, accepted

    seeds = 500
    ar, _ = runs(lambda seed: build("ar", micro_text), seeds)
    helpers.assert_fits(ar, exact, "constrained ar")
    anpd, accepted = runs(lambda seed: build("anpd", micro_text, MethodOptions(controller="constant:4")), seeds)
    helpers.assert_fits(anpd, exact, "constrained anpd")
    assert sum(a == b for a, b in zip(ar, anpd)) >= 0.995 * seeds  # one draw per committed token, as ar
    q_drafter = lambda seed: Recipe(helpers.DistributionDrafter(vocab, plausible, seed=1_000_003 + seed),  # noqa: E731
                                    ConstantLength(3), verify_lossless)
    drawn, accepted = runs(q_drafter, seeds)
    assert accepted > 0.05 * seeds, accepted
    helpers.assert_fits(drawn, exact, "constrained q-drafter")
    assert Counter(len(o) for o in drawn) == Counter({LENGTH: seeds})
    # Negative control: after a drawn token that left the grammar, sample from p instead of the
    # residual norm(max(p - q, 0)): the same test at the same size must see it.
    monkeypatch.setattr(constraint_module, "residual_distribution", lambda p, q: p)
    broken, _ = runs(q_drafter, seeds)
    _, pvalue, _ = helpers.chi_square_pvalue(Counter(broken), exact)
    assert pvalue < 1e-4, "the chi-square test lacks the power to see a wrong residual"


# -- the embedded model (slow) ---------------------------------------------------------------------

@pytest.mark.slow
def test_on_the_embedded_model_every_lossless_method_equals_constrained_ar():
    """The default Gemma 3 270M (its 262k sentencepiece vocabulary through llguidance's own
    reading of the tokenizer): the schema holds, and every lossless method (eesd and sps with the
    shipped exit head) gives constrained ar's tokens."""
    target = verispec.load()
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    prompt = "Extract the person as JSON with name, age and city.\nText: Maria Lopez is 34 and lives in Seville.\nJSON:"
    reference = verispec.generate(target, prompt, "ar", max_new_tokens=40, response_format=response_format,
                                  prompt_format="chat")
    assert reference.stats.stop_reason == "eos"
    value = json.loads(reference.text)
    assert set(value) == {"name", "age", "city"} and type(value["age"]) is int
    forced = 0
    for method in ("pld", "anpd", "anpd/tree=8", "eesd", "sps", "hybrid"):
        result = verispec.generate(target, prompt, method, max_new_tokens=40, response_format=response_format,
                                   prompt_format="chat")
        assert result.token_ids == reference.token_ids, method
        forced += result.stats.forced
    assert forced > 0
