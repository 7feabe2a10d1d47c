"""`verispec bench` end to end through the CLI on a tiny random Llama with a character-level
tokenizer saved to a temporary directory: every output file, the records, report.md, the JSON
last line; resuming an interrupted run; refusing a resume with different settings; input errors
before the model loads. Also `verispec.target.score.perplexity` against a token-by-token reference."""

from __future__ import annotations

import json
import math
import string
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from verispec.bench import report, runner
from verispec.cli import app

pytestmark = pytest.mark.long

METHODS = ["ar", "pld", "anpd"]
PEERS = ["hf-ar", "hf-pld"]
PROMPTS = 2


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer random Llama (float32) and a character-level WordLevel tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in string.ascii_letters + string.digits + string.punctuation + " \n":
        vocab.setdefault(char, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    lines = [
        {"question_id": 7, "category": "summarization",
         "turns": ["Summarize: the cat sat on the mat. The cat sat on the mat again.", "ignored"]},
        {"question_id": "code-1", "category": "code", "turns": ["Complete: def add(a, b): return a + b"]},
        {"question_id": 9, "category": "code", "turns": ["not selected by --per-category 1"]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def bench_args(model: Path, dataset: Path, out: Path, *extra: str, max_new_tokens: int = 8) -> list[str]:
    return [
        "bench", "--model", str(model), "--dtype", "float32", "--dataset", str(dataset),
        "--per-category", "1", "--methods", ",".join(METHODS), "--peers", ",".join(PEERS),
        "--max-new-tokens", str(max_new_tokens), "--out", str(out), *extra,
    ]


def invoke(args: list[str]):
    return CliRunner().invoke(app, args)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished_run(tiny_model, questions, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "run"
    result = invoke(bench_args(tiny_model, questions, out))
    assert result.exit_code == 0, result.output
    return out, result


def test_every_file_is_produced(finished_run):
    out, _ = finished_run
    for name in ("config.json", "records.jsonl", "summary.json", "report.md",
                 report.SPEEDUP_PLOT, report.HISTOGRAM_PLOT):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    for plot in (report.SPEEDUP_PLOT, report.HISTOGRAM_PLOT):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_records_cover_every_prompt_and_method_once(finished_run):
    out, _ = finished_run
    records = read_jsonl(out / "records.jsonl")
    assert len(records) == PROMPTS * (len(METHODS) + len(PEERS))
    assert all(tuple(record) == runner.RECORD_FIELDS for record in records)
    keys = {(str(r["question_id"]), r["method"], r["repeat"]) for r in records}
    assert keys == {(q, m, 0) for q in ("7", "code-1") for m in METHODS + PEERS}
    # rotation: prompt 0 starts at the first method, prompt 1 at the second
    assert [r["method"] for r in records[:5]] == METHODS + PEERS
    assert [r["method"] for r in records[5:]] == METHODS[1:] + PEERS + METHODS[:1]
    for record in records:
        assert 1 <= record["new_tokens"] <= 8 and len(record["token_ids"]) == record["new_tokens"]
        assert record["total_s"] > 0 and record["cpu_s"] >= 0
        assert record["perplexity"] is not None and record["perplexity"] > 1
        assert isinstance(record["text"], str)
        if record["method"] in PEERS:
            assert record["prefill_s"] is None and record["drafted"] is None
        else:
            assert record["prefill_s"] > 0 and record["decode_s"] >= 0
    by_key = {(str(r["question_id"]), r["method"]): r for r in records}
    for question in ("7", "code-1"):
        ar = by_key[(question, "ar")]
        assert ar["target_forwards"] == ar["new_tokens"]  # one token per forward
        assert by_key[(question, "hf-ar")]["target_forwards"] == by_key[(question, "hf-ar")]["new_tokens"]
        for lossless in ("pld", "anpd"):  # float32, greedy: identical ids
            assert by_key[(question, lossless)]["token_ids"] == ar["token_ids"]


def test_report_and_summary(finished_run):
    out, _ = finished_run
    text = (out / "report.md").read_text()
    for fragment in ("# verispec bench report", "## Overall", "## Per category", "### summarization",
                     "### code", "| method | prompts |", "## Machine", "CPU:", "RAM:", "torch",
                     "transformers", "verispec", "dtype: float32", "Command: `verispec",
                     "speedup = (sum of new tokens / sum of seconds)", report.SPEEDUP_PLOT):
        assert fragment in text, fragment
    for name in METHODS + PEERS:
        assert f"| {name} |" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "ar"
    assert list(summary["overall"]) == METHODS + PEERS
    assert all(s["prompts"] == PROMPTS for s in summary["overall"].values())
    assert summary["overall"]["pld"]["exact_match"] == 1.0
    # speedup, recomputed from the records by its definition (one repeat: the records' own times)
    records = read_jsonl(out / "records.jsonl")

    def rate(method: str) -> float:
        chosen = [r for r in records if r["method"] == method]
        return sum(r["new_tokens"] for r in chosen) / sum(r["total_s"] for r in chosen)

    for name in METHODS + PEERS:
        assert summary["overall"][name]["speedup"] == pytest.approx(rate(name) / rate("ar"), rel=1e-9), name
    energy_measured = summary["overall"]["ar"]["energy_j"] is not None
    assert energy_measured or "not measured" in text


def test_last_stdout_line_is_the_summary_json(finished_run):
    out, result = finished_run
    last = result.stdout.strip().splitlines()[-1]
    payload = json.loads(last)
    assert payload["baseline"] == "ar"
    assert list(payload["methods"]) == METHODS + PEERS
    overall = json.loads((out / "summary.json").read_text())["overall"]
    for name in METHODS + PEERS:  # the headline numbers of summary.json, rounded
        assert payload["methods"][name]["speedup"] == round(overall[name]["speedup"], 4), name
        assert payload["methods"][name]["tokens_per_s"] == round(overall[name]["tokens_per_s"], 3), name
    assert "tokens_per_s" in payload["methods"]["hf-pld"]
    assert "verispec bench" in result.stdout  # the table came before it


def test_resume_adds_only_the_missing_records(tiny_model, questions, tmp_path):
    out = tmp_path / "run"
    assert invoke(bench_args(tiny_model, questions, out, "--no-progress")).exit_code == 0
    complete = read_jsonl(out / "records.jsonl")
    lines = (out / "records.jsonl").read_text().splitlines(keepends=True)
    kept = 3
    # An interrupted run: the first k records, then half of a record being written when killed.
    (out / "records.jsonl").write_text("".join(lines[:kept]) + lines[kept][: len(lines[kept]) // 2])
    (out / "summary.json").unlink()
    result = invoke(bench_args(tiny_model, questions, out, "--resume", "--no-progress"))
    assert result.exit_code == 0, result.output
    records = read_jsonl(out / "records.jsonl")
    assert len(records) == len(complete)
    assert records[:kept] == complete[:kept]  # kept records untouched
    keys = [(str(r["question_id"]), r["method"], r["repeat"]) for r in records]
    assert len(set(keys)) == len(keys)
    assert set(keys) == {(str(r["question_id"]), r["method"], r["repeat"]) for r in complete}
    summary = json.loads((out / "summary.json").read_text())
    assert all(s["prompts"] == PROMPTS for s in summary["overall"].values())
    config = json.loads((out / "config.json").read_text())
    assert len(config["resumed"]) == 1
    assert "Resumed" in (out / "report.md").read_text()
    json.loads(result.stdout.strip().splitlines()[-1])

    # A second resume finds nothing missing and adds nothing.
    again = invoke(bench_args(tiny_model, questions, out, "--resume", "--no-progress"))
    assert again.exit_code == 0, again.output
    assert len(read_jsonl(out / "records.jsonl")) == len(complete)


def test_resume_with_different_settings_is_refused(finished_run, tiny_model, questions):
    out, _ = finished_run
    before = (out / "records.jsonl").read_bytes()
    result = invoke(bench_args(tiny_model, questions, out, "--resume", max_new_tokens=6))
    assert result.exit_code == 2
    assert "error:" in result.output and "refusing to resume" in result.output
    assert "max_new_tokens" in result.output and "Traceback" not in result.output
    assert (out / "records.jsonl").read_bytes() == before


def test_an_existing_run_is_not_overwritten(finished_run, tiny_model, questions):
    out, _ = finished_run
    result = invoke(bench_args(tiny_model, questions, out))
    assert result.exit_code == 2 and "already holds a benchmark run" in result.output


def test_input_errors_come_before_loading_the_model(tmp_path, questions):
    missing_model = tmp_path / "no-model-here"
    cases = [
        (["--peers", "hf-assisted"], "needs a draft model"),
        (["--methods", "ar,warp"], "unknown method 'warp'"),
        (["--peers", "hf-nope"], "unknown peer 'hf-nope'"),
        (["--categories", "poetry"], "unknown category poetry"),
        (["--repeats", "0"], "--repeats"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--resume"], "--resume needs --out"),
        (["--methods", "ar,eesd/head_int8=maybe"], "head_int8 must be true or false"),
        (["--methods", "ar,mtad/tau=x"], "tau must be a number"),
        (["--methods", "ar,mtad/width=2"], "unknown option 'width'"),
    ]
    for extra, fragment in cases:
        args = ["bench", "--model", str(missing_model), "--dataset", str(questions), *extra]
        if "--resume" not in extra:
            args += ["--out", str(tmp_path / "out")]
        result = invoke(args)
        assert result.exit_code == 2, (extra, result.output)
        assert "error:" in result.output and fragment in result.output, (extra, result.output)
        assert "Traceback" not in result.output
        assert "model path not found" not in result.output  # validated before the model loads


def test_a_malformed_dataset_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2, "category": "a", "turns": []}\n')
    result = invoke(["bench", "--dataset", str(bad), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "line 2" in result.output and "bad.jsonl" in result.output


# -- perplexity -------------------------------------------------------------------------------


def test_perplexity_matches_a_token_by_token_reference(tiny_model):
    from verispec.target.loading import load
    from verispec.target.score import perplexity

    target = load(str(tiny_model), "float32")
    prompt, output = [5, 9, 14, 20], [30, 31, 7, 2]
    context, nll = list(prompt), 0.0
    with torch.inference_mode():
        for token in output:  # obviously correct: one full forward per generated token
            logits = target.model(input_ids=torch.tensor([context]), use_cache=False).logits[0, -1]
            nll -= torch.log_softmax(logits.double(), -1)[token].item()
            context.append(token)
    expected = math.exp(nll / len(output))
    assert perplexity(target, prompt, output) == pytest.approx(expected, rel=1e-4)
    assert math.isnan(perplexity(target, prompt, []))


# -- the optional llama.cpp peers: clear refusals where they cannot run --------------------------

def test_llamacpp_peer_refuses_a_model_that_is_not_gguf(tiny_model, questions, tmp_path):
    """A transformers directory has no GGUF file for llama.cpp: one error line, status 2."""
    result = invoke(bench_args(tiny_model, questions, tmp_path / "out", "--peers", "llamacpp-ar"))
    assert result.exit_code == 2, result.output
    assert "need a GGUF model" in result.output and "Traceback" not in result.output


def test_llamacpp_peer_without_the_package_says_how_to_build_it(monkeypatch):
    from types import SimpleNamespace

    from verispec.bench.peers import PeerSettings, get_peer
    from verispec.errors import ConfigError

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    gguf_target = SimpleNamespace(name="model.gguf")
    for peer in ("llamacpp-ar", "llamacpp-pld"):
        with pytest.raises(ConfigError, match="make llamacpp"):
            get_peer(peer).prepare(gguf_target, PeerSettings())


def test_method_variants_parse_to_options():
    from verispec.core.methods import parse_variant

    assert parse_variant("eesd/head_int8=false") == ("eesd", None, {"head_int8": False})
    assert parse_variant("eesd/constant:4/head_int8=Yes") == ("eesd", "constant:4", {"head_int8": True})
    assert parse_variant("mtad/tau=0.1/beams=2") == ("mtad", None, {"tau": 0.1, "beams": 2})


# -- the OpenVINO GenAI peer: a worker process in its own environment ----------------------------

FAKE_WORKER = '''
import json, sys, time
if "fail-load" in sys.argv[1]:
    print(json.dumps({"error": "RuntimeError: cannot read the file"}), flush=True)
    sys.exit(1)
print(json.dumps({"ready": True, "load_s": 0.0}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    if request["max_new_tokens"] == 13:
        print(json.dumps({"error": "RuntimeError: bad request"}), flush=True)
        continue
    if request["max_new_tokens"] == 14:
        sys.exit(3)
    start = time.process_time()
    while time.process_time() - start < 0.05:  # 50 ms of CPU time of its own
        pass
    print(json.dumps({"tokens": [t + 1 for t in request["ids"]][: request["max_new_tokens"]]}), flush=True)
'''


def fake_openvino_python(tmp_path: Path) -> Path:
    """An 'interpreter' that runs FAKE_WORKER in place of the worker script it is given."""
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    interpreter = tmp_path / "python"
    interpreter.write_text(f'#!/bin/sh\nshift\nexec "{sys.executable}" "{worker}" "$@"\n')
    interpreter.chmod(0o755)
    return interpreter


def test_openvino_peer_speaks_to_its_worker_and_counts_the_workers_cpu(tmp_path):
    from types import SimpleNamespace

    from verispec.bench.peers import PeerError, PeerSettings, _openvino

    run = _openvino(SimpleNamespace(name="model.gguf"), PeerSettings(), prompt_lookup=True,
                    python=str(fake_openvino_python(tmp_path)))
    output = run([5, 6, 7], 2)
    assert output.token_ids == [6, 7] and output.target_forwards is None
    assert output.other_cpu_s is not None and 0.03 < output.other_cpu_s < 5  # the worker's, not this process's
    with pytest.raises(PeerError, match="bad request"):  # an error of one request
        run([1], 13)
    assert run([1, 2], 5).token_ids == [2, 3]  # and the worker goes on
    with pytest.raises(PeerError, match="worker stopped"):
        run([1], 14)


def test_openvino_peer_reports_a_failed_load_and_a_missing_environment(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from verispec.bench import peers
    from verispec.errors import ConfigError

    with pytest.raises(peers.PeerError, match="cannot read the file"):
        peers._openvino(SimpleNamespace(name="fail-load.gguf"), peers.PeerSettings(), prompt_lookup=False,
                        python=str(fake_openvino_python(tmp_path)))
    monkeypatch.setattr(peers, "OPENVINO_PYTHON", Path(".peers/no-such-openvino/bin/python"))
    for peer in ("ov-ar", "ov-pld"):
        with pytest.raises(ConfigError, match="make openvino"):
            peers.get_peer(peer).prepare(SimpleNamespace(name="model.gguf"), peers.PeerSettings())
