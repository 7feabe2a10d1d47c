"""The command line: user errors give one `error:` line and a non-zero exit, never a traceback,
and are caught before any model is loaded; `generate` works end to end on a tiny saved model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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

    monkeypatch.setattr(cli, "_load", refuse)


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
        (["train-exit", "--steps", "0"], "steps must be"),
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
    result = runner.invoke(app, ["info", "--model", str(tiny_model_dir), "--no-block-kernel"])
    assert result.exit_code == 0, result.output


def _subprocess(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "verispec.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_real_process_exit_code():
    """One real `python -m verispec.cli` process (each costs seconds of imports on 2 cores)."""
    empty = _subprocess("generate", "")
    assert empty.returncode == 2
    assert empty.stderr.strip() == "error: the prompt is empty"
    assert "Traceback" not in empty.stderr + empty.stdout


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
