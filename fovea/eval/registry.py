"""Named models for `fovea eval --model NAME`: where the weights are, how to start the engine, how to ask.

Entries come from three places: the built-in Qwen2.5-VL sizes below, YAML files, and Python files that use the
decorator. `--registry FILE` (repeatable) loads either kind:

    # models.yaml                                   # models.py
    models:                                         from fovea.eval.registry import register_model
      my-vlm:
        path: /checkpoints/my-vlm                   @register_model("my-vlm")
        max_pixels: 401408                          def my_vlm():
        engine_kwargs: {max_num_seqs: 64}               return {"path": "/checkpoints/my-vlm", "max_tokens": 32}
        system_prompt: You are a pathologist.

Any other `--model` value (a model directory, a hub id in the local cache, the name a server serves) gets the
defaults: greedy decoding, no system prompt, the engine's own settings.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

QWEN_MAX_PIXELS = 1280 * 28 * 28  # the Qwen2.5-VL model card's suggested cap: at most 1280 visual tokens per image
QWEN3_MAX_PIXELS = 1280 * 32 * 32  # the same 1280 tokens for Qwen3-VL, whose tokens are 32 x 32 pixels


@dataclass
class ModelEntry:
    name: str
    path: str  # a model directory or hub id; with --base-url, the model name sent to the server
    tensor_parallel_size: int = 1  # GPUs per engine replica
    max_pixels: int | None = None  # image resize cap (the processor's max_pixels)
    engine_kwargs: dict = field(default_factory=dict)  # any other LLM(...) argument: max_num_seqs, max_model_len
    system_prompt: str | None = None
    temperature: float = 0.0
    max_tokens: int = 64
    sampling: dict = field(default_factory=dict)  # other sampling parameters: top_p, repetition_penalty, seed...

    def sampling_params(self) -> dict:
        """What every backend asks with. Plain greedy unless the entry says otherwise: a server would otherwise
        apply the checkpoint's generation_config (Qwen2.5-VL's has repetition_penalty 1.05), in-process would not."""
        return {
            "repetition_penalty": 1.0,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            **self.sampling,
        }

    def llm_kwargs(self) -> dict:
        kwargs = dict(self.engine_kwargs)
        if self.tensor_parallel_size != 1:
            kwargs["tensor_parallel_size"] = self.tensor_parallel_size
        if self.max_pixels:
            kwargs["mm_processor_kwargs"] = {**kwargs.get("mm_processor_kwargs", {}), "max_pixels": self.max_pixels}
        return kwargs


MODELS: dict[str, ModelEntry] = {}


def register_model(name: str) -> Callable:
    """Decorates a function returning a ModelEntry, or a dict of its fields (`name` comes from here)."""

    def register(make: Callable) -> Callable:
        made = make()
        MODELS[name] = made if isinstance(made, ModelEntry) else _entry(name, made, f"@register_model({name!r})")
        return make

    return register


def _entry(name: str, values, where: str) -> ModelEntry:
    if not isinstance(values, dict) or "path" not in values:
        raise ValueError(f"{where}: model {name!r} needs a mapping with at least a path")
    unknown = set(values) - {f.name for f in fields(ModelEntry)}
    if unknown:
        raise ValueError(f"{where}: model {name!r} has unknown keys {sorted(unknown)}")
    from fovea import SamplingParams

    unknown = set(values.get("sampling") or {}) - {f.name for f in fields(SamplingParams)}
    if unknown:
        raise ValueError(f"{where}: model {name!r} has unknown sampling parameters {sorted(unknown)}")
    return ModelEntry(**{"name": name, **values})


def load_registry(path: str | Path) -> None:
    """Adds the entries of a YAML file (a `models:` mapping of name -> fields) or a Python file's decorators."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"registry file {path} does not exist")
    if path.suffix == ".py":
        spec = importlib.util.spec_from_file_location(f"fovea_registry_{path.stem}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return
    import yaml

    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict):
        raise ValueError(f"{path}: a registry file holds a `models:` mapping of name -> settings")
    for name, values in raw["models"].items():
        MODELS[str(name)] = _entry(str(name), values, str(path))


def find_model(name_or_path: str) -> ModelEntry:
    return MODELS.get(name_or_path) or ModelEntry(name=Path(name_or_path).name or name_or_path, path=name_or_path)


def _qwen(name: str, hub: str, tensor_parallel_size: int, max_pixels: int) -> None:
    """A Qwen-VL Instruct checkpoint: greedy, its images capped at 1280 tokens, 8192 positions."""
    MODELS[name] = ModelEntry(
        name=name,
        path=f"Qwen/{hub}-Instruct",
        tensor_parallel_size=tensor_parallel_size,
        max_pixels=max_pixels,
        engine_kwargs={"max_model_len": 8192},
    )


# Built-in entries. Tensor-parallel size: the fewest GPUs (a power of two) that keep each 80 GB GPU's share of the
# bf16 weights under 60% of it, leaving the rest to the KV cache and activations: 3B (7.5 GB) and 7B (16.6 GB) on
# one, 32B (67 GB) on two, 72B (147 GB) on four.
for _size, _tp in (("3B", 1), ("7B", 1), ("32B", 2), ("72B", 4)):
    _qwen(f"qwen2.5-vl-{_size.lower()}", f"Qwen2.5-VL-{_size}", _tp, QWEN_MAX_PIXELS)
# The other families, one GPU each (bf16 weights: LLaVA-1.5-7B 14 GB, Qwen2-VL-7B 16.6 GB); LLaVA-1.5's images are
# always 576 tokens (no max_pixels), its language model reaches 4096 positions
MODELS["llava-1.5-7b"] = ModelEntry(
    name="llava-1.5-7b", path="llava-hf/llava-1.5-7b-hf", engine_kwargs={"max_model_len": 4096}
)
_qwen("qwen2-vl-7b", "Qwen2-VL-7B", 1, QWEN_MAX_PIXELS)
# Qwen3-VL by the same rule (bf16 weights: 8B 17.5 GB, 32B 66.7 GB, the 30B-A3B MoE 62 GB: its experts split over
# the ranks as the rest does)
for _size, _tp in (("8B", 1), ("32B", 2), ("30B-A3B", 2)):
    _qwen(f"qwen3-vl-{_size.lower()}", f"Qwen3-VL-{_size}", _tp, QWEN3_MAX_PIXELS)
# Gemma 3 (bf16 weights: 4B 8.6 GB, 12B 24 GB, 27B 55 GB: two GPUs), images always 256 tokens (no max_pixels)
for _size, _tp in (("4b", 1), ("12b", 1), ("27b", 2)):
    MODELS[f"gemma-3-{_size}"] = ModelEntry(
        name=f"gemma-3-{_size}",
        path=f"google/gemma-3-{_size}-it",
        tensor_parallel_size=_tp,
        engine_kwargs={"max_model_len": 8192},
    )
# InternVL3.5 as transformers converts it ("-HF"; bf16 weights: 8B 17 GB, 14B 30 GB, 38B 77 GB: two GPUs), images
# 256 tokens a tile, up to 12 tiles and a thumbnail. The 38B's InternViT-6B (25 heads, q and k normed over all of
# them) runs whole on each rank: the engine chooses mm_encoder_tp_mode data for it. The 30B-A3B (Qwen3-MoE decoder,
# 62 GB): two GPUs, its experts split as the rest
for _size, _tp in (("1B", 1), ("2B", 1), ("4B", 1), ("8B", 1), ("14B", 1), ("38B", 2), ("30B-A3B", 2)):
    MODELS[f"internvl3.5-{_size.lower()}"] = ModelEntry(
        name=f"internvl3.5-{_size.lower()}",
        path=f"OpenGVLab/InternVL3_5-{_size}-HF",
        tensor_parallel_size=_tp,
        engine_kwargs={"max_model_len": 8192},
    )
# InternVL3.5-GPT-OSS-20B-A4B (a GPT-OSS decoder; 21.2B parameters, 42 GB in bf16: one GPU), uploaded only as
# OpenGVLab uploads InternVL (InternVLChatModel)
MODELS["internvl3.5-gpt-oss-20b-a4b"] = ModelEntry(
    name="internvl3.5-gpt-oss-20b-a4b",
    path="OpenGVLab/InternVL3_5-GPT-OSS-20B-A4B-Preview",
    engine_kwargs={"max_model_len": 8192},
)
