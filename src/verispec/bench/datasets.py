"""Prompt sets for the benchmark: reading, resolving, selecting and formatting questions.

Owns the Spec-Bench JSONL format (one JSON object a line with `question_id`, `category` and
`turns`, a list of strings whose first item is the prompt), the built-in prompt set that ships in
`data/builtin.jsonl` (so the benchmark runs on a fresh install), the resolution of the name
`spec-bench` to a question file on disk, category filters and per-category limits, and turning a
question into prompt ids (the tokenizer's chat template when it has one, otherwise the documented
plain template, via `verispec.text.encode_prompt(..., "chat")`). Does not own running anything.

Only the first turn of a question is used: the benchmark measures single-turn generation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import ConfigError
from ..text import encode_prompt

BUILTIN_PATH = Path(__file__).parent / "data" / "builtin.jsonl"
SPEC_BENCH_RELATIVE = (
    Path("shared/data/spec_bench/question.jsonl"),
    Path("../shared/data/spec_bench/question.jsonl"),
)
DATASET_NAMES = ("builtin", "spec-bench")


class DatasetError(ConfigError):
    """A question file is missing or malformed (the message names the file and line)."""


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    prompt: str

    @property
    def key(self) -> str:
        """The id as a string: the identity used by records and resume."""
        return str(self.question_id)


def read_questions(path: str | Path) -> list[Question]:
    """Parse a Spec-Bench style JSONL file; blank lines are skipped.

    Raises DatasetError naming the file and 1-based line number for bad JSON, a missing or
    ill-typed field, empty turns, or a repeated question_id.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"question file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"cannot read question file {path}: {error}") from None
    questions: list[Question] = []
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
        questions.append(question)
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
    return Question(qid, category.strip(), turns[0])


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
    """'builtin' | 'spec-bench' | a path to a JSONL file -> the file to read."""
    if name == "builtin":
        return BUILTIN_PATH
    if name == "spec-bench":
        starts = [cwd or Path.cwd(), package_dir or Path(__file__).parent]
        found = find_spec_bench(starts)
        if found is None:
            raise DatasetError(
                "the Spec-Bench question set was not found: looked for "
                f"{SPEC_BENCH_RELATIVE[0]} and {SPEC_BENCH_RELATIVE[1]} in "
                f"{', '.join(str(Path(s).resolve()) for s in starts)} and every directory above them; "
                "pass its path instead: --dataset PATH/question.jsonl"
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
    in file order."""
    if per_category is not None and (isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1):
        raise DatasetError(f"--per-category must be an integer >= 1, got {per_category!r}")
    available = list(dict.fromkeys(q.category for q in questions))
    wanted = [c.strip() for c in categories or () if c.strip()]
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise DatasetError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                           f"the dataset has: {', '.join(available)}")
    taken: dict[str, int] = {}
    chosen = []
    for question in questions:
        if wanted and question.category not in wanted:
            continue
        if per_category is not None and taken.get(question.category, 0) >= per_category:
            continue
        taken[question.category] = taken.get(question.category, 0) + 1
        chosen.append(question)
    return chosen


def load_dataset(
    name: str, categories: Sequence[str] | None = None, per_category: int | None = None
) -> tuple[Path, list[Question]]:
    """Resolve, read and select: -> (the file read, the chosen questions)."""
    path = resolve_dataset(name)
    return path, select(read_questions(path), categories, per_category)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes: identifies the exact question set a run used."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def encode_question(tokenizer, question: Question) -> list[int]:
    """Prompt ids: the chat template if the tokenizer has one, else `PLAIN_TEMPLATE`."""
    return encode_prompt(tokenizer, question.prompt, "chat")
