"""KV-cache rollback: crop then re-feed gives the logits of a fresh forward (float32), for every
architecture, including Gemma 3's and Qwen2's sliding-window layers when the rejected part of a
draft crosses the window."""

from __future__ import annotations

import random

import pytest
import torch

import helpers
from verispec.target.hf_cache import cache_length, crop_to, new_cache
from verispec.target.model import Target

ATOL = 1e-5  # float32; logits here are O(1)


def fresh_logits(target: Target, tokens: list[int]) -> torch.Tensor:
    """Logits of every position of `tokens` from the model's own forward, no cache. [n, vocab]"""
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


def sequence(seed: int, length: int, vocab: int = 128) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@pytest.mark.parametrize(
    "prefix,drafted,kept",
    [
        (6, 6, 0),  # window 8: the rejected draft (positions 6..11) crosses the window
        (6, 6, 1),  # ... and the kept part stays below it
        (5, 8, 4),  # kept part reaches the window edge exactly (9 positions)
        (12, 5, 2),  # already past the window
        (20, 7, 7),  # everything accepted: crop(0) still trims the sliding layers
        (1, 12, 3),
    ],
)
def test_crop_then_refeed_equals_fresh_forward(arch_target, prefix, drafted, kept):
    target = arch_target
    tokens = sequence(prefix * 100 + drafted, prefix + drafted)
    replacement = sequence(7 + kept, 10)  # what is fed after the rollback
    target.reset()
    target.forward(tokens[:prefix])
    target.forward(tokens[prefix:])  # the draft
    assert target.length == prefix + drafted
    target.crop(prefix + kept)
    assert target.length == prefix + kept
    refed = target.forward(replacement)  # [10, vocab]
    whole = tokens[: prefix + kept] + replacement
    expected = fresh_logits(target, whole)[prefix + kept :]
    torch.testing.assert_close(refed.float(), expected, rtol=0, atol=ATOL)


def test_repeated_draft_and_rollback_cycles_match_fresh_forwards(arch_target):
    """Emulates decoding: feed [last] + draft, keep a random prefix, crop, repeat; every step's
    logits equal those of a fresh forward over the committed sequence plus the draft."""
    target = arch_target
    rng = random.Random(11)
    committed = sequence(3, 4)
    target.reset()
    target.forward(committed[:-1])
    for step in range(14):
        draft = [rng.randrange(target.vocab_size) for _ in range(rng.randint(0, 7))]
        logits = target.forward([committed[-1], *draft])  # [k+1, vocab]
        expected = fresh_logits(target, committed + draft)[len(committed) - 1 :]
        torch.testing.assert_close(logits.float(), expected, rtol=0, atol=ATOL, msg=f"step {step}")
        kept = rng.randint(0, len(draft))
        target.crop(len(committed) + kept)
        committed = committed + draft[:kept] + [rng.randrange(target.vocab_size)]
        assert target.length == len(committed) - 1
    assert len(committed) > 2 * helpers.SLIDING_WINDOW  # the sliding windows were crossed


def test_crop_to_current_length_is_a_no_op_for_the_logits(gemma3_target):
    target = gemma3_target
    tokens = sequence(5, 20)
    target.reset()
    target.forward(tokens[:15])
    target.crop(15)
    target.crop(15)
    torch.testing.assert_close(target.forward(tokens[15:]).float(), fresh_logits(target, tokens)[15:],
                               rtol=0, atol=ATOL)


def test_cache_helpers_on_a_raw_dynamic_cache(gemma3_target):
    model = gemma3_target.model
    cache = new_cache(model)
    assert cache_length(cache) == 0
    with torch.inference_mode():
        model(input_ids=torch.tensor([sequence(1, 12)]), cache=cache, use_cache=True)
    assert cache_length(cache) == 12
    crop_to(cache, 5)
    assert cache_length(cache) == 5
    with pytest.raises(AssertionError):
        crop_to(cache, 6)  # cannot grow
    with pytest.raises(AssertionError):
        crop_to(cache, -1)


def test_forward_last_only_and_shapes(llama_target):
    target = llama_target
    tokens = sequence(2, 9)
    target.reset()
    last = target.forward(tokens, last_only=True)
    assert last.shape == (1, target.vocab_size)
    torch.testing.assert_close(last.float(), fresh_logits(target, tokens)[-1:], rtol=0, atol=ATOL)
    with pytest.raises(AssertionError):
        target.forward([])


def test_model_with_its_own_head_path():
    """Gemma 3 with final-logit soft-capping: logits are not hidden @ W^T, so Target must use the
    model's own forward; rollback must hold there too."""
    target = helpers.make_target("gemma3", seed=4, final_logit_softcapping=3.0)
    assert not target.uses_own_head
    tokens = sequence(9, 16)
    target.reset()
    target.forward(tokens[:6])
    target.forward(tokens[6:14])
    target.crop(8)
    refed = target.forward(tokens[8:])
    torch.testing.assert_close(refed.float(), fresh_logits(target, tokens)[8:], rtol=0, atol=ATOL)


def test_targets_use_the_chunked_head_when_it_is_exact(tiny_targets):
    for target in tiny_targets.values():
        assert target.uses_own_head, target.name


# -- the fast path's static cache ----------------------------------------------------------


def test_static_kv_grows_and_keeps_contents():
    from verispec.runtime.static_kv import StaticKV

    cache = StaticKV(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, capacity=4)
    keys = torch.arange(24, dtype=torch.float32).view(1, 6, 4)
    cache.reserve(6)
    assert cache.capacity >= 8
    cache.write(1, 0, keys, -keys)
    cache.length = 6
    k, v = cache.read(1, 2, 6)
    assert torch.equal(k, keys[:, 2:6]) and torch.equal(v, -keys[:, 2:6])
    cache.crop(3)
    assert cache.length == 3
    with pytest.raises(AssertionError):
        cache.crop(4)


def test_fast_and_eager_paths_agree_on_logits(tiny_targets):
    """The same weights through both forward paths, over a chunked prefill and a draft step."""
    for arch in ("llama", "gemma3", "qwen2"):
        fast, eager = tiny_targets[arch], tiny_targets[f"{arch}-eager"]
        sequence = list(range(3, 40))
        outputs = []
        for target in (fast, eager):
            target.reset()
            first = target.forward(sequence[:20])
            second = target.forward(sequence[20:])
            outputs.append(torch.cat([first, second]))
        assert fast.fast and not eager.fast
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
