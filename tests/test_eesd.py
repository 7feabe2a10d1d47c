"""EESD: the early-exit drafter is lossless, its head files are checked, training helps.

- Greedy equivalence with `ar` (float32, tiny Llama / Gemma 3 / Qwen2 on the fast path) with an
  untrained head at several exit layers and controllers, on weights where drafts are partly
  rejected; and with N = L and a head whose layer adds nothing (zeroed output projections), so
  the draft equals the target and every draft token is accepted.
- Speculative sampling with the head's q is lossless: the distribution of the first three tokens
  equals the exact autoregressive one (chi-square, false-positive rate ALPHA per test).
- Training on a tiny model lowers the held-out KL; a head trained for another model or exit layer
  is refused; the head round-trips through its files; training files (checkpoint, labels) hold
  tensors and plain values only, and one holding any other pickled object is refused unopened.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import helpers
from verispec.core.acceptance import verify_lossless
from verispec.core.control import parse_controller
from verispec.core.drafters.early_exit import (
    EarlyExitDrafter, ExitHead, load_head, save_head, target_fingerprint,
)
from verispec.core.engine import Recipe
from verispec.errors import ConfigError, ModelLoadError
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig

ALPHA = 1e-4
NEW_TOKENS = 40


def eesd_recipe(target, head, controller="constant:4", sampling=SamplingConfig()):
    return Recipe(EarlyExitDrafter(target, head, sampling), parse_controller(controller, 4), verify_lossless)


def identity_head(target, vocab=None) -> ExitHead:
    """N = L and a layer whose attention and MLP outputs are zero: with the full vocabulary
    (default) the draft distribution is exactly the target's."""
    layers = len(target.model.get_decoder().layers)
    head = ExitHead(target.model, layers, vocab if vocab is not None else list(range(target.vocab_size)))
    with torch.no_grad():
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_untrained_head_is_lossless_with_partial_acceptance(arch):
    # init 0.3: sharper, varied outputs, so an untrained head is often wrong
    target = helpers.make_target(arch, seed=1, init=0.3)
    layers = len(target.model.get_decoder().layers)
    accepted = rejected = 0
    for prompt_seed in (0, 1):
        prompt = helpers.repetitive_prompt(target.vocab_size, prompt_seed, period=5, repeats=4)
        reference = helpers.run(target, build("ar", target), prompt, NEW_TOKENS)[0]
        assert reference == helpers.hf_greedy(target.model, prompt, NEW_TOKENS)
        heads = [ExitHead(target.model, n, list(range(target.vocab_size // 2))) for n in range(1, layers)]
        # the target itself restricted to half the vocabulary: right exactly when the target's
        # choice lies in that half, so acceptance is partial by construction
        heads.append(identity_head(target, vocab=list(range(0, target.vocab_size, 2))))
        for head in heads:
            exit_layer = head.exit_layer
            for controller in ("constant:4", "constant:1", "beta-ts:6", "calibrated-ts:6", "heuristic:3"):
                ids, stats, _ = helpers.run(target, eesd_recipe(target, head, controller), prompt, NEW_TOKENS)
                assert ids == reference, (exit_layer, controller)
                accepted += stats.accepted
                rejected += stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0  # both outcomes really happened


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_exit_at_the_last_layer_with_an_identity_head_accepts_everything(arch):
    target = helpers.make_target(arch, seed=1, init=0.3)
    prompt = helpers.repetitive_prompt(target.vocab_size, 0, period=5, repeats=4)
    reference = helpers.run(target, build("ar", target), prompt, NEW_TOKENS)[0]
    ids, stats, steps = helpers.run(target, eesd_recipe(target, identity_head(target), "constant:5"), prompt, NEW_TOKENS)
    assert ids == reference
    assert stats.drafted > 0 and stats.accepted == stats.drafted
    assert max(len(s) for s in steps) == 6


def test_eesd_refuses_a_model_the_pytorch_path_cannot_take_apart():
    """Off the fast path eesd runs through the model's own modules (tests/test_torch_path.py);
    a family it does not know (GPT-NeoX here) is refused with the reason, not run."""
    target = Target(helpers.make_model(helpers.neox_config()), None, name="tiny-neox")
    assert not target.fast
    with pytest.raises(ConfigError, match="an exit head cannot run on .* 'gpt_neox' is not one of the families"):
        ExitHead(target.model, 1, [0, 1, 2])
    llama = helpers.make_target("llama", seed=0, fast=False)
    with pytest.raises(ConfigError, match="eesd cannot run on .* 'gpt_neox'"):
        EarlyExitDrafter(target, ExitHead(llama.model, 1, [0, 1, 2]))


@pytest.mark.long
def test_speculative_sampling_with_the_head_is_lossless():
    micro = Target(helpers.make_model(helpers.micro_llama_config(8, init=0.3), seed=0), None, name="micro")
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(micro.model, prompt, 3, sampling)
    head = ExitHead(micro.model, 1, list(range(6)))  # q is zero on 2 of the 8 tokens
    outcomes, drafted, accepted = [], 0, 0
    for seed in range(500):
        config = SamplingConfig(1.0, seed=seed)
        recipe = eesd_recipe(micro, head, "constant:3", config)
        ids, stats, _ = helpers.run(micro, recipe, prompt, 5, config)
        outcomes.append(tuple(ids[:3]))
        drafted += stats.drafted
        accepted += stats.accepted
    assert 0 < accepted < drafted  # q really went through accept and reject paths
    statistic, pvalue, df = helpers.chi_square_pvalue(Counter(outcomes), exact)
    assert pvalue > ALPHA, f"chi2={statistic:.1f}, df={df}, p={pvalue:.2e}"


@pytest.mark.parametrize("controller", ["constant:3", "heuristic:2"])
def test_sampled_eesd_is_reproducible_from_its_seed_under_a_timing_free_controller(controller):
    """The README's promise: with a controller that does not adapt to measured timings, the same
    seed gives the same sample (and another seed, at some point, another one)."""
    micro = Target(helpers.make_model(helpers.micro_llama_config(32, init=0.3), seed=0), None, name="micro")
    head = ExitHead(micro.model, 1, list(range(24)))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def sample(seed):
        config = SamplingConfig(0.9, seed=seed)
        ids, stats, _ = helpers.run(micro, eesd_recipe(micro, head, controller, config), prompt, 24, config)
        return ids, stats

    first, stats = sample(7)
    assert stats.drafted > 0
    assert sample(7)[0] == first
    assert any(sample(seed)[0] != first for seed in (8, 9, 10))


def test_head_files_round_trip_and_mismatches_are_refused(tmp_path):
    target = helpers.make_target("llama", seed=0)
    head = ExitHead(target.model, 1, [5, 3, 9])
    with torch.no_grad():
        head.norm.weight.add_(0.25)
    save_head(head, head.spec(target.model, "tiny"), tmp_path, dtype=torch.float32)
    loaded, spec = load_head(tmp_path, target.model, "tiny")
    assert spec.exit_layer == 1 and list(spec.draft_vocab) == [5, 3, 9]
    assert torch.equal(loaded.norm.weight, head.norm.weight)
    with pytest.raises(ModelLoadError, match="layer 1"):
        load_head(tmp_path, target.model, "tiny", exit_layer=2)
    other = helpers.make_target("llama", seed=7)  # same architecture, different weights
    assert target_fingerprint(other.model) != target_fingerprint(target.model)
    with pytest.raises(ModelLoadError, match="trained for"):
        load_head(tmp_path, other.model, "other")


def test_a_head_sharing_the_targets_mlp_saves_the_rest_and_loads_it_back(tmp_path):
    """shared=("layer.mlp.",): the MLP is layer init_layer's own, frozen, left out of the file,
    and filled from the target again on loading; the rest round-trips."""
    from safetensors.torch import load_file

    target = helpers.make_target("llama", seed=0)
    head = ExitHead(target.model, 1, [5, 3, 9], shared=("layer.mlp.",))
    trained = [name for name, p in head.named_parameters() if p.requires_grad]
    assert trained and not any(name.startswith("layer.mlp.") for name in trained)
    assert any(name.startswith("layer.mlp.") for name, _ in head.named_parameters())
    with torch.no_grad():
        head.layer.self_attn.q_proj.weight.add_(0.5)
    save_head(head, head.spec(target.model, "tiny"), tmp_path, dtype=torch.float32)
    saved = load_file(str(tmp_path / "exit_head.safetensors"))
    assert saved and not any(key.startswith("layer.mlp.") for key in saved)
    loaded, spec = load_head(tmp_path, target.model, "tiny")
    assert spec.shared == ("layer.mlp.",)
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    layer = target.model.model.layers[head.init_layer]
    assert torch.equal(loaded.layer.mlp.up_proj.weight, layer.mlp.up_proj.weight)


def test_fingerprint_ignores_the_dtype():
    target = helpers.make_target("llama", seed=0)
    bf16 = helpers.make_model(helpers.make_config("llama"), seed=0).to(torch.bfloat16)
    assert target_fingerprint(bf16) == target_fingerprint(target.model)


def test_eesd_method_with_a_head_directory(tmp_path):
    target = helpers.make_target("llama", seed=1, init=0.3)
    head = ExitHead(target.model, 1, list(range(64)))
    save_head(head, head.spec(target.model, "tiny"), tmp_path, dtype=torch.float32)
    prompt = helpers.repetitive_prompt(target.vocab_size, 0)
    reference = helpers.run(target, build("ar", target), prompt, 20)[0]
    recipe = build("eesd", target, MethodOptions(exit_head=str(tmp_path)))
    assert helpers.run(target, recipe, prompt, 20)[0] == reference
    with pytest.raises(ConfigError, match="not found"):
        MethodOptions(exit_head=str(tmp_path / "missing"))


def write_word_corpus(path, documents: int = 40) -> None:
    import json
    import random

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud"]
    with path.open("w") as sink:
        for _ in range(documents):
            sink.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(30))}) + "\n")


@pytest.mark.long
def test_training_lowers_the_held_out_kl(tmp_path):
    from verispec.train.exit_head import CHECKPOINT, LABELS, TrainConfig, train_exit_head

    target = helpers.make_target("gemma3", seed=2, init=0.3, tokenizer=helpers.char_tokenizer())
    corpus = tmp_path / "corpus.jsonl"
    write_word_corpus(corpus)
    config = TrainConfig(exit_layer=1, draft_vocab=24, sequence_length=48, batch=4, steps=60,
                         learning_rate=3e-3, warmup=5, checkpoint_every=20, eval_tokens=256)
    summary = train_exit_head(target, corpus, tmp_path / "head", config, log=lambda *_: None)
    before, after = summary["held_out_before"], summary["held_out_after"]
    assert after["kl_draft_vocab"] < 0.8 * before["kl_draft_vocab"], summary
    assert (tmp_path / "head" / "exit_head.safetensors").is_file()
    # the trained head loads for its model and drafts losslessly
    head, spec = load_head(tmp_path / "head", target.model)
    assert spec.training["steps"] == 60
    prompt = target.tokenizer("alpha beta gamma")["input_ids"]
    reference = helpers.run(target, build("ar", target), prompt, 16)[0]
    assert helpers.run(target, eesd_recipe(target, head), prompt, 16)[0] == reference
    # the training files load as tensors and plain values only, with what was trained
    checkpoint = torch.load(tmp_path / "head" / CHECKPOINT, weights_only=True)
    assert checkpoint["step"] == 60 and checkpoint["vocab"] == head.vocab.tolist()
    assert set(checkpoint["head"]) == set(head.state_dict())
    assert head.shared == ("layer.mlp.",)  # by default the MLP stays the target's: trained, it would differ
    for name, value in head.layer.mlp.state_dict().items():
        assert torch.equal(value, target.model.model.layers[head.init_layer].mlp.state_dict()[name]), name
    for name, value in head.state_dict().items():  # the head files hold the checkpoint's weights in bf16
        expected = checkpoint["head"][name] if head.is_shared(name) else checkpoint["head"][name].to(torch.bfloat16)
        torch.testing.assert_close(expected.float(), value.float(), rtol=0, atol=0)
    labels = torch.load(tmp_path / "head" / LABELS, weights_only=True)
    assert len(labels["token_ids"]) == len(labels["exit_states"]) == summary["sequences"]
    # resume continues from the checkpoint and refuses changed settings
    longer = TrainConfig(**{**config.__dict__, "steps": 70})
    assert train_exit_head(target, corpus, tmp_path / "head", longer, resume=True, log=lambda *_: None)["steps"] == 70
    with pytest.raises(ConfigError, match="exists"):
        train_exit_head(target, corpus, tmp_path / "head", config, log=lambda *_: None)
    changed = TrainConfig(**{**config.__dict__, "draft_vocab": 30})
    with pytest.raises(ConfigError, match="different settings"):
        train_exit_head(target, corpus, tmp_path / "head", changed, resume=True, log=lambda *_: None)


class RunsCodeWhenUnpickled:
    """Unpickling it opens (creates) `path`: the kind of object a tampered training file carries."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("tampered", ["checkpoint", "labels"])
def test_training_files_with_other_pickled_objects_are_refused(tmp_path, tampered):
    from dataclasses import asdict

    from verispec.train.exit_head import CHECKPOINT, LABELS, TrainConfig, train_exit_head

    target = helpers.make_target("gemma3", seed=2, tokenizer=helpers.char_tokenizer())
    corpus, out, marker = tmp_path / "corpus.jsonl", tmp_path / "head", tmp_path / "code-ran"
    write_word_corpus(corpus, documents=4)
    config = TrainConfig(exit_layer=1, draft_vocab=24, sequence_length=48, steps=2, eval_tokens=16)
    out.mkdir()
    # a well-formed checkpoint of plain values, so that a tampered labels file is reached
    checkpoint = {"head": {}, "optimizer": {}, "step": 0, "vocab": [], "config": asdict(config), "before": {}}
    if tampered == "checkpoint":
        checkpoint["vocab"] = RunsCodeWhenUnpickled(marker)
    else:
        torch.save({"exit_states": [RunsCodeWhenUnpickled(marker)], "final_states": [], "token_ids": []},
                   out / LABELS)
    torch.save(checkpoint, out / CHECKPOINT)
    with pytest.raises(ConfigError, match="refusing to load") as refused:
        train_exit_head(target, corpus, out, config, resume=True, log=lambda *_: None)
    assert (CHECKPOINT if tampered == "checkpoint" else LABELS) in str(refused.value)
    assert not marker.exists()  # refused, not executed


class SkippingController:
    """Drafts up to k tokens, but declines to draft at all on a fixed pattern of steps, so the
    draft model must catch up on several committed tokens at once."""

    def __init__(self, k: int, pattern=(True, False, False, True, False)):
        self.k, self.pattern, self.step = k, pattern, 0

    def next_length(self) -> int:
        return self.k

    def keep(self, j, confidence) -> bool:
        if j == 0:
            self.step += 1
            return self.pattern[self.step % len(self.pattern)]
        return True

    def cut(self, confidence, proposed):
        return proposed

    def observe(self, *args) -> None:
        pass


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_skipped_draft_steps_are_caught_up(arch, tmp_path):
    """EESD and sps with a draft model stay lossless when the controller skips drafting on some
    steps (the draft model then catches up from the target's captured states / its own cache)."""
    from verispec.core.drafters.draft_model import AuxLM, SampledDrafter

    target = helpers.make_target(arch, seed=1, init=0.3)
    prompt = helpers.repetitive_prompt(target.vocab_size, 0, period=5, repeats=4)
    reference = helpers.run(target, build("ar", target), prompt, NEW_TOKENS)[0]
    drafters = [
        EarlyExitDrafter(target, identity_head(target)),  # right about everything: long acceptances
        EarlyExitDrafter(target, ExitHead(target.model, 1, list(range(target.vocab_size)))),
        SampledDrafter(AuxLM(helpers.make_target(arch, seed=4, init=0.3), target)),
    ]
    for drafter in drafters:
        recipe = Recipe(drafter, SkippingController(4), verify_lossless)
        ids, stats, steps = helpers.run(target, recipe, prompt, NEW_TOKENS)
        assert ids == reference
        assert stats.drafted > 0 and sum(1 for s in steps if len(s) == 1) > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
def test_head_layer_on_int8_forms_runs_in_c_and_stays_lossless(arch):
    """On a block-kernel target the head's layer gets Q8_0-style int8 forms and runs as one C
    call; greedy eesd still equals ar with drafts partly accepted, the N = L identity head is
    still fully accepted (zeroed projections quantize to zeros), and `head_int8=False` keeps the
    float32 layer."""
    from verispec.core.drafters.early_exit import PreparedHead
    from verispec.runtime.fastpath import BlockLinear

    target = helpers.make_target_for_path(f"{arch}-blocks", seed=1, init=0.3)
    prompt = helpers.repetitive_prompt(target.vocab_size, 0, period=5, repeats=4)
    reference = helpers.run(target, build("ar", target), prompt, NEW_TOKENS)[0]
    head = ExitHead(target.model, 1, list(range(target.vocab_size // 2)))
    prepared = PreparedHead(target, head)
    assert prepared.layer.native is not None
    assert all(isinstance(linear, BlockLinear) for linear in (prepared.layer.qkv, prepared.layer.o,
                                                              prepared.layer.gate_up, prepared.layer.down))
    float_layer = PreparedHead(target, head, quantize=False).layer
    assert float_layer.native is None and not isinstance(float_layer.qkv, BlockLinear)
    accepted = rejected = 0
    for controller in ("constant:4", "calibrated-ts:6"):
        ids, stats, _ = helpers.run(target, eesd_recipe(target, prepared, controller), prompt, NEW_TOKENS)
        assert ids == reference, controller
        accepted, rejected = accepted + stats.accepted, rejected + stats.drafted - stats.accepted
    assert accepted > 0 and rejected > 0
    ids, stats, _ = helpers.run(target, eesd_recipe(target, PreparedHead(target, identity_head(target)), "constant:5"),
                                prompt, NEW_TOKENS)
    assert ids == reference and stats.drafted > 0 and stats.accepted == stats.drafted


def test_int8_head_drafts_match_the_float_head_closely():
    """The int8 head approximates the float32 head: same logits to a small relative error on a
    real context, computed by the C layer and by the PyTorch layer on the same int8 forms alike."""
    from verispec.core.drafters.early_exit import ExitHeadLM, PreparedHead
    from verispec.runtime.static_kv import Tree

    target = helpers.make_target_for_path("gemma3-blocks", seed=2)
    head = ExitHead(target.model, 1, list(range(target.vocab_size)))
    with torch.no_grad():  # a head layer unlike the target's, so that it matters
        for parameter in head.layer.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
    prompt = helpers.repetitive_prompt(target.vocab_size, 1, period=7, repeats=3)
    logits = {}
    for quantize, native in ((False, True), (True, True), (True, False)):
        lm = ExitHeadLM(target, PreparedHead(target, head, quantize=quantize))
        target.reset()
        lm.begin(prompt)
        target.forward(prompt[:-1])
        lm.sync(prompt)
        target.decoder.use_native = native
        try:
            logits[quantize, native] = lm.extend(torch.tensor([prompt[0], prompt[1]]), Tree.contiguous(len(prompt), 2))
        finally:
            target.decoder.use_native = True
    reference = logits[False, True]
    assert torch.allclose(logits[True, True], logits[True, False], rtol=1e-5, atol=1e-5)
    error = (logits[True, True] - reference).abs().max() / reference.abs().max()
    assert 0 < error < 2e-2, error  # quantized (not the float head), yet close to it


def test_captured_exit_states_survive_rollbacks():
    """The residual stream captured after layer N equals a fresh forward's, position by position,
    after forwards of several widths, rollbacks inside and at the edge of earlier chunks, and
    re-feeding."""
    target = helpers.make_target("gemma3", seed=3)
    ids = helpers.repetitive_prompt(target.vocab_size, 2, period=7, repeats=4)[:24]
    target.reset()
    target.capture_exit(2)
    target.forward(ids[:24], last_only=True)
    expected = target.exit_states(0, 24).clone()  # [24, hidden]
    target.reset()
    target.capture_exit(2)
    target.forward(ids[:10], last_only=True)
    for start, end, keep in ((10, 16, 13), (13, 14, 14), (14, 20, 14), (14, 21, 18), (18, 24, 24)):
        assert target.cache.length == start
        target.forward(ids[start:end], last_only=True)
        target.crop(keep)  # the verification kept only part of the chunk
    torch.testing.assert_close(target.exit_states(0, 24), expected, rtol=1e-5, atol=1e-5)
