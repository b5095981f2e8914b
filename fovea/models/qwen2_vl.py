"""Qwen2-VL: Qwen2.5-VL's ancestor, and its network with three changes (see qwen2_5_vl.py for the rest).

- The vision tower attends over whole frames in every block (no windows), its blocks normalise with LayerNorm and
  their MLP is fc1 -> QuickGELU -> fc2; the patch merger's norm is a LayerNorm too.
- The vision config names the tower's width `embed_dim` (its `hidden_size` is the language model's) and its MLP
  width `mlp_ratio` x embed_dim (read in fovea/config/families.py).
- A video's M-RoPE time index counts temporal patches, not seconds (no tokens_per_second).
"""

from __future__ import annotations

from torch import nn

from fovea.attention.layer import AttentionMetadata
from fovea.config.model import VisionConfig
from fovea.models import qwen2_5_vl
from fovea.models.decoder import FeedForward


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
