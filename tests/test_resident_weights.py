"""The GGUF runtime's matrices copied into huge pages (`runtime.resident`): the copy holds the
file's bytes, the decoder multiplies the copy (not the map) for every matrix a step reads in
full, an untied embedding stays mapped, and the logits are the mapped run's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_models import write_tiny_gguf

from verispec.errors import ModelLoadError
from verispec.gguf.metadata import read_gguf_model
from verispec.gguf.reader import GgufFile
from verispec.runtime import blockmm
from verispec.runtime.gguf_decoder import GgufDecoder
from verispec.runtime.resident import HUGE_PAGE, huge_page_bytes, resident_copy
from verispec.target.model import Target


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resident")
    return {"untied": write_tiny_gguf(folder / "qwen2.gguf", "qwen2", types={"ffn_down": "Q6_K", "attn_q": "Q4_K"}),
            "tied": write_tiny_gguf(folder / "llama.gguf", "llama", types={"token_embd": "Q6_K"}, tied=True),
            "cache": folder / "cache"}


def test_the_copy_holds_each_tensors_bytes_aligned_and_read_only(files):
    file = GgufFile(files["untied"])
    names = [info.name for info in file.tensors.values() if info.name.startswith("blk.")]
    copies = resident_copy(file, names)
    assert sorted(copies) == sorted(names)
    first = min(view.ctypes.data for view in copies.values())
    assert first % HUGE_PAGE == 0  # the region starts on a huge page
    for name, view in copies.items():
        assert view.ctypes.data % 64 == 0
        assert not view.flags.writeable
        assert np.array_equal(view, file.tensor_bytes(name).reshape(-1)), name
    # the copy is its own memory, not a view of the file's map
    mapped = file.tensor_bytes(names[0])
    assert not np.shares_memory(copies[names[0]], mapped)


def test_mapped_weights_are_kept_on_request_and_a_bad_value_is_refused(files, monkeypatch):
    file = GgufFile(files["untied"])
    monkeypatch.setenv("VERISPEC_WEIGHTS", "mapped")
    assert resident_copy(file, ["blk.0.attn_q.weight"]) == {}
    monkeypatch.setenv("VERISPEC_WEIGHTS", "Resident")
    assert list(resident_copy(file, ["blk.0.attn_q.weight"])) == ["blk.0.attn_q.weight"]
    monkeypatch.setenv("VERISPEC_WEIGHTS", "hugepages")
    with pytest.raises(ModelLoadError, match="VERISPEC_WEIGHTS='hugepages'.*'resident'.*'mapped'"):
        resident_copy(file, ["blk.0.attn_q.weight"])


def test_without_the_region_the_matrices_stay_mapped_and_the_model_still_runs(files, monkeypatch):
    import mmap

    real = mmap.mmap

    def refused(fileno, *args, **kwargs):
        if fileno == -1:
            raise OSError(12, "Cannot allocate memory")
        return real(fileno, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refused)
    d = decoder(files["untied"], files["cache"], monkeypatch, "")
    assert d._resident == {} and d.weight_pages() is None
    target = Target.of_decoder(d, d.config, read_gguf_model(files["untied"], cache_dir=files["cache"]).tokenizer,
                               "untied", [0])
    sequence = target.new_sequence()
    sequence.reset()
    assert torch.isfinite(sequence.forward([1, 2, 3]).float()).all()
    sequence.release()


def test_huge_page_bytes_reads_the_smaps_record_of_the_region_holding_the_view(files):
    view = np.zeros(64, dtype=np.uint8)
    address = view.ctypes.data
    record = lambda start, end, huge: [f"{start:x}-{end:x} rw-p 00000000 00:00 0\n", "Size:  4 kB\n",
                                       f"AnonHugePages:  {huge} kB\n"]  # noqa: E731
    smaps = record(address - 8192, address - 4096, 6144) + record(address - 64, address + 4096, 2048) \
        + record(address + 4096, address + 8192, 4096)
    assert huge_page_bytes(view, smaps) == 2048 * 1024  # the second record's, not its neighbours'
    assert huge_page_bytes(view, record(address + 64, address + 128, 2048)) is None  # no region holds it
    # the real file: the copy's region is found, and holds at most the copy's size in huge pages
    file = GgufFile(files["untied"])
    copy = resident_copy(file, ["blk.0.ffn_down.weight"])["blk.0.ffn_down.weight"]
    granted = huge_page_bytes(copy)
    assert granted is not None and 0 <= granted <= copy.nbytes + HUGE_PAGE


def decoder(path, cache, monkeypatch, mode: str) -> GgufDecoder:
    monkeypatch.setenv("VERISPEC_WEIGHTS", mode)
    return GgufDecoder(read_gguf_model(path, cache_dir=cache), blockmm.kernel()[0])


def inside(matrix, region: np.ndarray) -> bool:
    start = region.ctypes.data
    return start <= matrix.address < start + region.size


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_the_decoder_multiplies_the_copy_and_gives_the_mapped_logits(files, monkeypatch, name):
    resident = decoder(files[name], files["cache"], monkeypatch, "")
    mapped = decoder(files[name], files["cache"], monkeypatch, "mapped")
    assert resident._resident and not mapped._resident
    whole = resident.file._bytes  # the file's map
    matrices = [m for layer in resident.layers for m in layer.keep if hasattr(m, "address")]
    assert len(matrices) == 7 * len(resident.layers)  # q, k, v, o, gate, up, down
    assert not any(inside(matrix, whole) for matrix in matrices)  # every layer matrix comes from the copy
    assert not inside(resident.head.matrix, whole)
    # an untied embedding is looked up a row at a time: it stays mapped (not copied)
    assert inside(resident.embedding, whole) == (name == "untied")
    targets = [Target.of_decoder(d, d.config, read_gguf_model(files[name], cache_dir=files["cache"]).tokenizer,
                                 name, [0]) for d in (resident, mapped)]
    ids = torch.randint(0, targets[0].vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = []
    for target in targets:
        sequence = target.new_sequence()
        sequence.reset()
        logits.append(sequence.forward(ids).float().clone())
        sequence.release()
    assert torch.equal(logits[0], logits[1])


def test_profile_says_where_the_matrices_are(files, monkeypatch):
    from verispec.bench.profile import format_profile, profile_target

    for mode in ("", "mapped"):
        d = decoder(files["untied"], files["cache"], monkeypatch, mode)
        target = Target.of_decoder(d, d.config, read_gguf_model(files["untied"], cache_dir=files["cache"]).tokenizer,
                                   "untied", [0])
        profile = profile_target(target, context_length=8, widths=(2,), repeats=1, rounds=1)
        line = [text for text in format_profile(profile).splitlines() if text.startswith("matrices copied")]
        if mode == "mapped":
            assert profile["weight_pages"] is None and not line
        else:
            assert profile["weight_pages"]["copied_bytes"] == sum(view.nbytes for view in d._resident.values())
            assert line == [line[0]] and f"{profile['weight_pages']['copied_bytes'] / 1e6:.0f} MB" in line[0]
