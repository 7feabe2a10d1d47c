"""The GGUF runtime (`runtime/gguf_decoder.py`: a GGUF file's own quantized blocks, multiplied by
`kernels/qmatmul.c` inside the C decoder layer) on tiny random models written as llama.cpp's
converter writes them (`gguf_models.write_tiny_gguf`: Llama with permuted q/k, Qwen2 with q/k/v
biases, Gemma 3 with 1 + w norms, sliding and full layers; every supported weight type in some
model; one model with a tied head):

- its logits agree with transformers' float32 forward of the same file (transformers undoes the
  converter's conventions its own way: un-permutes q/k, subtracts 1 from Gemma's norms), within
  what the int8 activations explain; and they do not when a convention is not undone (the
  negative controls show the comparison can tell);
- lossless methods give `ar`'s tokens; a prompt's logits are the same bits however it is run
  (whole, in chunks, one token at a time, beside another sequence, from the prefix cache, on 1
  or 2 threads); `generate_many` gives each request what it gives alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gguf_models
import helpers
from gguf_models import SUPPORTED_TYPES, transformers_logits, transformers_model, write_tiny_gguf
from verispec.api import generate, generate_many, make_request
from verispec.core.batch import BatchEngine
from verispec.target.shared_forward import LAST, Part
from verispec.gguf.reader import read_gguf
from verispec.gguf.metadata import read_gguf_model
from verispec.target.model import Target
from verispec.runtime import blockmm, gguf_decoder, native_layer
from verispec.runtime.gguf_decoder import GgufDecoder
from verispec.runtime.rows import BLOCK

# name -> (architecture, {tensor kind: GGUF type} over gguf_models.DEFAULT_TYPES, tied head)
MODELS = {
    "llama": ("llama", None, False),  # Q8_0 embedding, Q6_K head, Q4_K / Q5_0 / Q8_0 / Q6_K matrices
    "qwen2": ("qwen2", {"token_embd": "Q4_0", "output": "Q5_K", "attn_q": "Q5_K", "attn_k": "F16", "attn_v": "BF16",
                        "attn_output": "Q4_0", "ffn_gate": "Q5_K", "ffn_up": "F32", "ffn_down": "Q4_0"}, False),
    "gemma3": ("gemma3", {"attn_q": "Q5_K", "attn_k": "Q8_0", "attn_v": "Q6_K", "ffn_up": "BF16"}, False),
    "llama-tied": ("llama", {"token_embd": "Q6_K", "attn_v": "F16", "ffn_gate": "Q4_0"}, True),
}
ARCH_MODELS = ("llama", "qwen2", "gemma3")

# Agreement with transformers' float32 forward: activations are quantized to int8 per block of 32
# before every quantized matrix, so logits differ by a small fraction of their range.
MAX_RELATIVE_ERROR = 0.04  # max |difference| / (max - min of the reference logits)
MIN_TOP1_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf_decoder")


@pytest.fixture(scope="module")
def files(workdir) -> dict[str, Path]:
    (workdir / "models").mkdir()
    return {name: write_tiny_gguf(workdir / "models" / f"{name}.gguf", arch, types=types, tied=tied)
            for name, (arch, types, tied) in MODELS.items()}


def gguf_target(path: Path, cache_dir: Path) -> Target:
    """A target on the file's own blocks, as `loading` makes one."""
    gguf = read_gguf_model(path, cache_dir=cache_dir)
    decoder = GgufDecoder(gguf, blockmm.kernel()[0])
    return Target.of_decoder(decoder, gguf.config, gguf.tokenizer, gguf.name, gguf.eos_token_ids)


@pytest.fixture(scope="module")
def targets(files, workdir) -> dict[str, Target]:
    kernel, why = blockmm.kernel()
    assert kernel is not None, why  # the project needs cc: no skip
    return {name: gguf_target(path, workdir / "cache") for name, path in files.items()}


@pytest.fixture(scope="module")
def references(files) -> dict:
    """transformers' float32 model of each file (loaded once)."""
    return {}


def reference(references: dict, files: dict, name: str):
    if name not in references:
        references[name] = transformers_model(files[name])
    return references[name]


def random_ids(target: Target, n: int, seed: int) -> list[int]:
    return torch.randint(0, target.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_prompt(target: Target, ids: list[int], last_only: bool = False) -> torch.Tensor:
    """The prompt's logits from an empty sequence, its blocks given back after."""
    sequence = target.new_sequence()
    sequence.reset()
    try:
        return sequence.forward(ids, last_only=last_only).float().clone()
    finally:
        sequence.release()


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(max |difference| relative to the reference's logit range, share of positions whose top-1 agree)."""
    relative = float((ours - theirs).abs().max() / (theirs.max() - theirs.min()))
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    return relative, top1


# -- the files and the decoder ------------------------------------------------------------------


def test_every_supported_weight_type_is_in_some_model(files, targets):
    matrix_types = set()
    for name, path in files.items():
        parsed = read_gguf(path)
        kinds = {info.type_name for tensor, info in parsed.tensors.items() if gguf_models._kind(tensor)}
        matrix_types |= kinds
        decoder_types = {part.split(" x")[0] for part in targets[name].decoder.weight_types.split(", ")}
        assert decoder_types <= kinds and targets[name].numerics == "gguf", name
    assert matrix_types == set(SUPPORTED_TYPES)
    assert set(gguf_decoder.ARCHITECTURES) >= {"llama", "qwen2", "gemma3_text"}
    assert "output.weight" not in read_gguf(files["llama-tied"]).tensors
    assert targets["llama-tied"].head.matrix.type_name == "Q6_K"  # the embedding, as the head


def test_the_files_are_what_llama_cpps_converter_writes(files, workdir):
    """transformers, which undoes the converter's conventions, reads back the source model: the
    llama file's q/k rows are permuted, Gemma's norms stored as 1 + w. F32 files: exactly."""
    for arch in ARCH_MODELS:
        path = write_tiny_gguf(workdir / f"{arch}-f32.gguf", arch, types="F32", seed=5)
        source = gguf_models.source_model(arch, seed=5)
        ids = list(range(3, 60))
        assert torch.equal(transformers_logits(transformers_model(path), ids), transformers_logits(source, ids)), arch
    parsed = read_gguf(workdir / "llama-f32.gguf")
    source = gguf_models.source_model("llama", seed=5)
    stored_q = torch.from_numpy(parsed.tensor_bytes("blk.0.attn_q.weight").view("<f4").copy())
    assert not torch.equal(stored_q, source.model.layers[0].self_attn.q_proj.weight.detach())  # permuted rows
    parsed = read_gguf(workdir / "gemma3-f32.gguf")
    stored_norm = torch.from_numpy(parsed.tensor_bytes("blk.0.attn_q_norm.weight").view("<f4").copy())
    gemma = gguf_models.source_model("gemma3", seed=5)
    assert torch.allclose(stored_norm, gemma.model.layers[0].self_attn.q_norm.weight.detach() + 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_agree_with_transformers(name, files, targets, references):
    target = targets[name]
    model = reference(references, files, name)
    assert target.vocab_size == model.config.vocab_size
    for length, seed in ((40, 1), (150, 2)):  # 150: past two KV blocks and Gemma's window of 32
        ids = random_ids(target, length, seed)
        ours, theirs = run_prompt(target, ids), transformers_logits(model, ids)
        assert torch.isfinite(ours).all()
        assert len(set(theirs.argmax(-1).tolist())) > length // 5  # a model that says something
        relative, top1 = agreement(ours, theirs)
        assert relative < MAX_RELATIVE_ERROR, (name, length, relative)
        assert top1 >= MIN_TOP1_AGREEMENT, (name, length, top1)


def test_a_text_prompt_through_the_files_tokenizer(files, targets, references):
    """The tokenizer built from the file's metadata encodes text; those ids agree too."""
    for name in ARCH_MODELS:
        target = targets[name]
        ids = target.tokenizer("the cat sat on the mat and the big red fox ran. hello world " * 3).input_ids[:40]
        assert len(ids) == 40 and target.tokenizer.decode(ids)
        theirs = transformers_logits(reference(references, files, name), ids)
        relative, top1 = agreement(run_prompt(target, ids), theirs)
        assert relative < MAX_RELATIVE_ERROR and top1 >= MIN_TOP1_AGREEMENT, (name, relative, top1)


def test_llama_logits_disagree_when_the_permutation_is_not_undone(files, targets, references, workdir, monkeypatch):
    """Negative control: the same decoder rotating halves (as if the file's q/k rows were not
    permuted) is far from transformers, so the agreement above depends on the convention."""
    monkeypatch.setitem(gguf_decoder.ARCHITECTURES, "llama", ("llama", "LlamaRotaryEmbedding", False))
    wrong = gguf_target(files["llama"], workdir / "cache")
    ids = random_ids(wrong, 40, 1)
    theirs = transformers_logits(reference(references, files, "llama"), ids)
    relative, top1 = agreement(run_prompt(wrong, ids), theirs)
    assert relative > 2 * MAX_RELATIVE_ERROR and top1 < MIN_TOP1_AGREEMENT, (relative, top1)
    assert agreement(run_prompt(targets["llama"], ids), theirs)[0] < MAX_RELATIVE_ERROR


def test_gemma_logits_disagree_without_the_embedding_scale(files, references, workdir):
    """Negative control: Gemma's embedding not multiplied by sqrt(hidden) is far from transformers."""
    wrong = gguf_target(files["gemma3"], workdir / "cache")
    wrong.decoder.embed_scale = None
    ids = random_ids(wrong, 40, 1)
    relative, top1 = agreement(run_prompt(wrong, ids), transformers_logits(reference(references, files, "gemma3"), ids))
    assert relative > 2 * MAX_RELATIVE_ERROR and top1 < MIN_TOP1_AGREEMENT, (relative, top1)


# -- exactness: lossless methods, batch invariance, many requests ---------------------------------


def repetitive_prompt(target: Target, seed: int) -> list[int]:
    """A phrase of random ids said four times, and its start once more: n-gram drafts find matches."""
    phrase = random_ids(target, 11, seed)
    return phrase * 4 + phrase[:3]


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_lossless_methods_give_ar_tokens(name, targets):
    target = targets[name]
    target.set_eos_token_ids([])  # no early end: every method runs its whole budget
    prompt = repetitive_prompt(target, seed=3)
    expected = generate(target, prompt, "ar", max_new_tokens=40).token_ids
    target.release()
    assert len(expected) == 40
    for method in ("anpd", "pld", "anpd/tree=8"):
        result = generate(target, prompt, method, max_new_tokens=40)
        target.release()
        assert result.token_ids == expected, method
        assert result.stats.accepted > 0, method  # drafts were really verified and kept


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_a_prompts_logits_are_the_same_bits_however_it_is_run(name, targets, monkeypatch):
    target = targets[name]
    prompt = random_ids(target, 2 * BLOCK, seed=4)  # a whole number of blocks: all of it cached the second time
    target.prefix_cache = False
    whole = run_prompt(target, prompt)[-1:]

    # in chunks, the last ones one token at a time (the decode step's path)
    sequence = target.new_sequence()
    sequence.reset()
    for a, b in ((0, 50), (50, 123), (123, 125), (125, 126), (126, 127), (127, 128)):
        logits = sequence.forward(prompt[a:b])
    sequence.release()
    assert torch.equal(logits[-1:].float(), whole), "chunks"

    # beside another sequence's rows in one forward
    one, other = target.new_sequence(), target.new_sequence()
    one.reset(), other.reset()
    other.forward(random_ids(target, 30, seed=5))
    together = target.forward_parts([Part(other, random_ids(target, 9, seed=6)), Part(one, prompt, logits=LAST)])
    one.release(), other.release()
    assert torch.equal(together[1].float(), whole), "beside another sequence"

    # from the prefix cache: the second run shares both blocks and recomputes the last token
    target.prefix_cache = True
    try:
        first = run_prompt(target, prompt, last_only=True)
        hits = target.pool.prefix.hit_tokens
        again = target.new_sequence()
        again.reset()
        cached = again.forward(prompt, last_only=True).float().clone()
        shared = again.cache._shared
        again.release()
        assert target.pool.prefix.hit_tokens - hits == 2 * BLOCK and shared >= 1, "the cache was not used"
        assert torch.equal(first[-1:], whole) and torch.equal(cached[-1:], whole), "from the prefix cache"
    finally:
        target.prefix_cache = True

    # on 2 threads, then 1
    for threads in (2, 1):
        assert torch.equal(helpers.with_threads(threads, lambda: run_prompt(target, prompt)[-1:]), whole), threads

    # in consecutive C calls (as a prompt wider than CALL_ROWS runs): a ragged last call, and
    # calls of exactly one KV block each
    for rows in (7, BLOCK):
        monkeypatch.setattr(native_layer, "CALL_ROWS", rows)
        assert torch.equal(run_prompt(target, prompt)[-1:], whole), f"in calls of {rows} rows"
    assert target.pool.used_blocks == 0


def test_generate_many_gives_each_request_what_it_gives_alone(targets, monkeypatch):
    target = targets["gemma3"]
    target.set_eos_token_ids([])
    requests = [make_request(target, prompt, method, max_new_tokens=24 + 5 * i)
                for i, prompt in enumerate([repetitive_prompt(target, 7), random_ids(target, 70, 8),
                                            repetitive_prompt(target, 9)[:20]])
                for method in ("ar", "anpd", "pld", "anpd/tree=8")]
    alone = []
    for request in requests:
        alone.append(generate(target, list(request.prompt_ids), request.method,
                              max_new_tokens=request.max_new_tokens).token_ids)
        target.release()
    running = []
    step = BatchEngine.step

    def counted(engine):
        running.append(len(engine.running))
        return step(engine)

    monkeypatch.setattr(BatchEngine, "step", counted)
    results = generate_many(target, requests, max_rows=48, max_sequences=6)
    assert max(running) >= 4  # requests really shared steps
    for request, result, expected in zip(requests, results, alone):
        assert not isinstance(result, BaseException), result
        assert result.token_ids == expected, (request.method, request.prompt_ids[:4])
    assert sum(result.stats.accepted for result in results) > 0
    assert target.pool.used_blocks == 0


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_an_exit_head_trains_on_the_gguf_runtime_and_eesd_finds_it(name, files, workdir, tmp_path, monkeypatch):
    """`train-exit` on a target that runs its file's blocks: the head's layer starts from the
    target's own layer (dequantized, un-permuted for Llama, Gemma's norms minus 1: it reproduces
    the target's layer on the float32 path), trains, is saved into the cache under the target's
    fingerprint, and `eesd` finds it there with no --exit-head; greedy eesd and sps (the same head)
    equal ar."""
    import json

    from verispec.core.drafters.early_exit import ExitHead
    from verispec.core.methods import default_exit_head, trained_head_dir
    from verispec.train.exit_head import TrainConfig, train_exit_head

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target = gguf_target(files[name], workdir / "cache")
    target.set_eos_token_ids([])
    head = ExitHead(target, exit_layer=1, draft_vocab=list(range(target.vocab_size)), init_layer=1)
    reference_layer = transformers_model(files[name]).model.layers[1]
    for key, value in reference_layer.state_dict().items():
        assert torch.allclose(head.layer.state_dict()[key], value, atol=1e-6), key
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": " ".join(target.tokenizer.convert_ids_to_tokens(
        random_ids(target, 80, seed)))}) for seed in range(12)))
    directory = trained_head_dir(target)
    assert default_exit_head(target) != directory  # nothing trained yet
    config = TrainConfig(exit_layer=1, draft_vocab=64, sequence_length=32, batch=2, steps=3, warmup=1,
                         eval_tokens=32, checkpoint_every=100)
    train_exit_head(target, corpus, directory, config, log=lambda message: None)
    assert default_exit_head(target) == directory
    prompt = repetitive_prompt(target, seed=5)
    expected = generate(target, prompt, "ar", max_new_tokens=24).token_ids
    for method in ("eesd/constant:4", "sps/constant:3"):
        result = generate(target, prompt, method, max_new_tokens=24)
        target.release()
        assert result.token_ids == expected, method
        assert result.stats.drafted > 0, method


def test_perplexity_scores_on_the_files_own_blocks_without_touching_the_request(targets):
    """The benchmark scores every output with `score.perplexity`; a GGUF target has no transformers
    model, so it scores on its own runtime, on a sequence of its own: the same value as the
    token-by-token definition, and the request's sequence is left as it was."""
    import math

    from verispec.target.score import perplexity

    target = targets["llama"]
    prompt, output = random_ids(target, 9, seed=21), random_ids(target, 6, seed=22)
    target.reset()
    target.forward(random_ids(target, 5, seed=23))
    nll = 0.0
    for i, token in enumerate(output):  # one whole prompt per generated token
        logits = run_prompt(target, prompt + output[:i], last_only=True)[-1]
        nll -= torch.log_softmax(logits.double(), -1)[token].item()
    assert perplexity(target, prompt, output) == pytest.approx(math.exp(nll / len(output)), rel=1e-5)
    assert target.length == 5


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_the_amx_tile_path_gives_the_same_logits_and_tokens(name, files, targets, workdir):
    """The decoder on the "amx-emulated" build (wide forwards' products on emulated AMX tiles: a
    prompt's rows, a verify of 32 or more; fewer rows on the AVX2 paths) gives the default build's
    logits bit for bit, whole and in chunks around the tile threshold, and `generate` gives the
    same tokens with and without drafting (verifies of many rows)."""
    emulated, why = blockmm.load_variant("amx-emulated")
    assert emulated is not None, why
    gguf = read_gguf_model(files[name], cache_dir=workdir / "cache")
    tiled = Target.of_decoder(GgufDecoder(gguf, emulated), gguf.config, gguf.tokenizer, gguf.name, gguf.eos_token_ids)
    assert tiled.decoder.kernel_isa == "amx-emulated"
    default = targets[name]
    prompt = random_ids(default, 70, seed=9)
    assert torch.equal(run_prompt(tiled, prompt), run_prompt(default, prompt))
    sequence = tiled.new_sequence()
    sequence.reset()
    pieces = [sequence.forward(prompt[a:b]).float().clone() for a, b in ((0, 15), (15, 47), (47, 70))]
    sequence.release()
    assert torch.equal(torch.cat(pieces), run_prompt(default, prompt))
    for target in (tiled, default):
        target.set_eos_token_ids([])
    for method in ("ar", "anpd/tree=40"):
        expected = generate(default, repetitive_prompt(default, seed=5), method, max_new_tokens=24).token_ids
        default.release()
        got = generate(tiled, repetitive_prompt(tiled, seed=5), method, max_new_tokens=24).token_ids
        tiled.release()
        assert got == expected and len(got) == 24, method
