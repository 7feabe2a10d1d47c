"""Where a model runs: the `device` option, what it resolves to, and the CUDA decode step.

Owns:
- the spelling of `device` ("auto", "cpu", "cuda", "cuda:N", "auto-map"), its validation
  (`check_device`, syntax only, before anything loads) and resolution (`resolve_device`: "auto"
  is the first CUDA device when `torch.cuda.is_available()`, else the CPU; a CUDA device that is
  not there, or "auto-map" without accelerate, is a `ConfigError`);
- "auto-map": transformers' `device_map="auto"` (accelerate places the layers over every visible
  GPU, and CPU memory if they do not fit), for a model larger than one GPU;
- where a loaded model takes its inputs (`model_device`) and whether it is spread over several
  devices (`spread_over_devices`), and a one-line description of a device for reports;
- `CompiledStep`: the optional CUDA decode step of the PyTorch path, a `torch.compile`d
  one-token forward (CUDA graphs, mode "reduce-overhead") over transformers' `StaticCache`,
  with rollback by moving the cache's length. Unmeasured and untried on a GPU (CI has none; the
  CPU tests run it through TorchDynamo's "eager" backend); it falls back to the uncompiled
  forward, with a message, whenever compiling or running it fails.

The CPU runtime (fast path, block kernel, C layers) runs on the CPU only; `model.Target` runs
transformers' PyTorch forward on any other device.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import torch

from ..errors import ConfigError
from ..notices import notice

AUTO_MAP = "auto-map"
DEVICE_CHOICES = "auto | cpu | cuda | cuda:N | auto-map"
STATIC_CACHE_TOKENS = 4096  # positions of the compiled step's static KV cache (prompt + output)
_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+|auto-map)$")


def check_device(device: "str | torch.device") -> str:
    """The device option as written, checked for spelling only (no hardware is consulted):
    'auto', 'cpu', 'cuda', 'cuda:N' or 'auto-map'. A ConfigError names any other value."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str) or not _PATTERN.match(device.strip().lower()):
        raise ConfigError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    return device.strip().lower()


def accelerate_available() -> bool:
    return importlib.util.find_spec("accelerate") is not None


def _no_cuda(device: str) -> ConfigError:
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
    else:
        why = "CUDA is not available here (no GPU visible to torch)"
    return ConfigError(f"device {device!r} needs a CUDA GPU, but {why}; use device 'cpu' or 'auto'")


def resolve_device(device: "str | torch.device", compile: bool = False) -> str:
    """'cpu', 'cuda:N' or 'auto-map': what `device` means on this machine. A ConfigError for a
    bad spelling, a CUDA device that is not there, 'auto-map' without accelerate or CUDA, or
    `compile` (the compiled CUDA decode step) on the CPU."""
    resolved = _resolve(check_device(device))
    if compile and resolved == "cpu":
        raise ConfigError("compile (--compile) is for CUDA devices; on the CPU the fast path runs, nothing is compiled")
    return resolved


def _resolve(spec: str) -> str:
    if spec == "cpu":
        return "cpu"
    if spec == "auto":
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if spec == AUTO_MAP and not accelerate_available():
        raise ConfigError("device 'auto-map' needs the package accelerate (pip install accelerate)")
    if not torch.cuda.is_available():
        raise _no_cuda(spec)
    if spec == AUTO_MAP:
        return AUTO_MAP
    index = int(spec.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"device {spec!r}: there is no GPU {index} here ({count} visible: cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"


def default_dtype(device: str) -> torch.dtype:
    """dtype 'auto' on a GPU ('cuda:N' or 'auto-map'): bfloat16 where the GPU has native bf16
    (compute capability 8.0 and later), else float16."""
    index = 0 if device == AUTO_MAP else torch.device(device).index or 0
    return torch.bfloat16 if torch.cuda.get_device_capability(index)[0] >= 8 else torch.float16


def model_device(model) -> torch.device:
    """Where `model` takes its input ids: the device of its input embedding (with a device map,
    accelerate returns the outputs to that device too). Offloaded weights ('meta') mean the CPU."""
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def spread_over_devices(model) -> bool:
    """Whether a device map put `model`'s modules on more than one device."""
    placements = getattr(model, "hf_device_map", None) or {}
    return len({str(value) for value in placements.values()}) > 1


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:200]


def describe(device: torch.device | str) -> str:
    """'cpu', or e.g. 'cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)'."""
    device = torch.device(device)
    if device.type != "cuda":
        return str(device)
    properties = torch.cuda.get_device_properties(device)
    return f"{device} ({properties.name}, {properties.total_memory / 2**30:.1f} GiB)"


class CompiledStep:
    """A one-token decode step compiled with `torch.compile` over a transformers `StaticCache`
    (CUDA: mode "reduce-overhead" replays it as a CUDA graph), next to the uncompiled forward on
    the same cache for wider chunks (prefill, verification).

    `length` (a Python int) is the truth about how many positions the cache holds; rollback
    (`crop`) sets the cache's own length tensors in place (`cache.set_static_length`), so the
    graph keeps its addresses; sliding-window layers are full-length there, so they roll back too
    (`cache.new_static_cache`).
    When compiling or running the compiled step fails, the step says why once and runs
    uncompiled from then on.
    """

    def __init__(self, model, capacity: int, mode: str | None = "reduce-overhead", backend: str = "inductor"):
        from .hf_cache import new_static_cache

        cache = new_static_cache(model, capacity)
        assert not isinstance(cache, str), cache
        self.model, self.capacity, self.length, self.cache = model, capacity, 0, cache
        try:
            self._compiled = torch.compile(self._one_token, mode=mode, backend=backend, dynamic=False)
        except Exception as error:  # e.g. a Python that TorchDynamo does not support
            notice(f"decode step not compiled ({type(error).__name__}: {_first_line(error)}); running it uncompiled")
            self._compiled = None

    @staticmethod
    def unsupported(model) -> str | None:
        """None if the step can run `model`, else why not."""
        from .hf_cache import new_static_cache

        cache = new_static_cache(model, 8)
        return cache if isinstance(cache, str) else None

    def _one_token(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1).logits[0]

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (0 starts a new request)."""
        from .hf_cache import set_static_length

        assert 0 <= length <= self.length, f"cannot crop a cache of {self.length} positions to {length}"
        if length < self.length:
            set_static_length(self.cache, length)
        self.length = length

    def forward(self, ids: torch.Tensor, last_only: bool) -> torch.Tensor:
        """ids [1, n] appended at `length`; logits [n, vocab] (or [1, vocab] with last_only)."""
        n = ids.shape[1]
        assert self.length + n <= self.capacity, "the static cache is full (Target.max_length guards this)"
        if n == 1 and self._compiled is not None:
            try:
                logits = self._compiled(ids).clone()  # a CUDA graph's output is overwritten by its next replay
                self.length += 1
                return logits
            except Exception as error:  # compilation or graph capture failed: run uncompiled from now on
                from .hf_cache import set_static_length

                notice(f"compiled decode step failed ({type(error).__name__}: {_first_line(error)}); running it uncompiled")
                self._compiled = None
                set_static_length(self.cache, self.length)  # whatever the failed call wrote is not committed
        keep = 1 if last_only else 0
        logits = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=keep).logits[0]
        self.length += n
        return logits
