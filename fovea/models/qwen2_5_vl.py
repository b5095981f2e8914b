"""Qwen2.5-VL: a windowed ViT whose merged patches become tokens of a Qwen2 decoder with M-RoPE.

Read top to bottom: vision tower (patch embed -> blocks with window/full attention -> patch merger), then the
language model (embedding -> decoder layers -> norm -> lm_head), then the top-level model that joins them.
The language model runs on a flattened varlen batch: all sequences' tokens in one dimension, `positions` of
shape (3, num_tokens) for the t/h/w rotary axes, and `AttentionMetadata` saying where each sequence starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fovea.config import ModelConfig, TextConfig, VisionConfig
from fovea.distributed import TPGroup, current_tp, tensor_parallel
from fovea.layers.attention import AttentionMetadata, varlen_attention
from fovea.layers.basic import ParallelLMHead, RMSNorm, SiluAndMul, VocabParallelEmbedding
from fovea.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                 RowParallelLinear)
from fovea.layers.paged_attention import PagedAttentionMetadata
from fovea.layers.rotary import apply_rotary, mrope, vision_rope

# ----------------------------------------------------------------------------------------------- vision tower


class VisionPatchEmbed(nn.Module):
    """The checkpoint's Conv3d has kernel == stride == one patch, so it is a matmul over the 1176 patch values
    (3 channels x 2 frames x 14 x 14). A still image is its own second frame, so it comes as one frame (588 values)
    and meets the sum of the kernel's two temporal halves: the same result with half the input."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.channels, self.frames = cfg.in_channels, cfg.temporal_patch_size
        self.proj = LinearBase(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.proj.weight.weight_loader = self._load_conv

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        LinearBase._copy(param, loaded.reshape(loaded.shape[0], -1), "visual.patch_embed.proj.weight")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if pixel_values.shape[-1] != weight.shape[1]:  # one frame: the temporal halves summed (in fp32)
            out_dim = weight.shape[0]
            weight = weight.float().view(out_dim, self.channels, self.frames, -1).sum(2).view(out_dim, -1)
            weight = weight.to(self.proj.weight.dtype)
        return F.linear(pixel_values.to(weight.dtype), weight)


class VisionAttention(nn.Module):
    fp32_softmax = False  # set by the engine (--fp32-softmax-vision)

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_heads, cfg.num_heads, bias=True)
        self.proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.qkv.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        scale = self.head_dim ** -0.5
        if meta.tiles is not None:
            from fovea.kernels.varlen_attention import varlen_attention_triton

            out = varlen_attention_triton(q, k, v, meta.tiles, scale, fp32=self.fp32_softmax)
        else:
            out = varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=False, scale=scale,
                                   fp32=self.fp32_softmax, lengths=meta.lengths)
        return self.proj(out.reshape(x.shape[0], -1))


class GatedMLP(nn.Module):
    """SwiGLU MLP used by both towers (the vision one has biases, the language one does not)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias=bias)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        x = x + self.attn(self.norm1(x), cos, sin, meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each 2x2 group of patches (contiguous in our ordering) and projects to the LM width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(ColumnParallelLinear(self.group_dim, self.group_dim, bias=True), nn.GELU(),
                                 RowParallelLinear(self.group_dim, cfg.out_hidden_size, bias=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))


def vision_layout(grids: list[tuple[int, int, int]], merge: int, window: int, kernel: bool = False,
                  tile_rows: int | None = None) -> dict[str, torch.Tensor]:
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
        from fovea.kernels.varlen_attention import tile_table

        window_meta.tiles, frame_meta.tiles = tile_table(window_lens, tile_rows), tile_table(frame_lens, tile_rows)
    return {"window_index": torch.cat(window_index), "rope_pos": torch.cat(rope_pos, dim=1),
            "window_meta": window_meta, "frame_meta": frame_meta}


class VisionTransformer(nn.Module):
    use_kernel = False  # our Triton attention instead of the PyTorch reference (set by the engine on GPUs)

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = VisionPatchEmbed(cfg)
        self.rotary = vision_rope(cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: (num_patches, patch_dim) of all items -> (num_patches / merge^2, out_hidden_size)."""
        return self.run(pixel_values, self.layout(grids))

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        return vision_layout(grids, self.cfg.spatial_merge_size, self.cfg.window_merged, self.use_kernel, tile_rows)

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        """The forward over a ready layout; with the layout's tensors in static buffers, it can be captured."""
        unit = self.cfg.spatial_merge_size ** 2
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


# --------------------------------------------------------------------------------------------- language model


class Qwen2Attention(nn.Module):
    fp32_softmax = False  # set by the engine (--fp32-softmax); the paged backends take it at construction

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, bias=True)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.kv_cache: torch.Tensor | None = None  # this layer's paged KV cache, bound by the model runner

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | PagedAttentionMetadata):
        n = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        scale = self.head_dim ** -0.5
        if isinstance(meta, PagedAttentionMetadata):
            out = meta.backend.forward(q, k, v, self.kv_cache, meta, scale)
        else:  # whole prompts, no cache (reference checks, the demo)
            out = varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen, causal=True, scale=scale,
                                   fp32=self.fp32_softmax, lengths=meta.lengths)
        return self.o_proj(out.reshape(n, -1))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x, cos, sin, meta: AttentionMetadata):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = mrope(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        cos, sin = self.rotary.cos_sin(positions)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------- the full model


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    # checkpoint sub-module name -> (our fused module, which piece)
    packed_modules = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, vision_tp: TPGroup | None = None):
        """Layers are split over the tensor-parallel group being built (fovea.distributed.tensor_parallel); the
        vision tower over `vision_tp` when given (its own group, or none when each rank holds it whole)."""
        super().__init__()
        self.config = config
        with tensor_parallel(vision_tp or current_tp()):
            self.visual = VisionTransformer(config.vision)
        self.model = Qwen2Model(config.text)
        self.lm_head = ParallelLMHead(config.text.vocab_size, config.text.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Runs the vision tower once over several items; returns one (num_tokens_i, hidden) tensor per item."""
        return self.split_by_item(self.visual(pixel_values, grids), grids)

    def split_by_item(self, merged: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        unit = self.config.vision.spatial_merge_size ** 2
        return list(merged.split([t * h * w // unit for t, h, w in grids]))

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with `mm_embeds` rows written over the image/video placeholder positions, in order.
        `mm_mask` says which rows are placeholders when ids alone cannot (a generated placeholder id is text)."""
        x = self.model.embed_tokens(input_ids)
        is_placeholder = mm_mask if mm_mask is not None else (
            (input_ids == self.config.image_token_id) | (input_ids == self.config.video_token_id))
        count = int(is_placeholder.sum())
        given = 0 if mm_embeds is None else mm_embeds.shape[0]
        if count != given:
            raise ValueError(f"prompt has {count} image/video placeholder tokens but {given} vision embeddings")
        if count:
            x = x.masked_scatter(is_placeholder[:, None], mm_embeds.to(x.dtype))
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | PagedAttentionMetadata, mm_embeds: torch.Tensor | None = None,
                mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: (N,), positions: (3, N) -> final hidden states (N, hidden)."""
        return self.model(self.embed(input_ids, mm_embeds, mm_mask), positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states, out)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (our parameter name, shard id), or None for tensors we do not use.

        Accepts the published layout (`model.layers.*`, `visual.*`, `lm_head`) and the transformers-5 one
        (`model.language_model.*`, `model.visual.*`).
        """
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        elif name.startswith("model.visual."):
            name = name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed, never loaded
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # some tied checkpoints still store it; the embedding is the source
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.packed_modules:
                fused, shard = self.packed_modules[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1:]), shard
        return name, None
