"""Shared test helpers: tiny random-weight models, a character tokenizer, scripted drafters,
and small statistics utilities.

Nothing here downloads anything: every model is built from a config with seeded random weights,
and the tokenizer is built in memory from a `tokenizers` BPE model without merges (one token per
character, plus a few multi-character tokens that only the model can emit).
"""

from __future__ import annotations

import random
import warnings
from typing import Callable, Sequence

import torch

from verispec.core.acceptance import verify_lossless
from verispec.core.control import ConstantLength
from verispec.core.drafters.base import Draft
from verispec.core.engine import DecodeConfig, Recipe, decode
from verispec.gguf.blocks import BlockWeights
from verispec.target.model import Target
from verispec.core.sampling import SamplingConfig, probabilities
from verispec.core.stats import GenerationStats

ARCHITECTURES = ("llama", "gemma3", "qwen2", "gpt2")
SLIDING_WINDOW = 8  # Gemma 3 and Qwen2 tiny models: far shorter than the test sequences


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def with_threads(threads: int, function):
    """function() run with torch (and the kernels, which read it) on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return function()
    finally:
        torch.set_num_threads(previous)


def make_config(arch: str, vocab_size: int = 128, init: float = 0.1, max_positions: int = 512, **extra):
    """A tiny float32 config of one of ARCHITECTURES (2-3 layers, hidden 64; see also
    `micro_llama_config`)."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config

    no_special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
            initializer_range=init, **no_special,
        )
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            max_position_embeddings=max_positions, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            # Untied: with tied embeddings (scaled by sqrt(hidden)) a tiny random Gemma 3 just
            # repeats its last input token, which would make every equivalence test trivial.
            tie_word_embeddings=False,
            initializer_range=init, **no_special,
        )
    elif arch == "qwen2":
        # max_window_layers=1: layer 0 full attention, layer 1 sliding (window 8).
        config = Qwen2Config(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
            use_sliding_window=True, sliding_window=SLIDING_WINDOW, max_window_layers=1,
            initializer_range=init, **no_special,
        )
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_layer=2, n_head=4, n_positions=max_positions,
            initializer_range=init, **no_special,
        )
    else:
        raise ValueError(arch)
    for key, value in extra.items():
        setattr(config, key, value)
    return config


def mistral_config(vocab_size: int = 128, init: float = 0.1, max_positions: int = 512):
    """A tiny float32 Mistral (2 layers, hidden 64): every layer slides over a window of
    `SLIDING_WINDOW` positions. For the PyTorch path's tests (no fast path)."""
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        sliding_window=SLIDING_WINDOW, initializer_range=init, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def neox_config(vocab_size: int = 128):
    """A tiny GPT-NeoX: a family verispec's PyTorch path does not take apart (refusal tests)."""
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def micro_llama_config(vocab_size: int = 8, init: float = 0.5, max_positions: int = 64):
    """The smallest useful Llama (1 layer, hidden 32), for tests that run thousands of requests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
        initializer_range=init, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def make_model(config, seed: int = 0):
    """A random-weight float32 causal LM from `config`, seeded."""
    from transformers import AutoModelForCausalLM

    _quiet()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0  # silences generate()'s pad warning; no effect on ids
    return model.eval()


def make_target(arch: str, seed: int = 0, tokenizer=None, fast: bool = True, **config_kwargs) -> Target:
    """A Target on the fast path (where the architecture has one) or, with fast=False, on
    transformers' eager forward."""
    model = make_model(make_config(arch, **config_kwargs), seed)
    return Target(model, tokenizer, name=f"tiny-{arch}" + ("" if fast else "-eager"), fast=fast)


# Every architecture on each forward path it has: the fast path (not for GPT-2), the fast path
# with its linears on the int8 block kernel (weights made block-exact first), and the eager one.
FAST_ARCHITECTURES = tuple(arch for arch in ARCHITECTURES if arch != "gpt2")
PATHS = (
    FAST_ARCHITECTURES
    + tuple(f"{arch}-blocks" for arch in FAST_ARCHITECTURES)
    + tuple(f"{arch}-eager" for arch in ARCHITECTURES)
)


def make_target_for_path(path: str, seed: int = 0, **kwargs) -> Target:
    arch, _, variant = path.partition("-")
    if variant == "blocks":
        model = make_model(make_config(arch, **kwargs), seed)
        return Target(model, None, name=f"tiny-{arch}-blocks", fast=True, blocks=blockify(model))
    return make_target(arch, seed=seed, fast=not variant, **kwargs)


def block_quantize(weight: torch.Tensor, block: int, affine: bool) -> BlockWeights:
    """An int8 block form near `weight` [out, in], as GGUF quantizers make them: symmetric
    (8-bit codes, one fp16-rounded scale per block, like Q8_0/Q6_K) or affine (4-bit codes 0..15
    with a scale and an offset per block, like Q4_K's sub-blocks)."""
    out = weight.shape[0]
    grouped = weight.detach().view(out, -1, block)  # [out, nb, block]
    if affine:
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = ((high - low) / 15).half().float()
        offsets = (-low).half().float()
        codes = ((grouped + offsets.unsqueeze(-1)) / scales.unsqueeze(-1)).round().clamp(0, 15)
    else:
        scales = (grouped.abs().amax(-1) / 127).half().float()
        offsets = None
        codes = (grouped / scales.unsqueeze(-1)).round().clamp(-127, 127)
    return BlockWeights(codes.to(torch.int8).view(out, -1).contiguous(), scales, offsets, block)


def blockify(model) -> dict:
    """Make the decoder's linear weights and the LM head of `model` exactly block-representable,
    in the real GGUF model's mix of formats (symmetric blocks of 32 for q/k/v, gate/up and the
    head; affine 4-bit blocks of 32 for o; symmetric blocks of 16 for down), and return their block
    forms {nn.Linear: BlockWeights} for `Target(..., blocks=...)`."""
    formats = {"o_proj": (32, True), "down_proj": (16, False)}
    modules = [model.get_output_embeddings()]
    for layer in model.get_decoder().layers:
        attention, mlp = layer.self_attn, layer.mlp
        modules += [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                    mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    blocks = {}
    with torch.no_grad():
        for module in modules:
            block, affine = formats.get(names[module], (32, False))
            form = block_quantize(module.weight, block, affine)
            module.weight.copy_(form.dequantize())
            blocks[module] = form
    return blocks


def hf_greedy(model, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding: the external oracle."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(prompt):].tolist()


def run(
    target: Target,
    recipe: Recipe,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_token_ids: Sequence[int] = (),
) -> tuple[list[int], GenerationStats, list[list[int]]]:
    """Run the engine to the end: (new ids, stats, the per-step committed lists)."""
    stats = GenerationStats()
    config = DecodeConfig(max_new_tokens, sampling, frozenset(stop_token_ids))
    steps = [list(step) for step in decode(target, recipe, list(prompt), config, stats)]
    return [t for step in steps for t in step], stats, steps


def scripted_recipe(drafter, k: int) -> Recipe:
    return Recipe(drafter, ConstantLength(k), verify_lossless)


def repetitive_prompt(vocab_size: int, seed: int, period: int = 6, repeats: int = 4) -> list[int]:
    """A random motif repeated: n-gram drafters find matches in it."""
    generator = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab_size, (period,), generator=generator).tolist()
    return motif * repeats


class ScriptedDrafter:
    """A drafter that forces the verification outcome, given the true (greedy) continuation.

    reference: the target's greedy output after the prompt (the `ar` output). At each step the
    drafter proposes tokens for positions pos..pos+k-1 of that output, where pos is how many
    tokens have been generated:
      - "all":     the true next k tokens (all accepted);
      - "none":    k tokens each different from the true one (none accepted);
      - "partial": the first `right` true tokens, then wrong ones;
      - "random":  a random number (0..k) of true tokens, then random wrong ones (seeded).
    `expected_accepted` accumulates how many drafts a correct engine must accept, so tests can
    compare it with GenerationStats.accepted. Under sampling (`lenient=True`) the context may
    leave the reference; the drafter then still proposes reference tokens by position (plausible
    tokens, not necessarily right).
    """

    MODES = ("all", "none", "partial", "random")

    def __init__(self, reference: Sequence[int], mode: str, vocab_size: int, right: int = 1,
                 seed: int = 0, lenient: bool = False):
        assert mode in self.MODES, mode
        self.reference = list(reference)
        self.mode, self.vocab_size, self.right, self.seed = mode, vocab_size, right, seed
        self.lenient = lenient
        self.prompt_len = 0
        self.expected_accepted = 0
        self.proposed: list[list[int]] = []
        self.commits: list[tuple[list[int], int, int]] = []  # (committed, n_proposed, proposed)
        self._pending = 0

    def _wrong(self, token: int) -> int:
        return (token + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def begin(self, prompt: Sequence[int]) -> None:
        self.prompt_len = len(prompt)
        self._rng = random.Random(self.seed)
        self.expected_accepted = 0
        self.proposed, self.commits = [], []
        self._pending = 0

    def propose(self, context: Sequence[int], k: int, keep=None) -> Draft:
        pos = len(context) - self.prompt_len
        if not self.lenient:
            assert list(context[self.prompt_len:]) == self.reference[:pos], "context left the reference"
        truth = self.reference[pos : pos + k]
        if self.mode == "all":
            n_right = len(truth)
        elif self.mode == "none":
            n_right = 0
        elif self.mode == "partial":
            n_right = min(self.right, len(truth))
        else:
            n_right = self._rng.randint(0, len(truth))
        tokens = truth[:n_right] + [self._wrong(t) for t in truth[n_right:]]
        self.expected_accepted += n_right
        self.proposed.append(tokens)
        self._pending = len(tokens)
        return Draft.of(tokens)

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        # Record what the engine reported next to what this drafter really proposed since the
        # last commit (0 when the engine did not ask: the prefill, or a step with k = 0).
        self.commits.append((list(committed), n_proposed, self._pending))
        self._pending = 0


class DistributionDrafter:
    """A model-like drafter with a q distribution: drafts are sampled from q, so the engine uses
    speculative sampling. q at each drafted position is a fixed function of the context (a
    seeded random distribution mixed with a point mass on a plausible token), and the tokens are
    drawn with the drafter's own generator (reseeded per request)."""

    def __init__(self, vocab_size: int, plausible: Callable[[Sequence[int]], int], seed: int = 0,
                 point_mass: float = 0.5):
        self.vocab_size, self.plausible, self.seed, self.point_mass = vocab_size, plausible, seed, point_mass

    def begin(self, prompt: Sequence[int]) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def _q(self, context: Sequence[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash(tuple(context)) % (2**31))
        noise = torch.softmax(torch.randn(self.vocab_size, generator=g) * 2, -1)
        point = torch.zeros(self.vocab_size)
        point[self.plausible(context)] = 1.0
        return (1 - self.point_mass) * noise + self.point_mass * point  # [vocab]

    def propose(self, context: Sequence[int], k: int, keep=None) -> Draft:
        context = list(context)
        tokens, rows = [], []
        for _ in range(k):
            q = self._q(context)
            token = int(torch.multinomial(q, 1, generator=self._generator))
            tokens.append(token)
            rows.append(q)
            context.append(token)
        if not tokens:
            return Draft(torch.empty(0, dtype=torch.long), q=torch.empty(0, self.vocab_size))
        return Draft(torch.tensor(tokens, dtype=torch.long), q=torch.stack(rows))

    def commit(self, committed: Sequence[int], n_proposed: int) -> None:
        pass


# -- exact distributions and a goodness-of-fit test -----------------------------------------------

@torch.inference_mode()
def exact_sequence_distribution(model, prompt: Sequence[int], length: int, sampling: SamplingConfig) -> dict:
    """P(first `length` generated tokens) under autoregressive sampling with `sampling`,
    computed exactly by enumerating every prefix (the vocabulary must be tiny)."""
    dist = {(): 1.0}
    for _ in range(length):
        prefixes = list(dist)
        ids = torch.tensor([list(prompt) + list(prefix) for prefix in prefixes])  # [m, len]
        logits = model(input_ids=ids, use_cache=False).logits[:, -1, :]  # [m, vocab]
        probs = probabilities(logits.float(), sampling).double()  # [m, vocab]
        probs = probs / probs.sum(-1, keepdim=True)  # exact normalisation in float64
        new = {}
        for prefix, row in zip(prefixes, probs):
            for token, p in enumerate(row.tolist()):
                if p > 0:
                    new[prefix + (token,)] = dist[prefix] * p
        dist = new
    return dist


def chi_square_pvalue(counts: dict, expected_probs: dict, min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson chi-square goodness-of-fit of observed `counts` to `expected_probs`.

    Cells with expected count < min_expected are pooled into one cell. Returns (statistic,
    p-value, degrees of freedom); the p-value is the chi-square survival function,
    Q(df/2, x/2) = torch.special.gammaincc (no scipy needed). An outcome with expected
    probability 0 that was observed gives p-value 0.
    """
    n = sum(counts.values())
    if any(expected_probs.get(outcome, 0.0) == 0.0 for outcome in counts):
        return float("inf"), 0.0, 0
    big = [o for o, p in expected_probs.items() if p * n >= min_expected]
    small = [o for o, p in expected_probs.items() if p * n < min_expected]
    cells = [(counts.get(o, 0), expected_probs[o] * n) for o in big]
    if small:
        cells.append((sum(counts.get(o, 0) for o in small), sum(expected_probs[o] for o in small) * n))
    statistic = sum((obs - exp) ** 2 / exp for obs, exp in cells if exp > 0)
    df = len(cells) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                           torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, pvalue, df


# -- a character tokenizer ------------------------------------------------------------------------

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?\n")
MULTI_CHAR_TOKENS = ["the", "ing", "ab", "  "]
SPECIALS = ["<pad>", "<unk>", "</s>"]


def char_tokenizer(eos: bool = False):
    """A PreTrainedTokenizerFast with one token per character (plus a few multi-character tokens
    the model can emit); decoding concatenates tokens. `eos=True` registers </s> as EOS."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS + MULTI_CHAR_TOKENS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    kwargs = dict(unk_token="<unk>", pad_token="<pad>")
    if eos:
        kwargs["eos_token"] = "</s>"
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def assert_fits(outcomes, exact: dict, label: str, alpha: float = 1e-4) -> float:
    """Fail unless the observed `outcomes` fit the `exact` distribution (chi-square p > alpha)."""
    from collections import Counter

    statistic, pvalue, df = chi_square_pvalue(Counter(outcomes), exact)
    assert pvalue > alpha, f"{label}: chi2={statistic:.1f}, df={df}, p={pvalue:.2e}"
    return pvalue


def assert_cli_refuses_before_loading(monkeypatch, folder, args: list[str], message: str) -> None:
    """`verispec ARGS` (run in `folder`) exits 2 with exactly one line, an `error:` line containing
    `message`, no traceback, and without loading a model."""
    from typer.testing import CliRunner

    import verispec.cli as cli

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded a model before validating its arguments")

    monkeypatch.setattr("verispec.target.loading.load", refuse)
    monkeypatch.chdir(folder)
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in " ".join(result.stderr.split()), \
        result.stderr


def solo(target: Target, request) -> list[int]:
    """`request` (an `api.Request`) run alone, through the single-request API (its blocks given
    back after): the tokens a batched run of it must equal."""
    from verispec.api import generate

    sampling = request.sampling
    ids = generate(target, list(request.prompt_ids), request.method, max_new_tokens=request.max_new_tokens,
                   temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                   seed=sampling.seed, stop=request.stop, options=request.options).token_ids
    target.release()
    return ids
