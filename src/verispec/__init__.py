"""verispec: faster LLM generation by drafting cheaply and verifying in one target forward.

Public API only; see README.md. Typical use:

    import verispec
    target = verispec.load()                       # the embedded Gemma 3 270M
    result = verispec.generate(target, "Once upon a time", method="anpd", max_new_tokens=64)
    print(result.text, result.stats.mean_accepted_tokens)
"""

from .api import GenerationResult, TextStream, generate, stream
from .errors import ConfigError, ModelLoadError, VerispecError
from .methods import METHODS, MethodOptions, method_names
from .model import Target, load
from .sampling import SamplingConfig
from .stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "GenerationResult",
    "GenerationStats",
    "METHODS",
    "MethodOptions",
    "ModelLoadError",
    "SamplingConfig",
    "Target",
    "TextStream",
    "VerispecError",
    "generate",
    "load",
    "method_names",
    "stream",
]
