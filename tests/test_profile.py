"""verispec profile's core: forward costs by width, as milliseconds and ratios."""

from __future__ import annotations

import pytest

import helpers
from verispec.bench.profile import format_profile, profile_target, timing_context
from verispec.drafters.early_exit import ExitHead, PreparedHead


@pytest.mark.parametrize("path", ["llama", "llama-blocks"])
def test_profile_reports_every_width_its_ratio_and_the_draft_step(path):
    target = helpers.make_target_for_path(path, seed=0)
    head = PreparedHead(target, ExitHead(target.model, 1, list(range(64))), quantize=False)
    profile = profile_target(target, context_length=24, widths=(4, 2), prepared_head=head, repeats=2, rounds=1)
    assert list(profile["widths"]) == ["1", "2", "4"] and list(profile["ratios"]) == ["2", "4"]
    for width in ("2", "4"):
        assert profile["ratios"][width] == pytest.approx(profile["widths"][width] / profile["widths"]["1"], rel=1e-2)
    assert profile["context"] == 24 and profile["draft_ms"] > 0
    assert profile["numerics"] == target.numerics
    assert list(profile["rejected"]) == ["2", "4"] and list(profile["rejected_ratios"]) == ["2", "4"]
    assert all(ms > 0 for ms in profile["rejected"].values())
    text = format_profile(profile)
    assert "EESD draft token" in text and len(text.splitlines()) == 6
    assert "rejected ms" in text and f"{profile['rejected']['4']:12.2f}" in text.splitlines()[-2]
    assert target.cache.length == 24  # the context stays; the timed forwards were cropped


def test_timing_context_is_fixed_and_inside_the_vocabulary():
    assert timing_context(16, 100) == timing_context(16, 100)
    assert all(0 <= t < 100 for t in timing_context(64, 100)) and len(timing_context(64, 100)) == 64
