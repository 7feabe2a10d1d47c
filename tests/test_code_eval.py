"""Code answers checked against tests (`bench.code_eval`): extracting the code from a completion,
running it with the tests in a sandboxed subprocess (pass, failed assert, syntax error, timeout,
missing function, crash, limits, isolation), the shipped `code-tasks` set, and the wiring into
the benchmark: records carry `passed`, summaries and reports give pass@1 per method."""

from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import pytest

from verispec.bench import aggregate, code_eval, datasets, report, runner
from verispec.bench.code_eval import CheckResult, check_completion, extract_code, run_tests
from verispec.bench.datasets import DatasetError, read_questions

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
FAST = 1.0  # seconds: the timeout of the checks expected to time out


# -- extraction ---------------------------------------------------------------------------------


def test_the_first_python_block_is_the_code():
    completion = f"Here it is:\n\n```python\n{ADD}```\n\nIt adds two numbers."
    assert extract_code(completion) == ADD


def test_without_a_fence_the_whole_text_is_the_code():
    assert extract_code(ADD) == ADD
    assert extract_code("") == ""


def test_of_several_blocks_the_first_python_one_wins():
    completion = ("Install nothing:\n```bash\npip list\n```\nThen:\n```py\ndef first():\n    return 1\n```\n"
                  "and a test:\n```python\nassert first() == 1\n```\n")
    assert extract_code(completion) == "def first():\n    return 1\n"
    assert [language for language, _ in code_eval.fenced_blocks(completion)] == ["bash", "py", "python"]


def test_an_unlabelled_block_is_used_when_no_block_says_python():
    completion = "```text\nnot code\n```\n```\nx = 1\n```\n"
    assert extract_code(completion) == "x = 1\n"


def test_a_block_cut_off_by_the_token_limit_runs_to_the_end():
    assert extract_code("Sure:\n```python\ndef f():\n    return") == "def f():\n    return\n"


def test_an_indented_block_is_dedented():
    completion = "1. The function:\n   ```python\n   def f():\n       return 2\n   ```\n"
    assert extract_code(completion) == "def f():\n    return 2\n"


# -- running the tests ----------------------------------------------------------------------------


def test_a_correct_solution_passes():
    result = check_completion(f"```python\n{ADD}```", ADD_TESTS, "add")
    assert result == CheckResult(True, "passed") and result.reason == "passed"


def test_a_wrong_solution_fails_and_names_the_assert():
    result = run_tests("def add(a, b):\n    return a - b\n", ADD_TESTS, "add")
    assert not result.passed and result.status == "assertion failed"
    assert result.reason == "assertion failed: assert add(2, 3) == 5"


def test_a_syntax_error_is_reported_with_its_line():
    result = run_tests("def add(a, b)\n    return a + b\n", ADD_TESTS, "add")
    assert not result.passed and result.status == "syntax error" and "line 1" in result.detail


def test_a_missing_entry_point_is_reported():
    result = run_tests("def plus(a, b):\n    return a + b\n", ADD_TESTS, "add")
    assert (result.passed, result.status) == (False, "missing function") and "add" in result.detail
    assert run_tests("add = 3\n", ADD_TESTS, "add").status == "missing function"  # not callable


def test_an_exception_is_an_error_not_an_assertion():
    result = run_tests("def add(a, b):\n    return a + undefined\n", ADD_TESTS, "add")
    assert result.status == "error" and "NameError" in result.detail and "add(2, 3)" in result.detail
    result = run_tests("raise RuntimeError('boom')\n", ADD_TESTS, "add")
    assert result.status == "error" and "while defining the code: RuntimeError: boom" in result.detail


def test_an_infinite_loop_times_out_quickly():
    started = time.perf_counter()
    result = run_tests("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS, "add", timeout_s=FAST)
    assert (result.passed, result.status) == (False, "timeout")
    assert time.perf_counter() - started < FAST + 5  # the process was killed, not waited for


def test_the_main_block_does_not_run_and_exits_do_not_fake_a_result():
    main_block = ADD + "if __name__ == '__main__':\n    raise SystemExit('ran main')\n"
    assert run_tests(main_block, ADD_TESTS, "add").passed
    exit_early = ADD + "import os\nos._exit(0)\n"
    expected = CheckResult(False, "crashed", "exit status 0 before the tests finished")
    assert run_tests(exit_early, ADD_TESTS, "add") == expected
    assert run_tests(ADD + "raise SystemExit(0)\n", ADD_TESTS, "add").status == "error"


def test_the_code_runs_in_a_fresh_directory_without_our_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VERISPEC_TEST_SECRET", "hidden")
    code = ADD + "open('left_behind.txt', 'w').write('x')\n"
    tests = ("import os, sys\nassert 'VERISPEC_TEST_SECRET' not in os.environ\n"
             "assert sys.flags.isolated == 1\nassert os.listdir('.').count('left_behind.txt') == 1\n")
    assert run_tests(code, ADD_TESTS + tests, "add").passed
    assert not (tmp_path / "left_behind.txt").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="resource limits are POSIX only")
def test_memory_is_limited():
    code = ADD + "block = bytearray(4 * 2**30)\n"  # 4 GiB against a 256 MiB limit
    result = run_tests(code, ADD_TESTS, "add", memory_mb=256)
    assert result.status == "error" and "MemoryError" in result.detail


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="identifier"):
        run_tests(ADD, ADD_TESTS, "add; import os")
    with pytest.raises(ValueError):
        run_tests(ADD, ADD_TESTS, "add", timeout_s=0)


def test_interpret_covers_every_ending():
    interpret = code_eval.interpret
    assert interpret(None, None, True, 2.0) == CheckResult(False, "timeout", "no result within 2 s")
    assert interpret('{"status": "passed", "detail": ""}', 0, False, 2.0) == CheckResult(True, "passed")
    assert interpret(None, -9, False, 2.0) == CheckResult(False, "crashed", "killed by SIGKILL")
    assert interpret(None, 1, False, 2.0).status == "crashed"
    assert interpret("{torn", 0, False, 2.0) == CheckResult(False, "crashed", "unreadable result")
    assert interpret('{"status": "great"}', 0, False, 2.0).status == "crashed"
    long = interpret(json.dumps({"status": "error", "detail": "x" * 1000}), 0, False, 2.0)
    assert len(long.detail) == code_eval.DETAIL_CHARS and long.reason.startswith("error: xxx")


# -- the code-tasks set -------------------------------------------------------------------------


def test_the_code_tasks_set_ships_thirty_valid_tasks():
    assert "code-tasks" in datasets.DATASET_NAMES
    path, questions = datasets.load_dataset("code-tasks")
    assert path == datasets.CODE_TASKS_PATH and path.parent == datasets.BUILTIN_PATH.parent  # package data
    assert len(questions) == 30 and {q.category for q in questions} == {"coding"}
    assert len({q.entry_point for q in questions}) == 30
    for question in questions:
        assert f"`{question.entry_point}(" in question.prompt and "```python" in question.prompt, question.key
        tree = ast.parse(question.tests)  # valid Python
        called = {node.func.id for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert question.entry_point in called, question.key
        assert sum(isinstance(node, ast.Assert) for node in ast.walk(tree)) >= 3, question.key


def test_no_task_passes_with_a_function_that_does_nothing():
    """The tests test something: a stub returning None fails every task (one subprocess each)."""
    _, questions = datasets.load_dataset("code-tasks")
    for question in questions:
        stub = f"def {question.entry_point}(*args, **kwargs):\n    return None\n"
        result = run_tests(stub, question.tests, question.entry_point)
        assert result.status in ("assertion failed", "error"), (question.key, result)


def test_entry_point_and_tests_come_together(tmp_path):
    def line(**extra):
        return json.dumps({"question_id": 1, "category": "c", "turns": ["Write f."], **extra})

    path = tmp_path / "tasks.jsonl"
    path.write_text(line(entry_point="f", tests="assert f() == 1") + "\n")
    assert read_questions(path)[0].tests == "assert f() == 1" and read_questions(path)[0].entry_point == "f"
    for extra, fragment in [({"entry_point": "f"}, "tests must be"), ({"tests": "assert f()"}, "entry_point must be"),
                            ({"entry_point": "not a name", "tests": "assert 1"}, "entry_point must be"),
                            ({"entry_point": "f", "tests": " "}, "tests must be")]:
        path.write_text(line(**extra) + "\n")
        with pytest.raises(DatasetError, match=fragment):
            read_questions(path)
    path.write_text(line() + "\n")
    assert read_questions(path)[0].tests is None  # an ordinary question


# -- metrics and reports --------------------------------------------------------------------------


def record(qid, method, passed, *, repeat=0, category="coding") -> dict:
    fields = {"question_id": qid, "category": category, "method": method, "repeat": repeat, "prompt_tokens": 5,
              "new_tokens": 4, "target_forwards": 4, "drafted": None, "accepted": None,
              "accepted_histogram": None, "prefill_s": None, "decode_s": None, "total_s": 1.0, "cpu_s": 1.0,
              "energy_j": None, "perplexity": 2.0, "token_ids": [1, 2, 3, 4], "text": ""}
    if passed is not None:
        fields.update(passed=passed, check="passed" if passed else "assertion failed: assert f() == 1")
    assert tuple(fields)[: len(runner.RECORD_FIELDS)] == runner.RECORD_FIELDS
    return fields


def test_pass_at_1_is_passed_over_prompts_per_method_and_category():
    records = [record(1, "ar", True), record(2, "ar", False), record(3, "ar", True, category="other"),
               record(1, "pld", True), record(2, "pld", True), record(3, "pld", False, category="other")]
    summary = aggregate.summarize(records, ["ar", "pld"])
    assert summary["overall"]["ar"]["pass_at_1"] == pytest.approx(2 / 3)
    assert summary["overall"]["pld"]["pass_at_1"] == pytest.approx(2 / 3)
    assert summary["categories"]["coding"]["ar"]["pass_at_1"] == 0.5
    assert summary["categories"]["coding"]["pld"]["pass_at_1"] == 1.0
    assert {(p["question_id"], p["method"]): p["passed"] for p in summary["prompts"]}[(2, "ar")] == 0.0
    assert aggregate.compact(summary)["methods"]["ar"]["pass_at_1"] == 0.6667


def test_with_repeats_a_prompt_counts_the_share_of_repeats_that_passed():
    records = [record(1, "ar", True, repeat=0), record(1, "ar", False, repeat=1),
               record(2, "ar", True, repeat=0), record(2, "ar", True, repeat=1)]
    assert aggregate.summarize(records, ["ar"])["overall"]["ar"]["pass_at_1"] == pytest.approx(0.75)


def test_without_tests_there_is_no_pass_at_1_anywhere():
    summary = aggregate.summarize([record(1, "ar", None), record(1, "pld", None)], ["ar", "pld"])
    assert summary["overall"]["ar"]["pass_at_1"] is None
    assert "pass_at_1" not in aggregate.compact(summary)["methods"]["ar"]
    assert "pass@1" not in report.markdown_table(summary["overall"])
    assert "pass@1" not in [column.header for column in report.terminal_table(summary).columns]


def test_reports_show_pass_at_1_beside_the_other_columns():
    summary = aggregate.summarize([record(1, "ar", True), record(1, "pld", False)], ["ar", "pld"])
    table = report.markdown_table(summary["overall"]).splitlines()
    headers = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert headers.index("pass@1") == headers.index("exact match") + 1
    assert "| 100.0% |" in table[2] and table[2].startswith("| ar |")
    assert "| 0.0% |" in table[3] and table[3].startswith("| pld |")
    assert "pass@1" in [column.header for column in report.terminal_table(summary).columns]


# -- through the runner ---------------------------------------------------------------------------


def _settings(methods, **changes):
    values = dict(model=None, draft_model=None, dtype="float32", dataset="code-tasks", dataset_sha256="0",
                  categories=(), per_category=None, methods=tuple(methods), peers=(), max_new_tokens=8,
                  temperature=0.0, top_p=1.0, seed=None, repeats=1, draft_length=None, controller=None,
                  early_exit_layer=None)
    values.update(changes)
    return runner.BenchSettings(**values)


def test_the_runner_checks_each_answer_of_the_shipped_set(tmp_path, text_target):
    _, questions = datasets.load_dataset("code-tasks", None, 2)
    out = tmp_path / "run"
    out.mkdir()
    records = runner.run_bench(text_target, _settings(["ar", "pld"]), questions, out, progress=False)
    assert len(records) == 4
    for item in records:  # a tiny random model writes no working function
        assert tuple(item) == runner.RECORD_FIELDS + runner.CODE_CHECK_FIELDS
        assert item["passed"] is False and item["check"].split(":")[0] in code_eval.STATUSES
    summary = aggregate.summarize(records, ["ar", "pld"])
    assert {name: s["pass_at_1"] for name, s in summary["overall"].items()} == {"ar": 0.0, "pld": 0.0}


def test_end_to_end_pass_at_1_per_method(tmp_path, text_target, monkeypatch):
    """Fake methods answer (ar right, pld wrong) through the real loop, records, summary and report."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in [
        {"question_id": "t-1", "category": "coding", "turns": ["write add."], "entry_point": "add",
         "tests": "assert add(2, 3) == 5"},
        {"question_id": "t-2", "category": "coding", "turns": ["write mul."], "entry_point": "mul",
         "tests": "assert mul(2, 3) == 6"},
    ]))
    answers = {
        "ar": "sure.\n```python\ndef add(a, b):\n    return a + b\ndef mul(a, b):\n    return a * b\n```\n",
        "pld": "```python\ndef add(a, b):\n    return a + b\ndef mul(a, b):\n    return a + b\n```\n",
    }

    def fake_runner(target, name, settings):
        def run(prompt_ids, max_new_tokens):
            text = answers[name]
            ids = target.tokenizer(text)["input_ids"]
            return runner.Outcome(ids, len(ids), text=text)
        return run

    monkeypatch.setattr(runner, "method_runner", fake_runner)
    _, questions = datasets.load_dataset(str(tasks))
    settings = _settings(["ar", "pld"], dataset=str(tasks))
    out = tmp_path / "run"
    out.mkdir()
    records = runner.run_bench(text_target, settings, questions, out, progress=False)
    saved = runner.read_records(out / runner.RECORDS_FILE)
    assert saved == records
    by = {(r["question_id"], r["method"]): r for r in saved}
    assert by[("t-1", "pld")]["passed"] is True
    assert by[("t-1", "ar")]["passed"] is True and by[("t-2", "pld")]["passed"] is False
    assert by[("t-2", "pld")]["check"] == "assertion failed: assert mul(2, 3) == 6"
    summary = aggregate.summarize(saved, settings.names, settings.greedy)
    assert summary["overall"]["ar"]["pass_at_1"] == 1.0 and summary["overall"]["pld"]["pass_at_1"] == 0.5
    report.write_summary(out, summary)
    written = json.loads((out / report.SUMMARY_FILE).read_text())
    assert {name: s["pass_at_1"] for name, s in written["overall"].items()} == {"ar": 1.0, "pld": 0.5}
    markdown = report.render_markdown(summary, {"settings": settings.to_json(), "info": {}}, report.NOT_MEASURED)
    assert "| pass@1 |" in markdown and "- pass@1: the share of prompts" in markdown
    assert any(line.startswith("| pld |") and "| 50.0% |" in line for line in markdown.splitlines())


@pytest.mark.long
def test_verispec_bench_runs_the_code_tasks_set(tmp_path):
    """`verispec bench --dataset code-tasks` through the CLI on a tiny random Llama."""
    from typer.testing import CliRunner

    from test_bench_e2e import build_tiny_llama
    from verispec.cli import app

    model = build_tiny_llama(tmp_path / "tiny")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "bench", "--model", str(model), "--dtype", "float32", "--dataset", "code-tasks", "--per-category", "2",
        "--methods", "ar,pld", "--max-new-tokens", "8", "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / report.SUMMARY_FILE).read_text())
    assert summary["overall"]["ar"]["prompts"] == 2
    assert all(s["pass_at_1"] == 0.0 for s in summary["overall"].values())
    assert json.loads(result.stdout.strip().splitlines()[-1])["methods"]["pld"]["pass_at_1"] == 0.0
    assert "| pass@1 |" in Path(out / report.REPORT_FILE).read_text()
