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
from verispec.request.text import PLAIN_TEMPLATE

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


# -- multi-request sets ------------------------------------------------------------------------


def test_conversations_become_chained_turns(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [
        q(1, "math", ["Only one turn."]),
        q(81, "writing", ["Write a poem.", "Now shorten it.", "Now translate it."]),
        q("x", "coding", ["Write f.", "Add a test."]),
    ])
    turns = datasets.read_conversations(path)
    assert [t.question_id for t in turns] == ["81-1", "81-2", "81-3", "x-1", "x-2"]
    assert turns[0] == Question("81-1", "writing", "Write a poem.")
    assert turns[1] == Question("81-2", "writing", "Now shorten it.", ("Write a poem.",), "81-1")
    assert turns[2] == Question("81-3", "writing", "Now translate it.", ("Write a poem.", "Now shorten it."), "81-2")
    assert turns[4].follows == "x-1" and turns[4].earlier == ("Write f.",)
    # the single-turn reading is unchanged: one question per line, the first turn
    assert [x.key for x in read_questions(path)] == ["1", "81", "x"]


def test_conversation_errors(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", [q(1), q(2, "writing", ["Fine.", "  "])])
    with pytest.raises(DatasetError, match=r"line 2: turn 2 must be a non-empty string"):
        datasets.read_conversations(bad)
    single = write_lines(tmp_path / "single.jsonl", [q(1), q(2)])
    with pytest.raises(DatasetError, match="no question with two turns"):
        datasets.read_conversations(single)


def test_selection_keeps_conversations_whole_and_counts_them(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [
        q(1, "a", ["1", "1b"]), q(2, "b", ["2", "2b"]), q(3, "a", ["3", "3b"]),
    ])
    turns = datasets.read_conversations(path)
    assert [t.key for t in select(turns, None, 1)] == ["1-1", "1-2", "2-1", "2-2"]
    assert [t.key for t in select(turns, ["a"])] == ["1-1", "1-2", "3-1", "3-2"]
    assert [t.key for t in select(turns, ["b"], 5)] == ["2-1", "2-2"]


def test_multiturn_set_resolves_to_spec_bench_and_loads_conversations(tmp_path, monkeypatch):
    question_file = tmp_path / "shared" / "data" / "spec_bench" / "question.jsonl"
    question_file.parent.mkdir(parents=True)
    write_lines(question_file, [q(1, "qa"), q(81, "writing", ["A.", "B."]), q(91, "coding", ["C.", "D."])])
    monkeypatch.chdir(tmp_path)
    assert "spec-bench-multiturn" in datasets.DATASET_NAMES
    path, turns = datasets.load_dataset("spec-bench-multiturn", ["coding"], None)
    assert path == question_file.resolve()
    assert [t.key for t in turns] == ["91-1", "91-2"] and turns[1].earlier == ("C.",)
    _, single = datasets.load_dataset("spec-bench")
    assert [x.key for x in single] == ["1", "81", "91"]


def test_the_real_spec_bench_has_eighty_two_turn_conversations():
    found = datasets.find_spec_bench([REPO])
    if found is None:
        pytest.skip("Spec-Bench's question.jsonl is not next to this checkout")
    turns = datasets.read_conversations(found)
    assert len(turns) == 160 and sum(t.follows is not None for t in turns) == 80
    assert len({t.category for t in turns}) == 8


def test_code_edit_set_ships_and_repeats_its_functions():
    assert "code-edit" in datasets.DATASET_NAMES
    assert resolve_dataset("code-edit") == datasets.CODE_EDIT_PATH
    assert datasets.CODE_EDIT_PATH.parent == datasets.BUILTIN_PATH.parent  # packaged as bench/data/*.jsonl
    questions = read_questions(datasets.CODE_EDIT_PATH)
    assert 10 <= len(questions) <= 20 and {x.category for x in questions} == {"code-edit"}
    bodies = []
    for question in questions:
        assert question.prompt.startswith("Rewrite the following Python function")
        code = question.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
        compile(code, question.key, "exec")  # a real function
        bodies.append(code)
    # earlier requests help later ones: most functions appear again, verbatim, later on
    repeated = [i for i, body in enumerate(bodies) if body in bodies[:i]]
    assert len(repeated) >= len(bodies) // 2
    assert min(repeated) < len(bodies) // 2 + 1  # and early enough that a small --per-category sees it


def test_later_turns_re_send_the_conversation():
    turn = Question("81-3", "writing", "Third?", ("First?", "Second?"), "81-2")
    chat = _Tokenizer(chat_template="{{ messages }}")
    assert datasets.encode_turn(chat, turn, ["One.", "Two."]) == [1, 2, 3]
    assert chat.seen == [
        {"role": "user", "content": "First?"}, {"role": "assistant", "content": "One."},
        {"role": "user", "content": "Second?"}, {"role": "assistant", "content": "Two."},
        {"role": "user", "content": "Third?"},
    ]
    plain = _Tokenizer()
    datasets.encode_turn(plain, turn, ["One.", "Two."])
    assert plain.seen == "User: First?\n\nAssistant: One.\n\nUser: Second?\n\nAssistant: Two.\n\nUser: Third?\n\nAssistant:"
    with pytest.raises(ValueError, match="2 earlier turns, 1 answers"):
        datasets.encode_turn(chat, turn, ["One."])
    with pytest.raises(ValueError, match="later turn"):
        datasets.encode_question(chat, turn)


# -- multi-turn through the runner ---------------------------------------------------------------


def _settings(methods, repeats=1):
    from verispec.bench import runner

    return runner.BenchSettings(
        model=None, draft_model=None, dtype="float32", dataset="test", dataset_sha256="0", categories=(),
        per_category=None, methods=tuple(methods), peers=(), max_new_tokens=12, temperature=0.0, top_p=1.0,
        seed=None, repeats=repeats, draft_length=None, controller=None, early_exit_layer=None,
    )


def test_runner_asks_later_turns_with_the_methods_own_answers(tmp_path, text_target):
    from verispec.bench import runner

    path = write_lines(tmp_path / "q.jsonl", [q(7, "a", ["the cat sat", "then what"]), q(8, "b", ["abc abc", "more"])])
    turns = datasets.read_conversations(path)
    target = text_target  # the runner gives each method and repeat a memory of its own, then restores
    out = tmp_path / "run"
    out.mkdir()
    methods = ["ar", "anpd/constant:8"]
    records = runner.run_bench(target, _settings(methods, repeats=2), turns, out, progress=False)
    by = {(r["question_id"], r["method"], r["repeat"]): r for r in records}
    assert len(records) == 4 * 2 * 2
    for method in methods:
        for repeat in (0, 1):
            for qid in ("7", "8"):
                first, second = by[(f"{qid}-1", method, repeat)], by[(f"{qid}-2", method, repeat)]
                question = next(t for t in turns if t.key == f"{qid}-2")
                expected = datasets.encode_turn(target.tokenizer, question, [first["text"]])
                assert second["prompt_tokens"] == len(expected)
                assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["token_ids"]) - 2
    # every later turn ran after the turn it follows, for each method and repeat
    order = [(r["question_id"], r["method"], r["repeat"]) for r in records]
    assert all(order.index((f"{qid}-1", m, r)) < order.index((f"{qid}-2", m, r))
               for qid in ("7", "8") for m in methods for r in (0, 1))
    # resume: drop the last turn's records; they are rebuilt from the saved first-turn answers
    lines = (out / runner.RECORDS_FILE).read_text().splitlines()
    kept = [line for line in lines if not line.startswith('{"question_id": "8-2"')]
    assert len(kept) == len(lines) - 4
    (out / runner.RECORDS_FILE).write_text("\n".join(kept) + "\n")
    resumed = runner.run_bench(target, _settings(methods, repeats=2), turns, out, progress=False)
    again = {(r["question_id"], r["method"], r["repeat"]): r for r in resumed}
    for key, record in by.items():
        assert again[key]["token_ids"] == record["token_ids"] and again[key]["prompt_tokens"] == record["prompt_tokens"]


def test_earlier_answers_come_from_the_same_method_and_repeat():
    from verispec.bench import runner

    turns = [Question("1-1", "a", "x"), Question("1-2", "a", "y", ("x",), "1-1"),
             Question("1-3", "a", "z", ("x", "y"), "1-2")]
    by_key = {t.key: t for t in turns}
    answers = {("1-1", "m", 0): "A0", ("1-2", "m", 0): "B0", ("1-1", "m", 1): "A1", ("1-1", "n", 0): "N"}
    assert runner._earlier_answers(turns[2], by_key, answers, "m", 0) == ["A0", "B0"]
    assert runner._earlier_answers(turns[1], by_key, answers, "m", 1) == ["A1"]
    assert runner._earlier_answers(turns[1], by_key, answers, "n", 0) == ["N"]
    with pytest.raises(VerispecError, match="no answer to 1-2"):
        runner._earlier_answers(turns[2], by_key, answers, "m", 1)
