"""Devices: the `device` option, a request's tensors on the target's device, the static-cache
decode step.

- Spelling and resolution: "auto", "cpu", "cuda", "cuda:N", "auto-map"; misspelt devices,
  a GPU that is not there, auto-map without accelerate and --compile on the CPU are refused with
  a ConfigError (library) or one `error:` line and exit status 2 (every CLI command that loads a
  model, the server included), before any model is read.
- Greedy equivalence through `load(..., device=...)`: ar, pld, anpd (single paths and trees),
  eesd (an untrained exit head saved for the tiny model) and sps with a draft model give `ar`'s
  output, on the fast path and the PyTorch path, on the CPU always and on CUDA when
  VERISPEC_TEST_DEVICE=cuda (scripts/gpu_check.sh); mtad with a draft model runs there too.
- No tensor of a request is made on a hard-coded device: every tensor factory called from
  verispec's code during requests of every method (outside runtime/, the CPU-only kernels) says
  its device, every floating-point tensor made is on the target's device, and every random draw
  uses a generator on the device it draws on; the engine asks for its generator on the target's
  device.
- The static-cache decode step (`device.CompiledStep`, compiled on CUDA) run here through
  TorchDynamo's "eager" backend on the CPU: same outputs as the DynamicCache path for every
  method and forced rollbacks, for a model with sliding-window layers too (its static cache keeps
  them full-length, so they roll back), a failing compiled call recovers, the fast path is not
  compiled. Exit-head labelling through the PyTorch forward matches the fast path.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from typer.testing import CliRunner

import helpers
import verispec
import verispec.target.device as device_module
from verispec.core.acceptance import verify_joint, verify_lossless
from verispec.cli import app
from verispec.core.control import parse_controller
from verispec.target.device import CompiledStep, check_device, resolve_device
from verispec.core.drafters.early_exit import EarlyExitDrafter, ExitHead, save_head
from verispec.core.drafters.draft_model import AuxLM, BeamDrafter, SampledDrafter
from verispec.core.engine import Recipe
from verispec.errors import ConfigError
from verispec.core.methods import MethodOptions, build
from verispec.target.model import Target
from verispec.target.loading import load, resolve_dtype
from verispec.core.sampling import SamplingConfig

TEST_DEVICE = os.environ.get("VERISPEC_TEST_DEVICE", "cpu")
NEW_TOKENS = 32
SAMPLED = SamplingConfig(temperature=1.0, top_k=10, seed=1)


def available(name: str) -> str:
    """`name` ("cpu" or "cuda") if its tests run here, else skip with the reason."""
    if name == "cuda":
        if TEST_DEVICE != "cuda":
            pytest.skip("CUDA tests run only with VERISPEC_TEST_DEVICE=cuda (scripts/gpu_check.sh)")
        if not torch.cuda.is_available():
            pytest.skip("VERISPEC_TEST_DEVICE=cuda, but CUDA is not available here")
    return name


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """Each device the equivalence tests run on: the CPU always, CUDA on request."""
    return available(request.param)


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine without CUDA, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama and Gemma 3 (init 0.3: drafts partly rejected) with the character tokenizer,
    saved as transformers model directories."""
    tokenizer = helpers.char_tokenizer()
    dirs = {}
    for arch in ("llama", "gemma3"):
        directory = tmp_path_factory.mktemp(f"tiny-{arch}")
        config = helpers.make_config(arch, vocab_size=len(tokenizer), init=0.3, max_positions=256)
        helpers.make_model(config, seed=1).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs[arch] = directory
    return dirs


def prompt(vocab: int, seed: int) -> list[int]:
    return helpers.repetitive_prompt(vocab, seed, period=5, repeats=4)


# -- spelling and resolution ----------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "auto-map", " CPU "])
def test_good_spellings_pass_the_syntax_check(spelling):
    assert check_device(spelling) == spelling.strip().lower()
    assert check_device(torch.device("cpu")) == "cpu"


@pytest.mark.parametrize("spelling", ["gpu", "cuda:x", "cuda:", "cuda:-1", "cuda0", "mps", "", "auto-mapped", 0, None])
def test_bad_spellings_are_refused(spelling):
    with pytest.raises(ConfigError, match="device must be one of auto | cpu | cuda | cuda:N | auto-map"):
        check_device(spelling)
    with pytest.raises(ConfigError, match="device must be one of"):
        load("no/such/model", device=spelling)  # refused before the model is looked for


def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused(no_cuda):
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for spelling in ("cuda", "cuda:1", "auto-map"):
        with pytest.raises(ConfigError, match=f"device '{spelling}' needs a CUDA GPU"):
            resolve_device(spelling)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        load("no/such/model", device="cuda")  # the library refuses before reading anything
    with pytest.raises(ConfigError, match="compile .* is for CUDA devices"):
        resolve_device("cpu", compile=True)
    with pytest.raises(ConfigError, match="compile .* is for CUDA devices"):
        load("no/such/model", device="auto", compile=True)


def test_with_cuda_the_index_is_checked_and_auto_dtype_is_a_gpu_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError, match=r"no GPU 2 here \(2 visible: cuda:0..cuda:1\)"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert resolve_dtype("auto", device="cuda:1") == torch.bfloat16
    assert resolve_dtype("auto", block_kernel_model=True, device="cuda:0") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))  # e.g. a T4
    assert resolve_dtype("auto", device="cuda:0") == torch.float16
    assert resolve_dtype("float32", device="cuda:0") == torch.float32
    assert resolve_dtype("auto", block_kernel_model=True) == torch.float32  # the CPU's choice is unchanged


def test_auto_map_without_accelerate_is_refused(monkeypatch):
    monkeypatch.setattr(device_module, "accelerate_available", lambda: False)
    with pytest.raises(ConfigError, match=r"'auto-map' needs the package accelerate \(pip install accelerate\)"):
        resolve_device("auto-map")


# -- the command line and the server ---------------------------------------------------------------

runner = CliRunner()


COMMANDS = [["generate", "hi"], ["bench", "--peers", ""], ["serve", "--port", "0"], ["info"], ["profile"],
            ["train-exit"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("value,fragment", [
    ("cuda", "device 'cuda' needs a CUDA GPU"),
    ("cuda:3", "device 'cuda:3' needs a CUDA GPU"),
    ("gpu", "device must be one of auto | cpu | cuda | cuda:N | auto-map, got 'gpu'"),
    ("cuda:x", "got 'cuda:x'"),
])
def test_cli_refuses_an_absent_or_misspelt_device(no_cuda, monkeypatch, tmp_path, command, value, fragment):
    extra = ["--out", str(tmp_path / "run")] if command[0] in ("bench", "train-exit") else []
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, [*command, *extra, "--device", value], fragment)
    assert not (tmp_path / "run").exists()  # nothing was written (the benchmark's directory, the head's)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c[0] in ("generate", "bench", "serve", "profile")],
                         ids=lambda c: c[0])
def test_cli_refuses_compile_on_the_cpu(monkeypatch, tmp_path, command):
    extra = ["--out", str(tmp_path / "run")] if command[0] == "bench" else []
    helpers.assert_cli_refuses_before_loading(monkeypatch, tmp_path, [*command, *extra, "--device", "cpu", "--compile"],
                                              "is for CUDA devices")


@pytest.mark.long
def test_a_real_process_without_cuda_exits_2_with_one_error_line():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda would run")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    import subprocess

    result = subprocess.run([sys.executable, "-m", "verispec.cli", "generate", "hi", "--device", "cuda"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()][0].startswith("error: device 'cuda'")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_generate_json_names_the_device(tiny_dirs):
    result = runner.invoke(app, ["generate", "ab ab ab", "--model", str(tiny_dirs["llama"]), "--device", "cpu",
                                 "-n", "4", "--json"])
    assert result.exit_code == 0, result.output
    import json

    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["device"] == "cpu" and len(payload["token_ids"]) == 4


# -- greedy equivalence through load(device=...) ---------------------------------------------------

def _exit_head_dir(target: Target, directory: Path) -> Path:
    """An untrained exit head after layer 1, over half the vocabulary, saved for `target`."""
    head = ExitHead(target.model, 1, list(range(0, target.vocab_size, 2)))
    save_head(head, head.spec(target.model, target.name), directory)
    return directory


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "eager"])
def test_lossless_methods_equal_ar_on_the_device(tiny_dirs, tmp_path, device, arch, fast):
    target = load(str(tiny_dirs[arch]), "float32", fast=fast, device=device)
    assert target.device.type == device
    assert target.fast == (fast and device == "cpu")  # the CPU runtime stays on the CPU
    methods = {"pld": MethodOptions(), "anpd": MethodOptions(controller="constant:6"),
               "anpd/tree=8": MethodOptions(controller="constant:6", tree=8),
               "eesd": MethodOptions(exit_head=str(_exit_head_dir(target, tmp_path / "head")), controller="constant:3"),
               "sps": MethodOptions(draft_model=str(tiny_dirs["llama" if arch == "gemma3" else "gemma3"]),
                                    controller="constant:3")}
    accepted = dict.fromkeys(methods, 0)
    for seed in (0, 1):
        ids = prompt(target.vocab_size, seed)
        reference = verispec.generate(target, ids, "ar", max_new_tokens=NEW_TOKENS).token_ids
        assert len(reference) == NEW_TOKENS
        for label, options in methods.items():
            result = verispec.generate(target, ids, label.partition("/")[0], max_new_tokens=NEW_TOKENS, options=options)
            assert result.token_ids == reference, (label, seed)
            accepted[label] += result.stats.accepted
        mtad = verispec.generate(target, ids, "mtad", max_new_tokens=NEW_TOKENS, seed=seed,
                                 options=MethodOptions(draft_model=str(tiny_dirs["llama"]), controller="constant:3"))
        assert len(mtad.token_ids) == NEW_TOKENS and mtad.stats.drafted > 0
    assert all(accepted[label] for label in ("pld", "anpd", "eesd")), accepted  # not vacuous
    if not target.fast:  # the draft model is on the target's device and path
        assert target.attachments[("draft-model", str(tiny_dirs["llama" if arch == "gemma3" else "gemma3"]), 0)].device \
            == target.device


def test_a_model_moved_to_cuda_decodes_through_generate(tiny_dirs):
    """A user's own model on CUDA: `Target` builds (no fast path) and transformers' generate()
    with verispec's custom_generate equals its own greedy decoding."""
    available("cuda")
    model = helpers.make_model(helpers.make_config("llama", init=0.3), seed=1).to("cuda")
    ids = torch.tensor([prompt(128, 0)], device="cuda")
    mask = torch.ones_like(ids)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False)
    for method in ("ar", "pld", "anpd"):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                             custom_generate=verispec.transformers_generate, method=method)
        assert got.device == ids.device and torch.equal(got, expected), method


def test_compiled_step_on_cuda_equals_the_plain_forward(tiny_dirs):
    available("cuda")
    plain = load(str(tiny_dirs["llama"]), "float32", device="cuda")
    compiled = load(str(tiny_dirs["llama"]), "float32", device="cuda", compile=True)
    assert compiled.backend.step is not None and compiled.max_length == 256
    for seed in (0, 1):
        ids = prompt(plain.vocab_size, seed)
        reference = verispec.generate(plain, ids, "ar", max_new_tokens=NEW_TOKENS).token_ids
        for method in ("ar", "pld", "anpd"):
            assert verispec.generate(compiled, ids, method, max_new_tokens=NEW_TOKENS).token_ids == reference, method
    assert compiled.backend.step._compiled is not None  # it did not fall back


# -- no tensor of a request on a hard-coded device ------------------------------------------------

SOURCE = str(Path(verispec.__file__).resolve().parent)
RUNTIME = os.path.join(SOURCE, "runtime") + os.sep  # the CPU-only kernels
FACTORIES = _device_constructors()  # torch.zeros, torch.tensor, torch.arange, torch.rand, ...


class FactoryAudit(TorchFunctionMode):
    """Records, for tensor factories called from verispec's code (outside runtime/): calls that
    do not say their device, floating-point tensors made elsewhere than `device`, and random
    draws with a generator on another device than the one they draw on."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.undeclared: set[str] = set()
        self.misplaced: set[str] = set()
        self.generators: set[str] = set()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES:
            caller = sys._getframe(1)
            path = caller.f_code.co_filename
            if path.startswith(SOURCE) and not path.startswith(RUNTIME):
                self.calls += 1
                where = f"torch.{func.__name__} at {path[len(SOURCE) + 1:]}:{caller.f_lineno}"
                if kwargs.get("device") is None:
                    self.undeclared.add(where)
                if isinstance(result, torch.Tensor) and result.is_floating_point() and result.device != self.device:
                    self.misplaced.add(f"{where} on {result.device}")
                generator = kwargs.get("generator")
                if generator is not None and isinstance(result, torch.Tensor) and generator.device != result.device:
                    self.generators.add(f"{where}: generator on {generator.device}, draws on {result.device}")
        return result


def _requests(target: Target, draft_target: Target | None) -> None:
    """One short request of every method the target can run, greedy and sampled."""
    ids = prompt(target.vocab_size, 0)
    for method in ("ar", "pld", "anpd"):
        for sampling in (SamplingConfig(), SAMPLED):
            helpers.run(target, build(method, target, sampling=sampling), ids, 12, sampling)
    if importlib.util.find_spec("arctic_inference") is not None:
        helpers.run(target, build("suffix", target), ids, 12)
    helpers.run(target, build("anpd", target, MethodOptions(tree=8, controller="constant:8")), ids, 12)
    if draft_target is not None:  # eesd, sps, mtad: the drafters that run models
        head = target.attachments["audit-head"]  # built before the audit: not part of a request
        constant = lambda: parse_controller("constant:3", 3)  # noqa: E731
        for sampling in (SamplingConfig(), SAMPLED):
            helpers.run(target, Recipe(EarlyExitDrafter(target, head, sampling), constant(), verify_lossless),
                        ids, 12, sampling)
            helpers.run(target, Recipe(SampledDrafter(AuxLM(draft_target, target), sampling), constant(),
                                       verify_lossless), ids, 12, sampling)
        helpers.run(target, Recipe(BeamDrafter(AuxLM(draft_target, target), 3, SAMPLED), constant(),
                                   verify_joint(0.5)), ids, 12, SAMPLED)


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "eager"])
def test_no_tensor_of_a_request_is_made_on_a_hard_coded_device(device, fast):
    model = helpers.make_model(helpers.make_config("llama", init=0.3), seed=1).to(device)
    target = Target(model, None, name="tiny-llama", fast=fast)
    draft = Target(helpers.make_model(helpers.make_config("llama", init=0.3), seed=2).to(device), None, fast=fast)
    target.attachments["audit-head"] = ExitHead(target.model, 1, list(range(0, target.vocab_size, 2)))
    audit = FactoryAudit(target.device)
    with audit:
        _requests(target, draft)
    assert audit.calls > 0  # the audit saw verispec's factory calls
    assert not audit.undeclared, "factory calls without a device:\n" + "\n".join(sorted(audit.undeclared))
    assert not audit.misplaced, "floating-point tensors off the target's device:\n" + "\n".join(sorted(audit.misplaced))
    assert not audit.generators, "\n".join(sorted(audit.generators))


def test_the_audit_catches_a_factory_call_without_a_device():
    audit = FactoryAudit(torch.device("cpu"))
    with audit:
        exec(compile("import torch\ntorch.zeros(3)\n", os.path.join(SOURCE, "probe.py"), "exec"))
        torch.zeros(3)  # not verispec's code: not audited
    assert audit.undeclared == {"torch.zeros at probe.py:2"}


def test_the_engine_draws_with_a_generator_on_the_targets_device(monkeypatch, llama_target):
    asked = []
    original = SamplingConfig.generator

    def recording(self, stream=0, device="cpu"):
        asked.append((stream, torch.device(device)))
        return original(self, stream, device)

    monkeypatch.setattr(SamplingConfig, "generator", recording)
    helpers.run(llama_target, build("anpd", llama_target, sampling=SAMPLED), prompt(128, 0), 6, SAMPLED)
    assert asked == [(0, llama_target.device)]
    assert SamplingConfig(seed=3).generator(1, "cpu").device == torch.device("cpu")


# -- the static-cache decode step, here through TorchDynamo's eager backend -------------------------

def _compiled_target(model) -> Target:
    target = Target(model, None, name="tiny-static", fast=False)
    assert target.compile_decode_step(mode=None, backend="eager")  # Dynamo traces; no code generation on the CPU
    return target


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_static_cache_step_equals_the_dynamic_cache_path(arch):
    model = helpers.make_model(helpers.make_config(arch, init=0.1, max_positions=128), seed=0)
    plain, static = Target(model, None, fast=False), _compiled_target(model)
    assert static.max_length == 128 and static.cache is None
    head = ExitHead(model, 1, list(range(0, 128, 2)))
    draft = Target(helpers.make_model(helpers.make_config(arch, init=0.1), seed=4), None, fast=False)
    constant = lambda: parse_controller("constant:3", 3)  # noqa: E731
    for seed in (0, 1):
        ids = prompt(128, seed)
        reference = helpers.run(plain, build("ar", plain), ids, NEW_TOKENS)[0]
        for method, options in (("ar", MethodOptions()), ("pld", MethodOptions()),
                                ("anpd", MethodOptions(controller="constant:6")),
                                ("anpd", MethodOptions(controller="constant:6", tree=6))):
            got, stats, _ = helpers.run(static, build(method, static, options), ids, NEW_TOKENS)
            assert got == reference, (method, seed)
        for recipe in (Recipe(EarlyExitDrafter(static, head), constant(), verify_lossless),
                       Recipe(SampledDrafter(AuxLM(draft, static)), constant(), verify_lossless)):
            got, stats, _ = helpers.run(static, recipe, ids, NEW_TOKENS)
            assert got == reference and stats.drafted > 0, (recipe.drafter, seed)
        for mode in ("partial", "random", "none"):  # rollbacks of every size
            drafter = helpers.ScriptedDrafter(reference, mode, 128, right=2, seed=seed)
            got, stats, _ = helpers.run(static, helpers.scripted_recipe(drafter, 5), ids, NEW_TOKENS)
            assert got == reference and stats.accepted == drafter.expected_accepted, mode
        # sampled: the same draws as the dynamic path (same seed, same device)
        assert (helpers.run(static, build("anpd", static, sampling=SAMPLED), ids, 16, SAMPLED)[0]
                == helpers.run(plain, build("anpd", plain, sampling=SAMPLED), ids, 16, SAMPLED)[0])
    assert static.backend.step._compiled is not None  # every one-token step ran the compiled function


def test_a_failing_compiled_call_falls_back_and_keeps_the_cache_right(capfd):
    model = helpers.make_model(helpers.make_config("llama", init=0.1, max_positions=128), seed=0)
    plain, static = Target(model, None, fast=False), _compiled_target(model)
    step = static.backend.step

    def half_done(ids):  # writes the cache (advancing its lengths), then fails
        step._one_token(ids)
        raise RuntimeError("graph capture failed")

    step._compiled = half_done
    ids = prompt(128, 0)
    reference = helpers.run(plain, build("ar", plain), ids, NEW_TOKENS)[0]
    assert helpers.run(static, build("pld", static), ids, NEW_TOKENS)[0] == reference
    assert step._compiled is None
    assert "compiled decode step failed (RuntimeError: graph capture failed); running it uncompiled" in capfd.readouterr().err


def test_the_fast_path_is_not_compiled_and_sliding_window_models_are(capfd, llama_target):
    model = helpers.make_model(helpers.make_config("gemma3", init=0.1), seed=0)
    assert CompiledStep.unsupported(model) is None  # its sliding layers are full-length in the static cache
    assert not llama_target.compile_decode_step(mode=None, backend="eager")
    assert "the target runs the CPU fast path" in capfd.readouterr().err
    assert getattr(llama_target.backend, "step", None) is None


def test_exit_head_labels_through_the_pytorch_forward_match_the_fast_path(llama_target):
    """The GPU path of `train-exit` (a forward hook on layer N of the model's own decoder), run
    here on the CPU, labels as the fast path does."""
    from verispec.train.exit_head import label

    sequences = [prompt(128, 0), prompt(128, 1)[:13]]
    eager = Target(llama_target.model, None, fast=False)
    assert not eager.fast  # its labels come through the model's own forward, with a hook
    fast, hooked = label(llama_target, sequences, 1), label(eager, sequences, 1)
    for a, b in zip(fast.exit_states + fast.final_states, hooked.exit_states + hooked.final_states):
        assert a.shape == b.shape and a.device.type == b.device.type == "cpu"
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)  # both rounded to bfloat16
    with pytest.raises(ConfigError, match="exit layer must be in 1..2"):
        label(eager, sequences, 3)


def test_a_weight_off_the_cpu_is_not_packed_for_onednn():
    """oneDNN's packed linear is CPU-only: an exit head's weights on a GPU (here: the meta device,
    which has no kernels either) are multiplied with F.linear, not packed at construction."""
    from verispec.runtime.linear import Linear

    linear = Linear(torch.empty(8, 4, device="meta"), None)
    assert linear(torch.empty(3, 4, device="meta")).shape == (3, 8)


def test_a_static_caches_length_is_set_outside_inference_mode():
    """The compiled step's StaticCache is filled under inference mode (its forward's), where its
    length tensors are made (on a GPU: moved to the device there); a later crop from plain code
    (a reset between requests) must still set them."""
    from verispec.target.hf_cache import new_static_cache, set_static_length

    model = helpers.make_model(helpers.make_config("llama"))
    with torch.inference_mode():
        cache = new_static_cache(model, 32)
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, use_cache=True)
    set_static_length(cache, 2)
    assert all(int(layer.cumulative_length) == 2 for layer in cache.layers if layer.is_initialized)
