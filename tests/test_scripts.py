"""The scripts in scripts/ still import against the package (a renamed or removed name they use
fails here, not the next time someone measures with them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "scripts").glob("*.py"))


def test_there_are_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(script.parent))  # as run: a script may import its neighbours
    name = f"script_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)  # runs the imports and definitions; main() only under __main__
    assert callable(getattr(module, "main", None)), f"{script.name} has no main()"


def test_the_extraction_cases_are_schemas_with_prompts():
    """scripts/extraction_cases.jsonl (the structured-output benchmark's set): each line a prompt
    and a valid JSON schema of an object, two cases of each kind."""
    import json
    from collections import Counter

    import jsonschema

    path = Path(__file__).resolve().parent.parent / "scripts" / "extraction_cases.jsonl"
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(cases) >= 16
    for case in cases:
        assert case["prompt"].strip()
        jsonschema.Draft202012Validator.check_schema(case["schema"])
        assert case["schema"]["type"] == "object"
    assert set(Counter(case["kind"] for case in cases).values()) == {2}
