"""fovea: fast serving and evaluation of vision-language models."""

__version__ = "0.1.0"
