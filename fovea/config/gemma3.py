"""Gemma 3's config.json and preprocessor_config.json as a `ModelConfig` (its model: fovea/models/gemma3.py)."""

from __future__ import annotations

import dataclasses

from fovea.config.hf_keys import checkpoint_dtype, eos_ids, fixed_size_tower, parse_rope_scaling, parse_text
from fovea.config.image import ImageProcessorConfig
from fovea.config.model import ModelConfig, RopeScaling

GEMMA3_TEXT = dict(  # Gemma3TextConfig's defaults: published config.json files leave most keys to them
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    attention_bias=False,
)
SIGLIP_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_channels=3,
    image_size=224,
    patch_size=16,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)


def gemma3_rope(text: dict) -> tuple[float, RopeScaling, float]:
    """(global theta, its scaling, local theta) from `rope_parameters` per layer type (transformers 5) or the
    older `rope_scaling` + `rope_theta` + `rope_local_base_freq`."""
    per_type = text.get("rope_parameters") or {}
    scaling = per_type.get("full_attention") or text.get("rope_scaling") or {}
    local = per_type.get("sliding_attention") or {}
    theta = scaling.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    return theta, parse_rope_scaling(scaling, text), local.get("rope_theta", text.get("rope_local_base_freq", 10_000.0))


def parse_gemma3(raw: dict, preprocessor: dict) -> ModelConfig:
    """Gemma 3: a SigLIP tower, its patches average-pooled to `mm_tokens_per_image` tokens, and a Gemma decoder
    whose layers mostly see a sliding window (every `sliding_window_pattern`-th sees all); 1-D RoPE."""
    text_raw = {**GEMMA3_TEXT, **{k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}}
    if text_raw.get("final_logit_softcapping") or text_raw.get("attn_logit_softcapping"):
        raise ValueError("Gemma 3 with logit soft-capping is not supported (the released checkpoints have none)")
    if text_raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional text attention (an embedding model) is not supported")
    layers = text_raw["num_hidden_layers"]
    pattern = text_raw.get("sliding_window_pattern") or text_raw.get("_sliding_window_pattern") or 6
    types = text_raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    theta, scaling, local_theta = gemma3_rope(text_raw)
    text = dataclasses.replace(
        parse_text({**text_raw, "rope_parameters": None, "rope_scaling": None}, mrope=False, attention_bias=False),
        attention_bias=bool(text_raw["attention_bias"]),
        qk_norm=True,
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        sliding_window=text_raw["sliding_window"],
        sliding_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention"),
        attention_scale=text_raw["query_pre_attn_scalar"] ** -0.5,
        hidden_act=text_raw["hidden_activation"],
    )
    vision = {**SIGLIP_DEFAULTS, **(raw.get("vision_config") or {})}
    side, patch = vision["image_size"], vision["patch_size"]
    tokens = raw.get("mm_tokens_per_image", 256)
    pool = side // patch // round(tokens**0.5)
    if side % patch or pool * pool * tokens != (side // patch) ** 2:
        raise ValueError(f"a {side} px image in {patch} px patches does not pool to {tokens} tokens")
    return ModelConfig(
        architecture="Gemma3ForConditionalGeneration",
        text=text,
        vision=fixed_size_tower(vision, vision["num_hidden_layers"], text.hidden_size, merge=pool),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", True))),
        torch_dtype=checkpoint_dtype(raw),
        image_token_id=raw.get("image_token_id", raw.get("image_token_index", 262_144)),
        video_token_id=None,
        vision_start_token_id=raw.get("boi_token_id", raw.get("boi_token_index", 255_999)),
        vision_end_token_id=raw.get("eoi_token_id", raw.get("eoi_token_index", 256_000)),
        eos_token_ids=eos_ids(raw.get("eos_token_id", text_raw.get("eos_token_id"))),
        image=ImageProcessorConfig.fixed_size(preprocessor, patch, side, pool),
        mrope=False,
        bidirectional_images=True,
        image_placeholder_id=raw.get("boi_token_id", raw.get("boi_token_index", 255_999)),
    )
