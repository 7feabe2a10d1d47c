"""scripts/draft_ceiling.py's arithmetic: what a measured acceptance allows under measured step
costs (the figures in docs/benchmarks.md come from it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from verispec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("draft_ceiling", ROOT / "scripts" / "draft_ceiling.py")
ceiling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ceiling)

VERIFY = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]  # v(1..9), relative to one step


def test_one_draft_token_gives_one_plus_alpha_over_its_cost():
    # (1 + a) / (d + v(2)): the bound of one draft token
    assert ceiling.geometric_best(0.38, 0.15, VERIFY, 1, least=1) == (pytest.approx(1.38 / 1.25), 1)
    assert ceiling.geometric_best(0.0, 0.15, VERIFY, 8) == (1.0, 0)  # nothing accepted: ar is best
    speed, k = ceiling.geometric_best(0.9, 0.1, VERIFY, 8)
    assert k > 1 and speed == pytest.approx(sum(0.9 ** i for i in range(k + 1)) / (k * 0.1 + VERIFY[k]))


def test_the_needed_acceptance_reaches_the_goal_and_no_less_does():
    for goal in (1.0, 1.1, 1.25):
        alpha = ceiling.needed_acceptance(goal, 0.15, VERIFY, 8)
        assert ceiling.geometric_best(alpha, 0.15, VERIFY, 8, least=1)[0] >= goal - 1e-9
        assert ceiling.geometric_best(alpha - 1e-3, 0.15, VERIFY, 8, least=1)[0] < goal
    # drafting at 0.15 per token breaks even at one token when a = d + v(2) - 1 = 0.25
    assert ceiling.needed_acceptance(1.0, 0.15, VERIFY, 8) == pytest.approx(0.25, abs=1e-6)
    assert ceiling.needed_acceptance(10.0, 0.15, VERIFY, 8) is None  # out of reach


def test_widths_between_and_past_the_timed_ones():
    assert ceiling.interpolate(VERIFY, 1.0) == 1.0
    assert ceiling.interpolate(VERIFY, 2.5) == pytest.approx(1.15)
    assert ceiling.interpolate(VERIFY, 9.0) == pytest.approx(1.8)


def _run(directory: Path, methods: list[str], draft_model=None) -> Path:
    settings = dict(model=None, draft_model=draft_model, dtype="float32", dataset="spec-bench", dataset_sha256="x",
                    categories=[], per_category=1, methods=methods, peers=[], max_new_tokens=16, temperature=1.0,
                    top_p=0.9, seed=0, repeats=1, draft_length=None, controller=None, early_exit_layer=None,
                    fast=False, top_k=10)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"settings": settings}))
    overall = {"ar": dict(new_tokens=100, target_forwards=100, drafted=0, accepted=0, speedup=1.0),
               "sps": dict(new_tokens=100, target_forwards=50, drafted=100, accepted=50, speedup=0.9),
               "mtad/constant:4/beams=2": dict(new_tokens=100, target_forwards=40, drafted=160, accepted=60, speedup=1.1)}
    (directory / "summary.json").write_text(json.dumps({"overall": overall}))
    return directory


def test_rows_from_a_run_directory(tmp_path):
    settings, summary = ceiling.read_run(_run(tmp_path / "run", ["ar", "sps", "mtad/constant:4/beams=2"]))
    cost = {"verify": VERIFY, "draft": 0.2, "beam": {2: 0.3}}
    sps = ceiling.method_row("sps", settings, summary, cost, 8)
    assert (sps["tokens_per_forward"], sps["drafted_per_forward"], sps["acceptance"]) == (2.0, 2.0, 0.5)
    assert sps["model"] == pytest.approx(2.0 / (2 * 0.2 + 1.2))
    mtad = ceiling.method_row("mtad/constant:4/beams=2", settings, summary, cost, 8)
    # 4 tokens drafted each forward: one from the synced head, 3 beam steps of 2 rows
    assert mtad["model"] == pytest.approx(2.5 / (0.2 + 3 * 0.3 + 1.4))
    assert mtad["free_drafts"] == pytest.approx(2.5 / 1.4)


def test_a_run_with_another_draft_model_or_unfinished_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="exit head's steps only"):
        ceiling.read_run(_run(tmp_path / "drafted", ["ar", "sps"], draft_model="/models/small"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="config.json missing"):
        ceiling.read_run(tmp_path / "empty")
