"""The real embedded default model (Gemma 3 270M), end to end.

Marked `slow` but not skipped: CI runs it. The first load ever converts the GGUF file and caches
the result under ~/.cache/verispec (about 2 minutes); later loads take seconds. The model is
loaded once for the module.
"""

from __future__ import annotations

import pytest
import torch

import verispec
from verispec.methods import MethodOptions

pytestmark = pytest.mark.slow

PROMPT = (
    "Repeat the list exactly.\n"
    "List: apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n"
    "Again: apple, banana, cherry, date, elderberry, fig, grape, honeydew.\n"
    "Again: apple, banana, cherry, date,"
)


@pytest.fixture(scope="module")
def real_target():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # conftest uses 1 for the tiny models; the real one wants both cores
    try:
        yield verispec.load(None, dtype="float32")
    finally:
        torch.set_num_threads(threads)


def test_default_model_loads(real_target):
    assert real_target.tokenizer is not None
    assert real_target.dtype == torch.float32
    assert real_target.vocab_size >= 262_144
    assert real_target.eos_token_ids


def test_anpd_equals_ar_and_accepts_drafts(real_target):
    ar = verispec.generate(real_target, PROMPT, method="ar", max_new_tokens=32)
    anpd = verispec.generate(real_target, PROMPT, method="anpd", max_new_tokens=32,
                             options=MethodOptions(controller="constant:8"))
    assert anpd.token_ids == ar.token_ids
    assert anpd.text == ar.text
    assert len(ar.token_ids) == 32 or ar.stats.stop_reason == "eos"
    assert anpd.stats.accepted > 0, anpd.stats
    assert anpd.stats.target_forwards < ar.stats.target_forwards
    # the method's own default controller is lossless too
    default = verispec.generate(real_target, PROMPT, method="anpd", max_new_tokens=32)
    assert default.token_ids == ar.token_ids
