"""SamplingConfig: the one place sampling options are validated, and its generators."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.errors import ConfigError
from verispec.core.sampling import DRAFT_STREAM, MAX_SEED, SamplingConfig


@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -0.5), ("temperature", True),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_p", 0.0), ("top_p", math.nan), ("top_p", 1.5),
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 2**70), ("seed", 1.0), ("seed", True),
])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingConfig(**{field: value})


def test_the_largest_seed_works_for_both_streams():
    config = SamplingConfig(temperature=1.0, seed=MAX_SEED)
    acceptance, draft = config.generator(), config.generator(DRAFT_STREAM)
    assert draft.initial_seed() == 0 and acceptance.initial_seed() == MAX_SEED


def test_without_a_seed_every_generator_draws_afresh():
    config = SamplingConfig(temperature=1.0)
    draws = {float(torch.rand((), generator=config.generator(DRAFT_STREAM))) for _ in range(5)}
    assert len(draws) == 5


def test_a_seed_reproduces_each_stream_and_the_streams_differ():
    config = SamplingConfig(temperature=1.0, seed=7)
    first = [float(torch.rand((), generator=config.generator(s))) for s in (0, DRAFT_STREAM)]
    again = [float(torch.rand((), generator=config.generator(s))) for s in (0, DRAFT_STREAM)]
    assert first == again and first[0] != first[1]
