"""The transformers drop-in: `model.generate(..., custom_generate=verispec.transformers_generate)`.

- Greedy (float32, tiny random Llama / Gemma 3 / Qwen2 / GPT-2): every lossless method that runs
  without extra files (ar, pld, anpd), and sps with a saved draft model and eesd with a saved exit
  head, return exactly what the model's own `generate()` returns, on prompts where the n-gram
  drafters do draft (checked through `stats=`), with `max_new_tokens` or `max_length`, and with a
  stop token that occurs (the output ends at it, like generate()'s).
- The result has generate()'s type, dtype, device and shape contract; `return_dict_in_generate`
  gives a GenerateDecoderOnlyOutput with the same sequences.
- Sampled settings are accepted, give valid shapes, follow transformers' resolution of the
  defaults (do_sample=True alone = temperature 1, top-k 50) and are reproducible from a seed.
- Refused with an error naming the option: a batch of two, padding, an unknown method, beam
  search, num_return_sequences, repetition_penalty, a logits_processor / stopping_criteria list,
  output_scores, an unknown model input.
- The Target is built once per model and rebuilt when the weights change; the model's
  train/eval modes are left as they were.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import fields

import pytest
import torch

import helpers
import verispec
from verispec.core.drafters.early_exit import ExitHead, save_head
from verispec.errors import ConfigError, ModelLoadError
from verispec.hf_generate import target_for

NEW_TOKENS = 30
ARCHS = ("llama", "gemma3", "qwen2", "gpt2")
GENERATE = verispec.transformers_generate


@pytest.fixture(scope="module")
def models() -> dict:
    """One tiny float32 model per architecture (init 0.1: outputs repetitive enough that n-gram
    drafts are accepted on the repetitive prompts, and varied enough that some are rejected)."""
    return {arch: helpers.make_model(helpers.make_config(arch, init=0.1), seed=1) for arch in ARCHS}


def prompt_ids(seed: int = 0) -> torch.Tensor:
    return torch.tensor([helpers.repetitive_prompt(128, seed, period=5, repeats=4)])  # [1, 20]


def reference(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(ids, do_sample=False, **kwargs)


def ours(model, ids: torch.Tensor, method: str, **kwargs):
    return model.generate(ids, custom_generate=GENERATE, method=method, do_sample=False, **kwargs)


@pytest.mark.parametrize("method", ["ar", "pld", "anpd"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_equals_generate(models, arch, method):
    model = models[arch]
    drafted = accepted = 0
    for seed in (0, 1):
        ids = prompt_ids(seed)
        expected = reference(model, ids, max_new_tokens=NEW_TOKENS)
        stats = verispec.GenerationStats()
        # a fixed draft length: the default controllers learn from measured seconds, so on a loaded
        # machine they may stop drafting (3 drafted, none accepted, with both cores busy), and this
        # test needs drafts to check
        fixed = {} if method == "ar" else {"controller": "constant:4"}
        got = ours(model, ids, method, max_new_tokens=NEW_TOKENS, stats=stats, **fixed)
        assert torch.equal(got, expected), (arch, method, seed)
        assert stats.method == method and stats.new_tokens == NEW_TOKENS
        drafted += stats.drafted
        accepted += stats.accepted
    if method != "ar":  # the repetitive prompts made the n-gram drafters draft, and drafts were accepted
        assert drafted > 0 and accepted > 0
    else:
        assert drafted == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_method_options_reach_the_method(models, arch):
    model, ids = models[arch], prompt_ids(0)
    expected = reference(model, ids, max_new_tokens=NEW_TOKENS)
    for options in ({"draft_length": 2, "controller": "constant"}, {"draft_length": 6}, {"ngram_max_n": 2},
                    {"controller": "beta-ts:4"}):
        stats = verispec.GenerationStats()
        got = ours(model, ids, "anpd", max_new_tokens=NEW_TOKENS, stats=stats, **options)
        assert torch.equal(got, expected), options
        if options.get("controller") == "constant":
            assert len(stats.accepted_per_position) == 2  # never drafted more than draft_length tokens
    with pytest.raises(ConfigError, match="draft length"):
        ours(model, ids, "anpd", max_new_tokens=4, draft_length=0)


def test_a_method_takes_settings_as_in_the_benchmark(models):
    model, ids = models["llama"], prompt_ids(0)
    expected = reference(model, ids, max_new_tokens=NEW_TOKENS)
    stats = verispec.GenerationStats()
    assert torch.equal(ours(model, ids, "anpd/constant:2", max_new_tokens=NEW_TOKENS, stats=stats), expected)
    assert stats.method == "anpd" and len(stats.accepted_per_position) == 2  # drafted 2 tokens at most
    with pytest.raises(ConfigError, match="the draft length is given twice"):
        ours(model, ids, "anpd/constant:2", max_new_tokens=4, draft_length=3)


def test_the_signature_offers_every_method_option():
    """transformers routes a generate() keyword to custom_generate only if its signature names it."""
    parameters = inspect.signature(GENERATE).parameters
    for option in fields(verispec.MethodOptions):
        assert option.name in parameters, option.name
    assert {"method", "seed", "stats"} <= set(parameters)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_sps_with_a_draft_model_equals_generate(models, arch, tmp_path):
    helpers.make_model(helpers.make_config(arch, init=0.1), seed=9).save_pretrained(tmp_path)
    helpers.char_tokenizer().save_pretrained(tmp_path)  # loading needs one
    model, ids = models[arch], prompt_ids(0)
    stats = verispec.GenerationStats()
    got = ours(model, ids, "sps", max_new_tokens=NEW_TOKENS, draft_model=str(tmp_path), stats=stats)
    assert torch.equal(got, reference(model, ids, max_new_tokens=NEW_TOKENS))
    assert stats.drafted > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_eesd_with_an_exit_head_equals_generate(models, arch, tmp_path):
    model, ids = models[arch], prompt_ids(1)
    head = ExitHead(model, 1, list(range(64)))  # untrained, half the vocabulary: partly right
    save_head(head, head.spec(model, "tiny"), tmp_path, dtype=torch.float32)
    stats = verispec.GenerationStats()
    got = ours(model, ids, "eesd", max_new_tokens=NEW_TOKENS, exit_head=str(tmp_path), stats=stats)
    assert torch.equal(got, reference(model, ids, max_new_tokens=NEW_TOKENS))
    assert stats.drafted > 0


def test_eesd_without_a_head_for_this_model_is_refused(models):
    with pytest.raises(ModelLoadError, match="exit head"):
        ours(models["llama"], prompt_ids(0), "eesd", max_new_tokens=4)


def test_mtad_asks_for_sampling(models):
    with pytest.raises(ConfigError, match="do_sample=True"):
        ours(models["llama"], prompt_ids(0), "mtad", max_new_tokens=4)


@pytest.mark.parametrize("method", ["ar", "anpd"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_stop_token_ends_the_output_like_generate(models, arch, method):
    model, ids = models[arch], prompt_ids(0)
    free = reference(model, ids, max_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
    stop = free[7]  # a token the model does generate, at position 7 or earlier
    expected = reference(model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    got = ours(model, ids, method, max_new_tokens=NEW_TOKENS, eos_token_id=stop)
    assert torch.equal(got, expected)
    assert got.shape[1] <= ids.shape[1] + 8 and got[0, -1].item() == stop
    # a list of stop tokens, one of them never generated; and the model's generation_config
    never = next(t for t in range(128) if t not in free)
    expected = reference(model, ids, max_new_tokens=NEW_TOKENS, eos_token_id=[never, stop])
    assert torch.equal(ours(model, ids, method, max_new_tokens=NEW_TOKENS, eos_token_id=[never, stop]), expected)
    configured = copy.deepcopy(model)
    configured.generation_config.eos_token_id = stop
    assert torch.equal(ours(configured, ids, method, max_new_tokens=NEW_TOKENS), expected)


def test_max_length_and_the_default_length_are_honoured(models):
    model, ids = models["llama"], prompt_ids(0)
    for kwargs in ({"max_length": ids.shape[1] + 9}, {}, {"max_new_tokens": 1}):  # {}: generate's default, 20 new
        expected = reference(model, ids, **kwargs)
        got = ours(model, ids, "anpd", **kwargs)
        assert torch.equal(got, expected), kwargs
    assert ours(model, ids, "anpd", max_length=ids.shape[1] + 9).shape == (1, ids.shape[1] + 9)


def test_the_result_keeps_generates_contract(models):
    model = models["qwen2"]
    ids = prompt_ids(0)
    mask = torch.ones_like(ids)
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    got = model.generate(input_ids=ids, attention_mask=mask, custom_generate=GENERATE, method="pld",
                         max_new_tokens=12, do_sample=False)
    assert type(got) is type(expected) is torch.Tensor
    assert got.dtype == expected.dtype == torch.long and got.device == ids.device
    assert got.shape == expected.shape == (1, ids.shape[1] + 12)
    assert torch.equal(got[:, : ids.shape[1]], ids)
    from transformers.generation import GenerateDecoderOnlyOutput

    expected_dict = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    got_dict = ours(model, ids, "anpd", max_new_tokens=12, return_dict_in_generate=True)
    assert isinstance(got_dict, GenerateDecoderOnlyOutput) and isinstance(expected_dict, GenerateDecoderOnlyOutput)
    assert torch.equal(got_dict.sequences, expected_dict.sequences)


@pytest.mark.parametrize("method", ["ar", "anpd", "pld"])
def test_sampled_settings_give_valid_outputs(models, method):
    model, ids = models["gemma3"], prompt_ids(0)
    for kwargs in ({}, {"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.8, "temperature": 1.3},
                   {"top_k": 0, "top_p": 0.5}):
        stats = verispec.GenerationStats()
        out = model.generate(ids, custom_generate=GENERATE, method=method, do_sample=True, max_new_tokens=16,
                             seed=3, stats=stats, **kwargs)
        assert out.shape == (1, ids.shape[1] + 16) and out.dtype == torch.long, kwargs
        assert torch.equal(out[:, : ids.shape[1]], ids)
        assert bool(((out >= 0) & (out < 128)).all())
        assert stats.new_tokens == 16


def test_sampling_follows_transformers_defaults_and_seeds(models):
    model, ids = models["llama"], prompt_ids(0)

    def sample(seed=None, **kwargs):
        return model.generate(ids, custom_generate=GENERATE, method="anpd", do_sample=True, max_new_tokens=12,
                              seed=seed, **kwargs)[0, ids.shape[1]:].tolist()

    # top_k=1 is greedy under any temperature: the defaults would not be, so this shows top_k is read
    greedy = reference(model, ids, max_new_tokens=12)[0, ids.shape[1]:].tolist()
    assert sample(seed=0, top_k=1, temperature=5.0) == greedy
    # the same seed, the same sample; torch.manual_seed stands in for a seed
    assert sample(seed=4) == sample(seed=4)
    torch.manual_seed(11)
    first = sample()
    torch.manual_seed(11)
    assert sample() == first
    assert any(sample(seed=s) != sample(seed=4) for s in (5, 6, 7))
    # do_sample=False is greedy whatever the temperature
    assert ours(model, ids, "anpd", max_new_tokens=12, temperature=5.0)[0, ids.shape[1]:].tolist() == greedy


def test_sampling_reads_the_model_generation_config():
    """The model's generation_config top_k applies as in generate(): top_k=1 there makes sampling
    greedy; transformers' own default (50) would not on this flat-ish model."""
    model = helpers.make_model(helpers.make_config("llama", init=0.3), seed=1)
    ids = prompt_ids(0)
    greedy = reference(model, ids, max_new_tokens=12)
    model.generation_config.top_k = 1
    model.generation_config.do_sample = True
    model.generation_config.temperature = 3.0
    for seed in (0, 1, 2):
        assert torch.equal(model.generate(ids, custom_generate=GENERATE, method="pld", max_new_tokens=12, seed=seed),
                           greedy)
    model.generation_config.top_k = None  # now transformers' default top-k 50 at temperature 3: not greedy
    outs = [model.generate(ids, custom_generate=GENERATE, method="pld", max_new_tokens=12, seed=s) for s in range(3)]
    assert any(not torch.equal(out, greedy) for out in outs)


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "nope"}, "unknown method"),
    ({"num_beams": 2}, "num_beams"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size"),
    ({"output_scores": True, "return_dict_in_generate": True}, "output_scores"),
    ({"prompt_lookup_num_tokens": 3}, "prompt_lookup_num_tokens"),
    ({"max_time": 10.0}, "max_time"),
    ({"do_sample": True, "min_p": 0.1}, "min_p"),
    ({"min_new_tokens": 3, "eos_token_id": 5}, "min_new_tokens"),
    ({"stats": {}}, "GenerationStats"),
    ({"token_type_ids": torch.zeros(1, 20, dtype=torch.long)}, "token_type_ids"),
])
def test_unsupported_options_are_refused_by_name(models, kwargs, match):
    kwargs = {"method": "anpd", **kwargs}
    with pytest.raises(ValueError, match=match):
        models["gpt2"].generate(prompt_ids(0), custom_generate=GENERATE, max_new_tokens=4, **kwargs)


def test_logits_processors_and_stopping_criteria_lists_are_refused(models):
    from transformers import LogitsProcessorList, StoppingCriteriaList, TopKLogitsWarper
    from transformers.generation.stopping_criteria import MaxTimeCriteria

    model, ids = models["llama"], prompt_ids(0)
    with pytest.raises(ConfigError, match="logits_processor: TopKLogitsWarper"):
        ours(model, ids, "anpd", max_new_tokens=4, logits_processor=LogitsProcessorList([TopKLogitsWarper(3)]))
    with pytest.raises(ConfigError, match="max_time"):
        ours(model, ids, "anpd", max_new_tokens=4, stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(5.0)]))


def test_a_batch_and_padding_are_refused(models):
    model = models["llama"]
    batch = torch.cat([prompt_ids(0), prompt_ids(1)])  # [2, 20]
    with pytest.raises(ConfigError, match="one sequence at a time.*batch of 2"):
        ours(model, batch, "anpd", max_new_tokens=4)
    ids = prompt_ids(0)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with pytest.raises(ConfigError, match="attention_mask with padding"):
        model.generate(input_ids=ids, attention_mask=mask, custom_generate=GENERATE, method="anpd", max_new_tokens=4)


def test_the_target_is_built_once_and_rebuilt_when_the_weights_change():
    model = helpers.make_model(helpers.make_config("llama", init=0.3), seed=2)
    ids = prompt_ids(0)
    ours(model, ids, "anpd", max_new_tokens=8)
    first = target_for(model)
    ours(model, ids, "pld", max_new_tokens=8)
    assert target_for(model) is first
    with torch.no_grad():  # in place, as an optimizer step would: the fast path's fused copies are stale
        for parameter in model.parameters():
            parameter.mul_(1.5)
    expected = reference(model, ids, max_new_tokens=NEW_TOKENS)
    assert torch.equal(ours(model, ids, "anpd", max_new_tokens=NEW_TOKENS), expected)
    assert target_for(model) is not first
    # a copy of the model gets its own Target, never the original's
    clone = copy.deepcopy(model)
    assert torch.equal(ours(clone, ids, "anpd", max_new_tokens=NEW_TOKENS), expected)
    assert target_for(clone) is not target_for(model)


def test_the_models_modes_are_left_as_they_were():
    model = helpers.make_model(helpers.make_config("gpt2", init=0.3), seed=2)  # dropout 0.1
    ids = prompt_ids(0)
    ours(model, ids, "anpd", max_new_tokens=4)  # the Target exists: what follows reuses it
    model.train()
    model.transformer.h[0].eval()  # a mixed state, restored module by module
    modes = [module.training for module in model.modules()]
    got = ours(model, ids, "anpd", max_new_tokens=NEW_TOKENS)
    assert [module.training for module in model.modules()] == modes
    model.eval()
    assert torch.equal(got, reference(model, ids, max_new_tokens=NEW_TOKENS))  # no dropout ran
