"""Checking code answers: does a completion's Python code pass a task's tests?

Owns getting the code out of a completion (`extract_code`: the first ```python block, else the
first fenced block without a language, else the whole text) and running it with the task's tests
(`run_tests`, `check_completion`), giving pass or fail with a short reason (`CheckResult`). The
benchmark records this per answer of the `code-tasks` set (see `runner`); `metrics` turns it into
pass@1. Does not own the tasks (`datasets`) or any model.

This module EXECUTES MODEL OUTPUT, and only ever in a separate, sandboxed subprocess, never in the
calling process: `sys.executable -I` (isolated mode: no PYTHON* variables, no user site, no script
directory on sys.path), a fresh temporary directory as its working directory (removed afterwards),
a minimal environment, no stdin, stdout and stderr discarded, its own process group (killed whole
on timeout), a wall-clock timeout, and, where the `resource` module exists (POSIX), limits on
address space, CPU seconds, file size and core dumps set before the code runs. The code runs with
`__name__ == "solution"` (its `if __name__ == "__main__":` part does not run), then the tests run
statement by statement in the same namespace, so a failing assert is named in the reason. This
keeps a wrong, looping or crashing answer from harming the benchmark; it is not a security
boundary against deliberately hostile code (the file system and network stay reachable).

Statuses (`STATUSES`): passed; syntax error; missing function (the entry point is not defined or
not callable); assertion failed; error (an exception while defining the code or running a test);
timeout; crashed (the process ended without a result: a signal such as a resource limit, or an
exit before the tests finished).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024
FILE_SIZE_LIMIT_BYTES = 16 * 2**20
DETAIL_CHARS = 160
PYTHON_LANGUAGES = ("python", "py", "python3")
STATUSES = ("passed", "syntax error", "missing function", "assertion failed", "error", "timeout", "crashed")

SOLUTION_FILE = "solution.py"
TESTS_FILE = "tests.py"
HARNESS_FILE = "check.py"
RESULT_FILE = "result.json"

_FENCE_OPEN = re.compile(r"^\s*```+\s*([A-Za-z0-9_+.-]*)")
_FENCE_CLOSE = re.compile(r"^\s*```+\s*$")


@dataclass(frozen=True)
class CheckResult:
    """Pass or fail, one of STATUSES, and a short detail (which assert, which exception...)."""

    passed: bool
    status: str
    detail: str = ""

    @property
    def reason(self) -> str:
        """'status' or 'status: detail', the short text kept in a benchmark record."""
        return f"{self.status}: {self.detail}" if self.detail else self.status


def fenced_blocks(completion: str) -> list[tuple[str, str]]:
    """(language in lower case, "" if none; code) of each ``` block, in order. A block left open
    (the answer was cut off) runs to the end of the text; an indented block is dedented."""
    lines = completion.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opener = _FENCE_OPEN.match(lines[i])
        i += 1
        if opener is None:
            continue
        body = []
        while i < len(lines) and not _FENCE_CLOSE.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        blocks.append((opener.group(1).lower(), textwrap.dedent("\n".join(body) + "\n")))
    return blocks


def extract_code(completion: str) -> str:
    """The code of a completion: the first ```python (or ```py, ```python3) block, else the first
    ``` block without a language, else the whole text. Blocks in other languages are skipped."""
    blocks = fenced_blocks(completion)
    for wanted in (PYTHON_LANGUAGES, ("",)):
        for language, code in blocks:
            if language in wanted:
                return code
    return completion


def check_completion(completion: str, tests: str, entry_point: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                     memory_mb: int = DEFAULT_MEMORY_MB) -> CheckResult:
    """Extract the code of `completion` and run it with `tests` in a subprocess (`run_tests`)."""
    return run_tests(extract_code(completion), tests, entry_point, timeout_s=timeout_s, memory_mb=memory_mb)


def run_tests(code: str, tests: str, entry_point: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
              memory_mb: int = DEFAULT_MEMORY_MB) -> CheckResult:
    """Run `code`, check that it defines a callable `entry_point`, then run `tests` (Python
    statements, usually asserts) against it, all in a sandboxed subprocess (module docstring)."""
    if not entry_point.isidentifier():
        raise ValueError(f"entry point {entry_point!r} is not a Python identifier")
    if timeout_s <= 0 or memory_mb < 1:
        raise ValueError("timeout_s must be positive and memory_mb at least 1")
    cpu_seconds = int(timeout_s) + 1  # a backstop to the wall clock: a busy loop ends either way
    with tempfile.TemporaryDirectory(prefix="verispec-check-") as name:
        directory = Path(name)
        (directory / SOLUTION_FILE).write_text(code, encoding="utf-8", errors="replace")
        (directory / TESTS_FILE).write_text(tests, encoding="utf-8")
        (directory / HARNESS_FILE).write_text(HARNESS, encoding="utf-8")
        command = [sys.executable, "-I", str(directory / HARNESS_FILE), entry_point,
                   str(memory_mb * 2**20), str(cpu_seconds), str(FILE_SIZE_LIMIT_BYTES)]
        process = subprocess.Popen(command, cwd=directory, env=_child_environment(), stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=hasattr(os, "killpg"))
        try:
            returncode, timed_out = process.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        finally:
            _kill_group(process)  # also whatever the code left running
        result_path = directory / RESULT_FILE
        result = result_path.read_text(encoding="utf-8", errors="replace") if result_path.is_file() else None
    return interpret(result, returncode, timed_out, timeout_s)


def interpret(result: str | None, returncode: int | None, timed_out: bool, timeout_s: float) -> CheckResult:
    """The CheckResult of a finished check: the harness's result file (None if it wrote none),
    the exit status, and whether the wall-clock timeout ran out."""
    if timed_out:
        return CheckResult(False, "timeout", f"no result within {timeout_s:g} s")
    if result is not None:
        try:
            data = json.loads(result)
            status, detail = data["status"], str(data.get("detail", ""))
        except (ValueError, KeyError, TypeError):
            return CheckResult(False, "crashed", "unreadable result")
        if status in STATUSES:
            return CheckResult(status == "passed", status, _short(detail))
        return CheckResult(False, "crashed", "unreadable result")
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return CheckResult(False, "crashed", f"killed by {name}")
    return CheckResult(False, "crashed", f"exit status {returncode} before the tests finished")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 3] + "..."


def _child_environment() -> dict[str, str]:
    """No inherited variables (tokens, proxies, Python settings), only what starting needs."""
    environment = {"PATH": os.defpath, "LC_ALL": "C.UTF-8"}
    if "SYSTEMROOT" in os.environ:  # Windows needs it to start a process
        environment["SYSTEMROOT"] = os.environ["SYSTEMROOT"]
    return environment


def _kill_group(process: subprocess.Popen) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        elif process.poll() is None:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


# The program the subprocess runs (as HARNESS_FILE in the temporary directory): arguments entry
# point, address-space bytes, CPU seconds, file-size bytes. It writes RESULT_FILE, one JSON object
# {"status", "detail"}, and exits at once (os._exit: nothing the code registered runs after it).
HARNESS = r'''
import ast, json, os, sys

entry_point = sys.argv[1]
memory_bytes, cpu_seconds, file_bytes = (int(value) for value in sys.argv[2:5])
open_file, dumps, exit_now = open, json.dumps, os._exit  # kept before the code can replace them


def finish(status, detail=""):
    with open_file("result.json", "w", encoding="utf-8") as handle:
        handle.write(dumps({"status": status, "detail": detail}))
    exit_now(0)


def describe(error):
    text = str(error)
    return type(error).__name__ + (": " + text if text else "")


try:
    import resource
except ImportError:  # not on this platform: the wall-clock timeout still holds
    resource = None
if resource is not None:
    for limit, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_CPU", cpu_seconds),
                         ("RLIMIT_FSIZE", file_bytes), ("RLIMIT_CORE", 0)):
        if not hasattr(resource, limit):
            continue
        kind = getattr(resource, limit)
        try:
            _, hard = resource.getrlimit(kind)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass

with open_file("solution.py", encoding="utf-8") as handle:
    source = handle.read()
with open_file("tests.py", encoding="utf-8") as handle:
    tests = handle.read()
try:
    code = compile(source, "solution.py", "exec")
except (SyntaxError, ValueError) as error:
    where = getattr(error, "lineno", None)
    finish("syntax error", (f"line {where}: " if where else "") + str(getattr(error, "msg", error)))
namespace = {"__name__": "solution", "__builtins__": __builtins__}
try:
    exec(code, namespace)
except BaseException as error:
    finish("error", "while defining the code: " + describe(error))
if not callable(namespace.get(entry_point)):
    finish("missing function", f"{entry_point} is not defined")
try:
    statements = ast.parse(tests, "tests.py").body
except SyntaxError as error:
    finish("error", f"the tests do not parse (line {error.lineno}): {error.msg}")
for statement in statements:
    text = (ast.get_source_segment(tests, statement) or "").splitlines()[0]
    try:
        exec(compile(ast.Module([statement], []), "tests.py", "exec"), namespace)
    except AssertionError as error:
        finish("assertion failed", text + (f" ({error})" if str(error) else ""))
    except BaseException as error:
        finish("error", text + ": " + describe(error))
finish("passed")
'''
