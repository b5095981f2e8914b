"""Qwen2-VL: Qwen2.5-VL's ancestor, and its network with three changes (see qwen2_5_vl.py for the rest).

- The vision tower attends over whole frames in every block (no windows), its blocks normalise with LayerNorm and
  their MLP is fc1 -> QuickGELU -> fc2; the patch merger's norm is a LayerNorm too.
- The vision config names the tower's width `embed_dim` (its `hidden_size` is the language model's) and its MLP
  width `mlp_ratio` x embed_dim.
- A video's M-RoPE time index counts temporal patches, not seconds (no tokens_per_second).
"""

from __future__ import annotations

from torch import nn

from fovea.attention.layer import AttentionMetadata
from fovea.config.model import ModelConfig, VisionConfig, parse_text, text_keys
from fovea.models import qwen2_5_vl
from fovea.models.decoder import FeedForward


def parse_config(raw: dict, preprocessor: dict) -> ModelConfig:
    text = parse_text(text_keys(raw), mrope=True, attention_bias=True)
    vision = raw.get("vision_config") or {}
    width, depth = vision.get("embed_dim", 1280), vision.get("depth", 32)
    patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
    return qwen2_5_vl.qwen_model_config(raw, preprocessor, text, VisionConfig(
        depth=depth, hidden_size=width, intermediate_size=int(width * vision.get("mlp_ratio", 4)),
        num_heads=vision.get("num_heads", 16), in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
        patch_size=patch, temporal_patch_size=vision.get("temporal_patch_size", 2), spatial_merge_size=merge,
        window_size=patch * merge, fullatt_block_indexes=tuple(range(depth)),  # every block attends per frame
        out_hidden_size=vision.get("hidden_size", text.hidden_size), tokens_per_second=None,
        rope_theta=(vision.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        hidden_act=vision.get("hidden_act", "quick_gelu")))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = qwen2_5_vl.VisionAttention(cfg, fp32_softmax)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        x = x + self.attn(self.norm1(x), cos, sin, meta)
        return x + self.mlp(self.norm2(x))


class VisionTransformer(qwen2_5_vl.VisionTransformer):
    block, norm = VisionBlock, nn.LayerNorm


class Model(qwen2_5_vl.Model):
    vision_tower = VisionTransformer
