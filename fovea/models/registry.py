"""The model families fovea runs, keyed by the `architectures` entry of a checkpoint's config.json.

Each family is one module under fovea/models/ whose `Model` is a `VisionLanguageModel` (base.py) built from
(ModelConfig, ModelOptions, vision_tp); its config.json is parsed by fovea/config/families.py (shapes, placeholder
token ids, the image processor, the position rule). Adding a model is a parser there, a module here and a line
below (docs/models.md, "Adding a model").
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {
    "Qwen2_5_VLForConditionalGeneration": "fovea.models.qwen2_5_vl",
    "Qwen2VLForConditionalGeneration": "fovea.models.qwen2_vl",
    "Qwen3VLForConditionalGeneration": "fovea.models.qwen3_vl",
    "Qwen3VLMoeForConditionalGeneration": "fovea.models.qwen3_vl",  # the same module: its decoder builds experts
    "LlavaForConditionalGeneration": "fovea.models.llava",
    "Gemma3ForConditionalGeneration": "fovea.models.gemma3",
    "InternVLForConditionalGeneration": "fovea.models.internvl",
    "InternVLChatModel": "fovea.models.internvl",  # InternVL's own uploads: other names, the same network
}


def family(architecture: str) -> ModuleType:
    if architecture not in FAMILIES:
        raise ValueError(f"unsupported architecture {architecture!r}; fovea runs {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[architecture])
