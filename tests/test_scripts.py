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
