"""The exit-head training corpus: the shipped prompt list parses, bad records are refused with
their line, and corpus generation writes the documents it promises (an article and the two
documents built on it), reproducibly from its seed."""

from __future__ import annotations

import json

import pytest
import torch

import helpers
from verispec.errors import ConfigError
from verispec.request.text import PLAIN_TEMPLATE
from verispec.target.model import Target
from verispec.train.corpus import PROMPTS_PATH, PromptRecord, generate_corpus, read_corpus, read_prompts


def test_the_shipped_prompt_list_parses_and_has_both_kinds_of_record():
    records = read_prompts(PROMPTS_PATH)
    plain = [r for r in records if r.prompt is not None]
    articles = [r for r in records if r.article is not None]
    assert len(plain) >= 250 and len(articles) >= 20
    assert len({r.prompt for r in plain}) == len(plain), "a prompt is listed twice"


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": "a", "article": "b", "question": "c"}', "either"),
    ('{"article": "a topic"}', "either"),
    ('{"question": "why?"}', "either"),
    ('{"prompt": "   "}', "non-empty"),
    ('{"prompt": 3}', "non-empty"),
    ('not json', "not a prompt record"),
    ('["a list"]', "not a prompt record"),
])
def test_a_bad_prompt_record_is_refused_with_its_line(tmp_path, line, reason):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"prompts.jsonl:2: .*{reason}"):
        read_prompts(path)


def test_generate_corpus_writes_each_prompt_and_each_article_with_its_summary_and_answer(tmp_path):
    target = helpers.make_target("gemma3", seed=3, tokenizer=helpers.char_tokenizer())
    records = [PromptRecord(prompt="abc"), PromptRecord(article="cab", question="ba?")]
    out = tmp_path / "corpus.jsonl"
    calls = []
    generate_corpus(target, records, 8, out, samples=2, seed=5, progress=calls.append)
    documents = [json.loads(line) for line in out.read_text().splitlines()]
    assert calls == [1, 1, 1, 1]
    assert len(documents) == 2 * 1 + 2 * 3
    for document in documents:
        assert document["text"].startswith(document["prompt"])
    assert [d["prompt"] for d in documents[:2]] == [PLAIN_TEMPLATE.format(prompt="abc")] * 2
    for sample in range(2):
        written, summary, answer = documents[2 + 3 * sample : 5 + 3 * sample]
        assert written["prompt"] == PLAIN_TEMPLATE.format(prompt="Write a news article about cab.")
        article = written["text"][len(written["prompt"]):].strip()
        assert summary["prompt"] == PLAIN_TEMPLATE.format(prompt=f"Summarize: {article}")
        assert answer["prompt"] == PLAIN_TEMPLATE.format(prompt=f"{article}\nba?")
    assert read_corpus(out) == [d["text"] for d in documents]
    # reproducible from the seed; another seed samples other text
    again = tmp_path / "again.jsonl"
    generate_corpus(target, records, 8, again, samples=2, seed=5)
    assert again.read_text() == out.read_text()
    other = tmp_path / "other.jsonl"
    generate_corpus(target, records, 8, other, samples=2, seed=6)
    assert other.read_text() != out.read_text()


def test_a_stopped_corpus_keeps_the_work_in_flight_a_mix_of_kinds_labelled_and_a_resume_writes_the_rest(tmp_path):
    """`stop` (a time budget in the CLI) ends the generation before another forward: each sample
    stands as far as it was written (a prefix of what the whole run writes, labelled by the
    forwards that wrote it), a sample not begun is not written, the order was shuffled (not the
    prompt list's, which groups kinds), and a resume writes the samples not begun (an article's
    whole)."""
    from verispec.target.recorder import StateRecorder, recording
    from verispec.train.exit_head import corpus_documents, document_labels

    target = _int8_target()
    # prompts of 60 tokens: a forward's 256 rows begin four of them, so a stop after two forwards
    # leaves some not begun
    records = [PromptRecord(prompt=p * 20) for p in ("abc", "bca", "cab", "acb", "bac", "cba", "a b", "b a")]
    records.append(PromptRecord(article="cab", question="ba?"))
    whole = tmp_path / "whole.jsonl"
    generate_corpus(target, records, 12, whole, seed=5)
    whole_lines = {(d["record"], d["sample"], d["part"]): d for d in map(json.loads, whole.read_text().splitlines())}

    class Steps:  # stops the generation after a few of its forwards
        def __init__(self, target):
            self.count, self.forward = 0, target.forward_parts

        def __call__(self, *args, **kwargs):
            self.count += 1
            return self.forward(*args, **kwargs)

    steps = Steps(target)
    target.forward_parts = steps
    recorder = StateRecorder([1])
    stopped = tmp_path / "stopped.jsonl"
    with recording(target, recorder):
        generate_corpus(target, records, 12, stopped, seed=5, stop=lambda: steps.count >= 2)
    assert steps.count == 2, "a forward ran after the stop"
    lines = [json.loads(line) for line in stopped.read_text().splitlines()]
    cut = [d for d in lines if d != whole_lines[d["record"], d["sample"], d["part"]]]
    assert cut and len({d["record"] for d in lines}) < len(records)
    for line in lines:
        full = whole_lines[line["record"], line["sample"], line["part"]]["ids"]
        assert len(line["ids"]) > len(target.tokenizer(line["prompt"])["input_ids"])  # begun
        assert line["ids"] == full[:len(line["ids"])]
    assert sorted(d["record"] for d in lines) != list(range(len(lines))), "decoded in the list's order"
    _, _, taken = document_labels(target, corpus_documents(target.tokenizer, stopped), [1], 20, recorder)
    assert taken == len(lines)

    del target.forward_parts
    generate_corpus(target, records, 12, stopped, seed=5, resume=True)
    resumed = [json.loads(line) for line in stopped.read_text().splitlines()]
    assert {(d["record"], d["sample"], d["part"]) for d in resumed} == set(whole_lines)
    assert [d for d in resumed if d not in whole_lines.values()] == [d for d in cut if d["record"] < len(records) - 1]


def test_generate_corpus_refuses_a_budget_it_cannot_split(tmp_path):
    target = helpers.make_target("gemma3", seed=3, tokenizer=helpers.char_tokenizer())
    with pytest.raises(ConfigError, match=r"corpus-tokens must be >= 2 .*\(got 1, 1\)"):
        generate_corpus(target, [PromptRecord(prompt="abc")], 1, tmp_path / "c.jsonl")
    with pytest.raises(ConfigError, match=r"\(got 8, 0\)"):
        generate_corpus(target, [PromptRecord(prompt="abc")], 8, tmp_path / "c.jsonl", samples=0)


def test_the_corpus_is_decoded_together_and_each_document_is_the_text_it_gets_alone(tmp_path, monkeypatch):
    """On a target that batches exactly, the continuations share forwards (fewer forwards than
    documents' tokens), and each document is what `generate` writes for its prompt and seed alone."""
    from verispec.api import generate

    tokenizer = helpers.char_tokenizer(eos=True)
    model = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer)), 4)
    target = Target(model, tokenizer, name="tiny-int8", fast=True, blocks=helpers.blockify(model), numerics="int8")
    assert target.pages_kv
    records = [PromptRecord(prompt="abc"), PromptRecord(article="cab", question="ba?"), PromptRecord(prompt="b a")]
    forwards = []
    original = Target.forward_parts
    monkeypatch.setattr(Target, "forward_parts", lambda self, parts: forwards.append(len(parts)) or original(self, parts))
    out = generate_corpus(target, records, 8, tmp_path / "corpus.jsonl", samples=2, seed=5)
    monkeypatch.setattr(Target, "forward_parts", original)
    documents = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(documents) == 2 * 1 + 2 * 3 + 2 * 1
    assert max(forwards) > 1, "the continuations were decoded one at a time"
    # record i sample s is seeded 5 + 2 i + s; an article's summary and answer share its seed
    seeds = [5, 6, 7, 7, 7, 8, 8, 8, 9, 10]
    budgets = [8, 8, 16, 4, 4, 16, 4, 4, 8, 8]  # a prompt's continuation, an article, a summary, an answer
    for document, seed, budget in zip(documents, seeds, budgets):
        alone = generate(target, document["prompt"], "ar", max_new_tokens=budget, temperature=0.8, top_k=0,
                         top_p=0.95, seed=seed)
        target.release()
        assert document["prompt"] + alone.text == document["text"], document


def test_a_stopped_corpus_resumes_with_the_samples_it_had_and_ends_as_a_whole_run(tmp_path, monkeypatch):
    """A run stopped after one prompt's sample and half an article (its last line cut short):
    `resume` keeps that sample, drops the partial article, writes the others, and the file is
    the one a run without a stop writes."""
    import verispec.api as api

    target = helpers.make_target("gemma3", seed=3, tokenizer=helpers.char_tokenizer())
    records = [PromptRecord(prompt="abc"), PromptRecord(article="cab", question="ba?")]
    whole = generate_corpus(target, records, 8, tmp_path / "whole.jsonl", samples=2, seed=5).read_text()
    lines = whole.splitlines(keepends=True)
    stopped = tmp_path / "stopped.jsonl"
    stopped.write_text(lines[0] + lines[2] + lines[3][:20])  # "abc" sample 0; the first article, its summary cut
    made = []
    original = api.make_request
    monkeypatch.setattr(api, "make_request", lambda *a, **k: made.append(a[1]) or original(*a, **k))
    calls = []
    generate_corpus(target, records, 8, stopped, samples=2, seed=5, resume=True, progress=calls.append)
    assert stopped.read_text() == whole
    assert calls == [1, 1, 1, 1]  # the kept sample, then the three written
    assert len(made) == 1 + 2 * 3  # "abc" sample 1, and both articles with their summaries and answers


def test_resume_refuses_a_corpus_it_did_not_write_rather_than_overwrite_it(tmp_path):
    """A corpus file without the record/sample/part of each line (another version's, or the
    user's) is refused, not truncated to the samples it could recognise (none)."""
    target = helpers.make_target("gemma3", seed=3, tokenizer=helpers.char_tokenizer())
    out = tmp_path / "corpus.jsonl"
    text = '{"prompt": "p", "text": "p and more"}\n' * 3
    out.write_text(text)
    with pytest.raises(ConfigError, match="not written by this version"):
        generate_corpus(target, [PromptRecord(prompt="abc")], 8, out, resume=True)
    assert out.read_text() == text


def _int8_target():
    """A target whose every layer runs in C on int8 forms: paged and batch-invariant."""
    tokenizer = helpers.char_tokenizer(eos=True)
    model = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer)), 4)
    target = Target(model, tokenizer, name="tiny-int8", fast=True, blocks=helpers.blockify(model), numerics="int8")
    assert target.pages_kv
    return target


def test_the_forwards_that_write_the_corpus_label_it_with_the_bits_a_labelling_pass_computes(tmp_path):
    """With a recorder attached, every generated document's labels come from the forwards that
    wrote it (none is run through the target again), and they are the labelling pass's bits for
    every exit layer asked for; the prefix cache is off meanwhile and restored after."""
    from verispec.target.recorder import StateRecorder, recording
    from verispec.train.exit_head import corpus_documents, document_labels

    target = _int8_target()
    records = [PromptRecord(prompt="abc"), PromptRecord(article="cab", question="ba?"), PromptRecord(prompt="b a")]
    recorder = StateRecorder([2, 1])
    with recording(target, recorder):
        assert not target.prefix_cache
        out = generate_corpus(target, records, 12, tmp_path / "corpus.jsonl", samples=2, seed=5)
    assert target.prefix_cache and target.recorder is None
    documents = corpus_documents(target.tokenizer, out)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for ids, line in zip(documents, lines):  # the ids the target read and wrote, stored with the text
        assert ids == line["ids"] and target.tokenizer.decode(ids[len(target.tokenizer(line["prompt"])["input_ids"]):],
                                                               skip_special_tokens=True) in line["text"]
    exits, finals, taken = document_labels(target, documents, [1, 2], 20, recorder)
    assert taken == len(documents) == 10
    passed, passed_finals, none = document_labels(target, documents, [1, 2], 20)
    assert none == 0 and len(finals) == len(passed_finals) > len(documents)
    for got, expected in zip(finals, passed_finals):
        assert torch.equal(got, expected)
    for n in (1, 2):
        for got, expected in zip(exits[n], passed[n]):
            assert torch.equal(got, expected), n


def test_recorded_states_survive_rejected_drafts_and_a_gap_sends_a_document_to_the_pass(tmp_path):
    """Speculative requests roll rejected draft rows back: what the recorder keeps is still the
    pass's bits. A sequence that started from the prefix cache has a gap and is not taken."""
    from verispec.api import generate_many, make_request
    from verispec.target.recorder import StateRecorder, recording
    from verispec.train.exit_head import document_labels

    target = _int8_target()
    prompts = [helpers.repetitive_prompt(target.vocab_size, seed, period=5, repeats=4) for seed in (0, 1)]
    recorder = StateRecorder([1])
    with recording(target, recorder):
        results = generate_many(target, [make_request(target, p, "anpd", max_new_tokens=24) for p in prompts])
    assert sum(r.stats.drafted - r.stats.accepted for r in results) > 0, "no draft was rejected"
    documents = [r.prompt_ids + r.token_ids for r in results]
    exits, finals, taken = document_labels(target, documents, [1], 64, recorder)
    assert taken == 2
    passed, passed_finals, _ = document_labels(target, documents, [1], 64)
    for got, expected in zip(exits[1] + finals, passed[1] + passed_finals):
        assert torch.equal(got, expected)
    # with the prefix cache on, the second request of the same prompt starts from cached blocks
    recorder = StateRecorder([1])
    target.recorder = recorder
    long_prompt = helpers.repetitive_prompt(target.vocab_size, 3, period=7, repeats=6)
    for seed in (1, 2):
        generate_many(target, [make_request(target, long_prompt, "ar", max_new_tokens=4, temperature=1.0, seed=seed)])
    target.recorder = None
    assert [s.gap for s in recorder._streams] == [False, True]
