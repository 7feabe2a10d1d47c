"""Benchmark datasets: Spec-Bench JSONL parsing, malformed lines, selection, the built-in set,
resolution of `spec-bench`, and prompt formatting."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from verispec.bench import datasets
from verispec.bench.datasets import DatasetError, Question, read_questions, resolve_dataset, select
from verispec.errors import VerispecError
from verispec.text import PLAIN_TEMPLATE

REQUIRED_BUILTIN = ("summarization", "rag", "code", "translation", "math", "chat")
REPO = Path(__file__).resolve().parents[1]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def q(qid, category="writing", turns=("Say hello.",)) -> str:
    return json.dumps({"question_id": qid, "category": category, "turns": list(turns)})


# -- parsing ----------------------------------------------------------------------------------


def test_reads_questions_with_the_first_turn_as_prompt(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [q(81, "writing", ["First turn.", "Second turn."]), "", q("x-2", "math")])
    questions = read_questions(path)
    assert questions == [Question(81, "writing", "First turn."), Question("x-2", "math", "Say hello.")]
    assert [question.key for question in questions] == ["81", "x-2"]


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ('{"question_id": 2, "category": "a", "turns": ["x"]', "not valid JSON"),
        ('{"category": "a", "turns": ["x"]}', "missing field 'question_id'"),
        ('{"question_id": 2, "turns": ["x"]}', "missing field 'category'"),
        ('{"question_id": 2, "category": "a"}', "missing field 'turns'"),
        ('{"question_id": 2, "category": "a", "turns": []}', "turns must be a non-empty list"),
        ('{"question_id": 2, "category": "a", "turns": "x"}', "turns must be a non-empty list"),
        ('{"question_id": 2, "category": "a", "turns": ["  "]}', "first turn"),
        ('{"question_id": 2, "category": "", "turns": ["x"]}', "category"),
        ('{"question_id": null, "category": "a", "turns": ["x"]}', "question_id"),
        ('[1, 2]', "expected a JSON object"),
        (q(1), "repeats line 1"),
    ],
)
def test_a_malformed_line_names_the_file_and_line(tmp_path, bad, fragment):
    # Line 2 is blank (skipped), so the bad line is line 3: numbering counts every line.
    path = write_lines(tmp_path / "broken.jsonl", [q(1), "", bad, q(3)])
    with pytest.raises(DatasetError) as caught:
        read_questions(path)
    message = str(caught.value)
    assert str(path) in message and "line 3" in message and fragment in message
    assert isinstance(caught.value, VerispecError)


def test_missing_and_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        read_questions(tmp_path / "nope.jsonl")
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(DatasetError, match="no questions"):
        read_questions(empty)


# -- selection --------------------------------------------------------------------------------


@pytest.fixture
def mixed() -> list[Question]:
    cats = ["a", "b", "a", "c", "a", "b"]
    return [Question(i, c, f"prompt {i}") for i, c in enumerate(cats)]


def test_category_filter_keeps_file_order(mixed):
    assert [x.question_id for x in select(mixed, ["b", "c"])] == [1, 3, 5]
    assert select(mixed, None) == mixed
    assert select(mixed, []) == mixed


def test_per_category_limit_takes_the_first_n_of_each(mixed):
    assert [x.question_id for x in select(mixed, None, 1)] == [0, 1, 3]
    assert [x.question_id for x in select(mixed, ["a"], 2)] == [0, 2]
    assert [x.question_id for x in select(mixed, None, 10)] == [0, 1, 2, 3, 4, 5]


def test_selection_errors(mixed):
    with pytest.raises(DatasetError, match="unknown category z.*has: a, b, c"):
        select(mixed, ["a", "z"])
    for bad in (0, -1, True):
        with pytest.raises(DatasetError, match="per-category"):
            select(mixed, None, bad)


# -- the built-in set -------------------------------------------------------------------------


def test_builtin_set_has_at_least_four_prompts_per_required_category():
    questions = read_questions(datasets.BUILTIN_PATH)
    counts = {c: sum(x.category == c for x in questions) for c in REQUIRED_BUILTIN}
    assert all(n >= 4 for n in counts.values()), counts
    assert len({x.key for x in questions}) == len(questions)


def test_builtin_prompts_carry_their_material():
    questions = read_questions(datasets.BUILTIN_PATH)
    by = lambda c: [x.prompt for x in questions if x.category == c]  # noqa: E731
    for prompt in by("summarization"):  # the article is in the prompt, ~150-300 words of it
        assert 150 <= len(prompt.split()) <= 360
    for prompt in by("rag"):  # passages in the prompt, then the question
        assert "Question:" in prompt and len(prompt.split()) > 100
    for prompt in by("code"):
        assert "def " in prompt and '"""' in prompt
    for prompt in by("translation"):
        assert prompt.lower().startswith("translate")


def test_builtin_data_is_package_data():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["verispec"]
    assert "bench/data/*.jsonl" in patterns
    assert datasets.BUILTIN_PATH.is_file()
    assert resolve_dataset("builtin") == datasets.BUILTIN_PATH


# -- resolution -------------------------------------------------------------------------------


def test_spec_bench_is_found_walking_up(tmp_path):
    question_file = tmp_path / "work" / "shared" / "data" / "spec_bench" / "question.jsonl"
    question_file.parent.mkdir(parents=True)
    write_lines(question_file, [q(1)])
    deep = tmp_path / "work" / "main" / "src" / "pkg"
    deep.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert datasets.find_spec_bench([deep]) == question_file.resolve()
    # from the current directory or, failing that, from the package location
    assert resolve_dataset("spec-bench", cwd=elsewhere, package_dir=deep) == question_file.resolve()
    assert resolve_dataset("spec-bench", cwd=deep, package_dir=elsewhere) == question_file.resolve()


def test_spec_bench_is_found_in_a_sibling_shared_dir(tmp_path):
    # .../repo is the start; .../shared is its sibling (the `../shared/...` form)
    question_file = tmp_path / "shared" / "data" / "spec_bench" / "question.jsonl"
    question_file.parent.mkdir(parents=True)
    write_lines(question_file, [q(1)])
    repo = tmp_path / "repo"
    repo.mkdir()
    assert datasets.find_spec_bench([repo]) == question_file.resolve()


def test_spec_bench_missing_is_a_clear_error(tmp_path):
    if datasets.find_spec_bench([tmp_path]) is not None:
        pytest.skip("a shared/data/spec_bench above the temporary directory")
    with pytest.raises(DatasetError, match="Spec-Bench question set was not found.*--dataset"):
        resolve_dataset("spec-bench", cwd=tmp_path, package_dir=tmp_path)


def test_paths_and_unknown_names(tmp_path):
    path = write_lines(tmp_path / "mine.jsonl", [q(1)])
    assert resolve_dataset(str(path)) == path
    with pytest.raises(DatasetError, match="neither builtin nor spec-bench"):
        resolve_dataset(str(tmp_path / "missing.jsonl"))
    chosen_path, questions = datasets.load_dataset(str(path), ["writing"], 1)
    assert chosen_path == path and len(questions) == 1


# -- formatting -------------------------------------------------------------------------------


class _Tokenizer:
    """Records what it was asked to encode."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template
        self.seen = None

    def __call__(self, text):
        self.seen = text
        return {"input_ids": [ord(c) % 50 for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.seen = messages
        return [1, 2, 3]


def test_prompts_use_the_chat_template_or_the_plain_template():
    question = Question(1, "chat", "How are you?")
    plain = _Tokenizer()
    ids = datasets.encode_question(plain, question)
    assert plain.seen == PLAIN_TEMPLATE.format(prompt="How are you?") and len(ids) == len(plain.seen)
    chat = _Tokenizer(chat_template="{{ messages }}")
    assert datasets.encode_question(chat, question) == [1, 2, 3]
    assert chat.seen == [{"role": "user", "content": "How are you?"}]
