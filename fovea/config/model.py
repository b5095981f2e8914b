"""Model configuration read once from a Hugging Face model directory and passed down to every layer.

`ModelConfig.from_dir` reads config.json and preprocessor_config.json once; the family that `architectures` names
(fovea/models/registry.py) turns them into these dataclasses. The helpers below parse what the families share:
a decoder language model's keys, flat (published Qwen checkpoints) or nested under `text_config` (transformers 5,
LLaVA), with the defaults of transformers' config classes for keys a checkpoint leaves out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fovea.config.image import ImageProcessorConfig

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
    mrope_section: tuple[int, int, int]  # 1-D RoPE: (head_dim / 2, 0, 0)
    max_position_embeddings: int
    attention_bias: bool = True  # biases on q/k/v (Qwen2); Llama has none


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
    tokens_per_second: float | None  # M-RoPE time index per second of video; None: one per temporal patch
    rope_theta: float
    hidden_act: str = "silu"
    norm_eps: float = 1e-6
    image_size: int = 0  # a fixed input side (CLIP); 0: any size (Qwen's dynamic resolution)

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
    video_token_id: int | None  # None: the model takes no videos
    vision_start_token_id: int | None
    vision_end_token_id: int | None
    eos_token_ids: tuple[int, ...]
    image: ImageProcessorConfig = ImageProcessorConfig()  # the checkpoint's preprocessing, as its family reads it
    mrope: bool = True  # position rule: M-RoPE (t, h, w) for vision tokens, or 1-D for every token

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory: no config.json")
        preprocessor = Path(model_dir) / "preprocessor_config.json"
        return cls.from_dict(json.loads(path.read_text()),
                             json.loads(preprocessor.read_text()) if preprocessor.is_file() else {})

    @classmethod
    def from_dict(cls, raw: dict, preprocessor: dict | None = None) -> ModelConfig:
        from fovea.models.registry import architecture_of, family

        return family(architecture_of(raw)).parse_config(raw, preprocessor or {})


def text_keys(raw: dict) -> dict:
    """The language model's keys: transformers 5 and LLaVA nest them under text_config."""
    return {**raw, **(raw.get("text_config") or {})}


def parse_text(raw: dict, mrope: bool, attention_bias: bool, defaults: dict | None = None) -> TextConfig:
    """A decoder's settings from its (text_keys) dict; `defaults` for keys the checkpoint leaves out."""
    raw = {**(defaults or {}), **{k: v for k, v in raw.items() if v is not None}}
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if mrope:
        section = rope.get("mrope_section")
        if section is None or len(section) != 3:
            raise ValueError(f"config has no 3-axis mrope_section in rope_scaling/rope_parameters: {rope}")
        if 2 * sum(section) != head_dim:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {head_dim // 2}")
    else:
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"rope scaling {rope} is not supported; fovea runs the default RoPE")
        section = (head_dim // 2, 0, 0)  # every frequency reads the first position axis: 1-D RoPE
    return TextConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
        mrope_section=tuple(section),
        max_position_embeddings=raw.get("max_position_embeddings", 128000), attention_bias=attention_bias,
    )


def checkpoint_dtype(raw: dict) -> torch.dtype:
    text = raw.get("text_config") or {}
    return resolve_dtype(raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype")
                         or text.get("dtype") or "bfloat16")


def eos_ids(eos) -> tuple[int, ...]:
    return tuple(eos) if isinstance(eos, list) else (eos,)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, bfloat16, float16, float32") from None


def serving_dtype(checkpoint: torch.dtype, requested: str | torch.dtype, device_type: str) -> torch.dtype:
    """The dtype weights and activations run in: `requested`, or for auto the checkpoint's; an fp32 checkpoint
    serves in bf16 on a GPU (as published ones are), and fp16 runs as fp32 on the CPU (slow or missing there)."""
    dtype = checkpoint if requested == "auto" else resolve_dtype(requested)
    if requested == "auto" and device_type == "cuda" and dtype == torch.float32:
        return torch.bfloat16
    if device_type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype
