"""The exit-head training corpus: project-written prompts, continued by the target itself.

Owns the prompt list (`data/prompts.jsonl`, written for this project: instructions, questions and
passages across writing, role-play, reasoning, code, math and word problems, science, humanities,
summarisation, question answering, extraction, translation and chat, kept apart from every
benchmark prompt so that training never sees evaluation text), the generation of the corpus (the
target samples continuations of the prompts, in the plain `PLAIN_TEMPLATE` (the benchmark's
form for a tokenizer without a chat template), with `ar`, many sequences a forward where the
target batches exactly), and reading/writing the corpus file (JSONL, one document a line:
{"prompt": ..., "text": prompt + continuation, "ids": the token ids of both as the target read and
wrote them}). Training labels a document's ids where the line has them (`read_corpus_ids`), not a
re-tokenization of its text (which may differ where the target sampled a piece its tokenizer would
not produce); a target with a `recorder.StateRecorder` attached while it writes the corpus has
labelled them already (`train.exit_head`).

A prompt record is either {"prompt": instruction} or {"article": topic, "question": question}:
for the second the target first writes a news article on the topic, and that article then
becomes the passage of two more documents, "Summarize: <article>" and "<article>\n<question>"
(the shapes of Spec-Bench's summarisation and retrieval prompts), so the long-passage contexts
of those tasks are covered by text the target wrote, not by text from elsewhere.

The corpus generated for the embedded default model ships as `data/corpus.jsonl`; regenerate it
with `verispec train-exit --generate-corpus`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..request.text import PLAIN_TEMPLATE

DATA = Path(__file__).parent / "data"
PROMPTS_PATH = DATA / "prompts.jsonl"
CORPUS_PATH = DATA / "corpus.jsonl"
# of a training run's time budget (train-exit's --max-minutes): the most that writing its corpus
# takes, the rest left to training (a head needs both: with half the text it learnt its training
# text; measured in docs/methods.md)
BUDGET_SHARE = 0.65


@dataclass(frozen=True)
class PromptRecord:
    """One line of the prompt list: an instruction, or an article topic with a question."""

    prompt: str | None = None
    article: str | None = None
    question: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.article is None) or (self.article is not None) != (self.question is not None):
            raise ConfigError("a prompt record has either 'prompt', or 'article' and 'question'")
        for value in (self.prompt, self.article, self.question):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError("prompt, article and question must be non-empty strings")


def read_prompts(path: Path = PROMPTS_PATH) -> list[PromptRecord]:
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompts.append(PromptRecord(record.get("prompt"), record.get("article"), record.get("question")))
        except (ValueError, TypeError, AttributeError, ConfigError) as error:
            raise ConfigError(f"{path}:{number}: not a prompt record ({error})") from error
    return prompts


def read_corpus(path: Path = CORPUS_PATH) -> list[str]:
    """The documents of a corpus file: JSONL with a "text" field, or plain text (one
    document per blank-line-separated block)."""
    if not path.is_file():
        raise ConfigError(f"corpus file not found: {path}")
    raw = path.read_text()
    if path.suffix == ".jsonl":
        documents = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    documents.append(json.loads(line)["text"])
                except (ValueError, KeyError, TypeError) as error:
                    raise ConfigError(f"{path}:{number}: not a corpus record ({error})") from error
        return documents
    return [block.strip() for block in raw.split("\n\n") if block.strip()]


def read_corpus_ids(path: Path) -> list[list[int] | None]:
    """Each document's token ids as the corpus file gives them (a generated corpus's "ids"), in
    `read_corpus`'s order; None for a document without them (plain text, or a JSONL line
    without "ids")."""
    if path.suffix != ".jsonl":
        return [None] * len(read_corpus(path))
    found = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            ids = json.loads(line).get("ids")
            if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)):
                raise ConfigError(f"{path}:{number}: 'ids' must be a non-empty list of token ids")
            found.append(ids)
    return found


def check_generation(new_tokens: int, samples: int) -> None:
    """Refuse a corpus budget `generate_corpus` cannot use (the CLI asks before loading a model)."""
    if new_tokens < 2 or samples < 1:
        raise ConfigError(f"--corpus-tokens must be >= 2 and --corpus-samples >= 1 (got {new_tokens}, {samples})")


def generate_corpus(target, prompts: list[PromptRecord], new_tokens: int, out: Path, *, samples: int = 1,
                    temperature: float = 0.8, top_p: float = 0.95, seed: int = 0, resume: bool = False,
                    progress: Callable[[int], None] | None = None, stop: Callable[[], bool] | None = None) -> Path:
    """Continue every prompt `samples` times with the target (sampling, `ar`) and write the
    corpus JSONL. Sample s of record i is seeded with seed + i * samples + s, so the corpus is
    reproducible and each record's samples differ. An article is written with 2 * new_tokens
    tokens; its summary and answer with new_tokens // 2 (Spec-Bench's answers are short).

    The continuations are decoded together (`generate_many`: many sequences a forward where the
    target batches exactly, each the text it gives alone), in two rounds: every prompt's
    continuation and every article, then the articles' summaries and answers. Each sample's
    documents are appended to `out` as soon as they are all written (its lines carry "record",
    "sample" and "part"), so that `resume` keeps the samples a stopped run finished and writes
    only the others; at the end the lines are put in record order. `progress` is called with the
    number of samples finished (kept ones first).

    `stop`, asked between steps (e.g. whether a time budget is used up), ends the generation
    early, before another forward: each sample stands as far as it was written (a continuation
    cut short is still the target's own text; an article without the summary or answer it has
    not got), and the samples not begun are not written (a resume writes them, and an
    article's sample whole again). The samples are decoded in an order shuffled by `seed`, so that a
    stopped corpus still has every kind of prompt."""
    check_generation(new_tokens, samples)
    jobs = [(index, sample, record, seed + index * samples + sample)
            for index, record in enumerate(prompts) for sample in range(samples)]
    random.Random(seed).shuffle(jobs)
    parts = {(index, sample): 1 if record.prompt is not None else 3 for index, sample, record, _ in jobs}
    kept = _finished_samples(out, parts) if resume else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(_line(key, document) for key, group in kept.items() for document in group))
    if kept and progress is not None:
        progress(len(kept))
    todo = [job for job in jobs if (job[0], job[1]) not in kept]
    with out.open("a") as sink:

        def finish(key: tuple[int, int], group: list[dict]) -> None:
            sink.write("".join(_line(key, document) for document in group))
            sink.flush()
            if progress is not None:
                progress(1)

        _write_samples(target, todo, new_tokens, temperature, top_p, finish, stop)
    lines = out.read_text().splitlines()
    lines.sort(key=lambda line: tuple(json.loads(line)[field] for field in ("record", "sample", "part")))
    out.write_text("".join(line + "\n" for line in lines))
    return out


def _line(key: tuple[int, int], document: dict) -> str:
    return json.dumps({**document, "record": key[0], "sample": key[1]}) + "\n"


def _finished_samples(out: Path, parts: dict[tuple[int, int], int]) -> dict[tuple[int, int], list[dict]]:
    """The samples whose documents all stand in `out` (a partly written one is dropped), by
    (record, sample), their documents in part order, as `generate_corpus` wrote them."""
    if not out.is_file():
        return {}
    found: dict[tuple[int, int], list[dict]] = {}
    lines = out.read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            document = json.loads(line)
        except ValueError:
            if number == len(lines):
                continue  # the last line, cut short by the stop
            raise ConfigError(f"{out}:{number} is not a corpus line; delete {out} to write the corpus anew") from None
        if not isinstance(document, dict) or not {"record", "sample", "part"} <= set(document):
            raise ConfigError(f"{out} was not written by this version's corpus generation (line {number} has no "
                              f"record, sample and part); delete it to write the corpus anew") from None
        found.setdefault((document.pop("record"), document.pop("sample")), []).append(document)
    return {key: sorted(group, key=lambda d: d["part"]) for key, group in found.items()
            if parts.get(key) == len(group)}


def _write_samples(target, jobs: list, new_tokens: int, temperature: float, top_p: float,
                   finish: Callable[[tuple[int, int], list[dict]], None], stop: Callable[[], bool] | None) -> None:
    """Continue `jobs` ((record index, sample, record, seed)) in two rounds, calling `finish(key,
    documents)` as each sample's documents are all written (where `stop` ended the rounds, each
    article with the documents it has)."""
    firsts = [(record.prompt, new_tokens) if record.prompt is not None
              else (f"Write a news article about {record.article}.", 2 * new_tokens) for _, _, record, _ in jobs]
    articles: dict[int, list[dict | None]] = {}  # job position: [article, summary, answer] as they come

    def first_done(k: int, document: dict) -> None:
        index, sample, record, _ = jobs[k]
        if record.prompt is not None:
            finish((index, sample), [{**document, "part": 0}])
        else:
            articles[k] = [{**document, "part": 0}, None, None]

    if not _continue_all(target, firsts, [job[3] for job in jobs], temperature, top_p, first_done, stop):
        _finish_partly(jobs, articles, finish)
        return
    followers = []  # (job position, part, prompt, tokens): each article's summary (1) and answer (2)
    for k, (article_document, _, _) in articles.items():
        article = article_document["text"][len(article_document["prompt"]):].strip()
        followers += [(k, 1, f"Summarize: {article}", new_tokens // 2),
                      (k, 2, f"{article}\n{jobs[k][2].question}", new_tokens // 2)]

    def follower_done(j: int, document: dict) -> None:
        k, part = followers[j][:2]
        articles[k][part] = {**document, "part": part}
        if all(articles[k]):
            finish(jobs[k][:2], articles.pop(k))

    if not _continue_all(target, [(prompt, tokens) for _, _, prompt, tokens in followers],
                         [jobs[k][3] for k, _, _, _ in followers], temperature, top_p, follower_done, stop):
        _finish_partly(jobs, articles, finish)


def _finish_partly(jobs: list, articles: dict[int, list[dict | None]],
                   finish: Callable[[tuple[int, int], list[dict]], None]) -> None:
    """The articles a stopped generation left without their summary or answer, each with the
    documents it has."""
    for k, documents in articles.items():
        finish(jobs[k][:2], [document for document in documents if document is not None])


def _continue_all(target, prompts: list[tuple[str, int]], seeds: list[int], temperature: float, top_p: float,
                  finished: Callable[[int, dict], None], stop: Callable[[], bool] | None = None) -> bool:
    """Continue each (instruction, tokens) in the plain template with the target, sampled with
    its seed, decoded together; `finished(i, {"prompt", "text", "ids"})` as each one ends. The
    first request that fails raises its error. Where `stop()` ends it (returns False), every
    request still running is cancelled before another forward, and each that had written a token
    ends as a document of what it wrote (the work in flight is kept; one not yet begun is not);
    else returns True."""
    from ..api import RequestDone, make_request, stream_many

    texts = [PLAIN_TEMPLATE.format(prompt=prompt) for prompt, _ in prompts]
    requests = [make_request(target, text, "ar", max_new_tokens=tokens, temperature=temperature, top_k=0,
                             top_p=top_p, seed=seed) for text, (_, tokens), seed in zip(texts, prompts, seeds)]
    stream = stream_many(target, requests)
    events = iter(stream)
    stopped = False
    try:
        for event in events:
            if isinstance(event, RequestDone):
                if event.error is not None:
                    raise event.error
                if not stopped or event.result.token_ids:
                    finished(event.index, {"prompt": texts[event.index],
                                           "text": texts[event.index] + event.result.text,
                                           "ids": [*event.result.prompt_ids, *event.result.token_ids]})
            if not stopped and stop is not None and stop():
                stopped = True
                for index in range(len(requests)):
                    stream.cancel(index)
    finally:
        events.close()
    return not stopped
