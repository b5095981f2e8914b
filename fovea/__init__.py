"""fovea: fast serving and evaluation of vision-language models."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # imported on first use, so `fovea --version` and light tools do not pay for torch
    if name == "LLM":
        from fovea.llm import LLM
        return LLM
    if name == "SamplingParams":
        from fovea.engine.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from fovea.engine import request
        return getattr(request, name)
    raise AttributeError(f"module 'fovea' has no attribute {name!r}")
