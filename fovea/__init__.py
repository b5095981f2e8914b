"""fovea: fast serving and evaluation of vision-language models."""

import logging
import os
import sys

__version__ = "0.1.0"

# Like vLLM, fovea says what it sized and chose (KV cache, ...) at INFO on stderr unless the application set up
# the "fovea" logger itself; FOVEA_LOGGING_LEVEL changes the level.
_logger = logging.getLogger("fovea")
if not _logger.handlers:
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(levelname)s fovea: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(os.environ.get("FOVEA_LOGGING_LEVEL", "INFO").upper())
    _logger.propagate = False
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
]


def __getattr__(name: str):
    # imported on first use, so `fovea --version` and light tools do not pay for torch
    if name == "LLM":
        from fovea.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fovea.core.sampling_params import SamplingParams

        return SamplingParams
    if name in ("StructuredOutputsParams", "BeamSearchParams"):
        from fovea.core import sampling_params

        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput", "LoRARequest"):
        from fovea.core import request

        return getattr(request, name)
    raise AttributeError(f"module 'fovea' has no attribute {name!r}")
