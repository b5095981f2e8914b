"""InternVL (2.5, 3 and 3.5 in transformers' "-hf" form): an InternViT tower over 448 px tiles whose patch features,
pixel-shuffled 2 x 2, become tokens of a Qwen2, Qwen3 or Llama decoder through a two-layer MLP.

Read top to bottom (its config.json is read by fovea/config/internvl.py):
- the images: each is cut into tiles (a grid close to its aspect ratio, 1-12 tiles, and a thumbnail of the whole
  image where there are several; multimodal/image.py), every tile 448 x 448 in 14 px patches: 32 x 32 patches;
- the tower, per tile: patch embedding (a conv with a bias) + a class token + learned positions -> layers of
  norm -> attention (q, k, v with or without biases; InternViT-6B RMS-norms q and k over all heads) -> scaled by
  `lambda_1` -> residual, norm -> GELU MLP -> scaled by `lambda_2` -> residual -> the class token dropped;
- the projector: each 2 x 2 patches' features side by side (4 x the width: transformers' pixel shuffle, which is
  our patch order, merge groups contiguous), LayerNorm, linear, GELU, linear: 256 tokens a tile;
- the decoder (decoder.py) with 1-D positions; in the prompt each image's tokens sit between <img> and </img>.
Checkpoints: transformers 5's names (`model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head.*`) and the older "-hf" ones (`vision_tower.*`, `language_model.model.*`).
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.attention.layer import Attention, AttentionMetadata
from fovea.config.model import VisionConfig
from fovea.distributed import current_tp
from fovea.layers.basic import RMSNorm, activation
from fovea.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from fovea.models import llava
from fovea.models.base import ModelOptions
from fovea.models.decoder import FeedForward
from fovea.models.llava import FixedSizeTower, tower_and_decoder_name


def norm(cfg: VisionConfig, size: int) -> nn.Module:
    return RMSNorm(size, cfg.norm_eps) if cfg.rms_norm else nn.LayerNorm(size, eps=cfg.norm_eps)


class InternVisionEmbeddings(nn.Module):
    """The patch embedding (a matmul over each patch's 3 x 14 x 14 values, with a bias), the class token in
    front of each tile's patches and learned absolute positions. Patches arrive merge groups first (patchify);
    the positions, learned row by row, are read in that order."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        side, merge = cfg.image_size // cfg.patch_size, cfg.spatial_merge_size
        self.patches = side * side
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.hidden_size), requires_grad=False)
        self.patch_embeddings = LinearBase(cfg.frame_patch_dim, cfg.hidden_size, bias=True)
        self.patch_embeddings.weight.weight_loader = self._load_conv
        self.position_embeddings = nn.Parameter(torch.zeros(1, self.patches + 1, cfg.hidden_size), requires_grad=False)
        row_major = torch.arange(self.patches).view(side // merge, merge, side // merge, merge)
        order = torch.cat([torch.zeros(1, dtype=torch.long), 1 + row_major.permute(0, 2, 1, 3).flatten()])
        self.register_buffer("order", order, persistent=False)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        LinearBase._copy(param, loaded.reshape(loaded.shape[0], -1), "patch_embeddings.projection.weight")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles * patches, patch values) -> (tiles, 1 + patches, hidden)."""
        x = self.patch_embeddings(pixel_values.to(self.patch_embeddings.weight.dtype)).view(
            -1, self.patches, self.cls_token.shape[-1]
        )
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embeddings[0, self.order]


class InternVisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads, bias=cfg.attention_bias
        )
        self.projection_layer = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # over all heads of q (of k): its statistics need every head on this rank
            if current_tp().size > 1:
                raise ValueError(
                    "InternViT's q/k norm over all heads needs the whole tower on each rank: "
                    "use --mm-encoder-tp-mode data"
                )
            self.q_norm = RMSNorm(cfg.hidden_size, 1e-6)  # its own eps, not the layers' norms'
            self.k_norm = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = Attention(self.head_dim, causal=False, fp32=fp32_softmax)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        heads = self.qkv_proj.num_heads
        q, k, v = (t.reshape(x.shape[0], heads, self.head_dim) for t in (q, k, v))
        return self.projection_layer(self.attn(q, k, v, meta).reshape(x.shape[0], -1))


class InternVisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.layernorm_before = norm(cfg, cfg.hidden_size)
        self.attention = InternVisionAttention(cfg, fp32_softmax)
        self.lambda_1 = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.layernorm_after = norm(cfg, cfg.hidden_size)
        self.mlp = FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.lambda_2 = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x), meta)
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Projector(nn.Module):
    """(tokens, merge^2 x tower width) -> (tokens, model width)."""

    def __init__(self, in_width: int, text_hidden: int):
        super().__init__()
        self.layer_norm = nn.LayerNorm(in_width)
        self.linear_1 = ColumnParallelLinear(in_width, text_hidden, bias=True)
        self.act = activation("gelu")
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVisionTower(FixedSizeTower):
    """A tiled image's grid is (tiles, 32, 32): each tile (and its class token) attends over itself alone. Only
    the layers up to the feature layer are built."""

    extra_tokens = 1  # the class token, dropped before the projector

    def __init__(self, cfg: VisionConfig, options: ModelOptions):
        super().__init__()
        self.cfg, self.use_kernel = cfg, options.vision_kernel
        self.embeddings = InternVisionEmbeddings(cfg)
        self.layers = nn.ModuleList(InternVisionLayer(cfg, options.fp32_softmax_vision) for _ in range(cfg.depth))
        self.layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.post_norm else None
        self.projector = Projector(cfg.hidden_size * cfg.spatial_merge_size**2, cfg.out_hidden_size)

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        return super().layout([(1, h, w) for t, h, w in grids for _ in range(t)], tile_rows)

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        x = self.through_layers(self.embeddings(pixel_values), layout)[:, 1:]
        if self.layernorm is not None:
            x = self.layernorm(x)
        return self.projector(x.reshape(-1, x.shape[-1] * self.cfg.spatial_merge_size**2))


# InternVL's own uploads' names -> transformers' (the same tensors; qkv stays fused: our projection takes it whole)
ORIGINAL_NAMES = (
    ("vision_model.embeddings.class_embedding", "vision_tower.embeddings.cls_token"),
    ("vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.patch_embeddings.projection."),
    ("vision_model.embeddings.position_embedding", "vision_tower.embeddings.position_embeddings"),
    ("vision_model.encoder.layers.", "vision_tower.encoder.layer."),
    (".attn.qkv.", ".attention.qkv_proj."),
    (".attn.proj.", ".attention.projection_layer."),
    (".attn.q_norm.", ".attention.q_norm."),
    (".attn.k_norm.", ".attention.k_norm."),
    (".norm1.", ".layernorm_before."),
    (".norm2.", ".layernorm_after."),
    (".ls1", ".lambda_1"),
    (".ls2", ".lambda_2"),
    ("mlp1.0.", "multi_modal_projector.layer_norm."),
    ("mlp1.1.", "multi_modal_projector.linear_1."),
    ("mlp1.3.", "multi_modal_projector.linear_2."),
)


class Model(llava.Model):
    """LLaVA's shape (a tower, a projector, a plain decoder) with InternVL's tower and names."""

    vision_tower = InternVisionTower

    def rename(self, name: str) -> str | None:
        if name.startswith(("vision_model.", "mlp1.")):  # InternVL's own uploads (InternVLChatModel)
            for old, new in ORIGINAL_NAMES:
                name = name.replace(old, new)
        name = tower_and_decoder_name(name).replace(".mlp.router.", ".mlp.gate.")  # (GPT-OSS's router)
        if name.startswith("visual.layer."):
            name = "visual.layers." + name.removeprefix("visual.layer.")
            if int(name.split(".")[2]) >= self.config.vision.depth:
                return None  # past the feature layer
        if name.startswith("visual.layernorm.") and not self.config.vision.post_norm:
            return None  # an identity where the tower mean-pools, or after a feature layer before the last
        return name.replace("patch_embeddings.projection.", "patch_embeddings.")
