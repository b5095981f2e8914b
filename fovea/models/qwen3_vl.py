"""Qwen3-VL (dense): Qwen2-VL's tower with learned positions and DeepStack, joined to a Qwen3 decoder.

Read top to bottom (its config.json is read by fovea/config/families.py; see qwen2_5_vl.py for what is shared):
- The vision tower: patch embedding (16 x 16 patches, 2 frames, a conv with bias) plus learned absolute positions:
  a square table (48 x 48 for num_position_embeddings 2304) resampled bilinearly, corners aligned, to each
  image's patch grid; blocks as Qwen2-VL's (LayerNorm, full attention over each frame, 2-D rotary, GELU-tanh
  MLP), no windows; the patch merger normalises each patch before the 2 x 2 shuffle.
- DeepStack: after the blocks in `deepstack_indexes` (8, 16, 24 in the released models), a merger of their own
  (normalising after the shuffle) turns their output into one more feature per image token. The tower hands over
  [embedding | feature 1 | ... | feature K] per token; the decoder adds feature i to the image tokens' hidden
  states after its layer i.
- The decoder: Qwen3 (decoder.py with q/k norms), M-RoPE with the t, h, w frequencies interleaved.
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.config.model import ModelConfig, VisionConfig
from fovea.distributed import TPGroup
from fovea.layers.linear import ColumnParallelLinear, RowParallelLinear
from fovea.models import qwen2_5_vl, qwen2_vl
from fovea.models.base import ModelOptions


class PatchMerger(nn.Module):
    """Each 2 x 2 group of patches concatenated and projected to the language model's width; LayerNorm over a
    patch before the shuffle (the final merger) or over the group after it (DeepStack's)."""

    def __init__(self, cfg: VisionConfig, norm: type[nn.Module] = nn.LayerNorm, postshuffle: bool = False):
        super().__init__()
        self.group_dim, self.postshuffle = cfg.hidden_size * cfg.spatial_merge_size**2, postshuffle
        self.norm = norm(self.group_dim if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear(self.group_dim, self.group_dim, bias=True)
        self.act = nn.GELU()
        self.linear_fc2 = RowParallelLinear(self.group_dim, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.group_dim)) if self.postshuffle else self.norm(x).view(-1, self.group_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def position_taps(grids: list[tuple[int, int, int]], side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every patch (in the merge-group order patches arrive in), the 4 entries of the side x side position
    table that bilinear resampling with aligned corners reads, and their weights: (patches, 4) each."""
    indices, weights = [], []
    for t, h, w in grids:
        rows, cols = torch.linspace(0, side - 1, h), torch.linspace(0, side - 1, w)
        r0, c0 = rows.long(), cols.long()  # floor: both are >= 0
        r1, c1 = (r0 + 1).clamp(max=side - 1), (c0 + 1).clamp(max=side - 1)
        dr, dc = (rows - r0)[:, None], (cols - c0)[None, :]
        index = torch.stack([r0[:, None] * side + c0, r0[:, None] * side + c1, r1[:, None] * side + c0,
                             r1[:, None] * side + c1], dim=-1)  # fmt: skip
        weight = torch.stack([(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc], dim=-1)

        def in_groups(x: torch.Tensor) -> torch.Tensor:  # (h, w, 4) -> (h * w, 4), merge groups contiguous
            return x.reshape(h // merge, merge, w // merge, merge, 4).permute(0, 2, 1, 3, 4).reshape(-1, 4)

        indices.append(in_groups(index).repeat(t, 1))
        weights.append(in_groups(weight).repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


class VisionTransformer(qwen2_5_vl.VisionTransformer):
    block, norm, merger_type = qwen2_vl.VisionBlock, nn.LayerNorm, PatchMerger

    def __init__(self, cfg: VisionConfig, options: ModelOptions):
        super().__init__(cfg, options)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_indexes)

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        layout = super().layout(grids, tile_rows)
        layout["pos_index"], layout["pos_weight"] = position_taps(grids, self.side, self.cfg.spatial_merge_size)
        return layout

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        """(tokens, out_hidden * (1 + K)): every block attends over whole frames, so the patches stay in the order
        they came in (the layout's window order is not needed)."""
        device = pixel_values.device
        x = self.patch_embed(pixel_values)
        taps = self.pos_embed(layout["pos_index"].to(device)).float()
        x = x + (taps * layout["pos_weight"].to(device)[..., None]).sum(1).to(x.dtype)
        cos, sin = self.rotary.cos_sin(layout["rope_pos"].to(device))
        meta = layout["frame_meta"].to(device)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, meta)
            if i in self.cfg.deepstack_indexes:
                features.append(self.deepstack_merger_list[self.cfg.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *features], dim=-1)


class Model(qwen2_5_vl.Model):
    vision_tower = VisionTransformer

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), vision_tp: TPGroup | None = None):
        super().__init__(config, options, vision_tp)
        self.num_deepstack = len(config.vision.deepstack_indexes)

    def forward(self, input_ids, positions, meta, mm_embeds=None, mm_mask=None) -> torch.Tensor:
        """mm_embeds rows: [embedding | DeepStack features] of each image token (VisionTransformer.run)."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, meta, mm_embeds, mm_mask)
        width = self.config.text.hidden_size
        mask = self.placeholder_mask(input_ids, mm_mask)
        features = mm_embeds[:, width:].reshape(-1, self.num_deepstack, width).transpose(0, 1)
        return self.model(self.embed(input_ids, mm_embeds[:, :width], mask), positions, meta, (mask, features))

    def rename(self, name: str) -> str:
        """Both layouts (published and transformers 5) name the language model `model.language_model.*`."""
        return super().rename(name).replace(".mlp.linear_fc", ".mlp.fc")
