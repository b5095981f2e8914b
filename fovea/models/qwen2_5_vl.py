"""Qwen2.5-VL: a windowed ViT whose merged patches become tokens of a Qwen2 decoder with M-RoPE.

Read top to bottom: the vision tower (patch embed -> blocks with window/full attention -> patch merger), then the
model that joins it to the decoder (decoder.py). Its config.json is read by fovea/config/families.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.attention.layer import Attention, AttentionMetadata
from fovea.config.model import ModelConfig, VisionConfig
from fovea.distributed import TPGroup
from fovea.layers.basic import RMSNorm
from fovea.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from fovea.layers.rotary import apply_rotary, vision_rope
from fovea.models.base import ModelOptions, VisionLanguageModel
from fovea.models.decoder import DecoderModel, GatedMLP

# ----------------------------------------------------------------------------------------------- vision tower


class VisionPatchEmbed(nn.Module):
    """The checkpoint's Conv3d has kernel == stride == one patch, so it is a matmul over the 1176 patch values
    (3 channels x 2 frames x 14 x 14). A still image is its own second frame, so it comes as one frame (588 values)
    and meets the sum of the kernel's two temporal halves: the same result with half the input."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.channels, self.frames = cfg.in_channels, cfg.temporal_patch_size
        self.proj = LinearBase(cfg.patch_dim, cfg.hidden_size, bias=cfg.patch_bias)
        self.proj.weight.weight_loader = self._load_conv

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        LinearBase._copy(param, loaded.reshape(loaded.shape[0], -1), "visual.patch_embed.proj.weight")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if pixel_values.shape[-1] != weight.shape[1]:  # one frame: the temporal halves summed (in fp32)
            out_dim = weight.shape[0]
            weight = weight.float().view(out_dim, self.channels, self.frames, -1).sum(2).view(out_dim, -1)
            weight = weight.to(self.proj.weight.dtype)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads, bias=True)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.attn = Attention(self.head_dim, causal=False, fp32=fp32_softmax)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.qkv.num_heads, self.head_dim).unbind(1)
        out = self.attn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, meta)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, fp32_softmax: bool):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg, fp32_softmax)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True, act=cfg.hidden_act)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        x = x + self.attn(self.norm1(x), cos, sin, meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each 2x2 group of patches (contiguous in our ordering) and projects to the LM width."""

    def __init__(self, cfg: VisionConfig, norm: type[nn.Module]):
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = norm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            ColumnParallelLinear(self.group_dim, self.group_dim, bias=True),
            nn.GELU(),
            RowParallelLinear(self.group_dim, cfg.out_hidden_size, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))


def vision_layout(
    grids: list[tuple[int, int, int]], merge: int, window: int, kernel: bool = False, tile_rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Index bookkeeping for a batch of images/videos given their patch grids (t, h, w).

    Patches arrive with each merge group (merge x merge patches) contiguous, groups in row-major order per frame.
    Window layers attend within squares of `window` x `window` merge groups (edge windows are smaller), so the
    groups are reordered window by window; `window_index[new] = old` group index. Full-attention layers attend
    over each frame. Rotary (h, w) positions are given per patch, in the original order. `kernel` adds the tile
    tables our Triton attention kernel reads, padded to `tile_rows` rows (a fixed size for CUDA graphs).
    """
    window_index, window_lens, frame_lens, rope_pos = [], [], [], []
    offset = 0
    for t, h, w in grids:
        mh, mw = h // merge, w // merge
        rows = torch.arange(mh).repeat_interleave(mw)
        cols = torch.arange(mw).repeat(mh)
        windows_per_row = -(-mw // window)
        window_id = (rows // window) * windows_per_row + cols // window
        order = torch.argsort(window_id, stable=True)
        sizes = torch.bincount(window_id)
        sizes = sizes[sizes > 0] * merge * merge
        for frame in range(t):
            window_index.append(order + offset + frame * mh * mw)
            window_lens.append(sizes)
            frame_lens.append(h * w)
        offset += t * mh * mw
        hpos = torch.arange(h)[:, None].expand(h, w).reshape(mh, merge, mw, merge).permute(0, 2, 1, 3).flatten()
        wpos = torch.arange(w)[None, :].expand(h, w).reshape(mh, merge, mw, merge).permute(0, 2, 1, 3).flatten()
        rope_pos.append(torch.stack([hpos, wpos]).repeat(1, t))
    window_lens = torch.cat(window_lens).tolist()
    window_meta, frame_meta = AttentionMetadata.from_lengths(window_lens), AttentionMetadata.from_lengths(frame_lens)
    if kernel:
        from fovea.attention.triton_varlen import tile_table

        window_meta.tiles, frame_meta.tiles = tile_table(window_lens, tile_rows), tile_table(frame_lens, tile_rows)
    return {
        "window_index": torch.cat(window_index),
        "rope_pos": torch.cat(rope_pos, dim=1),
        "window_meta": window_meta,
        "frame_meta": frame_meta,
    }


class VisionTransformer(nn.Module):
    block, norm, merger_type = VisionBlock, RMSNorm, PatchMerger  # what Qwen2-VL's and Qwen3-VL's towers replace

    def __init__(self, cfg: VisionConfig, options: ModelOptions):
        super().__init__()
        self.cfg = cfg
        self.use_kernel = options.vision_kernel  # our Triton attention instead of the PyTorch reference
        self.patch_embed = VisionPatchEmbed(cfg)
        self.rotary = vision_rope(cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.blocks = nn.ModuleList(self.block(cfg, options.fp32_softmax_vision) for _ in range(cfg.depth))
        self.merger = self.merger_type(cfg, self.norm)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: (num_patches, patch_dim) of all items -> (num_patches / merge^2, out_hidden_size)."""
        return self.run(pixel_values, self.layout(grids))

    def filler_grids(self, pad: int) -> list[tuple[int, int, int]]:
        """Blank images that fill `pad` patches of an encoder bucket (encoder_buckets.py)."""
        return [(1, 2, pad // 2)]

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        return vision_layout(grids, self.cfg.spatial_merge_size, self.cfg.window_merged, self.use_kernel, tile_rows)

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        """The forward over a ready layout; with the layout's tensors in static buffers, it can be captured."""
        unit = self.cfg.spatial_merge_size**2
        device = pixel_values.device
        index = layout["window_index"].to(device)

        def to_windows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, unit, t.shape[-1])[index].reshape(-1, t.shape[-1])

        x = to_windows(self.patch_embed(pixel_values))
        cos, sin = self.rotary.cos_sin(to_windows(layout["rope_pos"].t().to(device)).t())
        window_meta, frame_meta = layout["window_meta"].to(device), layout["frame_meta"].to(device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_meta if i in self.cfg.fullatt_block_indexes else window_meta)
        return self.merger(x)[torch.argsort(index)]


# ---------------------------------------------------------------------------------------------- the full model


class Model(VisionLanguageModel):
    vision_tower = VisionTransformer

    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), vision_tp: TPGroup | None = None):
        """Layers are split over the tensor-parallel group being built (fovea.distributed.tensor_parallel); the
        vision tower over `vision_tp` when given (its own group, or none when each rank holds it whole)."""
        super().__init__(config, options)
        self.build_tower(config, options, vision_tp)
        self.model = DecoderModel(config.text, options)
        self.make_lm_head()

    def rename(self, name: str) -> str:
        """The published layout (`model.layers.*`, `visual.*`, `lm_head`) is ours; the transformers-5 one
        (`model.language_model.*`, `model.visual.*`) is mapped onto it."""
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name.removeprefix("model.") if name.startswith("model.visual.") else name
