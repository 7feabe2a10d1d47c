"""Prompt sets for the benchmark: reading, resolving, selecting and formatting questions.

Owns the Spec-Bench JSONL format (one JSON object a line with `question_id`, `category` and
`turns`, a list of strings whose first item is the prompt), the prompt sets that ship in `data/`
(so the benchmark runs on a fresh install), the resolution of the names in DATASET_NAMES to a
question file on disk, category filters and per-category limits, and turning a question into
prompt ids (the tokenizer's chat template when it has one, otherwise the documented plain
template, via `verispec.request.text.encode_prompt(..., "chat")`). Does not own running anything.

The sets, by name:
- `builtin` (`data/builtin.jsonl`) and `spec-bench` (Spec-Bench's question.jsonl, found on
  disk) or a PATH: single-turn; only the first turn of each question is used.
- `spec-bench-multiturn`: the questions of Spec-Bench's file with two or more turns (its MT-Bench
  part: 80 questions, 10 in each of 8 categories), each asked as a conversation of requests:
  turn t is its own question (id `QID-t`) whose prompt re-sends the conversation so far, the
  earlier user turns each followed by the answer the SAME method (or peer) generated for them
  in the same repeat, as a chat client would (`Question.follows`, `encode_turn`; the runner fills
  in the answers). So a method's later turns depend on its own earlier outputs: under greedy
  decoding lossless methods give `ar`'s answers, and the prompts are identical across them.
- `code-edit` (`data/code_edit.jsonl`): 16 requests, each a Python function in the prompt with
  an instruction to rewrite it with a change. The functions recur across prompts (the same
  function under several edits, and near-copies of each other), so a drafter that remembers
  earlier requests (ANPD's memory across requests) can draft later answers from earlier ones.
Both multi-request sets measure memory across requests; the runner gives each method its own
memory, empty at the start of each pass over the prompt set (see `runner`).
- `code-tasks` (`data/code_tasks.jsonl`): 30 small Python function tasks (category `coding`), each
  an instruction for a chat model to write one function and answer with it in a ```python block.
  A line of this set also has `entry_point` (the function's name) and `tests` (Python asserts):
  the runner checks each answer against them (`code_eval`) and the reports give pass@1. Any
  question file may carry these two fields (both or neither); single-turn reading keeps them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import ConfigError
from ..request.text import encode_messages, encode_prompt

BUILTIN_PATH = Path(__file__).parent / "data" / "builtin.jsonl"
CODE_EDIT_PATH = Path(__file__).parent / "data" / "code_edit.jsonl"
CODE_TASKS_PATH = Path(__file__).parent / "data" / "code_tasks.jsonl"
SPEC_BENCH_RELATIVE = (
    Path("shared/data/spec_bench/question.jsonl"),
    Path("../shared/data/spec_bench/question.jsonl"),
)
DATASET_NAMES = ("builtin", "spec-bench", "spec-bench-multiturn", "code-edit", "code-tasks")
MULTITURN = "spec-bench-multiturn"


class DatasetError(ConfigError):
    """A question file is missing or malformed (the message names the file and line)."""


@dataclass(frozen=True)
class Question:
    """One request. A later turn of a conversation also carries the user turns before it
    (`earlier`, oldest first) and the key of the question it follows (the previous turn), whose
    generated answer, and its predecessors', go into its prompt (`encode_turn`). A code task also
    carries the name of the function asked for (`entry_point`) and the `tests` its answer must
    pass (Python statements, see `code_eval`); None for other questions."""

    question_id: int | str
    category: str
    prompt: str
    earlier: tuple[str, ...] = ()
    follows: str | None = None
    entry_point: str | None = None
    tests: str | None = None

    @property
    def key(self) -> str:
        """The id as a string: the identity used by records and resume."""
        return str(self.question_id)


def read_questions(path: str | Path) -> list[Question]:
    """Parse a Spec-Bench style JSONL file; blank lines are skipped.

    Raises DatasetError naming the file and 1-based line number for bad JSON, a missing or
    ill-typed field, empty turns, a repeated question_id, or only one of `entry_point` and `tests`.
    """
    return [question for question, _, _ in _read(path)]


def read_conversations(path: str | Path) -> list[Question]:
    """The questions of a Spec-Bench style file that have two turns or more, each turn t as a
    question `QID-t` following turn t - 1 (see the module docstring); single-turn ones are
    skipped. Raises DatasetError as `read_questions` does, and for a later turn that is not a
    non-empty string, or a file without any multi-turn question."""
    path = Path(path)
    chosen: list[Question] = []
    for first, turns, where in _read(path):
        if len(turns) < 2:
            continue
        qid = first.question_id
        chosen.append(Question(f"{qid}-1", first.category, first.prompt))
        for number, turn in enumerate(turns[1:], 2):
            if not isinstance(turn, str) or not turn.strip():
                raise DatasetError(f"{where}: turn {number} must be a non-empty string")
            chosen.append(Question(f"{qid}-{number}", first.category, turn,
                                   tuple(turns[: number - 1]), f"{qid}-{number - 1}"))
    if not chosen:
        raise DatasetError(f"{path}: no question with two turns or more")
    return chosen


def _read(path: str | Path) -> list[tuple[Question, list, str]]:
    """(question from the first turn, all turns, where) for each line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"question file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"cannot read question file {path}: {error}") from None
    questions: list[tuple[Question, list, str]] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{where}: not valid JSON ({error.msg})") from None
        question = _question_from(item, where)
        if question.key in seen:
            raise DatasetError(f"{where}: question_id {question.question_id!r} repeats line {seen[question.key]}")
        seen[question.key] = number
        questions.append((question, item["turns"], where))
    if not questions:
        raise DatasetError(f"{path}: no questions in the file")
    return questions


def _question_from(item: object, where: str) -> Question:
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(item).__name__}")
    for name in ("question_id", "category", "turns"):
        if name not in item:
            raise DatasetError(f"{where}: missing field {name!r}")
    qid, category, turns = item["question_id"], item["category"], item["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or (isinstance(qid, str) and not qid.strip()):
        raise DatasetError(f"{where}: question_id must be an integer or a non-empty string, got {qid!r}")
    if not isinstance(category, str) or not category.strip():
        raise DatasetError(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns:
        raise DatasetError(f"{where}: turns must be a non-empty list of strings")
    if not isinstance(turns[0], str) or not turns[0].strip():
        raise DatasetError(f"{where}: the first turn (the prompt) must be a non-empty string")
    entry_point, tests = _code_task_fields(item, where)
    return Question(qid, category.strip(), turns[0], entry_point=entry_point, tests=tests)


def _code_task_fields(item: dict, where: str) -> tuple[str | None, str | None]:
    """(entry_point, tests) of a code task, (None, None) for a line that has neither."""
    if "entry_point" not in item and "tests" not in item:
        return None, None
    entry_point, tests = item.get("entry_point"), item.get("tests")
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise DatasetError(f"{where}: entry_point must be a Python function name (with tests), got {entry_point!r}")
    if not isinstance(tests, str) or not tests.strip():
        raise DatasetError(f"{where}: tests must be a non-empty string of Python statements (with entry_point)")
    return entry_point, tests


def find_spec_bench(starts: Iterable[Path]) -> Path | None:
    """The first `shared/data/spec_bench/question.jsonl` (or `../shared/...`) found walking up
    from each start directory in turn; None if there is none."""
    for start in starts:
        start = Path(start).resolve()
        for directory in (start, *start.parents):
            for relative in SPEC_BENCH_RELATIVE:
                candidate = directory / relative
                if candidate.is_file():
                    return candidate.resolve()
    return None


def resolve_dataset(name: str, cwd: Path | None = None, package_dir: Path | None = None) -> Path:
    """A name in DATASET_NAMES or a path to a JSONL file -> the file to read."""
    if name == "builtin":
        return BUILTIN_PATH
    if name == "code-edit":
        return CODE_EDIT_PATH
    if name == "code-tasks":
        return CODE_TASKS_PATH
    if name in ("spec-bench", MULTITURN):
        starts = [cwd or Path.cwd(), package_dir or Path(__file__).parent]
        found = find_spec_bench(starts)
        if found is None:
            raise DatasetError(
                "the Spec-Bench question set was not found: looked for "
                f"{SPEC_BENCH_RELATIVE[0]} and {SPEC_BENCH_RELATIVE[1]} in "
                f"{', '.join(str(Path(s).resolve()) for s in starts)} and every directory above them; "
                "download data/spec_bench/question.jsonl from Spec-Bench's repository "
                "(https://github.com/hemingkx/Spec-Bench) and pass its path: --dataset PATH/question.jsonl"
            )
        return found
    path = Path(name).expanduser()
    if not path.is_file():
        raise DatasetError(
            f"dataset {name!r} is neither {' nor '.join(DATASET_NAMES)} nor an existing JSONL file"
        )
    return path


def select(
    questions: Sequence[Question], categories: Sequence[str] | None = None, per_category: int | None = None
) -> list[Question]:
    """Keep the questions of `categories` (all if None/empty), the first `per_category` of each,
    in file order. A later turn of a conversation is kept with the turn it follows and does not
    count: `per_category` counts conversations."""
    if per_category is not None and (isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1):
        raise DatasetError(f"--per-category must be an integer >= 1, got {per_category!r}")
    available = list(dict.fromkeys(q.category for q in questions))
    wanted = [c.strip() for c in categories or () if c.strip()]
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise DatasetError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                           f"the dataset has: {', '.join(available)}")
    taken: dict[str, int] = {}
    chosen, kept = [], set()
    for question in questions:
        if question.follows is not None:
            if question.follows in kept:
                kept.add(question.key)
                chosen.append(question)
            continue
        if wanted and question.category not in wanted:
            continue
        if per_category is not None and taken.get(question.category, 0) >= per_category:
            continue
        taken[question.category] = taken.get(question.category, 0) + 1
        kept.add(question.key)
        chosen.append(question)
    return chosen


def load_dataset(
    name: str, categories: Sequence[str] | None = None, per_category: int | None = None
) -> tuple[Path, list[Question]]:
    """Resolve, read and select: -> (the file read, the chosen questions)."""
    path = resolve_dataset(name)
    read = read_conversations if name == MULTITURN else read_questions
    return path, select(read(path), categories, per_category)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes: identifies the exact question set a run used."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def encode_question(tokenizer, question: Question) -> list[int]:
    """Prompt ids: the chat template if the tokenizer has one, else `PLAIN_TEMPLATE`. For a
    later turn of a conversation, use `encode_turn` (it needs the earlier answers)."""
    if question.follows is not None:
        raise ValueError(f"question {question.key} is a later turn: its prompt needs the earlier answers (encode_turn)")
    return encode_prompt(tokenizer, question.prompt, "chat")


def encode_turn(tokenizer, question: Question, answers: Sequence[str]) -> list[int]:
    """Prompt ids of a later turn: the conversation re-sent, each earlier user turn followed by
    its answer (`answers`, oldest first, one per turn in `question.earlier`), then this turn, in
    the chat template (or the plain "Role: content" fallback, `encode_messages`)."""
    if len(answers) != len(question.earlier):
        raise ValueError(f"question {question.key}: {len(question.earlier)} earlier turns, {len(answers)} answers")
    messages = []
    for user, answer in zip(question.earlier, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question.prompt})
    return encode_messages(tokenizer, messages)
