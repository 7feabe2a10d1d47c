"""The command line: user errors give one `error:` line and a non-zero exit, never a traceback,
and are caught before any model is loaded; `generate` works end to end on a tiny saved model.

Text that is not valid UTF-8 (standard input, a corpus file, or an argument, which Python hands
over with each bad byte as a lone surrogate) is refused naming the byte and its offset. An option
that the chosen methods would silently ignore, or a draft length given twice, is refused too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest
from typer.testing import CliRunner

import helpers
import verispec.cli as cli
from verispec.cli import app

runner = CliRunner()


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the CLI tries to load a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the CLI loaded a model before validating its arguments")

    monkeypatch.setattr("verispec.target.loading.load", refuse)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, char_tokenizer):
    """A tiny Llama and the character tokenizer, saved as a transformers model directory."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    config = helpers.make_config("llama", vocab_size=len(char_tokenizer), init=0.1, max_positions=256)
    helpers.make_model(config, seed=3).save_pretrained(directory)
    char_tokenizer.save_pretrained(directory)
    return directory


def assert_clean_error(result, *fragments: str):
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # a clean exit, not a crash
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in " ".join(result.stderr.split()), (fragment, result.stderr)
    return lines


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["generate", ""], "prompt is empty"),
        (["generate", "   \n"], "prompt is empty"),
        (["generate", "hi", "--method", "nope"], "unknown method"),
        (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "hi", "--max-new-tokens", "-5"], "max_new_tokens"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--top-p", "1.5"], "top_p"),
        (["generate", "hi", "--top-k", "-3"], "top_k"),
        (["generate", "hi", "--draft-length", "0"], "draft length"),
        (["generate", "hi", "-m", "anpd/tree=8", "--tree", "4"], "tree is given twice, as 4 and as 8 in the method 'anpd/tree=8'"),
        (["generate", "hi", "-m", "pld/constant:4", "-k", "3"], "the draft length is given twice"),
        (["generate", "hi", "-m", "anpd/constant:8", "--controller", "adaptive"], "controller is given twice"),
        (["generate", "hi", "-m", "anpd/ngram_memory=true", "--no-ngram-memory"], "ngram_memory is given twice"),
        (["generate", "hi", "-m", "pld/tree=2"], "tree is an anpd option"),
        (["generate", "hi", "-m", "anpd/colour=red"], "unknown option 'colour'"),
        (["serve", "--method", "nope"], "unknown method"),
        (["serve", "--method", "pld/constant:64"], "at most 63 draft tokens a step, got 64"),
        (["serve", "--method", "mtad/beams=17"], "at most 16 beams, got 17"),
        (["serve", "--method", "anpd/color=red"], "unknown option 'color'"),
        (["serve", "--method", "eesd/tree=4"], "tree is an anpd option"),
        (["train-exit", "--steps", "0"], "steps must be"),
        (["train-exit", "--init-layer", "-1"], "init-layer must be an integer >= 0, got -1"),
        (["train-exit", "--corpus", "no-such-corpus.jsonl"], "corpus file not found"),
        (["train-exit", "--generate-corpus", "--corpus-samples", "0"], "--corpus-samples >= 1 (got 256, 0)"),
        (["train-exit", "--generate-corpus", "--corpus-tokens", "1"], "--corpus-tokens must be >= 2 and --corpus-samples >= 1 (got 1, 1)"),
    ],
)
def test_bad_arguments_fail_before_loading(no_model_loading, args, fragment):
    result = runner.invoke(app, args)
    lines = assert_clean_error(result, fragment)
    assert len(lines) == 1  # one line
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["generate"], "error: Missing argument 'prompt'; see 'verispec generate --help'"),
        (["generate", "hi", "--max-new-tokens", "many"], "Invalid value for '--max-new-tokens'"),
        (["generate", "hi", "--no-such-option"], "No such option: --no-such-option"),
        (["no-such-command"], "error: No such command 'no-such-command'; see 'verispec --help'"),
    ],
)
def test_usage_mistakes_are_one_error_line_too(no_model_loading, args, fragment):
    """What the argument parser itself refuses reads like every other mistake: one `error:` line."""
    result = runner.invoke(app, args, prog_name="verispec")
    lines = assert_clean_error(result, fragment)
    assert len(lines) == 1 and result.exit_code == 2, result.stderr


def test_the_command_alone_prints_the_help(no_model_loading):
    result = runner.invoke(app, [])
    assert "generate" in result.stdout and "Traceback" not in result.output


def test_generate_takes_a_method_with_settings(monkeypatch):
    """`generate -m anpd/constant:8/tree=8` runs anpd with those settings (and the flags' own)."""
    import verispec.api
    from verispec.core.methods import MethodOptions

    requested = {}

    def make_request(target, prompt, method, **kwargs):
        requested.update(method=method, options=kwargs["options"])
        raise ReachedModelLoading

    monkeypatch.setattr("verispec.target.loading.load", lambda *args, **kwargs: object())
    monkeypatch.setattr(verispec.api, "make_request", make_request)
    result = runner.invoke(app, ["generate", "hi", "-m", "anpd/constant:8/tree=8", "--span-min", "0"])
    assert isinstance(result.exception, ReachedModelLoading), result.output
    assert requested == {"method": "anpd", "options": MethodOptions(controller="constant:8", tree=8, span_min=0)}


def test_served_methods_take_settings_within_bounds():
    from verispec.core.methods import MethodOptions
    from verispec.server.app import MAX_DRAFT_LENGTH, served_method

    assert served_method("anpd") == ("anpd", MethodOptions())
    assert served_method("anpd/tree=8/ngram_memory=false") == ("anpd", MethodOptions(tree=8, ngram_memory=False))
    assert served_method(f"pld/constant:{MAX_DRAFT_LENGTH}") == ("pld", MethodOptions(controller=f"constant:{MAX_DRAFT_LENGTH}"))
    assert served_method("mtad/tau=0.1/beams=16") == ("mtad", MethodOptions(tau=0.1, beams=16))
    # a method's own draft length counts too: none of the registered ones is above the bound
    from verispec.core.methods import METHODS
    assert all(served_method(name)[0] == name for name in METHODS)


class ReachedModelLoading(Exception):
    pass


@pytest.fixture
def stop_at_model_loading(monkeypatch):
    """The CLI's arguments pass validation when it goes on to load the model: stop it there."""

    def reached(*args, **kwargs):
        raise ReachedModelLoading

    monkeypatch.setattr("verispec.target.loading.load", reached)


@pytest.mark.parametrize(
    "data,message",
    [
        (b"\xff\xfe", "byte 0xff at byte offset 0"),
        ("café ".encode() + b"\xe9t\xe9", "byte 0xe9 at byte offset 6"),  # Latin-1 after UTF-8
        ("naïve ".encode() + "€".encode()[:2], "byte 0xe2 at byte offset 7"),  # cut mid-character
    ],
)
def test_stdin_that_is_not_utf8_fails_cleanly(no_model_loading, data, message):
    result = runner.invoke(app, ["generate", "-"], input=data)
    lines = assert_clean_error(result, f"standard input is not valid UTF-8: {message}")
    assert len(lines) == 1 and result.exit_code == 2


def test_utf8_stdin_is_read_whatever_the_locale(stop_at_model_loading):
    result = runner.invoke(app, ["generate", "-"], input="naïve café €".encode())
    assert isinstance(result.exception, ReachedModelLoading), result.output


@pytest.mark.parametrize(
    "args,message",
    [
        # Python decodes an argument's bytes that are not UTF-8 as lone surrogates U+DC80..U+DCFF
        (["generate", "ok\udcff"], "the prompt is not valid UTF-8: byte 0xff at byte offset 2"),
        (["generate", "é\udce9"], "the prompt is not valid UTF-8: byte 0xe9 at byte offset 2"),
        (["generate", "hi", "--stop", "\udce9"], "--stop is not valid UTF-8: byte 0xe9 at byte offset 0"),
        (["generate", "x\ud800"], "the prompt is not valid Unicode text: a lone surrogate \\ud800 at character 1"),
        (["serve", "--api-key", "k\udcff"], "--api-key is not valid UTF-8: byte 0xff at byte offset 1"),
        (["serve", "--model-id", "\udcff"], "--model-id is not valid UTF-8: byte 0xff at byte offset 0"),
    ],
)
def test_arguments_that_are_not_utf8_fail_cleanly(no_model_loading, args, message):
    result = runner.invoke(app, args)
    lines = assert_clean_error(result, message)
    assert len(lines) == 1 and result.exit_code == 2


@pytest.mark.parametrize("flags,message", [
    (["--exit-layer", "3"], "exit layer must be in 1..2, got 3"),
    (["--exit-layer", "1", "--init-layer", "2"], "init layer must be in 0..1, got 2"),
])
def test_train_exit_checks_layers_against_the_model_before_any_long_work(tiny_model_dir, tmp_path, flags, message):
    """Layers the model does not have are refused right after loading it: before a corpus is
    generated or labelled, not after."""
    out = tmp_path / "head"
    result = runner.invoke(app, ["train-exit", "--model", str(tiny_model_dir), "--generate-corpus",
                                 "--corpus-tokens", "8", "--out", str(out), *flags])
    lines = assert_clean_error(result, message)
    assert len(lines) == 1 and result.exit_code == 2
    assert not (out / "corpus.jsonl").exists()


class CorpusChosen(Exception):
    pass


@pytest.mark.parametrize("flags,generates", [
    (["--model", "TINY"], True),  # a model of the user's: it writes its own corpus (self-distillation)
    (["--model", "TINY", "--shipped-corpus"], False),
    ([], False),  # the embedded model: the shipped corpus is its own text
    (["--generate-corpus"], True),
])
def test_train_exit_trains_on_the_models_own_text_unless_it_wrote_the_shipped_corpus(
        tiny_model_dir, tmp_path, monkeypatch, flags, generates):
    """Which text a head learns from: what the model writes itself, for any model but the embedded
    one, whose shipped corpus it wrote (the training itself is stopped where its corpus is known)."""
    chosen = []

    def generate(target, prompts, *args, **kwargs):
        chosen.append("generated")
        raise CorpusChosen

    def train(target, corpus_path, *args, **kwargs):
        chosen.append(corpus_path.name)
        raise CorpusChosen

    monkeypatch.setattr("verispec.train.corpus.generate_corpus", generate)
    monkeypatch.setattr("verispec.train.exit_head.train_exit_head", train)
    monkeypatch.setattr("verispec.target.loading.load", lambda *args, **kwargs: helpers.make_target("llama"))
    flags = [str(tiny_model_dir) if flag == "TINY" else flag for flag in flags]
    result = runner.invoke(app, ["train-exit", *flags, "--exit-layer", "1", "--out", str(tmp_path / "head")])
    assert isinstance(result.exception, CorpusChosen), result.output
    assert chosen == (["generated"] if generates else ["corpus.jsonl"])


def test_train_exit_resumes_on_the_corpus_it_generated(tiny_model_dir, tmp_path, monkeypatch):
    """--resume after (part of) the corpus was written goes on with that corpus: it is generated
    with resume, which keeps the samples already written (test_corpus), and trained on."""
    out = tmp_path / "head"
    out.mkdir()
    (out / "corpus.jsonl").write_text('{"text": "written before"}\n')
    chosen = []

    def train(target, corpus_path, *args, **kwargs):
        chosen.append(corpus_path)
        raise CorpusChosen

    monkeypatch.setattr("verispec.train.corpus.generate_corpus",
                        lambda target, prompts, tokens, path, **k: chosen.append(("generated", path, k["resume"])))
    monkeypatch.setattr("verispec.train.exit_head.train_exit_head", train)
    monkeypatch.setattr("verispec.target.loading.load", lambda *args, **kwargs: helpers.make_target("llama"))
    result = runner.invoke(app, ["train-exit", "--model", str(tiny_model_dir), "--exit-layer", "1", "--out", str(out),
                                 "--resume"])
    assert isinstance(result.exception, CorpusChosen), result.output
    assert chosen == [("generated", out / "corpus.jsonl", True), out / "corpus.jsonl"]
    result = runner.invoke(app, ["train-exit", "--model", str(tiny_model_dir), "--exit-layer", "1",
                                 "--out", str(tmp_path / "new"), "--resume"])
    assert_clean_error(result, "nothing to resume")


def test_corpus_that_is_not_utf8_fails_before_loading(no_model_loading, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes("first document\n\nsecond ".encode() + b"\x80")
    result = runner.invoke(app, ["train-exit", "--corpus", str(corpus), "--out", str(tmp_path / "head")])
    assert_clean_error(result, f"corpus file {corpus} is not valid UTF-8: byte 0x80 at byte offset 23")
    assert result.exit_code == 2


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "hi", "--beams", "2"], "--beams is used only by mtad, not by anpd"),
        (["generate", "hi", "-m", "eesd", "--tau", "0.3"], "--tau is used only by mtad, not by eesd"),
        (["generate", "hi", "-m", "eesd", "--draft-model", "small"], "--draft-model is used only by sps, mtad, hybrid, not by eesd"),
        (["generate", "hi", "-m", "ar", "--draft-model", "small"], "--draft-model is used only by sps, mtad, hybrid, not by ar"),
        (["generate", "hi", "-m", "pld", "--draft-model", "small"], "--draft-model is used only by sps, mtad, hybrid, not by pld"),
        (["generate", "hi", "--draft-model", "small"], "--draft-model is used only by sps, mtad, hybrid, not by anpd"),
        (["generate", "hi", "-m", "pld", "--exit-head", "."], "--exit-head is used only by eesd, sps, mtad, hybrid, not by pld"),
        (["generate", "hi", "-m", "ar", "--exit-head", "."], "--exit-head is used only by eesd, sps, mtad, hybrid, not by ar"),
        (["generate", "hi", "-m", "mtad", "--draft-model", "small", "--exit-head", "."],
         "--exit-head is used only by eesd, not by mtad (sps, mtad, hybrid draft with the draft model"),
        (["generate", "hi", "-m", "ar", "--draft-length", "4"], "--draft-length is used only by pld, anpd, eesd, sps, mtad, hybrid, suffix, not by ar"),
        (["generate", "hi", "-m", "ar", "--controller", "constant"], "--controller is used only by pld, anpd, eesd, sps, mtad, hybrid, suffix, not by ar"),
        (["generate", "hi", "--draft-length", "4", "--controller", "constant:8"],
         "--draft-length 4 and --controller constant:8 both set the draft length"),
        (["bench", "--methods", "ar,pld", "--draft-model", "small"], "--draft-model is used only by sps, mtad, hybrid, not by ar, pld, hf-ar, hf-pld"),
        (["bench", "--methods", "ar,sps", "--draft-model", "small", "--exit-head", "."], "--exit-head is used only by eesd, not by ar, sps, hf-ar, hf-pld"),
        (["bench", "--draft-length", "4", "--controller", "adaptive:8"], "both set the draft length"),
        (["train-exit", "--corpus", "README.md", "--generate-corpus"], "--corpus and --generate-corpus"),
    ],
)
def test_options_the_method_would_ignore_are_refused(no_model_loading, tmp_path, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # bench writes nothing, but would choose bench-out/ here
    (tmp_path / "README.md").write_text("a corpus\n")
    result = runner.invoke(app, args)
    lines = assert_clean_error(result, message)
    assert len(lines) == 1 and result.exit_code == 2
    assert not (tmp_path / "bench-out").exists()


@pytest.mark.parametrize(
    "args,given",
    [
        (["generate", "hi", "-m", "mtad", "--beams", "2", "--tau", "0.3"], {"beams": 2, "tau": 0.3}),
        (["generate", "hi", "-m", "mtad"], {}),  # methods.MethodOptions' defaults apply
        (["generate", "hi", "-m", "sps", "--draft-model", "small"], {"draft_model": "small"}),
        (["generate", "hi", "-m", "sps", "--exit-head", "."], {"exit_head": "."}),
        (["generate", "hi", "-m", "eesd", "--exit-head", ".", "--controller", "constant:4"],
         {"exit_head": ".", "controller": "constant:4"}),
        (["generate", "hi", "-m", "pld", "--draft-length", "4", "--controller", "constant"],
         {"draft_length": 4, "controller": "constant"}),
        (["bench", "--methods", "ar", "--peers", "hf-assisted", "--draft-model", "small"], {"draft_model": "small"}),
        (["bench", "--methods", "ar,eesd,sps", "--draft-model", "small", "--exit-head", "."],
         {"draft_model": "small", "exit_head": "."}),
    ],
)
def test_options_the_method_uses_are_passed_on(stop_at_model_loading, tmp_path, monkeypatch, args, given):
    """Only the options given reach MethodOptions, so its own defaults (beams 4, tau 0.5) apply."""
    import verispec.core.methods as methods

    monkeypatch.chdir(tmp_path)
    received = []

    class RecordingOptions(methods.MethodOptions):
        def __init__(self, **kwargs):
            received.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(methods, "MethodOptions", RecordingOptions)
    result = runner.invoke(app, args)
    assert isinstance(result.exception, ReachedModelLoading), result.output
    # The CLI's own calls (bench's parse_variant makes others, and dataclasses.replace passes every field)
    every_field = {field.name for field in fields(methods.MethodOptions)}
    from_the_cli = [call for call in received if "exit_head" in call and set(call) != every_field]
    expected = {"ngram_memory": True, **given}  # a switch: always passed, on unless --no-ngram-memory
    assert from_the_cli and all({k: v for k, v in call.items() if v is not None} == expected for call in from_the_cli)


def test_empty_prompt_from_stdin(no_model_loading):
    result = runner.invoke(app, ["generate", "-"], input="")
    assert_clean_error(result, "prompt is empty")


def test_unknown_controller_fails_before_loading(no_model_loading):
    result = runner.invoke(app, ["generate", "hi", "--controller", "weird"])
    assert_clean_error(result, "controller")


def test_unknown_controller_fails_cleanly_with_a_model(tiny_model_dir):
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_model_dir), "--dtype", "float32",
                                 "--controller", "weird"])
    assert_clean_error(result, "controller")


def test_missing_model_path_fails_fast(tmp_path):
    result = runner.invoke(app, ["generate", "hi", "--model", str(tmp_path / "no-such-model")])
    assert_clean_error(result, "not found")
    result = runner.invoke(app, ["info", "--model", str(tmp_path / "no-such-model")])
    assert_clean_error(result, "not found")


def test_directory_without_config_fails(tmp_path):
    result = runner.invoke(app, ["generate", "hi", "--model", str(tmp_path)])
    assert_clean_error(result, "config.json")


def test_missing_gguf_file_fails(tmp_path):
    result = runner.invoke(app, ["generate", "hi", "--model", str(tmp_path / "model.gguf")])
    assert_clean_error(result, "GGUF")


def test_bad_dtype_fails(tiny_model_dir):
    result = runner.invoke(app, ["generate", "hi", "--model", str(tiny_model_dir), "--dtype", "int3"])
    assert_clean_error(result, "dtype")


def test_non_causal_model_directory_fails_clearly(tmp_path, char_tokenizer):
    """DistilBERT has no causal-LM class at all."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(vocab_size=len(char_tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    DistilBertForMaskedLM(config).save_pretrained(tmp_path)
    char_tokenizer.save_pretrained(tmp_path)
    result = runner.invoke(app, ["generate", "hello", "--model", str(tmp_path), "--dtype", "float32", "-n", "4"])
    assert_clean_error(result, "not a causal language model")


def test_bert_encoder_directory_fails_clearly(tmp_path, char_tokenizer):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=len(char_tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    char_tokenizer.save_pretrained(tmp_path)
    result = runner.invoke(app, ["generate", "hello", "--model", str(tmp_path), "--dtype", "float32", "-n", "4"])
    assert_clean_error(result, "causal")


@pytest.mark.parametrize("method", ["anpd", "pld"])
def test_generate_compare_json_on_a_tiny_model(tiny_model_dir, method):
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    result = runner.invoke(app, ["generate", prompt, "--model", str(tiny_model_dir), "--dtype", "float32",
                                 "--method", method, "-n", "24", "--compare", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert isinstance(payload["text"], str) and payload["text"]
    assert payload["method"] == method and payload["dtype"] == "float32"
    assert payload["stats"]["new_tokens"] == 24 == len(payload["token_ids"])
    assert payload["stats"]["method"] == method
    assert payload["identical"] is True and payload["first_difference"] is None
    assert isinstance(payload["speedup"], (int, float)) and payload["speedup"] > 0
    assert payload["baseline"]["method"] == "ar"
    assert payload["baseline"]["token_ids"] == payload["token_ids"]
    assert payload["baseline"]["text"] == payload["text"]


def test_generate_table_stream_and_stop(tiny_model_dir):
    prompt = "the cat sat on the mat. the cat"
    plain = runner.invoke(app, ["generate", prompt, "--model", str(tiny_model_dir), "--dtype", "float32",
                                "-n", "20", "--json"])
    assert plain.exit_code == 0, plain.output
    text = json.loads(plain.stdout)["text"]
    stop = text[6:8]
    stopped = runner.invoke(app, ["generate", prompt, "--model", str(tiny_model_dir), "--dtype", "float32",
                                  "-n", "20", "--json", "--stop", stop])
    assert stopped.exit_code == 0, stopped.output
    payload = json.loads(stopped.stdout)
    assert payload["text"] == text[: text.find(stop)]
    assert payload["stats"]["stop_reason"] == "stop"
    table = runner.invoke(app, ["generate", prompt, "--model", str(tiny_model_dir), "--dtype", "float32",
                                "-n", "8", "--compare", "--stream"])
    assert table.exit_code == 0, table.output
    assert "speedup of anpd over ar" in table.stdout and "identical" in table.stdout
    assert "generation stats" in table.stdout


def test_info_on_a_tiny_model(tiny_model_dir):
    result = runner.invoke(app, ["info", "--model", str(tiny_model_dir), "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "LlamaForCausalLM" in result.stdout and "anpd" in result.stdout
    assert "block kernel" in result.stdout  # off: a transformers directory has no GGUF blocks
    from verispec.runtime import blockmm

    assert "kernels" in result.stdout and blockmm.kernel_path().split(" (")[0] in result.stdout
    assert "(AMX: " in result.stdout and "VNNI: " in result.stdout  # the path, whether tiles and VNNI run
    result = runner.invoke(app, ["info", "--model", str(tiny_model_dir), "--no-block-kernel"])
    assert result.exit_code == 0, result.output


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.long
def test_real_process_exit_code():
    """One real `python -m verispec.cli` process (each costs seconds of imports on 2 cores)."""
    empty = _subprocess("generate", "")
    assert empty.returncode == 2
    assert empty.stderr.strip() == "error: the prompt is empty"
    assert "Traceback" not in empty.stderr + empty.stdout


@pytest.mark.long
def test_real_process_refuses_bytes_that_are_not_utf8():
    """In a real process stdin and argv are decoded by Python itself (surrogateescape under a
    UTF-8 locale), not by the test runner."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "verispec.cli", "generate"]
    piped = subprocess.run([*command, "-"], input=b"ok\xff\xfe", capture_output=True, timeout=120, env=env)
    assert piped.returncode == 2
    assert piped.stderr.decode().strip() == "error: standard input is not valid UTF-8: byte 0xff at byte offset 2"
    argument = subprocess.run([*command, b"hi\xe9"], capture_output=True, timeout=120, env=env)
    assert argument.returncode == 2
    assert argument.stderr.decode().strip() == "error: the prompt is not valid UTF-8: byte 0xe9 at byte offset 2"


@pytest.mark.long
def test_help_answers_without_loading_torch():
    """`import verispec` and `verispec --help` do not import torch or transformers (about 7 s here
    before anything needs them); the public names still resolve on first use."""
    code = (
        "import sys\n"
        "import verispec\n"
        "from verispec.cli import main\n"
        "sys.argv = ['verispec', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, None), exit.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "assert callable(verispec.load) and 'torch' in sys.modules\n"
        "assert sorted(verispec.__all__) == sorted(n for n in verispec.__all__ if hasattr(verispec, n))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "generate" in result.stdout and "bench" in result.stdout


def test_type_checking_imports_match_the_lazy_exports():
    """verispec/__init__ names its public API twice (imports for type checkers, `_EXPORTS` for
    run time): the two must agree, name for name and module for module."""
    import ast

    import verispec

    tree = ast.parse(open(verispec.__file__).read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    imported = {alias.name: node.module for node in block.body for alias in node.names}
    assert imported == verispec._EXPORTS


@pytest.mark.parametrize("args,message", [
    (["--widths", "2,x"], "--widths must be comma-separated integers"),
    (["--widths", "0,4"], "--widths must lie in 1..64"),
    (["--widths", "100"], "--widths must lie in 1..64"),
    (["--context", "0"], "--context and --repeats must be >= 1"),
    (["--numerics", "int4"], "--numerics must be one of int8, fp32"),
])
def test_profile_refuses_bad_options_before_loading(stop_at_model_loading, args, message):
    result = runner.invoke(app, ["profile", *args])
    assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.stderr


def test_profile_reaches_the_model_with_good_options(stop_at_model_loading):
    result = runner.invoke(app, ["profile", "--widths", "2,8", "--context", "32", "--numerics", "fp32"])
    assert isinstance(result.exception, ReachedModelLoading), result.output
