"""Gemma 3: a SigLIP tower whose patch features are average-pooled, RMS-normed and projected into tokens of a Gemma
decoder that mostly attends over a sliding window.

Read top to bottom (its config.json is read by fovea/config/gemma3.py):
- the tower: every image is resized to one size (896 x 896 in 14 px patches: 64 x 64 = 4,096 patches), patch
  embedding + learned positions -> SigLIP encoder layers (CLIP's, llava.py) -> post-norm -> the projector: the
  mean of each pool x pool patches (4 x 4: 256 tokens an image), Gemma's RMSNorm, one matrix from tower width to
  model width;
- the decoder: token embeddings scaled by sqrt(hidden); each layer norms its input, attends (q and k RMS-normed per
  head, then rotated), norms the attention's output before adding it to the residual stream, and does the same
  around its GELU-gated MLP (four norms a layer); Gemma's RMSNorm multiplies by (1 + weight), in fp32;
- attention: `sliding_layers` see only their last `sliding_window` keys and rotate with `local_rope_theta`; the
  others see every key and rotate with `rope_theta`, scaled as `rope_scaling` says; scores are scaled by
  query_pre_attn_scalar^-1/2; an image's tokens see each other both ways (the step's `bidirectional_spans`),
  within a sliding layer's window.
Positions are 1-D. Checkpoints: the published layout (`language_model.model.*`, `vision_tower.vision_model.*`,
`multi_modal_projector.*`, which transformers 5.24 still writes, without `vision_model.`) and transformers 5's
module names (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.attention.layer import Attention
from fovea.config.model import ModelConfig, TextConfig, VisionConfig
from fovea.distributed import TPGroup
from fovea.layers.basic import VocabParallelEmbedding
from fovea.layers.linear import LinearBase
from fovea.layers.rotary import apply_rotary, mrope
from fovea.models.base import ModelOptions, VisionLanguageModel
from fovea.models.decoder import GatedMLP, attention_projections, mlp_quant
from fovea.models.llava import ClipLayer, FixedSizeTower, tower_and_decoder_name


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (Gemma's order: the product before the cast)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp32 = x.float()
        normed = fp32 * torch.rsqrt(fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


# ------------------------------------------------------------------------------------------------ SigLIP tower


class SiglipEmbeddings(nn.Module):
    """The Conv2d patch embedding (kernel == stride == one patch: a matmul over its 3 x 14 x 14 values, with a
    bias) and learned absolute positions; no class token. Patches arrive as patchify lays them out, each pool x
    pool group of one image token together: the positions, learned row by row, are read in that order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        side, pool = cfg.image_size // cfg.patch_size, cfg.spatial_merge_size
        self.patches = side * side
        self.patch_embedding = LinearBase(cfg.frame_patch_dim, cfg.hidden_size, bias=True)
        self.patch_embedding.weight.weight_loader = self._load_conv
        self.position_embedding = nn.Embedding(self.patches, cfg.hidden_size)
        row_major = torch.arange(self.patches).view(side // pool, pool, side // pool, pool)
        self.register_buffer("grouped", row_major.permute(0, 2, 1, 3).flatten(), persistent=False)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        LinearBase._copy(param, loaded.reshape(loaded.shape[0], -1), "patch_embedding.weight")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(images * patches, patch values) -> (images, patches, hidden)."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return x.view(-1, self.patches, x.shape[-1]) + self.position_embedding.weight[self.grouped]


class Projector(nn.Module):
    """(images, patches, tower width) -> (images, patches / pool^2 tokens, model width): each token the mean of
    its pool x pool patches (laid out together), RMS-normed, then projected."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        self.group = cfg.spatial_merge_size**2
        self.mm_soft_emb_norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, text_hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, patches, hidden = x.shape
        pooled = x.view(images, patches // self.group, self.group, hidden).mean(2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class SiglipVisionTower(FixedSizeTower):
    def __init__(self, cfg: VisionConfig, text_hidden: int, options: ModelOptions):
        super().__init__()
        self.cfg, self.use_kernel = cfg, options.vision_kernel
        self.embeddings = SiglipEmbeddings(cfg)
        self.layers = nn.ModuleList(ClipLayer(cfg, options.fp32_softmax_vision) for _ in range(cfg.depth))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.projector = Projector(cfg, text_hidden)

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        x = self.projector(self.post_layernorm(self.through_layers(self.embeddings(pixel_values), layout)))
        return x.reshape(-1, x.shape[-1])


# ----------------------------------------------------------------------------------------------- the decoder


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times sqrt(hidden), the factor rounded to the weights' dtype first (as released)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        # made once, where the weights are: not a host tensor copied to the device at every step
        scale = torch.tensor(hidden_size**0.5, dtype=self.weight.dtype, device=self.weight.device)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class GemmaAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_index: int, options: ModelOptions):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj, self.o_proj = attention_projections(cfg, layer_index, cfg.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        window = cfg.sliding_window if layer_index in cfg.sliding_layers else None
        self.attn = Attention(
            cfg.head_dim, True, layer_index, options.fp32_softmax, sliding_window=window, scale=cfg.attention_scale
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        n, dim = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * dim, self.num_kv_heads * dim, self.num_kv_heads * dim], -1)
        q = apply_rotary(self.q_norm(q.reshape(n, self.num_heads, dim)), cos, sin)
        k = apply_rotary(self.k_norm(k.reshape(n, self.num_kv_heads, dim)), cos, sin)
        out = self.attn(q, k, v.reshape(n, self.num_kv_heads, dim), meta)
        return self.o_proj(out.reshape(n, -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_index: int, options: ModelOptions):
        super().__init__()
        self.sliding = layer_index in cfg.sliding_layers
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = GemmaAttention(cfg, layer_index, options)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, False, quant=mlp_quant(cfg, layer_index), act=cfg.hidden_act
        )
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: TextConfig, options: ModelOptions):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size)
        section = (cfg.head_dim // 2, 0, 0)  # 1-D: every frequency reads the first position axis
        self.rotary = mrope(cfg.head_dim, cfg.rope_theta, section, scaling=cfg.rope_scaling)
        self.local_rotary = mrope(cfg.head_dim, cfg.local_rope_theta, section)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, options) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        global_cos_sin = self.rotary.cos_sin(positions)
        local_cos_sin = self.local_rotary.cos_sin(positions)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, *(local_cos_sin if layer.sliding else global_cos_sin), meta)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------- the full model


class Model(VisionLanguageModel):
    @classmethod
    def make_tower(cls, config: ModelConfig, options: ModelOptions) -> nn.Module:
        return SiglipVisionTower(config.vision, config.text.hidden_size, options)

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), vision_tp: TPGroup | None = None):
        super().__init__(config, options)
        self.build_tower(config, options, vision_tp)
        self.model = GemmaModel(config.text, options)
        self.make_lm_head()

    def rename(self, name: str) -> str | None:
        name = tower_and_decoder_name(name)
        return None if name.endswith("position_ids") else name
