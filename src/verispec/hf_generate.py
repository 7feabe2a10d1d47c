"""The transformers drop-in: any loaded causal LM decodes with a verispec method from `generate()`.

Spelling (transformers 5.x passes a callable `custom_generate` the prepared inputs, the resolved
`GenerationConfig` and the logits processors / stopping criteria it built, and routes to it every
`generate()` keyword that the callable's signature names)::

    import verispec
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    ids = model.generate(**inputs, custom_generate=verispec.transformers_generate,
                         method="anpd", max_new_tokens=64)          # same contract as generate()
    print(tokenizer.decode(ids[0]))

It returns what `generate()` returns for one sequence: a LongTensor [1, prompt + new] of the
prompt followed by the new tokens (on the prompt's device), or, with
`return_dict_in_generate=True`, a `GenerateDecoderOnlyOutput` holding only `sequences`.

What it honours, with transformers' meaning: `max_new_tokens` / `max_length`; the stop tokens
(`eos_token_id` of the call or of `model.generation_config`, int or list; the output ends with
the first one generated); `do_sample` (False = greedy, whatever the temperature) and, when
sampling, `temperature` / `top_k` / `top_p` as transformers resolves them (call > the model's
generation_config > transformers' defaults, so `do_sample=True` alone samples at temperature 1
with top-k 50, as `generate()` would). Randomness: `seed=` (an int), else a seed drawn from
torch's global generator, so `torch.manual_seed(...)` makes a sampled call reproducible.

verispec's own keywords: `method=` (default "anpd"; `verispec.method_names()`, or a name with
settings as in `verispec bench --methods`, e.g. "anpd/tree=8"), `seed=`,
`stats=` (a `verispec.GenerationStats`, overwritten with this call's counts: drafted, accepted,
target forwards, timings), and every `verispec.MethodOptions` field: `draft_length`,
`controller`, `ngram_max_n`, `span_min`, `pld_max_ngram`, `exit_head`, `draft_model`, `draft_vocab`, `beams`, `tau`,
`no_repeat_ngram`, `head_int8`, `ngram_memory`, `tree`, and suffix's `max_tree_depth`, `max_spec_factor`, `min_token_prob`,
`max_cached_requests` (left unset: the method's default). `draft_model=` (sps, mtad) takes a
model you loaded (a transformers causal LM with the same tokenizer, on the model's device) or a
path; transformers' own `assistant_model=` never reaches a callable `custom_generate`.

Every method runs on every device: the model runs on verispec's CPU fast path where its
architecture has one (Llama, Qwen2, Gemma 3 on the CPU), else through its own PyTorch forward
(any device); eesd, sps/mtad with the exit head, tree drafts and mtad's beams there need a model
of a family the PyTorch path can take apart (`verispec.torch_path.FAMILIES`), and say so for any
other.

Refused with a `ConfigError` (a ValueError) naming the option: a batch of more than one
sequence, `num_return_sequences` > 1, an attention mask with padding, beam search and the other
decoding modes (`num_beams`, `penalty_alpha`, `prompt_lookup_num_tokens` -- use method="pld"
--, `dola_layers`, ...), every logits processor but the sampling warpers above (e.g.
`repetition_penalty`, `min_new_tokens` with an EOS, `bad_words_ids`, a `logits_processor=`
list; pass the neutral value when the model's generation_config sets one, e.g.
`repetition_penalty=1.0`), stopping criteria other than length and EOS (`max_time`,
`stop_strings`, a `stopping_criteria=` list), `output_scores` / `output_logits` /
`output_attentions` / `output_hidden_states`, a cache passed in, and model inputs other than
`input_ids` (e.g. `inputs_embeds`). transformers does not hand a callable `custom_generate` the
`streamer`, `assistant_model` or `tokenizer` of the call (it drops them before calling it), so
they cannot be refused here: do not pass them.

The model is wrapped in a `verispec.Target` once (kept on the model object, so it lives and dies
with it; a copy or pickle of the model carries none) and rebuilt when a parameter or buffer
changes (in place, or by `.to()`), since the fast path keeps its own fused forms of the weights.
The call runs the model in eval mode (no dropout) and restores each module's mode afterwards.
Methods needing extra files refuse as they do elsewhere (eesd without an exit head for this
model; sps / mtad without `draft_model=` or an exit head). A loaded draft model gets its
`Target` the same way, kept on the draft model object.
"""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from dataclasses import fields

import torch

from .core.engine import DecodeConfig, decode
from .errors import ConfigError
from .core.methods import MethodOptions, build, get_method, with_settings
from .target.model import Target
from .core.sampling import MAX_SEED, SamplingConfig
from .core.stats import GenerationStats

# The option each logits processor comes from, and how to turn it off: named when refusing one.
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": ("repetition_penalty", "repetition_penalty=1.0"),
    "NoRepeatNGramLogitsProcessor": ("no_repeat_ngram_size", "no_repeat_ngram_size=0"),
    "NoBadWordsLogitsProcessor": ("bad_words_ids", "bad_words_ids=None"),
    "SequenceBiasLogitsProcessor": ("sequence_bias", "sequence_bias=None"),
    "MinLengthLogitsProcessor": ("min_length / min_new_tokens", "min_length=0, min_new_tokens=None"),
    "MinNewTokensLengthLogitsProcessor": ("min_new_tokens", "min_new_tokens=None"),
    "PrefixConstrainedLogitsProcessor": ("prefix_allowed_tokens_fn", "prefix_allowed_tokens_fn=None"),
    "ForcedBOSTokenLogitsProcessor": ("forced_bos_token_id", "forced_bos_token_id=None"),
    "ForcedEOSTokenLogitsProcessor": ("forced_eos_token_id", "forced_eos_token_id=None"),
    "InfNanRemoveLogitsProcessor": ("remove_invalid_values", "remove_invalid_values=False"),
    "ExponentialDecayLengthPenalty": ("exponential_decay_length_penalty", "exponential_decay_length_penalty=None"),
    "SuppressTokensLogitsProcessor": ("suppress_tokens", "suppress_tokens=None"),
    "SuppressTokensAtBeginLogitsProcessor": ("begin_suppress_tokens", "begin_suppress_tokens=None"),
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": ("guidance_scale", "guidance_scale=None"),
    "TopHLogitsWarper": ("top_h", "top_h=None"),
    "MinPLogitsWarper": ("min_p", "min_p=None"),
    "TypicalLogitsWarper": ("typical_p", "typical_p=1.0"),
    "EpsilonLogitsWarper": ("epsilon_cutoff", "epsilon_cutoff=0.0"),
    "EtaLogitsWarper": ("eta_cutoff", "eta_cutoff=0.0"),
    "WatermarkLogitsProcessor": ("watermarking_config", "watermarking_config=None"),
    "SynthIDTextWatermarkLogitsProcessor": ("watermarking_config", "watermarking_config=None"),
}
_CRITERIA_OPTIONS = {"MaxTimeCriteria": "max_time", "StopStringCriteria": "stop_strings"}
# What triggers each decoding mode other than greedy search and sampling.
_MODE_OPTIONS = {
    "contrastive_search": "penalty_alpha", "assisted_generation": "prompt_lookup_num_tokens / assistant_early_exit / use_mtp",
    "dola_generation": "dola_layers", "beam_search": "num_beams", "beam_sample": "num_beams",
    "group_beam_search": "num_beams / num_beam_groups", "constrained_beam_search": "constraints / force_words_ids",
}
# Model inputs that generate() prepares itself and that carry nothing for a single unpadded row.
_PREPARED_INPUTS = {"attention_mask", "position_ids", "cache", "logits_to_keep", "use_cache"}


def transformers_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool = False,
    streamer=None,
    *,
    method: str = "anpd",
    seed: int | None = None,
    draft_length: int | None = None,
    controller: str | None = None,
    ngram_max_n: int | None = None,
    pld_max_ngram: int | None = None,
    exit_head: str | None = None,
    draft_model=None,
    draft_vocab: int | None = None,
    beams: int | None = None,
    tau: float | None = None,
    no_repeat_ngram: int | None = None,
    head_int8: bool | None = None,
    ngram_memory: bool | None = None,
    tree: int | None = None,
    span_min: int | None = None,
    max_tree_depth: int | None = None,
    max_spec_factor: float | None = None,
    min_token_prob: float | None = None,
    max_cached_requests: int | None = None,
    stats: GenerationStats | None = None,
    **model_kwargs,
):
    """`model.generate(..., custom_generate=verispec.transformers_generate, method=...)`: decode
    one sequence with a verispec method; see the module docstring for what is honoured and what
    is refused. Called by transformers' `generate()`, not directly."""
    arguments = locals()  # the MethodOptions keywords are read from here by field name
    if generation_config is None:
        raise ConfigError("transformers_generate is called by model.generate(..., custom_generate=...), not directly")
    if streamer is not None:
        raise ConfigError("streamer is not supported by verispec's custom_generate")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError("verispec's custom_generate needs a decoder-only (causal) language model")
    given = {field.name: arguments[field.name] for field in fields(MethodOptions)}
    given["draft_model"] = _draft_model(draft_model)
    method, options = with_settings(method, MethodOptions(**{key: value for key, value in given.items()
                                                             if value is not None}))
    if get_method(method).default_sampling and not generation_config.do_sample:
        raise ConfigError(f"{method} samples (it has no greedy form): pass do_sample=True")
    if stats is not None and not isinstance(stats, GenerationStats):
        raise ConfigError(f"stats must be a verispec.GenerationStats, got {type(stats).__name__}")
    _check_generation_config(generation_config)
    _check_single_row(input_ids, model_kwargs)
    max_length, stop_ids = _stops(stopping_criteria or [], generation_config)
    sampling = _sampling(generation_config, logits_processor or [], seed)
    prompt = input_ids[0].tolist()
    config = DecodeConfig(max_length - len(prompt), sampling, stop_ids)

    counts = GenerationStats(method=method)
    with _eval_mode(model):
        target = target_for(model)
        recipe = build(method, target, options, sampling)
        new = [token for step in decode(target, recipe, prompt, config, counts) for token in step]
    if stats is not None:  # the caller's object now holds this call's counts, and only them
        for field in fields(GenerationStats):
            setattr(stats, field.name, getattr(counts, field.name))
    sequences = torch.cat([input_ids, input_ids.new_tensor([new])], dim=1)  # [1, prompt + new]
    if generation_config.return_dict_in_generate:
        from transformers.generation import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


# -- the Target of a model, built once ---------------------------------------------------------

class _TargetSlot:
    """The Target built for a model, kept as an attribute of that model: it lives and dies with
    the model (a WeakKeyDictionary would keep it alive forever, the Target holding the model).
    Copies and pickles of the model get an empty slot, never the Target's packed weights."""

    def __init__(self) -> None:
        self.target: Target | None = None
        self.fingerprint: tuple = ()

    def __deepcopy__(self, memo) -> "_TargetSlot":
        return _TargetSlot()

    def __reduce__(self):
        return (_TargetSlot, ())


_SLOT = "_verispec_target_slot"


def _fingerprint(model) -> tuple:
    """Changes when any parameter or buffer is replaced (`.to()`, reassignment) or modified in
    place (an optimizer step, `load_state_dict`): the fast path's fused weights are copies."""
    return tuple((t.data_ptr(), t._version, t.dtype, t.device)
                 for t in itertools.chain(model.parameters(), model.buffers()))


def target_for(model) -> Target:
    """The `Target` wrapping `model` (on the fast path where its architecture has one), built on
    first use and again after its weights change."""
    slot = model.__dict__.get(_SLOT)
    if slot is None:
        slot = _TargetSlot()
        object.__setattr__(model, _SLOT, slot)  # a plain attribute, not a registered submodule
    fingerprint = _fingerprint(model)
    if slot.target is None or slot.fingerprint != fingerprint:
        slot.target = None  # let the old one go before building the new one
        slot.target = Target(model, None, fast=True)
        slot.fingerprint = _fingerprint(model)
    return slot.target


def _draft_model(draft_model):
    """`draft_model=` as MethodOptions takes it: a path as it is, a loaded causal LM as its
    `Target` (built once, kept on that model)."""
    if draft_model is None or isinstance(draft_model, (str, Target)):
        return draft_model
    if isinstance(draft_model, os.PathLike):
        return str(draft_model)
    if not (isinstance(draft_model, torch.nn.Module) and hasattr(draft_model, "get_output_embeddings")):
        raise ConfigError(f"draft_model must be a loaded causal LM or a path, got {type(draft_model).__name__}")
    return target_for(draft_model)


@contextmanager
def _eval_mode(model):
    """Every module in eval mode inside the block (no dropout); each module's own mode restored after."""
    modes = [(module, module.training) for module in model.modules()]
    for module, _ in modes:
        module.training = False
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


# -- what generate() prepared, checked and translated -----------------------------------------

def _check_generation_config(generation_config) -> None:
    """Greedy search or sampling, one sequence, sequences only."""
    mode = generation_config.get_generation_mode().value
    if mode not in ("greedy_search", "sample"):
        raise ConfigError(
            f"{_MODE_OPTIONS.get(mode, mode)}: {mode.replace('_', ' ')} is not supported by verispec's "
            f"custom_generate, which decodes greedily (do_sample=False) or samples (do_sample=True), one beam"
        )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ConfigError("num_return_sequences > 1 is not supported by verispec's custom_generate (one sequence per call)")
    for option in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(generation_config, option, False):
            raise ConfigError(f"{option} is not supported by verispec's custom_generate (it returns sequences only)")


def _check_single_row(input_ids: torch.Tensor, model_kwargs: dict) -> None:
    """One unpadded prompt given as input ids, and nothing else the model would read."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ConfigError(
            f"verispec's custom_generate decodes one sequence at a time; got input_ids of shape "
            f"{tuple(input_ids.shape)} (a batch of {input_ids.shape[0] if input_ids.dim() == 2 else '?'})"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ConfigError("attention_mask with padding is not supported by verispec's custom_generate (one unpadded sequence)")
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        expected = torch.arange(input_ids.shape[1], device=positions.device)
        if positions.shape[-1] != input_ids.shape[1] or not bool((positions.reshape(-1, positions.shape[-1]) == expected).all()):
            raise ConfigError("position_ids other than 0..n-1 are not supported by verispec's custom_generate")
    cache = model_kwargs.get("cache")
    if cache is not None and getattr(cache, "_is_user_defined", False):
        raise ConfigError("a cache (past_key_values) passed to generate is not supported by verispec's custom_generate")
    unknown = sorted(key for key, value in model_kwargs.items() if value is not None and key not in _PREPARED_INPUTS)
    if unknown:
        raise ConfigError(f"verispec's custom_generate takes input_ids only; unsupported model inputs: {', '.join(unknown)}")


def _stops(criteria, generation_config) -> tuple[int, frozenset[int]]:
    """(max_length, stop token ids) from the stopping criteria generate() built: length and EOS
    are honoured, anything else is refused."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    max_length, stop_ids = generation_config.max_length, set()
    for criterion in criteria:
        if isinstance(criterion, MaxLengthCriteria):
            max_length = min(max_length, criterion.max_length) if max_length else criterion.max_length
        elif isinstance(criterion, EosTokenCriteria):
            stop_ids.update(torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
        else:
            name = type(criterion).__name__
            option = _CRITERIA_OPTIONS.get(name)
            raise ConfigError(
                f"{option or 'stopping_criteria'}: {name} is not supported by verispec's custom_generate "
                f"(it stops on max_new_tokens / max_length and eos_token_id only)"
            )
    return max_length, frozenset(stop_ids)


def _sampling(generation_config, processors, seed: int | None) -> SamplingConfig:
    """transformers' decoding rule as a SamplingConfig. Greedy unless do_sample; when sampling,
    the temperature / top-k / top-p warpers generate() built from the resolved generation config
    are the only processors accepted (log-softmax normalization too: it changes no probability)."""
    from transformers.generation.logits_process import (
        LogitNormalization, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    sampled = bool(generation_config.do_sample)
    temperature = float(generation_config.temperature if generation_config.temperature is not None else 1.0)
    top_k = int(generation_config.top_k or 0)
    top_p = float(generation_config.top_p if generation_config.top_p is not None else 1.0)
    expected = {  # the warpers generate() adds for these settings, and the value each must hold
        TemperatureLogitsWarper: ("temperature", temperature),
        TopKLogitsWarper: ("top_k", top_k),
        TopPLogitsWarper: ("top_p", top_p),
    }
    seen: set[type] = set()
    for processor in processors:
        kind = type(processor)
        if kind is LogitNormalization:
            continue
        if sampled and kind in expected and kind not in seen and getattr(processor, "min_tokens_to_keep", 1) == 1:
            attribute, value = expected[kind]
            if getattr(processor, attribute) == value:
                seen.add(kind)
                continue
        raise ConfigError(_processor_refusal(processor))
    if not sampled:
        return SamplingConfig()
    if seed is None:  # from torch's global generator: torch.manual_seed(...) reproduces the call
        seed = int(torch.randint(0, 2**62, (), dtype=torch.long))
    return SamplingConfig(temperature, top_k, top_p, seed % (MAX_SEED + 1))


def _processor_refusal(processor) -> str:
    name = type(processor).__name__
    if name in _PROCESSOR_OPTIONS:
        option, hint = _PROCESSOR_OPTIONS[name]
        return (f"{option} is not supported by verispec's custom_generate (it adds {name}); if the model's "
                f"generation_config sets it, pass {hint}")
    return (f"logits_processor: {name} is not supported by verispec's custom_generate (it applies "
            f"do_sample, temperature, top_k and top_p only)")
