"""Model configuration read once from a Hugging Face `config.json` and passed down to every layer.

Two on-disk forms exist for Qwen2.5-VL: the flat one of the published checkpoints (text keys at the top level,
`rope_scaling: {type: mrope, mrope_section}`, `vision_config.in_chans`) and the one transformers 5 writes
(`text_config`, `rope_parameters`, `vision_config.in_channels`, `dtype`). Both parse to the same dataclasses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
           "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16, "fp32": torch.float32,
           "float": torch.float32}


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    tokens_per_second: float
    rope_theta: float

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch (3*2*14*14 = 1176)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def frame_patch_dim(self) -> int:
        """Values in one patch of one frame (3*14*14 = 588): what a still image sends, see VisionPatchEmbed."""
        return self.in_channels * self.patch_size ** 2

    @property
    def window_merged(self) -> int:
        """Side of an attention window counted in merged tokens (112 px / 14 / 2 = 4)."""
        return self.window_size // self.patch_size // self.spatial_merge_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    text: TextConfig
    vision: VisionConfig
    tie_word_embeddings: bool
    torch_dtype: torch.dtype
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        arch = (raw.get("architectures") or ["Qwen2_5_VLForConditionalGeneration"])[0]
        if raw.get("model_type") not in (None, "qwen2_5_vl"):
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r}: fovea runs qwen2_5_vl checkpoints")
        # transformers 5 nests the language model's keys under text_config; published checkpoints keep them flat.
        text_raw = {**raw, **raw.get("text_config", {})}
        text = _parse_text(text_raw)
        vision = _parse_vision(raw.get("vision_config") or {}, text.hidden_size)
        tie = bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False)))
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or text_raw.get("dtype") or "bfloat16"
        eos = text_raw.get("eos_token_id", 151645)
        return cls(
            architecture=arch, text=text, vision=vision, tie_word_embeddings=tie,
            torch_dtype=resolve_dtype(dtype_name),
            image_token_id=raw.get("image_token_id", 151655),
            video_token_id=raw.get("video_token_id", 151656),
            vision_start_token_id=raw.get("vision_start_token_id", 151652),
            vision_end_token_id=raw.get("vision_end_token_id", 151653),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
        )


def _parse_text(raw: dict) -> TextConfig:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is None or len(section) != 3:
        raise ValueError(f"config has no 3-axis mrope_section in rope_scaling/rope_parameters: {rope}")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if 2 * sum(section) != head_dim:
        raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
    return TextConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
        mrope_section=tuple(section),
        max_position_embeddings=raw.get("max_position_embeddings", 128000),
    )


def _parse_vision(raw: dict, text_hidden: int) -> VisionConfig:
    rope = raw.get("rope_parameters") or {}
    return VisionConfig(
        depth=raw.get("depth", 32), hidden_size=raw.get("hidden_size", 1280),
        intermediate_size=raw.get("intermediate_size", 3420), num_heads=raw.get("num_heads", 16),
        in_channels=raw.get("in_channels", raw.get("in_chans", 3)), patch_size=raw.get("patch_size", 14),
        temporal_patch_size=raw.get("temporal_patch_size", 2), spatial_merge_size=raw.get("spatial_merge_size", 2),
        window_size=raw.get("window_size", 112),
        fullatt_block_indexes=tuple(raw.get("fullatt_block_indexes", (7, 15, 23, 31))),
        out_hidden_size=raw.get("out_hidden_size", text_hidden),
        tokens_per_second=raw.get("tokens_per_second", 2), rope_theta=rope.get("rope_theta", 10000.0),
    )


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, bfloat16, float16, float32") from None
