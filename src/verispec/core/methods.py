"""Named recipes: method name -> (drafter, draft-length controller, acceptance rule).

The registry `METHODS` is the single list every shell (CLI, benchmark, server) offers; adding a
method here makes it available everywhere. `MethodOptions` carries every per-method knob, with
`None` meaning "the method's default". Defaults chosen by measurement are explained in README.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from .acceptance import verify_joint, verify_lossless
from .control import CUTS_AFTER_DRAFTING, ControllerMemory, controller_name, parse_controller
from .drafters.base import Drafter, NullDrafter
from .drafters.early_exit import EarlyExitDrafter, ExitHeadLM, PreparedHead, load_head
from .drafters.draft_model import MIN_DRAFT_VOCAB, AuxLM, BeamDrafter, DraftLM, SampledDrafter, frequent_vocabulary
from .drafters.hybrid import HybridDrafter, ModelAcceptance
from .drafters.ngram import AnpdDrafter, NgramConfig, PromptLookupDrafter
from .drafters.suffix import SuffixConfig, SuffixDrafter
from .engine import Recipe, Rule
from ..errors import ConfigError, ModelLoadError, UnknownMethodError
from ..notices import notice
from ..target.model import Target
from ..target.loading import load
from ..runtime.fastpath import BLOCK_KERNEL_MAX_ROWS
from .sampling import SamplingConfig

# The exit head trained for the embedded default model ships inside the package.
DEFAULT_EXIT_HEAD = Path(__file__).parents[1] / "data" / "exit_heads" / "gemma-3-270m"


# A tree and the committed token it follows must fit one call of the C layers (their widest).
TREE_MAX_NODES = BLOCK_KERNEL_MAX_ROWS - 1


@dataclass(frozen=True)
class MethodOptions:
    """Knobs shared by the shells. None = the method's own default."""

    draft_length: int | None = None  # K: most tokens drafted per step
    controller: str | None = None  # e.g. "constant:8", "beta-ts"
    ngram_max_n: int = 5  # ANPD: largest n-gram order
    pld_max_ngram: int = 3  # prompt lookup: longest n-gram matched
    exit_head: str | None = None  # EESD: directory of a trained exit head (default: the shipped one)
    draft_model: "str | Target | None" = None  # sps / mtad: draft model, a path or a loaded Target (default: the EESD exit head)
    draft_vocab: int = 0  # sps / mtad with a draft model: its head over this many tokens (0: all; drafters.draft_model)
    beams: int = 4  # mtad: beam width W
    tau: float = 0.5  # mtad: joint-likelihood threshold
    no_repeat_ngram: int = 6  # mtad: beams may not repeat an n-gram of the output (0: off; see drafters.draft_model)
    head_int8: bool = True  # EESD head: its layer on int8 forms (block-kernel targets), else float32
    ngram_memory: bool = True  # ANPD: also draft from earlier requests on the target (drafters.ngram)
    tree: int = 0  # ANPD: node budget of tree drafts, verified in one forward (0: single-path drafts)
    span_min: int = NgramConfig.span_min  # ANPD: shortest long match copied from (0: none; drafters.spans)
    # suffix (drafters.suffix.SuffixConfig, vLLM's defaults); ngram_memory=False means no global tree
    max_tree_depth: int = SuffixConfig.max_tree_depth  # depth of its suffix trees
    max_spec_factor: float = SuffixConfig.max_spec_factor  # a draft is at most this x the match length
    min_token_prob: float = SuffixConfig.min_token_prob  # a draft stops where its estimate falls below
    max_cached_requests: int = SuffixConfig.max_cached_requests  # earlier outputs in its global tree

    def __post_init__(self) -> None:
        if isinstance(self.tree, bool) or not isinstance(self.tree, int) or not 0 <= self.tree <= TREE_MAX_NODES:
            raise ConfigError(f"tree must be an integer from 0 (off) to {TREE_MAX_NODES} nodes, got {self.tree!r}")
        NgramConfig(max_n=self.ngram_max_n, span_min=self.span_min)  # validates the ANPD knobs
        if not isinstance(self.ngram_memory, bool):
            raise ConfigError(f"ngram_memory must be true or false, got {self.ngram_memory!r}")
        self.suffix_config()  # validates the suffix knobs
        if not self.ngram_memory and self.max_cached_requests not in (0, SuffixConfig.max_cached_requests):
            raise ConfigError(f"max_cached_requests={self.max_cached_requests} sizes suffix's memory across requests, "
                              f"which ngram_memory=false turns off; give only one")
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or not (
                self.draft_vocab == 0 or self.draft_vocab >= MIN_DRAFT_VOCAB):
            raise ConfigError(f"draft_vocab must be 0 (the whole vocabulary) or an integer >= {MIN_DRAFT_VOCAB}, "
                              f"got {self.draft_vocab!r}")
        if not isinstance(self.beams, int) or self.beams < 1:
            raise ConfigError(f"beams must be an integer >= 1, got {self.beams!r}")
        if not isinstance(self.tau, (int, float)) or not self.tau > 0:
            raise ConfigError(f"tau must be > 0, got {self.tau!r}")
        if isinstance(self.no_repeat_ngram, bool) or not isinstance(self.no_repeat_ngram, int) or self.no_repeat_ngram < 0:
            raise ConfigError(f"no_repeat_ngram must be an integer >= 0 (0: off), got {self.no_repeat_ngram!r}")
        if self.draft_length is not None and (not isinstance(self.draft_length, int) or self.draft_length < 1):
            raise ConfigError(f"draft length must be an integer >= 1, got {self.draft_length!r}")
        if self.controller is not None:
            parse_controller(self.controller, self.draft_length or 1)  # validates the spec
        if self.exit_head is not None and not Path(self.exit_head).expanduser().is_dir():
            raise ConfigError(f"exit head directory not found: {self.exit_head}")

    def suffix_config(self) -> SuffixConfig:
        """suffix's knobs; no global tree (max_cached_requests 0) without memory across requests."""
        return SuffixConfig(max_tree_depth=self.max_tree_depth, max_spec_factor=self.max_spec_factor,
                            min_token_prob=self.min_token_prob,
                            max_cached_requests=self.max_cached_requests if self.ngram_memory else 0)


MakeDrafter = Callable[[Target, MethodOptions, SamplingConfig], Drafter]


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    lossless: bool
    default_length: int
    make_drafter: MakeDrafter
    default_controller: str = "constant"
    make_rule: Callable[[MethodOptions], Rule] = lambda options: verify_lossless
    # Sampling defaults applied when a request leaves them unset (None = the global defaults:
    # greedy). mtad samples: temperature 1, top-k 10, top-p 0.9, as in the authors' code.
    default_sampling: dict | None = None
    # Under sampling its drafts are drawn from a draft distribution q (`Draft.drawn`): a
    # controller that cuts a draft after seeing it (`adaptive`) would bias what is accepted.
    draws: bool = False
    # The `MethodOptions` fields its drafter and rule read, besides the draft length and the
    # controller (which every method that drafts reads): what a shell may set for it.
    settings: frozenset = frozenset()

    def reads(self, setting: str, options: "MethodOptions | None" = None) -> bool:
        """Whether this method reads `setting` (a `MethodOptions` field) under `options`: the draft
        length and the controller where it drafts at all; the exit head (and its form) not where
        a draft model replaces it."""
        if setting in ("draft_length", "controller"):
            return self.default_length > 0
        if setting in HEAD_SETTINGS and "draft_model" in self.settings and options is not None \
                and options.draft_model is not None:
            return False
        if setting == "draft_vocab" and options is not None and options.draft_model is None:
            return False  # the exit head has a draft vocabulary of its own
        return setting in self.settings
    # It only samples (mtad's beams): greedy decoding (temperature 0) is refused.
    samples_only: bool = False


def trained_head_dir(target) -> Path:
    """Where `verispec train-exit` keeps the exit head it trains for `target` when given no --out,
    and where eesd looks for one: the cache, under the target's fingerprint (its architecture and
    weights, not the file's path)."""
    from .drafters.early_exit import target_fingerprint
    from ..paths import cache_root

    key = ("head-dir",)
    if key not in target.attachments:
        target.attachments[key] = cache_root() / "exit-heads" / target_fingerprint(target)
    return target.attachments[key]


def default_exit_head(target) -> Path:
    """The exit head eesd uses without --exit-head: one trained for `target` into the cache
    (`trained_head_dir`), else the one that ships with the package (for the embedded default)."""
    trained = trained_head_dir(target)
    return trained if (trained / "exit_head.json").is_file() else DEFAULT_EXIT_HEAD


def prepared_exit_head(target: Target, directory: str | None, int8: bool = True) -> PreparedHead:
    """The exit head for `target` (`default_exit_head` unless a directory is given), loaded once
    per target and form (`int8`: its layer on int8 forms where the target runs on the block
    kernel; `PreparedHead`)."""
    path = Path(directory).expanduser() if directory else default_exit_head(target)
    key = ("exit-head", str(path.resolve()), int8)
    if key not in target.attachments:
        if directory is None and not (path / "exit_head.json").is_file():
            raise ModelLoadError("no exit head ships with this installation; train one with `verispec train-exit`")
        try:
            head, spec = load_head(path, target, target.name)
        except ModelLoadError as error:
            if directory is None:
                raise ModelLoadError(
                    f"no exit head for {target.name}: train one once with `verispec train-exit --model "
                    f"{target.name}` (eesd then finds it), or pass --exit-head"
                ) from error
            raise
        target.attachments[key] = PreparedHead(target, head, spec, quantize=int8)
    return target.attachments[key]


def _eesd(target: Target, options: MethodOptions, sampling: SamplingConfig) -> Drafter:
    return EarlyExitDrafter(target, prepared_exit_head(target, options.exit_head, options.head_int8), sampling)


def draft_cost(target: Target, lm: DraftLM) -> float:
    """A draft token's cost in target steps: the weight bytes the draft model reads a token over
    the target's (an exit head: its exit layer's share of the layers, plus one layer)."""
    if isinstance(lm, AuxLM):
        return lm.model.target.weight_bytes_per_token / max(target.weight_bytes_per_token, 1)
    layers = target.config.num_hidden_layers
    return (lm.exit_layer + 1) / layers


def _hybrid(target: Target, options: MethodOptions, sampling: SamplingConfig) -> Drafter:
    ngram = AnpdDrafter.for_target(target.attachments, NgramConfig(max_n=options.ngram_max_n, span_min=options.span_min),
                                   options.ngram_memory, 0, target.tokenizer)
    lm = draft_lm(target, options)
    key = ("hybrid-acceptance", str(options.draft_model), str(options.exit_head), options.head_int8, options.draft_vocab)
    acceptance = target.attachments.setdefault(key, ModelAcceptance())
    return HybridDrafter(ngram, SampledDrafter(lm, sampling), draft_cost(target, lm), acceptance)


def draft_lm(target: Target, options: MethodOptions) -> DraftLM:
    """The auxiliary drafting model: --draft-model when given (a loaded Target, or a path loaded
    once per target on its device, on the fast path where the target and the draft model both
    have one, else on the PyTorch path), else the target's own first layers with the EESD exit
    head."""
    if options.draft_model is None:
        return ExitHeadLM(target, prepared_exit_head(target, options.exit_head, options.head_int8))
    if isinstance(options.draft_model, Target):
        return AuxLM(options.draft_model, target)
    path = str(Path(options.draft_model).expanduser())
    key = ("draft-model", path, options.draft_vocab)
    if key not in target.attachments:
        draft = load(path, target.dtype, fast=target.fast, device=target.device)
        if options.draft_vocab and not draft.restrict_vocabulary(frequent_vocabulary(draft, options.draft_vocab)):
            notice(f"{draft.name}: draft_vocab ignored (its logits come from the model's own forward)")
        target.attachments[key] = draft
    return AuxLM(target.attachments[key], target)


MTAD_SAMPLING = {"temperature": 1.0, "top_k": 10, "top_p": 0.9}
HEAD_SETTINGS = frozenset({"exit_head", "head_int8"})  # the EESD exit head a drafter reads
DRAFT_LM_SETTINGS = frozenset({"draft_model", "draft_vocab", *HEAD_SETTINGS})  # sps and mtad: a draft model, else the head
NGRAM_SETTINGS = frozenset({"ngram_max_n", "ngram_memory", "tree", "span_min"})
SUFFIX_SETTINGS = frozenset({"ngram_memory", "max_tree_depth", "max_spec_factor", "min_token_prob", "max_cached_requests"})


# Draft lengths and controllers chosen by measurement on the default model; see README.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ar", "autoregressive decoding: one target forward per token (the baseline)", True, 0,
               lambda target, options, sampling: NullDrafter()),
        Method("pld", "prompt lookup: copy what followed the last n-gram match in the context", True, 10,
               lambda target, options, sampling: PromptLookupDrafter(options.pld_max_ngram),
               settings=frozenset({"pld_max_ngram"})),
        Method("anpd", "ANPD: adaptive multi-level n-gram tables from the prompt and the output", True, 16,
               lambda target, options, sampling: AnpdDrafter.for_target(
                   target.attachments, NgramConfig(max_n=options.ngram_max_n, span_min=options.span_min), options.ngram_memory,
                   _tree_budget(target, options.tree), target.tokenizer),
               "adaptive", settings=NGRAM_SETTINGS),
        Method("eesd", "EESD: the target's first layers plus a trained exit head, Thompson-sampled length",
               True, 8, _eesd, "calibrated-ts", draws=True, settings=HEAD_SETTINGS),
        Method("sps", "speculative sampling with an auxiliary drafter (default: the EESD exit head)", True, 2,
               lambda target, options, sampling: SampledDrafter(draft_lm(target, options), sampling), draws=True,
               settings=DRAFT_LM_SETTINGS),
        Method("mtad", "MTAD: beam-sampled drafts, joint-likelihood acceptance (approximate joint decoding)",
               False, 2, lambda target, options, sampling: BeamDrafter(
                   draft_lm(target, options), options.beams, sampling, options.no_repeat_ngram),
               make_rule=lambda options: verify_joint(options.tau), default_sampling=MTAD_SAMPLING, draws=True,
               settings=DRAFT_LM_SETTINGS | {"beams", "tau", "no_repeat_ngram"},
               samples_only=True),
        Method("hybrid", "ANPD's n-gram drafts where they are expected to pay more, else the draft model's or "
               "the exit head's (a cost model of this machine's steps)", True, 16, _hybrid, "measured", draws=True,
               settings=(NGRAM_SETTINGS - {"tree"}) | DRAFT_LM_SETTINGS),
        Method("suffix", "SuffixDecoding: suffix trees over the prompt and earlier outputs (make suffix)", True, 24,
               lambda target, options, sampling: SuffixDrafter.for_target(target.attachments, options.suffix_config()),
               settings=SUFFIX_SETTINGS),
    )
}


_FLAG_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _flag(value: str) -> bool:
    try:
        return _FLAG_WORDS[value.strip().lower()]
    except KeyError:
        raise ValueError(value) from None


_DEFAULT_OPTIONS = MethodOptions()

# The settings a method spec may give (`parse_variant`), with how each is read from text.
VARIANT_OPTIONS = {"tau": float, "beams": int, "draft_vocab": int, "no_repeat_ngram": int, "head_int8": _flag, "ngram_memory": _flag,
                   "tree": int, "span_min": int, "max_tree_depth": int, "max_spec_factor": float,
                   "min_token_prob": float, "max_cached_requests": int}


def users_of(setting: str, options: MethodOptions | None = None) -> list[str]:
    """The methods that read `setting` (under `options`), in registry order."""
    return [name for name, method in METHODS.items() if method.reads(setting, options)]


def refuse_unread(names: Sequence[str], given: dict[str, str], options: MethodOptions | None = None,
                  also_read_by: dict[str, Sequence[str]] | None = None) -> None:
    """A ConfigError for a setting that none of the methods `names` reads: `given` maps each
    setting a user gave to how the user gave it (a CLI flag, a field), `also_read_by` names
    other readers of a setting (a benchmark's peers). A silently ignored setting makes a run, a
    benchmark above all, measure something other than what was asked."""
    also_read_by = also_read_by or {}
    for setting, shown in given.items():
        readers = [*users_of(setting, options), *also_read_by.get(setting, ())]
        if not set(readers) & set(names):
            note = ""
            if setting in HEAD_SETTINGS and options is not None and options.draft_model is not None:
                note = f" ({', '.join(users_of('draft_model'))} draft with the draft model, not with the exit head)"
            raise ConfigError(f"{shown} is used only by {', '.join(readers)}, not by {', '.join(names)}{note}")


def parse_variant(spec: str) -> tuple[str, str | None, dict]:
    """'METHOD[/CONTROLLER][/KEY=VALUE...]' -> (method, controller or None, option overrides).

    Used by the benchmark to run one method under several settings side by side, and by
    `with_settings` for every other shell's `method`, e.g.
    'eesd/constant:4', 'mtad/tau=0.1', 'eesd/head_int8=false', 'anpd/tree=8' or
    'suffix/max_spec_factor=2'. KEY is one of VARIANT_OPTIONS; each setting (and the controller)
    at most once. Validated."""
    name, *parts = spec.split("/")
    method = get_method(name.strip())
    controller, overrides = None, {}
    for part in parts:
        key, equals, value = part.partition("=")
        if not equals:
            if controller is not None:
                raise ConfigError(f"in {spec!r}: the controller is given twice, as {controller!r} and {part!r}; "
                                  f"give only one")
            controller = part
            parse_controller(controller, method.default_length or 1)
            continue
        if key not in VARIANT_OPTIONS:
            raise ConfigError(f"in {spec!r}: unknown option {key!r} (known: {', '.join(VARIANT_OPTIONS)})")
        if key in overrides:
            raise ConfigError(f"in {spec!r}: {key} is given twice; give only one")
        if not method.reads(key):
            users = "/".join(users_of(key))
            raise ConfigError(f"in {spec!r}: {key} is {'an' if users[0] in 'aeiou' else 'a'} {users} option, "
                              f"not one of {method.name}")
        try:
            overrides[key] = VARIANT_OPTIONS[key](value)
        except ValueError:
            kind = {_flag: "true or false", int: "an integer"}.get(VARIANT_OPTIONS[key], "a number")
            raise ConfigError(f"in {spec!r}: {key} must be {kind}, got {value!r}") from None
    MethodOptions(**overrides)  # validates the values
    return method.name, controller, overrides


def with_settings(spec: str, options: MethodOptions | None = None) -> tuple[str, MethodOptions]:
    """A method with its settings, in `parse_variant`'s syntax (e.g. 'anpd/tree=8',
    'pld/constant:12', or a plain name), as (method name, `options` with the spec's settings
    applied): the one syntax of `--method` in every command, of the library's `method=` and of
    the server's `method` field. A setting that `options` already gives another value (not its
    default), or a draft length given both as `options.draft_length` and in the spec's
    controller, is a ConfigError naming both: one of them would be silently ignored."""
    name, controller, overrides = parse_variant(spec)
    base = options if options is not None else MethodOptions()
    settings = {**({"controller": controller} if controller is not None else {}), **overrides}
    for key, value in settings.items():
        given = getattr(base, key)
        if given != getattr(_DEFAULT_OPTIONS, key) and given != value:
            raise ConfigError(f"{key} is given twice, as {given!r} and as {value!r} in the method {spec!r}; "
                              f"give only one")
    if controller is not None and ":" in controller and base.draft_length is not None:
        raise ConfigError(f"the draft length is given twice, as {base.draft_length} and in the method {spec!r}; "
                          f"give only one")
    return name, replace(base, **settings) if settings else base


def method_request(spec: str, max_draft_length: int | None = None, max_beams: int | None = None,
                   max_cached_requests: int | None = None) -> tuple[str, MethodOptions]:
    """`with_settings(spec)`, refused (a ConfigError) where it asks for more than
    `max_draft_length` draft tokens a step or `max_beams` beams (bounds on what one request may
    make a forward compute: the server's), or for a suffix cache of more than
    `max_cached_requests` earlier outputs (-1, unbounded, included)."""
    name, options = with_settings(spec)
    cached = options.max_cached_requests
    if max_cached_requests is not None and not 0 <= cached <= max_cached_requests:
        raise ConfigError(f"in {spec!r}: max_cached_requests must be from 0 to {max_cached_requests}, got {cached}")
    length = get_method(name).default_length
    if options.controller is not None and ":" in options.controller:
        length = int(options.controller.partition(":")[2])
    if max_draft_length is not None and length > max_draft_length:
        raise ConfigError(f"in {spec!r}: at most {max_draft_length} draft tokens a step, got {length}")
    if max_beams is not None and options.beams > max_beams:
        raise ConfigError(f"in {spec!r}: at most {max_beams} beams, got {options.beams}")
    return name, options


def method_names() -> list[str]:
    return list(METHODS)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise UnknownMethodError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None


CONTROLLER_MEMORIES = 64  # per target; a server's requests may each bring other settings


def controller_memory(target: Target, key: tuple) -> ControllerMemory:
    """The target's `ControllerMemory` for `key`, kept in a least-recently-used table of at most
    CONTROLLER_MEMORIES entries (the key holds float sampling settings: unbounded otherwise)."""
    memories = target.attachments.setdefault("controller-memories", OrderedDict())
    memory = memories.pop(key, None) or ControllerMemory()
    memories[key] = memory
    while len(memories) > CONTROLLER_MEMORIES:
        memories.popitem(last=False)
    return memory


def _tree_budget(target: Target, tree: int) -> int:
    """ANPD's node budget on `target`: `tree`, or 0 (single-path drafts: the tree's best branch)
    where the target cannot verify trees (a model the PyTorch path cannot mask), said once per
    target with the reason."""
    if tree and not target.verifies_trees:
        if not target.attachments.get("tree-fallback-said"):
            from ..target.torch_path import unsupported

            target.attachments["tree-fallback-said"] = True
            print(f"[verispec] {target.name} cannot verify trees of drafts ({unsupported(target.model)}); "
                  f"anpd drafts single paths on it", file=sys.stderr, flush=True)
        return 0
    return tree


def check_settings(name: str, options: MethodOptions, sampling: SamplingConfig) -> None:
    """A ConfigError where a method's settings do not go together, for any target: tree drafts for
    a method other than anpd, greedy decoding for a method that only samples (its message begins
    with "temperature"), or, under sampling, a controller that cuts a drawn draft after seeing it
    (which would bias what is accepted). `build` checks it; shells call it first, to refuse a
    request before it runs."""
    method = get_method(name)
    if method.samples_only and sampling.greedy:
        raise ConfigError(f"temperature must be > 0 for {method.name}, which samples its drafts (its default is "
                          f"{(method.default_sampling or {}).get('temperature', 1.0):g})")
    if options.tree and method.name not in ("anpd", "ar"):  # ar drafts nothing, whatever the options say
        raise ConfigError(f"tree drafts (tree={options.tree}) are an anpd option, not one of {method.name}")
    spec = options.controller or method.default_controller
    if method.name != "ar" and method.draws and not sampling.greedy and controller_name(spec) in CUTS_AFTER_DRAFTING:
        raise ConfigError(
            f"the {controller_name(spec)} controller chooses how much of a draft to verify after "
            f"seeing all of it, which would bias {method.name}'s sampled drafts; use constant, "
            f"heuristic, beta-ts or calibrated-ts (they stop before drawing the next token)"
        )


def build(name: str, target: Target, options: MethodOptions = MethodOptions(),
          sampling: SamplingConfig = SamplingConfig()) -> Recipe:
    """A fresh recipe (drafter with its own state, controller, rule) for one request."""
    check_settings(name, options, sampling)
    method = get_method(name)
    length = options.draft_length if options.draft_length is not None else method.default_length
    if method.name == "ar":  # nothing to draft, whatever the options say
        controller = parse_controller("constant", 0)
    else:
        spec = options.controller or method.default_controller
        # What the controller learns carries over to the next request with the same drafter,
        # settings and controller (see ControllerMemory); the seed is not part of the key.
        key = (method.name, spec, length, options, sampling.temperature, sampling.top_k, sampling.top_p)
        memory = controller_memory(target, key)
        controller = parse_controller(spec, length, memory)
        drafter = method.make_drafter(target, options, sampling)
        if hasattr(drafter, "measure_with"):  # a drafter that chooses its own lengths (hybrid)
            drafter.measure_with(memory.cost)
        return Recipe(drafter, controller, method.make_rule(options))
    return Recipe(method.make_drafter(target, options, sampling), controller, method.make_rule(options))
