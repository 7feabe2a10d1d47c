"""Fixtures: tiny seeded float32 models of four architectures wrapped as `Target`s, and a
character-level tokenizer with a matching tiny model for text-level tests.

Models are session-scoped (built once; building is fast but not free on 2 cores). A `Target`
holds per-request state only in its KV cache, which `decode` resets, so sharing is safe.
"""

from __future__ import annotations

import os

import pytest
import torch

import helpers
from verispec.target.model import Target

torch.set_num_threads(1)
# The suite tests the CPU semantics wherever it runs: a GPU stays hidden (device "auto" means the
# CPU, here and in subprocesses) unless VERISPEC_TEST_DEVICE=cuda asks for the device tests on it.
if os.environ.get("VERISPEC_TEST_DEVICE", "cpu") != "cuda":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.fixture(scope="session")
def tiny_targets() -> dict[str, Target]:
    """One tiny Target per architecture and forward path ("llama" runs the fast path,
    "llama-eager" transformers' eager forward; vocab 128, init 0.1, seed 0). Gemma 3 and Qwen2
    have a sliding window of 8 positions."""
    targets = {path: helpers.make_target_for_path(path, seed=0) for path in helpers.PATHS}
    targets["gpt2"] = targets["gpt2-eager"]  # GPT-2 has no fast path
    return targets


@pytest.fixture(params=helpers.PATHS)
def arch_target(request, tiny_targets) -> Target:
    """Each architecture on each of its forward paths (fast and eager)."""
    return tiny_targets[request.param]


@pytest.fixture(scope="session")
def llama_target(tiny_targets) -> Target:
    return tiny_targets["llama"]


@pytest.fixture(scope="session")
def gemma3_target(tiny_targets) -> Target:
    return tiny_targets["gemma3"]


@pytest.fixture(scope="session")
def qwen2_target(tiny_targets) -> Target:
    return tiny_targets["qwen2"]


@pytest.fixture(scope="session")
def gpt2_target(tiny_targets) -> Target:
    return tiny_targets["gpt2"]


@pytest.fixture(scope="session")
def char_tokenizer():
    return helpers.char_tokenizer()


@pytest.fixture(scope="session")
def text_target(char_tokenizer) -> Target:
    """A tiny Llama over the character tokenizer's vocabulary (no EOS anywhere)."""
    config = helpers.make_config("llama", vocab_size=len(char_tokenizer), init=0.1)
    return Target(helpers.make_model(config, seed=3), char_tokenizer, name="tiny-text-llama")


@pytest.fixture(scope="module")
def micro():
    """A micro Llama over 8 tokens (exact sequence distributions are cheap to enumerate)."""
    return Target(helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=0), None, name="micro")


@pytest.fixture(scope="module")
def micro_draft(tmp_path_factory):
    """A different micro Llama with the same vocabulary, saved so methods can load it by path."""
    path = tmp_path_factory.mktemp("draft")
    helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=5).save_pretrained(path)
    helpers.char_tokenizer().save_pretrained(path)  # loading needs one; ids are compared by vocab size here
    return path
