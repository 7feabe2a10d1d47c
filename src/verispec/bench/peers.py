"""Peer systems: other implementations measured in the same run, on the same loaded model.

Owns the registry `PEERS` (name -> `Peer`) and the peers built on transformers' own
`generate()`: `hf-ar` (plain greedy or sampled decoding), `hf-pld` (prompt lookup,
`prompt_lookup_num_tokens=10`), `hf-early-exit` (self-speculation from the target's first N
layers, `assistant_early_exit=N`) and `hf-assisted` (assisted generation with a separate draft
model from `--draft-model`). Each runs on `target.model` itself (a target that runs a GGUF file's
own blocks has none: transformers' float32 reading of the file is loaded for them), so weights,
prompts and token budget are the ones our methods get. Also llama.cpp on the same GGUF file, with
its own quantized arithmetic: `llamacpp-ar` / `llamacpp-pld` through llama-cpp-python (optional),
and `llama-ar` / `llama-draft` (its draft-model speculation, `--draft-model` as `-md`) /
`llama-ngram` / `llama-ngram-mod` (its n-gram speculations, `ngram-simple` and `ngram-mod`) through its own server, `llama-server` (`make
llama-native` builds it for this CPU), one request at a time; and OpenVINO GenAI on the same file,
`ov-ar` / `ov-pld` (its prompt lookup), in a worker process of its own environment (`make
openvino`; `openvino_worker.py`).

Target forwards are counted with a forward hook on `target.model`, registered around each call and
removed after it. `hf-early-exit` drafts with the same module object, shallowed by temporarily
lowering `config.num_hidden_layers`; the hook counts a forward only when the model runs at full
depth, so draft passes are not counted as target forwards.

Does not own timing, records or metrics (see `runner` and `metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import ConfigError, VerispecError
from ..target.model import Target


class PeerError(VerispecError):
    """A peer system failed on a prompt (its own exception is chained)."""


@dataclass(frozen=True)
class PeerSettings:
    """Everything a peer needs besides the target and the prompt."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    early_exit_layer: int = 4
    draft_model: str | None = None
    dtype: str = "auto"
    top_k: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.early_exit_layer, bool) or not isinstance(self.early_exit_layer, int) or self.early_exit_layer < 1:
            raise ConfigError(f"--early-exit-layer must be an integer >= 1, got {self.early_exit_layer!r}")


@dataclass
class PeerOutput:
    token_ids: list[int]  # the generated ids only (no prompt), EOS included when generated
    target_forwards: int | None  # full-depth forward passes of target.model, prefill included (None: not visible)
    other_cpu_s: float | None = 0.0  # CPU seconds spent in the peer's own processes (a server, a worker); None: unknown


PeerRun = Callable[[Sequence[int], int], PeerOutput]  # (prompt ids, max_new_tokens) -> output


@dataclass(frozen=True)
class Peer:
    name: str
    summary: str
    prepare: Callable[[Target, PeerSettings], PeerRun]  # one-time setup (e.g. load a draft model)
    needs_draft_model: bool = False

    def check(self, settings: PeerSettings, target: Target | None = None) -> None:
        """Raise ConfigError for settings this peer cannot run with (before any model loads)."""
        if self.needs_draft_model and not settings.draft_model:
            raise ConfigError(f"peer {self.name!r} needs a draft model: pass --draft-model PATH")
        if target is not None and self.name == "hf-early-exit":
            layers = int(target.config.num_hidden_layers)
            if settings.early_exit_layer >= layers:
                raise ConfigError(
                    f"--early-exit-layer {settings.early_exit_layer} must be below the model's {layers} layers"
                )


def _transformers_model(target: Target):
    """The transformers model of `target`; for a target without one (a GGUF file's own blocks),
    transformers' float32 reading of its file, loaded once."""
    if target.model is not None:
        return target.model
    if "transformers-model" not in target.attachments:
        from ..target.loading import load

        target.attachments["transformers-model"] = load(_gguf_of(target), numerics="fp32", fast=False).model
    return target.attachments["transformers-model"]


def _gguf_of(target: Target) -> str:
    """The GGUF file `target` was loaded from (the embedded default's, or a --model FILE.gguf)."""
    from ..target.loading import DEFAULT_MODEL_NAME, embedded_default_path

    if target.name == DEFAULT_MODEL_NAME:
        return str(embedded_default_path())
    if str(target.name).endswith(".gguf"):
        return str(target.name)
    raise ConfigError("the llama.cpp peers need a GGUF model: the default model or --model FILE.gguf")


def _generate_runner(target: Target, settings: PeerSettings, extra: dict | None = None) -> PeerRun:
    """A `PeerRun` calling the target's transformers model's `generate()` with `extra` arguments."""
    model = _transformers_model(target)
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    full_depth = int(base.config.num_hidden_layers)
    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    sampling = settings.temperature > 0
    arguments = dict(min_new_tokens=0, do_sample=sampling, eos_token_id=eos or None, pad_token_id=pad, **(extra or {}))
    if sampling:
        # Every sampling knob is passed explicitly, so the model's own generation_config (which may
        # carry e.g. top_k=64) cannot change the distribution: top_k=0 is "off", as for our methods.
        arguments.update(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> PeerOutput:
        assert len(prompt_ids) > 0 and max_new_tokens >= 1, "a prompt and a positive budget"
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)  # [1, n]
        count = [0]

        def hook(module, args, output) -> None:
            if int(base.config.num_hidden_layers) == full_depth:  # not an early-exit draft pass
                count[0] += 1

        handle = model.register_forward_hook(hook)
        try:
            if settings.seed is not None and sampling:
                torch.manual_seed(settings.seed)  # transformers samples from the global generator
            with torch.inference_mode():
                output = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **arguments
                )  # [1, n + new]
        except Exception as error:  # another system's failure: report it as such, not as our bug
            raise PeerError(f"transformers generate() failed ({type(error).__name__}: {error})") from error
        finally:
            handle.remove()
        return PeerOutput([int(t) for t in output[0, ids.shape[1]:]], count[0])

    return run


def _assisted(target: Target, settings: PeerSettings) -> PeerRun:
    from ..target.loading import load

    draft = load(settings.draft_model, settings.dtype, device=target.device)  # generate() needs both on one device
    extra: dict = {"assistant_model": _transformers_model(draft)}
    if draft.vocab_size != target.vocab_size:  # different tokenizers: universal assisted decoding
        extra.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
    return _generate_runner(target, settings, extra)


def _llamacpp(target: Target, settings: PeerSettings, prompt_lookup: bool) -> PeerRun:
    """llama.cpp (llama-cpp-python, an optional dependency) on the GGUF file the target came
    from: the embedded default's, or a --model given as .gguf. Its own tokenizer; greedy or
    sampled per the flags; torch's thread count. Target forwards are not visible (None)."""
    gguf = _gguf_of(target)
    try:
        from llama_cpp import Llama
    except ImportError as error:
        raise ConfigError(
            "the llamacpp peers need llama-cpp-python: build it with `make llamacpp` (or "
            "CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON\" pip install llama-cpp-python==0.3.36; "
            "add -DGGML_AVX512=ON on CPUs with AVX-512)"
        ) from error
    extra = {}
    if prompt_lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        extra["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
        # With a draft model llama-cpp-python keeps logits for every position but sizes its score
        # buffer from the logits_all argument: without it, a prompt past n_batch (512) tokens fails
        # with "could not broadcast ... into shape (0,)" (0.3.36). The buffer is allocated lazily:
        # only the rows of the positions used are touched.
        extra["logits_all"] = True
    llm = Llama(model_path=str(gguf), n_ctx=8192, n_threads=torch.get_num_threads(), verbose=False,
                seed=settings.seed if settings.seed is not None else 0, **extra)
    eos = set(target.eos_token_ids)
    sampling = settings.temperature > 0

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> PeerOutput:
        llm.reset()
        produced: list[int] = []
        try:
            for token in llm.generate(
                list(prompt_ids), temp=settings.temperature if sampling else 0.0, top_k=settings.top_k if sampling else 1,
                top_p=settings.top_p if sampling else 1.0, repeat_penalty=1.0, reset=True,
            ):
                produced.append(int(token))
                if token in eos or len(produced) >= max_new_tokens:
                    break
        except Exception as error:
            raise PeerError(f"llama.cpp failed ({type(error).__name__}: {error})") from error
        return PeerOutput(produced, None)

    return run


def _cpu_since(watch, start: float | None) -> float | None:
    """CPU seconds of the watched process tree since `start` (None where either reading failed)."""
    now = watch.cpu_s()
    return None if now is None or start is None else now - start


LLAMA_DRAFT_MAX = 8  # llama-draft's --spec-draft-n-max
LLAMA_NGRAM = "ngram-simple"  # llama-ngram's --spec-type
LLAMA_NGRAM_MOD = "ngram-mod"  # llama-ngram-mod's: n-grams of the context by a rolling hash


def _llama_server(target: Target, settings: PeerSettings, speculation: list[str]) -> PeerRun:
    """llama.cpp's own server on the target's GGUF file, started once (stopped when the process
    ends), `speculation` its speculative-decoding flags; each run is one /completion request of
    the prompt's token ids (no prompt cache), greedy or sampled per the flags, with torch's thread
    count. Target forwards are not visible (None)."""
    import atexit
    import tempfile
    from pathlib import Path

    import httpx

    from . import servers

    binary = servers.llama_binary("llama-server")
    threads = torch.get_num_threads()
    port = servers.free_port()
    argv = [str(binary), "-m", _gguf_of(target), "-c", "8192", "--parallel", "1", "-t", str(threads), "-tb", str(threads),
            "--host", "127.0.0.1", "--port", str(port), *speculation]
    log = Path(tempfile.mkdtemp(prefix="verispec-llama-")) / "llama-server.log"
    server = servers.ManagedServer(argv, servers.llama_environment(), log, port)
    atexit.register(server.stop)
    try:
        servers.wait_ready(server.base_url, 600, server.alive)
    except servers.ServerStartError as error:
        server.stop()
        raise PeerError(f"llama-server did not start: {error}\n{server.log_tail()}") from error
    client = httpx.Client(timeout=None)
    watch = servers.ProcessWatch(server.pid)
    sampling = settings.temperature > 0

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> PeerOutput:
        body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                "temperature": settings.temperature if sampling else 0.0, "top_k": settings.top_k if sampling else 1,
                "top_p": settings.top_p if sampling else 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
                "seed": settings.seed if settings.seed is not None else 0}
        cpu_start = watch.cpu_s()
        try:
            answer = client.post(f"{server.base_url}/completion", json=body)
            answer.raise_for_status()
            tokens = answer.json()["tokens"]
        except (httpx.HTTPError, ValueError, KeyError) as error:
            raise PeerError(f"llama-server failed ({type(error).__name__}: {error})\n{server.log_tail()}") from error
        return PeerOutput([int(t) for t in tokens], None, _cpu_since(watch, cpu_start))

    return run


OPENVINO_PYTHON = Path(".peers/openvino/bin/python")  # `make openvino`'s environment


def _openvino(target: Target, settings: PeerSettings, prompt_lookup: bool, python: str | None = None) -> PeerRun:
    """OpenVINO GenAI's `LLMPipeline` on the target's GGUF file (its own reading of the blocks), in a
    worker process of OpenVINO's environment (`openvino_worker.py`: JSON lines over its stdin and
    stdout), with torch's thread count; `prompt_lookup`: its prompt-lookup speculation. `python`:
    that environment's interpreter (default: `make openvino`'s). Target forwards are not visible."""
    import atexit
    import json
    import subprocess

    from . import openvino_worker, servers

    interpreter = servers.find_peer(python, OPENVINO_PYTHON, "openvino")
    argv = [str(interpreter), openvino_worker.__file__, _gguf_of(target), str(torch.get_num_threads())]
    if prompt_lookup:
        argv.append("--prompt-lookup")
    worker = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    atexit.register(worker.kill)

    def exchange(message: dict | None) -> dict:
        if message is not None:
            worker.stdin.write(json.dumps(message) + "\n")
            worker.stdin.flush()
        line = worker.stdout.readline()
        try:
            reply = json.loads(line)
        except ValueError:
            reply = {"error": f"the worker stopped (exit code {worker.poll()})"}
        if "error" in reply:
            raise PeerError(f"OpenVINO GenAI failed: {reply['error']}")
        return reply

    try:
        exchange(None)  # loaded
    except (PeerError, OSError):
        worker.kill()
        raise
    watch = servers.ProcessWatch(worker.pid)
    sampling = settings.temperature > 0

    def run(prompt_ids: Sequence[int], max_new_tokens: int) -> PeerOutput:
        cpu_start = watch.cpu_s()
        request = {"ids": [int(t) for t in prompt_ids], "max_new_tokens": max_new_tokens,
                   "temperature": settings.temperature if sampling else 0.0, "top_k": settings.top_k,
                   "top_p": settings.top_p, "seed": settings.seed if settings.seed is not None else 0}
        try:
            tokens = exchange(request)["tokens"]
        except OSError as error:
            raise PeerError(f"OpenVINO GenAI's worker is gone ({error})") from error
        return PeerOutput([int(t) for t in tokens], None, _cpu_since(watch, cpu_start))

    return run


def _llama_draft(target: Target, settings: PeerSettings) -> PeerRun:
    threads = str(torch.get_num_threads())
    # --spec-type draft-simple: with -md alone this llama-server loads the draft but does not speculate
    return _llama_server(target, settings, ["-md", str(settings.draft_model), "--spec-type", "draft-simple",
                                            "--spec-draft-n-max", str(LLAMA_DRAFT_MAX), "-td", threads, "-tbd", threads])


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("hf-ar", "transformers generate(): autoregressive decoding (greedy or sampled per the flags)",
             lambda target, s: _generate_runner(target, s)),
        Peer("hf-pld", "transformers generate(): prompt lookup decoding, prompt_lookup_num_tokens=10",
             lambda target, s: _generate_runner(target, s, {"prompt_lookup_num_tokens": 10})),
        Peer("hf-early-exit", "transformers generate(): self-speculation from the first N layers (assistant_early_exit=N)",
             lambda target, s: _generate_runner(target, s, {"assistant_early_exit": s.early_exit_layer})),
        Peer("hf-assisted", "transformers generate(): assisted generation with --draft-model as assistant_model",
             _assisted, needs_draft_model=True),
        Peer("llamacpp-ar", "llama.cpp on the same GGUF file (quantized weights): autoregressive decoding",
             lambda target, s: _llamacpp(target, s, prompt_lookup=False)),
        Peer("llamacpp-pld", "llama.cpp on the same GGUF file: prompt lookup decoding, 10 tokens",
             lambda target, s: _llamacpp(target, s, prompt_lookup=True)),
        Peer("llama-ar", "llama-server (llama.cpp built for this CPU) on the same GGUF file: autoregressive decoding",
             lambda target, s: _llama_server(target, s, [])),
        Peer("llama-draft", f"llama-server: speculation with --draft-model (-md, --spec-type draft-simple, "
             f"--spec-draft-n-max {LLAMA_DRAFT_MAX})",
             _llama_draft, needs_draft_model=True),
        Peer("llama-ngram", f"llama-server: n-gram speculation from the context (--spec-type {LLAMA_NGRAM})",
             lambda target, s: _llama_server(target, s, ["--spec-type", LLAMA_NGRAM])),
        Peer("llama-ngram-mod", f"llama-server: n-gram speculation from the context (--spec-type {LLAMA_NGRAM_MOD})",
             lambda target, s: _llama_server(target, s, ["--spec-type", LLAMA_NGRAM_MOD])),
        Peer("ov-ar", "OpenVINO GenAI (`make openvino`) on the same GGUF file: autoregressive decoding",
             lambda target, s: _openvino(target, s, prompt_lookup=False)),
        Peer("ov-pld", "OpenVINO GenAI on the same GGUF file: its prompt-lookup speculation (10 tokens, 3-grams)",
             lambda target, s: _openvino(target, s, prompt_lookup=True)),
    )
}


def get_peer(name: str) -> Peer:
    try:
        return PEERS[name]
    except KeyError:
        raise ConfigError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}") from None
