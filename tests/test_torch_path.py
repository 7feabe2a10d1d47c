"""The PyTorch path (`torch_path`): eesd, sps, mtad and tree verification through a transformers
model's own modules, on tiny random float32 models of several families (Llama, Qwen2, Qwen3,
Gemma 3 and Mistral with sliding windows of 8 positions, GPT-2 with learned positions and no
rotary module), all with `fast=False`.

- Taking models apart: layers, final norm, rotary module, each layer's kind and window; other
  families and attention implementations without custom masks are refused with the reason.
- Placed rows: each row of a tree verified in one forward, and each beam of MTAD's steps, gets
  the logits a plain forward of its own path gives (to float32 rounding); after `keep_path` the
  cache is that of the accepted path. The first N layers alone give the residual a full forward
  has after layer N, and leave the cache as it was once the draft is done; the exit head's
  drafts (linear and beams) equal the head run over whole sequences; captured exit states
  survive rollbacks.
- Greedy eesd (an untrained head, and a head that equals the target), sps with a draft model
  and anpd's trees equal `ar`, which equals transformers' `generate()`, on every family, with
  near-ties ruled out as in the equivalence suite; drafts are accepted and rejected.
- MTAD's rule: every verdict equals a brute-force joint-likelihood computation (the target's and
  the draft's probabilities from fresh forwards of each prefix) on a tiny vocabulary, for a
  draft model and for the exit head, with beams crossing a sliding window.
- Sampling (long): sps and eesd follow the exact distribution of the first tokens (chi-square,
  ALPHA = 1e-4 per test), seeded and unseeded, on Llama, Gemma 3 and GPT-2.
- Training an exit head through the PyTorch path lowers its held-out KL (long).
- transformers' `generate(custom_generate=...)` with every method on models without a fast path.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import helpers
import verispec
from verispec.target import torch_path
from verispec.core.acceptance import verify_joint, verify_lossless
from verispec.runtime.static_kv import Tree
from verispec.core.control import parse_controller
from verispec.core.drafters.early_exit import EarlyExitDrafter, ExitHead, ExitHeadLM, save_head
from verispec.core.drafters.draft_model import AuxLM, BeamDrafter, SampledDrafter, tree_for_beams
from verispec.core.engine import Recipe
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig, probabilities

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral", "gpt2")
ALPHA = 1e-4
NEW_TOKENS = 40


def config(arch: str, vocab_size: int = 128, init: float = 0.3):
    if arch == "mistral":
        return helpers.mistral_config(vocab_size, init)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=init,
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return helpers.make_config(arch, vocab_size=vocab_size, init=init)


def target(arch: str, seed: int = 1, vocab_size: int = 128, init: float = 0.3) -> Target:
    return Target(helpers.make_model(config(arch, vocab_size, init), seed), None, name=f"tiny-{arch}", fast=False)


@pytest.fixture(scope="module")
def targets() -> dict[str, Target]:
    return {arch: target(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def drafts() -> dict[str, Target]:
    """Another model of each family (other weights, the same vocabulary)."""
    return {arch: target(arch, seed=4) for arch in ARCHS}


def fresh(model, tokens) -> torch.Tensor:
    """Logits of every position of `tokens` from a plain forward without a cache: [n, vocab]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([list(tokens)]), use_cache=False).logits[0].float()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=1e-5 * max(1.0, float(b.abs().max())))


def prompt(seed: int, length: int = 20) -> list[int]:
    return helpers.repetitive_prompt(128, seed, period=5, repeats=6)[:length]


def identity_head(model) -> ExitHead:
    """N = L, the whole vocabulary and a layer that adds nothing: the draft is the target."""
    layers = len(torch_path.parts(model).layers)
    head = ExitHead(model, layers, list(range(model.get_output_embeddings().weight.shape[0])))
    with torch.no_grad():
        for name, parameter in head.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight", "c_proj.bias")):
                parameter.zero_()
    return head


def assert_no_near_ties(model, prompt_ids, output) -> None:
    """As the equivalence suite: a top-2 logit gap far above float32 rounding at every step of
    the reference, so differently shaped forwards cannot flip a token."""
    logits = fresh(model, list(prompt_ids) + list(output))[len(prompt_ids) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4


# -- taking models apart ---------------------------------------------------------------------------

def test_every_family_is_taken_apart(targets):
    kinds = {}
    for arch, t in targets.items():
        parts = torch_path.parts(t.model)
        assert len(parts.layers) == t.config.num_hidden_layers and parts.norm is not None
        assert (parts.rotary is None) == (arch == "gpt2")
        kinds[arch] = list(zip(parts.kinds, parts.windows))
    sliding, full = ("sliding_attention", helpers.SLIDING_WINDOW), ("full_attention", None)
    assert kinds["gemma3"] == [sliding, full, sliding]
    assert kinds["qwen2"] == [full, sliding]
    assert kinds["mistral"] == [sliding, sliding]
    assert kinds["llama"] == kinds["qwen3"] == kinds["gpt2"] == [full, full]
    assert torch_path.parts(targets["gemma3"].model).mixed and not torch_path.parts(targets["mistral"].model).mixed


def test_other_models_are_refused_with_the_reason():
    neox = helpers.make_model(helpers.neox_config())
    assert "'gpt_neox' is not one of the families" in torch_path.unsupported(neox)
    with pytest.raises(ConfigError, match="tree verification cannot run on .*gpt_neox"):
        torch_path.parts(neox, "tree verification")
    flash = helpers.make_model(config("llama"))
    flash.config._attn_implementation = "flash_attention_2"  # what the check reads; nothing runs here
    assert "takes no custom attention mask" in torch_path.unsupported(flash)
    assert not Target(neox, None, fast=False).verifies_trees and target("llama").verifies_trees


def test_multi_row_products_run_on_packed_weights_that_follow_the_weights():
    """On the CPU in float32, inside `packed_linears` an nn.Linear multiplies several rows with
    a packed copy of its weight (the same product to float32 rounding) and one row with PyTorch's
    own product; a weight changed in place is packed again; outside the block nothing changed."""
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        with torch_path.packed_linears(layer, 15):
            assert "forward" in layer.__dict__
            close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            assert layer(x[:1, :1]).shape == (1, 1, 32)
        assert "forward" not in layer.__dict__ and layer in torch_path._PACKED
        first = torch_path._PACKED[layer][1]
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with torch.inference_mode():
        with torch_path.packed_linears(layer, 15):
            close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert torch_path._PACKED[layer][1] is not first


# -- placed rows -------------------------------------------------------------------------------------

PARENTS = [-1, 0, 1, 0, 3, 2, 5, 4, -1]  # two branches of depth 4 and a sibling of the root's child


@pytest.mark.parametrize("arch", ARCHS)
def test_each_tree_row_gets_its_paths_logits_and_keep_path_keeps_that_path(targets, arch):
    t = targets[arch]
    context = prompt(0)  # 20 tokens: past the sliding windows
    tokens = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    paths = []
    for i, parent in enumerate(PARENTS):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[i]])
    for kept_row in (6, 7, 1):  # a path through the primary branch, the other branch, and a short one
        t.reset()
        t.forward(context)
        logits = t.forward_tree(tokens, PARENTS)  # [9, vocab]
        assert t.length == len(context) + len(tokens)  # rows appended in row order until keep_path
        for row, path in enumerate(paths):
            close(logits[row], fresh(t.model, context + path)[-1])
        rows = []
        row = kept_row
        while row >= 0:
            rows.insert(0, row)
            row = PARENTS[row]
        t.keep_path(rows)
        assert t.length == len(context) + len(rows)
        after = t.forward([3, 4])  # the cache is now context + the kept path
        close(after, fresh(t.model, context + paths[kept_row] + [3, 4])[-2:])


@pytest.mark.parametrize("arch", ARCHS)
def test_beams_placed_step_after_step_get_their_paths_logits(targets, drafts, arch):
    """MTAD's beams on a draft model's own cache: three steps of three beams appended after
    scratch rows, in a sliding window's reach (context 12, window 8)."""
    lm = AuxLM(drafts[arch], targets[arch])
    context = prompt(1, 12)
    lm.begin(context)
    lm.sync(context)
    paths: list[list[int]] = [[], [], []]
    slots: list[list[int]] = [[], [], []]
    earlier: list[int] = []
    for step, (chosen, parents) in enumerate((([4, 5, 6], [0, 0, 0]), ([7, 1, 2], [0, 0, 2]),
                                              ([3, 9, 8], [1, 2, 2])), start=1):
        paths = [paths[p] for p in parents]
        slots = [slots[p] for p in parents]
        tree = tree_for_beams(len(context), step, 3, slots, earlier)
        logits = lm.extend(torch.tensor(chosen), tree)  # [3, vocab]
        earlier += [len(context) + step - 1] * 3
        paths = [path + [token] for path, token in zip(paths, chosen)]
        slots = [s + [int(slot)] for s, slot in zip(slots, tree.slots)]
        for b in range(3):
            close(logits[b], fresh(drafts[arch].model, context + paths[b])[-1])
    lm.end_draft()
    lm.keep(0)
    assert lm.model.length == len(context)
    close(lm.sync(context + [5]), fresh(drafts[arch].model, context + [5])[-1])  # the cache is the context's


@pytest.mark.parametrize("arch", ARCHS)
def test_the_first_layers_alone_give_a_full_forwards_residual_and_leave_the_cache(targets, arch):
    t = targets[arch]
    context = prompt(2)
    with torch.inference_mode():
        states = t.model(input_ids=torch.tensor([context + [5, 6]]), output_hidden_states=True).hidden_states
    t.reset()
    t.forward(context)
    residual, _ = torch_path.through(t.model, t.decoder_body, t.head, t.cache, torch.tensor([5, 6]), torch_path.contiguous(len(context), 2, "cpu"),
                                     stop_after=1)
    close(residual, states[1][0, -2:])
    torch_path.crop_layers(t.cache, range(1), len(context))
    assert {int(layer.get_seq_length()) for layer in t.cache.layers} == {len(context)}
    close(t.forward([5, 6]), fresh(t.model, context + [5, 6])[-2:])


@pytest.mark.parametrize("arch", ["gemma3", "mistral", "gpt2"])
def test_exit_head_drafts_equal_the_head_over_whole_sequences(targets, arch):
    """ExitHeadLM on the PyTorch path (layers 0..N-1 in the target's cache, the head's layer in
    its own) against `ExitHead.forward` over the residual of whole sequences, through the steps
    of a request: a linear draft, its verification, beams, a step without a draft, a catch-up."""
    t = targets[arch]
    head = ExitHead(t.model, 1, list(range(t.vocab_size)))
    with torch.no_grad():  # a head layer unlike the target's
        for parameter in head.layer.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))

    def reference(tokens):  # the head's logits after the last token of `tokens`
        with torch.inference_mode():
            states = t.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[1]
            return head(states)[0, -1]

    def layer_lengths():
        return {int(layer.get_seq_length()) for layer in t.cache.layers}

    lm = ExitHeadLM(t, head)
    context = prompt(3)
    t.reset()
    lm.begin(context)
    t.forward(context[:-1])
    close(lm.sync(context), reference(context))
    close(lm.extend(torch.tensor([9]), Tree.contiguous(len(context), 1))[0], reference(context + [9]))
    lm.end_draft()
    assert layer_lengths() == {len(context) - 1}  # the draft's rows left layer 0
    t.forward([context[-1], 9])  # the verification; 9 accepted, then the target's token 2
    lm.keep(1)
    context += [9, 2]
    close(lm.sync(context), reference(context))
    beams = lm.extend(torch.tensor([4, 6]), tree_for_beams(len(context), 1, 2, [[], []], []))
    close(beams[0], reference(context + [4]))
    close(beams[1], reference(context + [6]))
    lm.end_draft()
    lm.keep(0)
    assert layer_lengths() == {len(context) - 1}
    t.forward([context[-1]])  # a step without a draft: the head catches up on it later
    t.forward([5, 3, 7])  # and a deterministic draft, all accepted
    context += [5, 3, 7, 1]
    close(lm.sync(context), reference(context))


@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_captured_exit_states_survive_rollbacks(targets, arch):
    t = targets[arch]
    ids = prompt(2, 24)
    with torch.inference_mode():  # the residual after layer 1 (the last hidden state is normed: not it)
        expected = t.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
    t.reset()
    t.capture_exit(1)
    t.forward(ids[:10], last_only=True)
    for start, end, keep in ((10, 16, 13), (13, 14, 14), (14, 20, 14), (14, 21, 18), (18, 24, 24)):
        assert t.length == start
        t.forward(ids[start:end], last_only=True)
        t.crop(keep)
    close(t.exit_states(0, 24), expected)


# -- greedy equivalence ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_eesd_sps_and_trees_equal_ar(targets, drafts, arch):
    t = targets[arch]
    counts = {"eesd": [0, 0], "sps": [0, 0], "tree": [0, 0]}
    layers = len(torch_path.parts(t.model).layers)
    for seed in (0, 1):
        ids = prompt(seed)
        reference = helpers.run(t, build("ar", t), ids, NEW_TOKENS)[0]
        assert reference == helpers.hf_greedy(t.model, ids, NEW_TOKENS)
        assert_no_near_ties(t.model, ids, reference)
        heads = [ExitHead(t.model, n, list(range(t.vocab_size // 2))) for n in range(1, layers)]
        for head in heads:
            for controller in ("constant:4", "calibrated-ts:6"):
                recipe = Recipe(EarlyExitDrafter(t, head), parse_controller(controller, 4), verify_lossless)
                got, stats, _ = helpers.run(t, recipe, ids, NEW_TOKENS)
                assert got == reference, (head.exit_layer, controller)
                counts["eesd"][0] += stats.accepted
                counts["eesd"][1] += stats.drafted - stats.accepted
        got, stats, steps = helpers.run(t, Recipe(EarlyExitDrafter(t, identity_head(t.model)),
                                                  parse_controller("constant:5", 5), verify_lossless), ids, NEW_TOKENS)
        assert got == reference and stats.drafted > 0 and stats.accepted == stats.drafted  # the head is the target
        for controller in ("constant:3", "beta-ts:6"):
            got, stats, _ = helpers.run(t, build("sps", t, MethodOptions(draft_model=drafts[arch], controller=controller)),
                                        ids, NEW_TOKENS)
            assert got == reference, controller
            counts["sps"][1] += stats.drafted - stats.accepted
        for options in (MethodOptions(tree=8, controller="constant:8"), MethodOptions(tree=4)):
            got, stats, _ = helpers.run(t, build("anpd", t, options), ids, NEW_TOKENS)
            assert got == reference, options
            counts["tree"][0] += stats.accepted
    assert counts["eesd"][0] > 0 and counts["eesd"][1] > 0, counts  # both outcomes
    assert counts["sps"][1] > 0 and counts["tree"][0] > 0, counts


# -- mtad's rule against brute force ------------------------------------------------------------------

def recording(rule, log):
    def recorded(draft, logits, sampling, generator):
        verdict = rule(draft, logits, sampling, generator)
        log.append((draft, verdict))
        return verdict

    return recorded


@pytest.mark.parametrize("arch,drafter", [("llama", "model"), ("gemma3", "model"), ("gemma3", "head"), ("gpt2", "head")])
def test_mtad_verdicts_equal_a_brute_force_joint_likelihood(arch, drafter):
    tau = 0.9  # some drafts pass, some fail here
    vocab = 8
    t = target(arch, seed=0, vocab_size=vocab)
    sampling = SamplingConfig(1.0, top_k=5, seed=11)
    if drafter == "model":
        other = target(arch, seed=5, vocab_size=vocab)
        lm = AuxLM(other, t)

        def q_rows(tokens):  # the draft model's probabilities after each prefix of `tokens`
            return probabilities(fresh(other.model, tokens), sampling)
    else:
        head = ExitHead(t.model, 1, list(range(vocab)))
        with torch.no_grad():  # GPT-2's head after layer 1 of 2 would be its last layer: made to differ
            for parameter in head.layer.parameters():
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)))
        lm = ExitHeadLM(t, head)

        def q_rows(tokens):
            with torch.inference_mode():
                states = t.model(input_ids=torch.tensor([tokens]), output_hidden_states=True).hidden_states[1]
                return probabilities(head(states)[0].float(), sampling)

    ids = [1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 1, 2]  # 12 tokens: beams cross Gemma 3's window of 8
    log: list = []
    recipe = Recipe(BeamDrafter(lm, 3, sampling), parse_controller("constant:4", 4), recording(verify_joint(tau), log))
    out, stats, steps = helpers.run(t, recipe, ids, 40, sampling)
    context = list(ids) + steps[0]
    checked = 0
    assert len(log) == len(steps)  # the prefill's token, then one verdict per step
    for (draft, verdict), committed in zip(log[1:], steps[1:]):
        tokens = draft.tokens.tolist()
        if tokens:
            p = probabilities(fresh(t.model, context + tokens)[len(context) - 1 :], sampling).double()  # [k+1, V]
            q = q_rows(context + tokens)[len(context) - 1 : -1].double()  # [k, V]
            drafted_q = q[torch.arange(len(tokens)), torch.tensor(tokens)]
            torch.testing.assert_close(draft.q_tokens.double(), drafted_q, rtol=1e-4, atol=1e-7)
            ratios = [float(p[j, token] / drafted_q[j]) for j, token in enumerate(tokens)]
            products = [math.prod(ratios[: length + 1]) for length in range(len(tokens))]
            assert all(abs(product - tau) > 1e-6 * tau for product in products)  # no decision on a tie
            longest = max([0] + [length + 1 for length, product in enumerate(products) if product > tau])
            assert verdict.n_accepted == longest, (tokens, products)
            assert committed[:longest] == tokens[:longest]
            checked += 1
        context += committed
    assert checked >= 5 and 0 < stats.accepted < stats.drafted


# -- sampling (long) -----------------------------------------------------------------------------------

MICRO_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]


def micro(arch: str, seed: int = 0) -> Target:
    model_config = helpers.micro_llama_config(8, init=0.3) if arch == "llama" else config(arch, vocab_size=8, init=0.3)
    return Target(helpers.make_model(model_config, seed), None, name=f"micro-{arch}", fast=False)


def sampled_recipe(method, t, draft, sampling):
    if method == "sps":
        return build("sps", t, MethodOptions(draft_model=draft), sampling)
    return Recipe(EarlyExitDrafter(t, ExitHead(t.model, 1, list(range(6)), init_layer=0), sampling), parse_controller("constant:3", 3),
                  verify_lossless)


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("method", ["sps", "eesd"])
def test_sampled_drafts_are_lossless_with_seeds(arch, method):
    t, draft = micro(arch), micro(arch, seed=5)
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(t.model, MICRO_PROMPT, 3, sampling)
    outcomes, drafted, accepted = [], 0, 0
    for seed in range(500):
        config_ = SamplingConfig(1.0, seed=seed)
        ids, stats, _ = helpers.run(t, sampled_recipe(method, t, draft, config_), MICRO_PROMPT, 5, config_)
        outcomes.append(tuple(ids[:3]))
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert 0 < accepted < drafted  # both paths of the rule
    helpers.assert_fits(outcomes, exact, f"{method} on {arch}")


@pytest.mark.long
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("method", ["sps", "eesd"])
def test_sampled_drafts_are_lossless_without_seeds(arch, method):
    """As users call them (no seed: fresh randomness per request); the second generated token,
    the first verified against a draft, jointly with the first."""
    t, draft = micro(arch), micro(arch, seed=5)
    sampling = SamplingConfig(temperature=1.0)
    exact = helpers.exact_sequence_distribution(t.model, MICRO_PROMPT, 2, sampling)
    outcomes, drafted, accepted = [], 0, 0
    for _ in range(600):
        ids, stats, _ = helpers.run(t, sampled_recipe(method, t, draft, sampling), MICRO_PROMPT, 3, sampling)
        outcomes.append(tuple(ids[:2]))
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert drafted >= 540 and 0 < accepted < drafted
    helpers.assert_fits(outcomes, exact, f"unseeded {method} on {arch}")


# -- training (long) -----------------------------------------------------------------------------------

@pytest.mark.long
@pytest.mark.parametrize("arch", ["gemma3", "gpt2"])
def test_training_through_the_pytorch_path_lowers_the_held_out_kl(tmp_path, arch):
    from test_eesd import write_word_corpus

    from verispec.train.exit_head import TrainConfig, train_exit_head

    tokenizer = helpers.char_tokenizer()
    model_config = config(arch, vocab_size=len(tokenizer), init=0.3)
    model_config.num_hidden_layers = 3  # a head after layer 1 then starts as layer 1, not as the last layer
    t = Target(helpers.make_model(model_config, seed=2), tokenizer, name=f"tiny-{arch}", fast=False)
    corpus = tmp_path / "corpus.jsonl"
    write_word_corpus(corpus)
    settings = TrainConfig(exit_layer=1, draft_vocab=24, sequence_length=48, batch=4, steps=60, learning_rate=3e-3,
                           warmup=5, checkpoint_every=20, eval_tokens=256)
    summary = train_exit_head(t, corpus, tmp_path / "head", settings, log=lambda *_: None)
    assert summary["held_out_after"]["kl_draft_vocab"] < 0.8 * summary["held_out_before"]["kl_draft_vocab"], summary
    ids = tokenizer("alpha beta gamma")["input_ids"]
    reference = helpers.run(t, build("ar", t), ids, 16)[0]
    recipe = build("eesd", t, MethodOptions(exit_head=str(tmp_path / "head"), controller="constant:3"))
    got, stats, _ = helpers.run(t, recipe, ids, 16)
    assert got == reference and stats.drafted > 0


# -- transformers' generate() ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gpt2", "mistral"])
def test_generate_with_every_method_on_the_pytorch_path(arch, tmp_path):
    """Families without a fast path: every method through `model.generate(custom_generate=...)`;
    greedy ones equal the model's own `generate()`, sampled ones run and follow their seed."""
    model = helpers.make_model(config(arch, init=0.3), seed=1)
    draft = helpers.make_model(config(arch, init=0.3), seed=4)  # a loaded draft model, passed as is
    head = ExitHead(model, 1, list(range(64)))
    save_head(head, head.spec(model, "tiny"), tmp_path, dtype=torch.float32)
    ids = torch.tensor([prompt(0)])
    expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)

    def ours(method, **kwargs):
        stats = verispec.GenerationStats()
        out = model.generate(ids, custom_generate=verispec.transformers_generate, method=method,
                             max_new_tokens=NEW_TOKENS, stats=stats, **kwargs)
        return out, stats

    greedy = {"ar": {}, "pld": {}, "anpd": {}, "anpd/tree=8": {}, "eesd": {"exit_head": str(tmp_path)},
              "sps": {"draft_model": draft}}
    if importlib.util.find_spec("arctic_inference") is not None:
        greedy["suffix"] = {}
    else:  # the one method that needs an optional package says how to get it
        with pytest.raises(ConfigError, match="make suffix"):
            ours("suffix", do_sample=False)
    for method, kwargs in greedy.items():
        out, stats = ours(method, do_sample=False, **kwargs)
        assert torch.equal(out, expected), method
        assert stats.new_tokens == NEW_TOKENS
        assert (stats.drafted > 0) == (method != "ar"), method
    assert not target_fast(model)
    for method, kwargs in (("sps", {"draft_model": draft}), ("mtad", {"draft_model": draft}),
                           ("eesd", {"exit_head": str(tmp_path)}), ("mtad", {"exit_head": str(tmp_path)})):
        first, stats = ours(method, do_sample=True, seed=3, controller="constant:3", **kwargs)
        again, _ = ours(method, do_sample=True, seed=3, controller="constant:3", **kwargs)
        assert first.shape == (1, ids.shape[1] + NEW_TOKENS) and torch.equal(first, again), method
        assert stats.drafted > 0, method


def target_fast(model) -> bool:
    from verispec.hf_generate import target_for

    return target_for(model).fast


def test_a_draft_model_on_another_device_or_of_another_kind_is_refused(targets):
    with pytest.raises(ConfigError, match="draft_model must be a loaded causal LM or a path"):
        helpers.make_model(config("gpt2")).generate(torch.tensor([prompt(0)]), custom_generate=verispec.transformers_generate,
                                                    method="sps", max_new_tokens=4, draft_model=3)
    elsewhere = target("llama")
    elsewhere.device = torch.device("meta")  # as a model on another device reports itself
    with pytest.raises(ConfigError, match="load both on one device"):
        AuxLM(elsewhere, targets["llama"])


def test_the_command_line_runs_model_drafting_off_the_fast_path(tmp_path):
    """`verispec generate --no-fast` with eesd (an exit head), sps (a draft model) and trees on a
    tiny Llama directory: each output equals ar's (`--compare`)."""
    import json

    from typer.testing import CliRunner

    from verispec.cli import app

    tokenizer = helpers.char_tokenizer()
    for name, seed in (("target", 3), ("draft", 4)):
        model_config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.3, max_positions=256)
        helpers.make_model(model_config, seed=seed).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    target_model = helpers.make_model(helpers.make_config("llama", vocab_size=len(tokenizer), init=0.3, max_positions=256),
                                      seed=3)
    head = ExitHead(target_model, 1, list(range(len(tokenizer))))
    save_head(head, head.spec(target_model, "tiny"), tmp_path / "head", dtype=torch.float32)
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    for flags in (["--method", "eesd", "--exit-head", str(tmp_path / "head")],
                  ["--method", "sps", "--draft-model", str(tmp_path / "draft")],
                  ["--method", "anpd", "--tree", "8"]):
        result = CliRunner().invoke(app, ["generate", prompt, "--model", str(tmp_path / "target"), "--no-fast",
                                          "--dtype", "float32", "-n", "24", "--compare", "--json", *flags])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        assert payload["identical"] is True and payload["stats"]["drafted"] > 0, flags

