"""An early-exit draft's first layers reused by the verify: the same bits as a verify that recomputes.

While drafting, EESD runs the target's layers 0..N-1 for the last committed token and the fed
draft tokens, in the target's own cache. Where every layer runs in C (batch-invariant), the
verify takes those rows (their residual stream after layer N and the keys they wrote) and runs
layers 0..N-1 only for the rest. These tests compare, bit for bit, two sequences of one target
driven through the same drafts: one whose drafter offers its rows, one whose drafter does not:

- the verify's logits (read whole, and staged in two parts as the engine reads them), the exit
  states it captures, and a later forward's logits (which read every cached key), over drafts
  fully verified, verified only up to a token that differs from the drafted one, and after
  rollbacks of the cache;
- whole greedy and sampled (seeded) eesd generations, equal with and without reuse (and greedy
  equal to `ar`), with rows really taken and drafts really rejected.
"""

from __future__ import annotations

import pytest
import torch

import helpers
from gguf_models import write_tiny_gguf
from test_eesd import eesd_recipe
from test_gguf_decoder import gguf_target
from verispec.core.drafters.early_exit import ExitHead, ExitHeadLM, PreparedHead
from verispec.core.methods import build
from verispec.core.sampling import SamplingConfig
from verispec.runtime.static_kv import Tree
from verispec.target import backends
from verispec.target.lazy_logits import LazyRows

EXIT_LAYER = 1


@pytest.fixture(scope="module", params=["llama-blocks", "gemma3-blocks", "qwen2-gguf"])
def target(request, tmp_path_factory):
    """A target whose every layer runs in C: the fast path on int8 block forms, or a GGUF file's blocks."""
    if request.param.endswith("-gguf"):
        folder = tmp_path_factory.mktemp("reuse")
        path = write_tiny_gguf(folder / "model.gguf", request.param.split("-")[0], types="Q8_0", seed=3)
        made = gguf_target(path, folder / "cache")
    else:
        made = helpers.make_target_for_path(request.param, seed=1, init=0.3)
        made.numerics = "int8"  # batch-invariant at every width (fp32's block path is not)
    made.set_eos_token_ids([])
    return made


def half_vocabulary_head(target) -> ExitHead:
    owner = target.model if target.model is not None else target
    return ExitHead(owner, EXIT_LAYER, list(range(target.vocab_size // 2)))


class Counted:
    """Counts the rows verifies took from drafts (`SequenceState.take_drafted`)."""

    def __init__(self, monkeypatch):
        self.rows = 0
        take = backends.SequenceState.take_drafted

        def counting(state, start, ids):
            taken = take(state, start, ids)
            self.rows += 0 if taken is None else taken.shape[0]
            return taken

        monkeypatch.setattr(backends.SequenceState, "take_drafted", counting)


def read_all(logits) -> torch.Tensor:
    """Every row, in order, as a rule reads them (a staged verify computes its second part then)."""
    if isinstance(logits, LazyRows):
        return torch.stack([logits[i] for i in range(len(logits))])
    return logits


def test_a_verify_taking_the_drafts_first_layers_has_the_bits_of_one_that_recomputes(target, monkeypatch):
    counted = Counted(monkeypatch)
    prepared = PreparedHead(target, half_vocabulary_head(target))
    offering, plain = target.new_sequence(), target.new_sequence()
    lms = {}
    for sequence in (offering, plain):
        sequence.reset()
        lms[id(sequence)] = ExitHeadLM(sequence, prepared)
    monkeypatch.setattr(plain, "offer_drafted", lambda *args: None)  # its verifies recompute every row
    prompt = helpers.repetitive_prompt(target.vocab_size, 4, period=6, repeats=3)
    context = list(prompt)
    for sequence in (offering, plain):
        lms[id(sequence)].begin(context)
        sequence.forward(context[:-1], last_only=True)
    vocab = target.vocab_size
    # (draft tokens fed through the first layers, tokens verified after the committed one, lazy,
    # tokens kept in the cache after the verify): all verified; verified up to a differing token;
    # more verified than drafted; staged in two parts; nothing kept
    steps = [([5, 9, 11], [5, 9, 11, 2], False, 4), ([7, 3], [7, (3 + 1) % vocab, 8], False, 1),
             ([1], [1, 2, 3, 4], False, 2), ([4, 6, 8, 10, 12, 14], [4, 6, 8, 10, 12, 14, 16, 18], True, 6),
             ([2, 2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2, 2, 2, 2], True, 0), ([9, 8], [9, 8, 7], False, 3)]
    for fed, verified, lazy, kept in steps:
        outputs = []
        for sequence in (offering, plain):
            lm = lms[id(sequence)]
            lm.sync(context)
            for i, token in enumerate(fed):
                lm.extend(torch.tensor([token]), Tree.contiguous(len(context) + i, 1))
            lm.end_draft()
            logits = read_all(sequence.forward([context[-1], *verified], lazy=lazy))  # [len(verified) + 1, vocab]
            states = sequence.exit_states(len(context) - 1, len(context) + len(verified)).clone()
            lm.keep(0)
            sequence.crop(len(context) + kept)
            outputs.append((logits, states))
        (logits, states), (expected_logits, expected_states) = outputs
        assert torch.equal(logits, expected_logits), (fed, verified)
        assert torch.equal(states, expected_states), (fed, verified)
        # the cache holds the context and verified[:kept]; the token chosen after them is the next
        # committed one (not in the cache yet: the next verify's first row)
        context += [*verified[:kept], int(expected_logits[kept].argmax())]
    # every cached key and value of both: a forward reading them all gives the same bits
    last = [sequence.forward([context[-1], 1, 2, 3]) for sequence in (offering, plain)]
    assert torch.equal(last[0], last[1])
    assert counted.rows >= 15  # the verifies really took drafted rows (not a vacuous comparison)
    for sequence in (offering, plain):
        sequence.release()


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.9, seed=11)], ids=["greedy", "sampled"])
def test_eesd_generations_are_the_same_with_the_first_layers_reused(target, sampling, monkeypatch):
    counted = Counted(monkeypatch)
    prepared = PreparedHead(target, half_vocabulary_head(target))
    prompt = helpers.repetitive_prompt(target.vocab_size, 2, period=5, repeats=4)
    reused, stats, _ = helpers.run(target, eesd_recipe(target, prepared, "constant:4", sampling), prompt, 40, sampling)
    target.release()
    assert counted.rows > 0 and 0 < stats.accepted < stats.drafted  # rows taken, drafts accepted and rejected
    with monkeypatch.context() as patched:
        patched.setattr(backends.DecoderBackend, "reuses_drafted", lambda self: False)
        recomputed = helpers.run(target, eesd_recipe(target, prepared, "constant:4", sampling), prompt, 40, sampling)[0]
        target.release()
    assert reused == recomputed
    if sampling.greedy:
        assert reused == helpers.run(target, build("ar", target), prompt, 40)[0]
        target.release()


def test_layers_that_are_not_batch_invariant_recompute_every_row(monkeypatch):
    """On the fp32 block path a row's sums depend on the width: the verify takes nothing from
    the draft there, and eesd still equals ar."""
    counted = Counted(monkeypatch)
    fp32 = helpers.make_target_for_path("llama-blocks", seed=1, init=0.3)
    assert fp32.numerics == "fp32"
    prepared = PreparedHead(fp32, half_vocabulary_head(fp32))
    prompt = helpers.repetitive_prompt(fp32.vocab_size, 2, period=5, repeats=4)
    ids, stats, _ = helpers.run(fp32, eesd_recipe(fp32, prepared, "constant:4"), prompt, 40)
    assert stats.drafted > 0 and counted.rows == 0
    assert ids == helpers.run(fp32, build("ar", fp32), prompt, 40)[0]
