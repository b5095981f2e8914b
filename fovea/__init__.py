"""fovea: fast serving and evaluation of vision-language models."""

import logging
import os
import sys

__version__ = "0.1.0"

# Like vLLM, fovea says what it sized and chose (KV cache, ...) at INFO on stderr unless the application set up
# the "fovea" logger itself; FOVEA_LOGGING_LEVEL (or vLLM's VLLM_LOGGING_LEVEL) changes the level, vLLM's
# VLLM_LOGGING_CONFIG_PATH names a JSON logging configuration (dictConfig's; `fovea serve --log-config-file` sets it
# for its engine processes), and VLLM_CONFIGURE_LOGGING=0 leaves the logger to the application.


def apply_logging_config(path: str) -> dict:
    """Reads the JSON dictConfig at `path` and applies it; returns it. A ValueError names what is wrong."""
    import json
    import logging.config

    try:
        with open(path) as file:
            config = json.load(file)
        logging.config.dictConfig(config)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as error:
        raise ValueError(f"{path}: {error}") from None
    return config


_logger = logging.getLogger("fovea")
_config_path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
if _config_path and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
    try:
        apply_logging_config(_config_path)
    except ValueError as _error:
        raise ValueError(f"VLLM_LOGGING_CONFIG_PATH={_error}") from None
elif not _logger.handlers and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
    _variable = next((v for v in ("FOVEA_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL") if os.environ.get(v)), None)
    _level = os.environ[_variable].upper() if _variable else "INFO"
    if not isinstance(logging.getLevelName(_level), int):
        raise ValueError(
            f"{_variable}={os.environ[_variable]!r} is not a level: DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(levelname)s fovea: %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_level)
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
