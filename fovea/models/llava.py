"""LLaVA-1.5: a CLIP ViT whose patch features, through a two-layer MLP projector, become tokens of a Llama decoder.

Read top to bottom: the config (published llava-hf checkpoints leave most keys to the defaults of transformers'
LlamaConfig and CLIPVisionConfig, so those defaults are part of the format), the CLIP tower (patch embedding +
class token + learned positions -> pre-norm -> encoder layers up to `vision_feature_layer` -> drop the class
token -> projector), then the model. Every image is resized and cropped to one size (336 x 336 for ViT-L/14-336),
so it is always 24 x 24 = 576 patches and 576 tokens; the decoder numbers every token 1-D (plain RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from fovea.attention.layer import Attention, AttentionMetadata
from fovea.config.image import ImageProcessorConfig
from fovea.config.model import ModelConfig, VisionConfig, checkpoint_dtype, eos_ids, parse_text, text_keys
from fovea.distributed import TPGroup, current_tp, tensor_parallel
from fovea.layers.linear import ColumnParallelLinear, LinearBase, QKVParallelLinear, RowParallelLinear
from fovea.models.base import ModelOptions, VisionLanguageModel
from fovea.models.decoder import DecoderModel, FeedForward

# ----------------------------------------------------------------------------------------------------- config

LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048)
CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5, num_channels=3)
LLAVA_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14)  # LlavaConfig's tower when config.json names none


def parse_config(raw: dict, preprocessor: dict) -> ModelConfig:
    text_raw = text_keys(raw)
    text = parse_text(text_raw, mrope=False, attention_bias=bool(text_raw.get("attention_bias", False)),
                      defaults=LLAMA_DEFAULTS)
    given = raw.get("vision_config")
    vision = {**CLIP_DEFAULTS, **(LLAVA_VISION if given is None else {}), **(given or {})}
    layer, strategy = raw.get("vision_feature_layer", -2), raw.get("vision_feature_select_strategy", "default")
    if not isinstance(layer, int) or strategy != "default":
        raise ValueError(f"vision_feature_layer {layer!r} with select strategy {strategy!r} is not supported: fovea "
                         "runs one feature layer with the class token dropped ('default')")
    layers = vision["num_hidden_layers"]
    used = layer if layer >= 0 else layers + 1 + layer  # hidden_states[0] is the embeddings' output
    if not 0 < used <= layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the tower's {layers} layers")
    side, patch = vision["image_size"], vision["patch_size"]
    if side % patch:
        raise ValueError(f"the vision tower's image_size {side} is not a multiple of its patch_size {patch}")
    image_token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    return ModelConfig(
        architecture="LlavaForConditionalGeneration", text=text,
        vision=VisionConfig(
            depth=used, hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
            num_heads=vision["num_attention_heads"], in_channels=vision["num_channels"], patch_size=patch,
            temporal_patch_size=1, spatial_merge_size=1, window_size=0, fullatt_block_indexes=(),
            out_hidden_size=text.hidden_size, tokens_per_second=None, rope_theta=0.0,
            hidden_act=vision["hidden_act"], norm_eps=vision["layer_norm_eps"], image_size=side),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), torch_dtype=checkpoint_dtype(raw),
        image_token_id=image_token, video_token_id=None, vision_start_token_id=None, vision_end_token_id=None,
        eos_token_ids=eos_ids(text_raw.get("eos_token_id", 2)),
        image=ImageProcessorConfig.center_crop(preprocessor, patch, side), mrope=False)


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
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).view(-1, self.patches,
                                                                                          self.class_embedding.numel())
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
    def __init__(self, vision_hidden: int, text_hidden: int):
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias=True)
        self.act = nn.GELU()
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ClipVisionTower(nn.Module):
    """Only the layers up to the feature layer are built (the rest, and the post-norm, are never used)."""

    def __init__(self, cfg: VisionConfig, options: ModelOptions):
        super().__init__()
        self.cfg, self.use_kernel = cfg, options.vision_kernel
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)  # (sic: CLIP's name)
        self.layers = nn.ModuleList(ClipLayer(cfg, options.fp32_softmax_vision) for _ in range(cfg.depth))
        self.projector = Projector(cfg.hidden_size, cfg.out_hidden_size)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values: (images * 576, 588) -> (images * 576, text hidden)."""
        return self.run(pixel_values, self.layout(grids))

    def filler_grids(self, pad: int) -> list[tuple[int, int, int]]:
        side = self.cfg.image_size // self.cfg.patch_size
        return [(1, side, side)] * (pad // side ** 2)

    def layout(self, grids: list[tuple[int, int, int]], tile_rows: int | None = None) -> dict:
        lengths = [1 + t * h * w for t, h, w in grids]  # each image attends over itself and its class token
        meta = AttentionMetadata.from_lengths(lengths) if lengths else AttentionMetadata.from_lengths([0])
        if self.use_kernel:
            from fovea.attention.triton_varlen import tile_table

            meta.tiles = tile_table(lengths, tile_rows)
        return {"meta": meta}

    def run(self, pixel_values: torch.Tensor, layout: dict) -> torch.Tensor:
        meta = layout["meta"].to(pixel_values.device)
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        images, tokens, hidden = x.shape
        x = x.reshape(images * tokens, hidden)
        for layer in self.layers:
            x = layer(x, meta)
        return self.projector(x.view(images, tokens, hidden)[:, 1:].reshape(-1, hidden))


# ---------------------------------------------------------------------------------------------- the full model


class Model(VisionLanguageModel):
    def __init__(self, config: ModelConfig, options: ModelOptions = ModelOptions(), vision_tp: TPGroup | None = None):
        super().__init__(config, options)
        with tensor_parallel(vision_tp or current_tp()):
            self.visual = ClipVisionTower(config.vision, options)
        self.model = DecoderModel(config.text, options)
        self.make_lm_head()

    def rename(self, name: str) -> str | None:
        """transformers 5 (`model.vision_tower.*`, `model.multi_modal_projector.*`, `model.language_model.*`,
        `lm_head.*`), what its save_pretrained writes, and the earlier llava-hf layout (`vision_tower.*`,
        `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.*`) onto ours."""
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("model.vision_tower.", "visual."),
                         ("vision_tower.", "visual."), ("model.multi_modal_projector.", "visual.projector."),
                         ("multi_modal_projector.", "visual.projector.")):
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        if not name.startswith("visual.") or name.startswith("visual.projector."):
            return name
        # the CLIP tower's keys come with `vision_model.` (llava-hf, transformers 5.24's save_pretrained) or without
        # it (transformers 5.23's save_pretrained)
        name = "visual." + name.removeprefix("visual.").removeprefix("vision_model.").removeprefix("encoder.")
        if name.startswith("visual.post_layernorm") or name.endswith("position_ids"):
            return None  # the post-norm only feeds CLIP's pooled output
        if name.startswith("visual.layers.") and int(name.split(".")[2]) >= self.config.vision.depth:
            return None  # past the feature layer
        return name
