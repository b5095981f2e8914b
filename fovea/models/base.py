"""What the engine calls on any model: the common half of every family's top-level module.

A family (one file under fovea/models/, listed in registry.py) subclasses `VisionLanguageModel`, builds
`self.visual` (its vision tower, projector included) and `self.model` (the language model, decoder.py) in its
constructor from its `ModelConfig` and the engine's `ModelOptions`, and says how its checkpoint names map to ours
(`rename`). The engine then only uses the methods below and `visual.layout / run` (encoder_buckets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fovea.config.model import ModelConfig
from fovea.distributed import TPGroup, current_tp, tensor_parallel
from fovea.layers.basic import ParallelLMHead

# tensors of a layer's Attention as checkpoints name them (after self_attn.): KV-cache scales (fp8 checkpoints,
# compressed-tensors), GPT-OSS's sink logits
ATTENTION_TENSORS = {
    "k_scale": "k_scale",
    "v_scale": "v_scale",
    "k_proj.output_scale": "k_scale",
    "v_proj.output_scale": "v_scale",
    "sinks": "sinks",
}


@dataclass(frozen=True)
class ModelOptions:
    """Engine settings a model is built with (never set on its modules afterwards)."""

    fp32_softmax: bool = False  # language-model attention scores in fp32 on the uncached path
    fp32_softmax_vision: bool = False  # the same for the vision tower
    vision_kernel: bool = False  # the vision tower's attention on our Triton kernel (CUDA) instead of PyTorch's
    fused_kernels: bool = False  # the decoder's RMSNorm (+ residual), SiLU-and-mul and rotary as Triton kernels (CUDA)
    tower: bool = True  # the vision tower built and loaded (False: encoder worker processes run it, issue 58)


class VisionLanguageModel(nn.Module):
    # checkpoint sub-module name -> (our fused module, which piece)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    visual: nn.Module
    model: nn.Module
    vision_tower: type  # the family's tower class, built from (VisionConfig, ModelOptions) unless make_tower says else

    def __init__(self, config: ModelConfig, options: ModelOptions):
        super().__init__()
        self.config, self.options = config, options

    @classmethod
    def make_tower(cls, config: ModelConfig, options: ModelOptions) -> nn.Module:
        """The vision tower, projector included, as `self.visual` holds it (split over the tensor-parallel group
        being built); an encoder worker builds it alone (loader.py, `load_tower`)."""
        return cls.vision_tower(config.vision, options)

    def build_tower(self, config: ModelConfig, options: ModelOptions, vision_tp: TPGroup | None) -> None:
        """`self.visual`, split over `vision_tp` (when given: its own group, or none when each rank holds it
        whole), else over the group being built; None where encoder workers run it (`options.tower` False)."""
        with tensor_parallel(vision_tp or current_tp()):
            self.visual = self.make_tower(config, options) if options.tower else None

    def make_lm_head(self) -> None:
        self.lm_head = ParallelLMHead(self.config.text.vocab_size, self.config.text.hidden_size)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Runs the vision tower once over several items; returns one (num_tokens_i, hidden) tensor per item."""
        return self.split_by_item(self.visual(pixel_values, grids), grids)

    def split_by_item(self, merged: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        unit = self.config.vision.spatial_merge_size**2
        return list(merged.split([t * h * w // unit for t, h, w in grids]))

    def embed(
        self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None, mm_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token embeddings with `mm_embeds` rows written over the image/video placeholder positions, in order.
        `mm_mask` says which rows are placeholders when ids alone cannot (a generated placeholder id is text)."""
        x = self.model.embed_tokens(input_ids)
        is_placeholder = self.placeholder_mask(input_ids, mm_mask)
        count = int(is_placeholder.sum())
        given = 0 if mm_embeds is None else mm_embeds.shape[0]
        if count != given:
            raise ValueError(f"prompt has {count} image/video placeholder tokens but {given} vision embeddings")
        if count:
            x = x.masked_scatter(is_placeholder[:, None], mm_embeds.to(x.dtype))
        return x

    def placeholder_mask(self, input_ids: torch.Tensor, mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        if mm_mask is not None:
            return mm_mask
        is_placeholder = input_ids == self.config.image_token_id
        if self.config.video_token_id is not None:
            is_placeholder |= input_ids == self.config.video_token_id
        return is_placeholder

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta,
        mm_embeds: torch.Tensor | None = None,
        mm_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: (N,), positions: (3, N) -> final hidden states (N, hidden)."""
        return self.model(self.embed(input_ids, mm_embeds, mm_mask), positions, meta)

    def text_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Text tokens only, with no host-side check (what a captured decode step runs)."""
        return self.model(self.model.embed_tokens(input_ids), positions, meta)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden_states, out)

    def rename(self, name: str) -> str | None:
        """A checkpoint tensor's name in our module tree (before fusing), or None for tensors we do not use."""
        raise NotImplementedError

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """Checkpoint tensor name -> (our parameter name, shard id), or None for tensors we do not use."""
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed, never loaded
        name = self.rename(name)
        if name is None or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None  # some tied checkpoints still store the head; the embedding is the source
        for stored, ours in ATTENTION_TENSORS.items():
            if name.endswith(".self_attn." + stored):
                return name.removesuffix(stored) + "attn." + ours, None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if (
                part == "experts" and len(parts) > i + 3 and parts[i + 1].isdigit()
            ):  # one expert's tensor (Qwen3-MoE's layout) -> its slice
                piece = self.packed_modules.get(parts[i + 2], ("down_proj", 0))[1]
                fused = "down_proj" if parts[i + 2] == "down_proj" else "gate_up_proj"
                kind = ".".join(parts[i + 3 :])  # weight, or a quantized one's scales and packed values
                name = fused if kind == "weight" else f"{fused}_{kind}"
                return ".".join(parts[: i + 1] + [name]), (int(parts[i + 1]), piece)
            if part in self.packed_modules:
                fused, shard = self.packed_modules[part]
                return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
        return name, None
