"""verispec: faster LLM generation by drafting cheaply and verifying in one target forward.

Public API only; see README.md. Typical use:

    import verispec
    target = verispec.load()                       # the embedded Gemma 3 270M
    result = verispec.generate(target, "Once upon a time", method="anpd", max_new_tokens=64)
    print(result.text, result.stats.mean_accepted_tokens)
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time each name loads on first use
    from .api import GenerationResult, TextStream, generate, generate_many, make_request, stream, stream_many
    from .errors import ConfigError, ModelLoadError, VerispecError
    from .hf_generate import transformers_generate
    from .core.methods import METHODS, MethodOptions, method_names
    from .target.model import Target
    from .target.loading import load
    from .core.sampling import SamplingConfig
    from .core.stats import GenerationStats

# Where each public name lives. They are imported on first use (PEP 562), so that `import
# verispec` -- and with it `verispec --help` -- does not load torch and transformers (about 7 s
# here) before anything needs them.
_EXPORTS = {
    "GenerationResult": "api", "TextStream": "api", "generate": "api", "stream": "api",
    "generate_many": "api", "stream_many": "api", "make_request": "api",
    "ConfigError": "errors", "ModelLoadError": "errors", "VerispecError": "errors",
    "transformers_generate": "hf_generate",
    "METHODS": "core.methods", "MethodOptions": "core.methods", "method_names": "core.methods",
    "Target": "target.model", "load": "target.loading",
    "SamplingConfig": "core.sampling",
    "GenerationStats": "core.stats",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__version__ = "0.1.0"

__all__ = sorted(_EXPORTS)
