"""LLaVA-1.5: a CLIP ViT whose patch features, through a two-layer MLP projector, become tokens of a Llama decoder.

Read top to bottom (its config.json is read by fovea/config/families.py): the CLIP tower (patch embedding +
class token + learned positions -> pre-norm -> encoder layers up to `vision_feature_layer` -> drop the class
token -> projector), then the model. Every image is resized and cropped to one size (336 x 336 for ViT-L/14-336),
so it is always 24 x 24 = 576 patches and 576 tokens; the decoder numbers every token 1-D (plain RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.attention.layer import Attention, AttentionMetadata
from fovea.config.model import ModelConfig, VisionConfig
from fovea.distributed import TPGroup
from fovea.layers.basic import activation
from fovea.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from fovea.models.base import ModelOptions, VisionLanguageModel
from fovea.models.decoder import DecoderModel, FeedForward

# ------------------------------------------------------------------------------------------------ CLIP tower


class ClipEmbeddings(nn.Module):
    """The Conv2d patch embedding (kernel == stride == one patch: a matmul over the patch's 3 x 14 x 14 values),
    a class token in front of each image's patches, and learned absolute positions."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patches = (cfg.image_size // cfg.patch_size) ** 2
        self.class_embedding = nn.Parameter(torch.zeros(cfg.hidden_size), requires_grad=False)
        self.patch_embedding = LinearBase(cfg.frame_patch_dim, cfg.hidden_size, bias=False)
        self.patch_embedding.weight.weight_loader = self._load_conv
        self.position_embedding = nn.Embedding(self.patches + 1, cfg.hidden_size)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        LinearBase._copy(param, loaded.reshape(loaded.shape[0], -1), "patch_embedding.weight")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(images * patches, patch values) -> (images, 1 + patches, hidden)."""
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).view(
            -1, self.patches, self.class_embedding.numel()
        )
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embedding.weight


class ClipAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads, bias=True)
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.attn = Attention(self.head_dim, causal=False, fp32=fp32_softmax)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.qkv_proj.num_heads, self.head_dim).unbind(1)
        return self.out_proj(self.attn(q, k, v, meta).reshape(x.shape[0], -1))


class ClipLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.self_attn = ClipAttention(cfg, fp32_softmax)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), meta)
        return x + self.mlp(self.layer_norm2(x))


class Projector(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        text_hidden = cfg.out_hidden_size
        self.linear_1 = ColumnParallelLinear(cfg.hidden_size, text_hidden, bias=cfg.projector_bias)
        self.act = activation(cfg.projector_act)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class FixedSizeTower(nn.Module):
    """What a tower that takes one image size (CLIP's, SigLIP's) gives the engine: each image's patches (and
    `extra_tokens`, a class token) attend over themselves; encoder buckets pad with whole blank images. A subclass
    builds its layers and `run`s them."""

    extra_tokens = 0
    cfg: VisionConfig
    use_kernel: bool
    layers: nn.ModuleList

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: (images * patches, 588) -> (images * tokens, model width)."""
        return self.run(pixel_values, self.layout(grids))

    def filler_grids(self, pad: int) -> list[tuple[int, int, int]]:
        side = self.cfg.image_size // self.cfg.patch_size
        return [(1, side, side)] * (pad // side**2)

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        lengths = [self.extra_tokens + t * h * w for t, h, w in grids] or [0]
        meta = AttentionMetadata.from_lengths(lengths)
        if self.use_kernel:
            from fovea.attention.triton_varlen import tile_table

            meta.tiles = tile_table(lengths, tile_rows)
        return {"meta": meta}

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        raise NotImplementedError

    def through_layers(self, x: torch.Tensor, layout: dict) -> torch.Tensor:
        """(images, tokens, hidden) embeddings through `self.layers`, each image attending over itself."""
        meta = layout["meta"].to(x.device)
        images, tokens, hidden = x.shape
        x = x.reshape(images * tokens, hidden)
        for layer in self.layers:
            x = layer(x, meta)
        return x.view(images, tokens, hidden)


class ClipVisionTower(FixedSizeTower):
    """Only the layers up to the feature layer are built (the rest, and the post-norm, are never used)."""

    extra_tokens = 1  # the class token, dropped before the projector

    def __init__(self, cfg: VisionConfig, options: ModelOptions):
        super().__init__()
        self.cfg, self.use_kernel = cfg, options.vision_kernel
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)  # (sic: CLIP's name)
        self.layers = nn.ModuleList(ClipLayer(cfg, options.fp32_softmax_vision) for _ in range(cfg.depth))
        self.projector = Projector(cfg)

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        x = self.through_layers(self.pre_layrnorm(self.embeddings(pixel_values)), layout)
        return self.projector(x[:, 1:].reshape(-1, x.shape[-1]))


# ---------------------------------------------------------------------------------------------- the full model


class Model(VisionLanguageModel):
    vision_tower = ClipVisionTower

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), vision_tp: TPGroup | None = None):
        super().__init__(config, options)
        self.build_tower(config, options, vision_tp)
        self.model = DecoderModel(config.text, options)
        self.make_lm_head()

    def rename(self, name: str) -> str | None:
        """transformers 5 (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
        `lm_head.*`), what its save_pretrained writes, and the earlier llava-hf layout (`vision_tower.*`,
        `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`) onto ours."""
        name = tower_and_decoder_name(name)
        if name.startswith("visual.post_layernorm") or name.endswith("position_ids"):
            return None  # the post-norm only feeds CLIP's pooled output
        if name.startswith("visual.layers.") and int(name.split(".")[2]) >= self.config.vision.depth:
            return None  # past the feature layer
        return name


def tower_and_decoder_name(name: str) -> str:
    """A LLaVA-style checkpoint's names (a ViT tower, a projector, a language model; Gemma 3's too) onto ours."""
    for old, new in (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.", "visual."),
        ("vision_tower.", "visual."),
        ("model.multi_modal_projector.", "visual.projector."),
        ("multi_modal_projector.", "visual.projector."),
    ):
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    if not name.startswith("visual.") or name.startswith("visual.projector."):
        return name
    # the tower's keys come with `vision_model.` (llava-hf, transformers 5.24's save_pretrained of LLaVA) or without
    # it (transformers 5.23's save_pretrained, 5.24's of Gemma 3)
    return "visual." + name.removeprefix("visual.").removeprefix("vision_model.").removeprefix("encoder.")
