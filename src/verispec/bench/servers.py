"""The servers `verispec bench-serve` measures: naming them, starting and stopping them, watching them.

Owns the server spec syntax (`[LABEL=]TARGET [ARGS...]`, see `parse_server`), the command line
that starts each kind of server on the same model with the same thread count (`verispec serve`,
llama.cpp's `llama-server` built by `make llama-server`, vLLM's OpenAI server from the virtual
environment `make vllm` builds), waiting until a server answers `/health` and `/v1/models`,
stopping it (its whole process group), and sampling a server process's resident memory and CPU
time (its child processes included: vLLM computes in a child). Does not own the workloads
(`serve`) or the report (`load_test_report`).

Kinds of TARGET:
- `http://HOST:PORT` (or `.../v1`): a server already running; ARGS may be `--pid N` (its process,
  for memory and CPU) and `--body JSON` (fields added to every request, e.g. `{"method": "ar"}`).
- `verispec[:METHOD]`: `verispec serve --method METHOD ARGS` (default method: the server's own).
- `llama-server[:N]`: `llama-server -m GGUF --parallel N -c N*4096 -t THREADS ARGS` (default N:
  the largest closed-loop concurrency of the run).
For a model without a chat template, llama-server and vLLM are given PLAIN_CHAT_TEMPLATE,
verispec's own chat format for such models, so that a chat request is the same prompt on every
server.
- `vllm`: `python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32
  --max-model-len 4096 ARGS`, computing on as many cores as the thread count
  (VLLM_CPU_OMP_THREADS_BIND; by default it keeps one core of two for its scheduler) with a KV
  cache of VLLM_KV_CACHE_GIB GiB (VLLM_CPU_KVCACHE_SPACE; by default it reserves a share of all
  RAM, refused when other processes hold some). DIR: the transformers directory verispec
  converts a GGUF file to, seen through links without verispec's cached int8 blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import ConfigError, VerispecError
from ..runtime.build import cpu_flags

KINDS = ("url", "verispec", "llama-server", "vllm")
SLOT_CONTEXT = 4096  # positions of context per llama-server slot, and vLLM's --max-model-len
LLAMA_SERVER_RELATIVE = Path(".peers/llama.cpp/build/bin/llama-server")  # where `make llama-server` builds it
LLAMA_NATIVE_RELATIVE = Path(".peers/llama.cpp-native/build/bin")  # `make llama-native`: built for this CPU
VLLM_PYTHON_RELATIVE = Path(".venv-vllm/bin/python")  # the virtual environment `make vllm` builds
VLLM_KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE unless the environment sets one
# verispec's chat format for a model without a chat template (`verispec.request.text.encode_messages`):
# BOS, one "Role: content" paragraph per message, then "Assistant:". Peers get it as a template
# so that every server sees the same prompt tokens.
PLAIN_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
                       "{{ message['role'] | capitalize }}: {{ message['content'] }}{% endfor %}{{ '\\n\\nAssistant:' }}")
VERISPEC_BLOCKS = "blocks.safetensors"  # written by verispec into a converted model's directory
READY_POLL_S = 0.5
STOP_GRACE_S = 30.0


class ServerStartError(VerispecError):
    """A server could not be started, or did not become ready in time."""


@dataclass(frozen=True)
class ServerSpec:
    """One server of a run. `label` names it in records and the report (unique in a run)."""

    label: str
    kind: str
    url: str | None = None
    method: str | None = None
    parallel: int | None = None
    args: tuple[str, ...] = ()
    pid: int | None = None
    body: dict = field(default_factory=dict)

    @property
    def managed(self) -> bool:
        """True when bench-serve starts and stops it."""
        return self.kind != "url"

    def to_json(self) -> dict:
        return {"label": self.label, "kind": self.kind, "url": self.url, "method": self.method,
                "parallel": self.parallel, "args": list(self.args), "pid": self.pid, "body": self.body}


def parse_server(text: str, default_parallel: int) -> ServerSpec:
    """A ServerSpec from `[LABEL=]TARGET [ARGS...]` (see the module docstring); a ConfigError naming
    what is wrong otherwise. The label defaults to the spec as written (TARGET and ARGS)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("--server needs a non-empty spec, e.g. verispec:ar, llama-server:8, vllm or http://HOST:PORT")
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise ConfigError(f"--server {text!r}: {error}") from None
    head, args = words[0], tuple(words[1:])
    label = None
    if "=" in head and not head.startswith(("http://", "https://")):
        label, head = head.split("=", 1)
        if not label.strip() or not head:
            raise ConfigError(f"--server {text!r}: LABEL=TARGET needs both a label and a target")
    default_label = shlex.join([head, *args])
    label = (label or default_label).strip()
    if head.startswith(("http://", "https://")):
        url = head.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        pid, body = _url_options(text, args)
        return ServerSpec(label, "url", url=url, pid=pid, body=body)
    name, _, setting = head.partition(":")
    if name == "verispec":
        if setting:
            from ..server.app import served_method

            served_method(setting)  # a ConfigError for an unknown method or setting
        return ServerSpec(label, "verispec", method=setting or None, args=args)
    if name == "llama-server":
        parallel = default_parallel
        if setting:
            if not setting.isdigit() or not 1 <= int(setting) <= 256:
                raise ConfigError(f"--server {text!r}: llama-server:N needs N (--parallel) in 1..256, got {setting!r}")
            parallel = int(setting)
        return ServerSpec(label, "llama-server", parallel=parallel, args=args)
    if name == "vllm" and not setting:
        return ServerSpec(label, "vllm", args=args)
    raise ConfigError(f"--server {text!r}: the target must be http://HOST:PORT, verispec[:METHOD], "
                      f"llama-server[:N] or vllm")


def _url_options(text: str, args: Sequence[str]) -> tuple[int | None, dict]:
    parser = argparse.ArgumentParser(prog="--server URL", add_help=False, exit_on_error=False)
    parser.add_argument("--pid", type=int)
    parser.add_argument("--body")
    try:
        options, unknown = parser.parse_known_args(list(args))
    except argparse.ArgumentError as error:
        raise ConfigError(f"--server {text!r}: {error}") from None
    if unknown:
        raise ConfigError(f"--server {text!r}: a running server takes only --pid N and --body JSON, got {' '.join(unknown)}")
    if options.pid is not None and options.pid <= 0:
        raise ConfigError(f"--server {text!r}: --pid must be a process id, got {options.pid}")
    body = {}
    if options.body is not None:
        try:
            body = json.loads(options.body)
        except json.JSONDecodeError as error:
            raise ConfigError(f"--server {text!r}: --body is not valid JSON ({error.msg})") from None
        if not isinstance(body, dict):
            raise ConfigError(f"--server {text!r}: --body must be a JSON object")
    return options.pid, body


def check_labels(specs: Sequence[ServerSpec]) -> None:
    seen = set()
    for spec in specs:
        if spec.label in seen:
            raise ConfigError(f"two servers are labelled {spec.label!r}; give one another label with LABEL=TARGET")
        seen.add(spec.label)


# -- the model each kind of server needs ---------------------------------------------------------


@dataclass(frozen=True)
class ModelFiles:
    """The model as each server takes it: `verispec` the --model argument as given (None: the
    embedded model), llama-server a GGUF file, vLLM a transformers directory."""

    argument: str | None

    def gguf(self) -> Path:
        if self.argument is None:
            from ..target.loading import embedded_default_path

            return embedded_default_path()
        path = Path(self.argument).expanduser()
        if path.suffix != ".gguf":
            raise ConfigError(f"llama-server serves a GGUF file; --model {self.argument} is not one")
        if not path.is_file():
            raise ConfigError(f"GGUF file not found: {path}")
        return path

    def transformers_dir(self) -> Path:
        """The directory vLLM loads: the given one, or a float32 checkpoint of the GGUF file
        (dequantized by transformers, converted once for this peer and cached; verispec itself
        runs the file's own blocks and keeps no such copy)."""
        if self.argument is not None and Path(self.argument).expanduser().is_dir():
            return Path(self.argument).expanduser()
        return checkpoint_of(self.gguf())

    def vllm_dir(self, folder: Path) -> Path:
        """`transformers_dir()` as vLLM can load it: a folder of links to its files without the
        cached int8 blocks verispec keeps next to a converted model (`blocks.safetensors`, whose
        tensors vLLM would try to load as the model's)."""
        source = self.transformers_dir()
        if not (source / VERISPEC_BLOCKS).exists():
            return source
        folder.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            link = folder / item.name
            if item.name != VERISPEC_BLOCKS and not link.exists():
                link.symlink_to(item.resolve())
        return folder

    def has_chat_template(self, kind: str) -> bool:
        """Whether the model, as server `kind` reads it, carries a chat template (a GGUF file's
        `tokenizer.chat_template`, a directory's tokenizer_config.json or chat_template.jinja)."""
        if kind == "llama-server":
            from ..gguf.reader import read_gguf

            try:
                with read_gguf(self.gguf()) as file:
                    return "tokenizer.chat_template" in file
            except VerispecError as error:  # a file that is not GGUF
                raise ConfigError(f"cannot read GGUF file {self.gguf()}: {error}") from None
        directory = self.transformers_dir()
        if (directory / "chat_template.jinja").exists():
            return True
        try:
            return bool(json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template"))
        except (OSError, ValueError):
            return False

    def tokenizer_dir(self) -> Path | None:
        """A directory with the model's tokenizer, if one is already on disk (nothing converted)."""
        if self.argument is not None and Path(self.argument).expanduser().is_dir():
            return Path(self.argument).expanduser()
        try:
            gguf = self.gguf()
        except (ConfigError, VerispecError):
            return None
        from ..gguf.metadata import read_gguf_model

        return read_gguf_model(gguf).tokenizer_dir


def checkpoint_of(gguf_path: Path) -> Path:
    """A transformers checkpoint of a GGUF file for a peer that loads only those (vLLM):
    dequantized to float32 by transformers, with the file's tokenizer, made once under the cache
    directory (keyed by the file's path, size and time) and reused."""
    import hashlib
    import shutil
    import tempfile

    import torch

    from ..gguf.metadata import read_gguf_model
    from ..paths import cache_root

    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "converted" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, GgufConfig

    gguf = read_gguf_model(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, config=gguf.config,
                                                 dtype=torch.float32, quantization_config=GgufConfig(dequantize=True))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    model.save_pretrained(staging)
    gguf.tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)  # atomic: a concurrent conversion either wins or finds it done
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def find_peer(explicit: str | None, relative: Path, make_target: str) -> Path:
    """An executable given by path, else `relative` under the working directory or the source
    tree this package lives in; a ConfigError saying which make target builds it."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"{explicit} not found")
        return path
    roots = [Path.cwd(), *Path(__file__).resolve().parents]
    for root in roots:
        if (root / relative).is_file():
            return root / relative
    raise ConfigError(f"{relative} not found in {Path.cwd()} or above the verispec sources: build it with "
                      f"`make {make_target}` in the verispec repository, or give its path")


def llama_binary(name: str, explicit: str | None = None) -> Path:
    """A llama.cpp program: `explicit`, else the native build's (`make llama-native`), else (for
    llama-server) the portable one (`make llama-server`)."""
    if explicit is not None:
        return find_peer(explicit, LLAMA_NATIVE_RELATIVE / name, "llama-native")
    try:
        return find_peer(None, LLAMA_NATIVE_RELATIVE / name, "llama-native")
    except ConfigError:
        if name != "llama-server":
            raise
        return find_peer(None, LLAMA_SERVER_RELATIVE, "llama-server")


def llama_environment(flags: frozenset[str] | None = None) -> dict:
    """Environment additions for a llama.cpp server on this CPU: on CPUs with AMX-INT8 its weight
    repacking off (`LLAMA_ARG_REPACK=0`), since the native build's repacked AMX path dies in prompt
    processing there (SIGILL from llama-bench's pp on an Intel Xeon of family 6 model 207); else none."""
    return {"LLAMA_ARG_REPACK": "0"} if "amx_int8" in (cpu_flags() if flags is None else flags) else {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(spec: ServerSpec, model: ModelFiles, threads: int, port: int, *,
                   llama_server: str | None = None, vllm_python: str | None = None,
                   scratch: Path | None = None) -> tuple[list[str], dict]:
    """(argv, environment additions) that start `spec` on 127.0.0.1:`port`; `scratch`: a folder
    for what a server needs written (vLLM's view of the model directory)."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if spec.kind == "verispec":
        argv = [sys.executable, "-m", "verispec.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        if spec.method:
            argv += ["--method", spec.method]
        if model.argument is not None:
            argv += ["--model", model.argument]
        return argv + list(spec.args), env
    if spec.kind == "llama-server":
        binary = llama_binary("llama-server", llama_server)
        argv = [str(binary), "-m", str(model.gguf()), "-c", str(SLOT_CONTEXT * spec.parallel),
                "--parallel", str(spec.parallel), "-t", str(threads), "-tb", str(threads),
                "--host", "127.0.0.1", "--port", str(port)]
        if not model.has_chat_template("llama-server"):
            argv += ["--jinja", "--chat-template-file", str(_plain_template(scratch))]
        return argv + list(spec.args), {**env, **llama_environment()}
    if spec.kind == "vllm":
        python = find_peer(vllm_python, VLLM_PYTHON_RELATIVE, "vllm")
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.vllm_dir((scratch or Path.cwd()) / "vllm-model")),
                "--dtype", "float32", "--max-model-len", str(SLOT_CONTEXT), "--served-model-name", "verispec-default",
                "--host", "127.0.0.1", "--port", str(port)]
        if not model.has_chat_template("vllm"):
            argv += ["--chat-template", str(_plain_template(scratch))]
        # vLLM's CPU backend keeps a core for its scheduler unless told which cores to compute on,
        # and reserves a share of all RAM for its KV cache unless given a size (GiB).
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(threads))
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(cpu) for cpu in cpus[:threads])
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(VLLM_KV_CACHE_GIB))
        return argv + list(spec.args), env
    raise ValueError(f"{spec.kind} servers are not started by bench-serve")


def _plain_template(scratch: Path | None) -> Path:
    """PLAIN_CHAT_TEMPLATE written to a file in `scratch` (default: the working directory)."""
    path = (scratch or Path.cwd()) / "plain_chat_template.jinja"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PLAIN_CHAT_TEMPLATE)
    return path


# -- running servers -------------------------------------------------------------------------------


def wait_ready(base_url: str, timeout: float, alive: Callable[[], bool] = lambda: True,
               api_key: str | None = None) -> str:
    """Poll `/health` until it answers 200, then return the first model id of `/v1/models`.
    A ServerStartError if `alive()` turns false or `timeout` seconds pass."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not alive():
            raise ServerStartError(f"the server at {base_url} exited before it was ready")
        try:
            health = httpx.get(f"{base_url}/health", timeout=5, headers=headers)
            if health.status_code == 200:
                models = httpx.get(f"{base_url}/v1/models", timeout=10, headers=headers)
                if models.status_code == 200 and models.json().get("data"):
                    return str(models.json()["data"][0]["id"])
                last = f"/v1/models answered {models.status_code}"
            else:
                last = f"/health answered {health.status_code}"
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            last = f"{type(error).__name__}"
        time.sleep(READY_POLL_S)
    raise ServerStartError(f"the server at {base_url} was not ready after {timeout:.0f} s ({last})")


class ManagedServer:
    """A server process bench-serve started: in its own process group (so that stopping it stops
    its workers too), its output in `log_path`."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, port: int):
        self.argv, self.port, self.log_path = argv, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        try:
            self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, **env}, start_new_session=True)
        except OSError as error:
            self._log.close()
            raise ServerStartError(f"cannot start {argv[0]}: {error.strerror or error}") from None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after STOP_GRACE_S."""
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(STOP_GRACE_S)
        else:  # its workers may outlive it
            self._signal(signal.SIGKILL)
        self._log.close()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# -- memory and CPU of a server process ------------------------------------------------------------


class ProcessWatch:
    """Resident memory (bytes) and CPU seconds (user + system) of a process and its descendants,
    with psutil where it is installed, else from /proc (the process alone)."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            import psutil

            self._process = psutil.Process(pid)
        except ImportError:
            self._process = None
        except Exception as error:  # psutil.NoSuchProcess
            raise ConfigError(f"no process {pid} to watch: {error}") from None

    def _tree(self) -> list:
        import psutil

        try:
            return [self._process, *self._process.children(recursive=True)]
        except psutil.Error:
            return []

    def rss(self) -> int | None:
        if self._process is not None:
            import psutil

            total = 0
            for process in self._tree():
                try:
                    total += process.memory_info().rss
                except psutil.Error:
                    pass
            return total or None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def cpu_s(self) -> float | None:
        if self._process is not None:
            import psutil

            total = 0.0
            for process in self._tree():
                try:
                    times = process.cpu_times()
                    total += times.user + times.system
                except psutil.Error:
                    pass
            return total
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
