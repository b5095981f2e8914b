"""The model families fovea runs, keyed by the `architectures` entry of a checkpoint's config.json.

Each family is one module under fovea/models/ with two names:
- `parse_config(raw, preprocessor) -> ModelConfig`: config.json and preprocessor_config.json (as dicts) to the
  settings the engine and the model use: shapes, placeholder token ids, the image processor (multimodal/image.py),
  the position rule (`mrope`: t/h/w M-RoPE, or 1-D).
- `Model`: a `VisionLanguageModel` (base.py) built from (ModelConfig, ModelOptions, vision_tp).
Adding a model is adding a module and a line here (README, "Adding a model").
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": "fovea.models.qwen2_5_vl",
    "Qwen2VLForConditionalGeneration": "fovea.models.qwen2_vl",
    "LlavaForConditionalGeneration": "fovea.models.llava",
}
# config.json files without `architectures` are named by their model_type
MODEL_TYPES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
               "llava": "LlavaForConditionalGeneration"}


def architecture_of(raw: dict) -> str:
    names = raw.get("architectures") or [MODEL_TYPES.get(raw.get("model_type"), str(raw.get("model_type")))]
    supported = [name for name in names if name in FAMILIES]
    if not supported:
        raise ValueError(f"unsupported architecture {names[0]!r} (model_type {raw.get('model_type')!r}); fovea runs "
                         f"{', '.join(sorted(FAMILIES))}")
    return supported[0]


def family(architecture: str) -> ModuleType:
    if architecture not in FAMILIES:
        raise ValueError(f"unsupported architecture {architecture!r}; fovea runs {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[architecture])
